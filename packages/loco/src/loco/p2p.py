"""All-to-all and all-gather as point-to-point sends and receives, for gloo.

gloo's collectives move a pair's two directions one after the other: measured between two
emulated nodes over a 100 Mbit/s link (2 x 2 ranks, 6.45 MB each way per rank pair),
``all_to_all_single`` on two ranks took 1.08 s, ``all_gather_into_tensor`` 0.63-0.84 s, and the
same exchange as an ``isend``/``irecv`` pair 0.55 s, the link's rate (0.52 s for the payload).  A
single TCP connection carries both directions at full rate; these collectives wait on one before
they start the other.  So on gloo loco exchanges its rows with point-to-point operations, which
run every direction at once.  Other backends (NCCL builds its all-to-all from grouped sends and
receives) keep their collectives.

The result is the collective's, element for element: each row is copied, not combined.  Every
rank issues its operations in the order its collectives would have been issued, so sends and
receives between a pair match in order (gloo matches a pair's messages of one tag first in,
first out).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Exchange", "all_gather", "all_to_all_single", "preferred"]

TAG = 0x10C0
"""The tag of loco's point-to-point messages (apart from any other sender's on the same group)."""


class Exchange:
    """The work handle of one exchange: the point-to-point works it issued, waited as one
    (``wait(timeout=...)`` and ``is_completed()``, as :mod:`zerohooks.watchdog` uses them)."""

    __slots__ = ("works",)

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for every send and receive; with ``timeout``, all of them within it in total
        (a ``RuntimeError`` saying it timed out otherwise, as a collective's wait raises)."""
        if timeout is None:
            for w in self.works:
                w.wait()
            return True
        deadline = time.monotonic() + timeout.total_seconds()
        for w in self.works:
            left = deadline - time.monotonic()
            if left <= 0 and not w.is_completed():
                raise RuntimeError(
                    f"loco point-to-point exchange timed out after {timeout.total_seconds():g} s"
                )
            w.wait(timeout=datetime.timedelta(seconds=max(left, 0.001)))
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def preferred(group: Any, tensor: torch.Tensor) -> bool:
    """Whether loco exchanges ``tensor`` on ``group`` point to point: gloo, more than one rank,
    and host memory.  gloo's point-to-point operations abort the sending process on device
    memory (H100, torch 2.11: ``pair.cc:339 writev ... Bad address``, the GPU suite's multirank
    section, 2026-11-27), while its collectives take CUDA tensors; so device buffers keep gloo's
    collectives (on a GPU the backend is NCCL anyway)."""
    return (
        dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1 and tensor.device.type == "cpu"
    )


def _issue(pairs: Sequence[tuple[str, torch.Tensor, int]], group: Any) -> Exchange:
    works = []
    for kind, t, peer in pairs:
        op: Callable[..., Any] = dist.irecv if kind == "recv" else dist.isend
        works.append(op(t, peer, group=group, tag=TAG))
    return Exchange(works)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Exchange:
    """``dist.all_to_all_single(out, inp, group)`` with equal splits: row j of ``inp`` (split
    into as many rows as ``group`` has ranks) goes to the group's rank j, whose row i of ``out``
    receives it from the group's rank i.  Both contiguous."""
    ranks = dist.get_process_group_ranks(group)
    w, me = len(ranks), ranks.index(dist.get_rank())
    if not (out.is_contiguous() and inp.is_contiguous()) or out.numel() != inp.numel() or inp.numel() % w:
        raise ValueError(f"loco all_to_all: {inp.numel()} -> {out.numel()} elements do not split in {w} rows")
    o, i = out.view(w, -1), inp.view(w, -1)
    o[me].copy_(i[me])
    pairs = []
    for step in range(1, w):  # receive from the rank `step` behind, send to the one `step` ahead
        src, dst = (me - step) % w, (me + step) % w
        pairs += [("recv", o[src], ranks[src]), ("send", i[dst], ranks[dst])]
    return _issue(pairs, group)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Exchange:
    """``dist.all_gather_into_tensor(out, inp, group)``: row j of ``out`` is the group's rank j's
    ``inp``, sent by it to every other rank directly (the bytes a ring moves, on a group whose
    ranks are on different nodes: each node sends its rows once to each other node).  Both
    contiguous."""
    ranks = dist.get_process_group_ranks(group)
    w, me = len(ranks), ranks.index(dist.get_rank())
    if not (out.is_contiguous() and inp.is_contiguous()) or out.numel() != w * inp.numel():
        raise ValueError(f"loco all_gather: {inp.numel()} -> {out.numel()} elements, expected {w} x")
    o = out.view(w, -1)
    o[me].copy_(inp.view(-1))
    pairs = []
    for step in range(1, w):
        src, dst = (me - step) % w, (me + step) % w
        pairs += [("recv", o[src], ranks[src]), ("send", inp.view(-1), ranks[dst])]
    return _issue(pairs, group)
