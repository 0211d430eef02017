"""Just-in-time builds of plugins' C++/CUDA extensions under several ranks.

:func:`local_rank0_first` is the one place that decides who builds: local rank 0 of each machine
builds while the other ranks of that machine wait, then they load the cached build, or give up
without building when their machine's rank 0 failed.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["local_rank0_first"]


def local_rank0_first(load: Callable[..., Any]) -> Any:
    """``load()`` on local rank 0 of each machine while the other ranks wait, then
    ``load(build=ok)`` on them, ``ok`` saying whether their machine's local rank 0 succeeded
    (truthy result).  A JIT build then happens once per machine, and a failed one is not retried
    by every rank.  Without an initialised process group (or with one rank) this is ``load()``.
    Every rank of the process group must call it (it gathers one small object from each)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return load()
    first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    out = load() if first else None
    host = socket.gethostname()
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (host, first, bool(out)))  # also the barrier
    if first:
        return out
    mine = [ok for h, is_first, ok in seen if h == host and is_first]
    return load(build=mine[0] if mine else True)
