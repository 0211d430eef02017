"""Just-in-time builds of C++/CUDA extensions: who builds, and saying so while it happens.

* :func:`local_rank0_first` decides who builds: local rank 0 of each machine builds while the
  other ranks of that machine wait (and say so), then they load the cached build, or give up
  without building when their machine's rank 0 failed.
* :func:`announce_build` wraps a build that may take a while: a line on stderr when it starts
  (what, why, roughly how long, how to build ahead of time), a heartbeat line every
  ``ZEROHOOKS_HEARTBEAT_S`` seconds (10) while it runs, and one when it ends.  When the build is
  already cached (:func:`extension_cached`) it stays quiet unless loading takes more than a few
  seconds after all (ninja found something to rebuild).

Build everything ahead of time with ``python -m zerohooks.build`` (see :mod:`zerohooks.build`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "AOT_COMMAND",
    "announce_build",
    "extension_build_dir",
    "extension_cached",
    "extension_root",
    "heartbeat_interval",
    "local_rank0_first",
]

AOT_COMMAND = "python -m zerohooks.build"
"""The command that builds every extension ahead of time (same environment, same TORCH_EXTENSIONS_DIR)."""

_QUIET_GRACE_S = 3.0  # a cached build that still takes this long gets announced after all


def heartbeat_interval() -> float:
    """Seconds between heartbeat lines: ``ZEROHOOKS_HEARTBEAT_S`` (default 10)."""
    try:
        return max(0.05, float(os.environ.get("ZEROHOOKS_HEARTBEAT_S", "10")))
    except ValueError:
        return 10.0


def _rank_tag() -> str:
    rank = os.environ.get("RANK")
    return f"zerohooks[rank {rank}]" if rank is not None else "zerohooks"


def _say(stream: TextIO | None, text: str) -> None:
    out = stream if stream is not None else sys.stderr
    with contextlib.suppress(Exception):  # a closed stream must never break a build
        print(f"{_rank_tag()}: {text}", file=out, flush=True)


def extension_root() -> Path:
    """Where ``torch.utils.cpp_extension.load`` builds: ``TORCH_EXTENSIONS_DIR`` when set, else
    torch's default (``~/.cache/torch_extensions/py<ver>_<cpu|cuXY>``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    try:
        import torch
        from torch.utils import cpp_extension

        cu = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        return Path(cpp_extension.get_default_build_root()) / f"{py}_{cu}"
    except Exception:
        return Path.home() / ".cache" / "torch_extensions"


def extension_build_dir(name: str) -> Path:
    """The folder where ``torch.utils.cpp_extension.load(name=...)`` builds extension ``name``."""
    return extension_root() / name


def extension_cached(name: str) -> bool:
    """Whether a built library of extension ``name`` is in its build folder (then loading it is
    quick, unless its sources or flags changed)."""
    folder = extension_build_dir(name)
    with contextlib.suppress(OSError):
        return any(folder.glob(f"{name}*.so")) or any(folder.glob(f"{name}*.pyd"))
    return False


@contextlib.contextmanager
def announce_build(
    what: str,
    *,
    why: str,
    eta: str,
    hint: str | None = None,
    cached: bool = False,
    interval: float | None = None,
    stream: TextIO | None = None,
) -> Iterator[None]:
    """Say on ``stream`` (stderr) that ``what`` is being built, keep saying it is alive every
    ``interval`` seconds (:func:`heartbeat_interval`) while the ``with`` body runs, then say how
    long it took, or that it failed.

    ``why``: what needs it; ``eta``: roughly how long (e.g. ``"about 1 min on 2 cores"``);
    ``hint``: how to avoid the wait next time (default: the ahead-of-time command).  With
    ``cached=True`` nothing is said unless the body takes more than 3 s after all."""
    every = heartbeat_interval() if interval is None else interval
    hint = hint if hint is not None else f"build it ahead of time with `{AOT_COMMAND}`"
    start = time.monotonic()
    done = threading.Event()
    announced = threading.Event()

    def announce(late: bool) -> None:
        prefix = "rebuilding" if late else "building"
        _say(
            stream,
            f"{prefix} {what} ({why}); {eta}, once per environment and build folder "
            f"(under {extension_root()}). Faster next time: {hint}",
        )
        announced.set()

    def beat() -> None:
        if cached:
            if done.wait(_QUIET_GRACE_S):
                return
            announce(late=True)
        while not done.wait(every):
            _say(stream, f"still building {what}: {time.monotonic() - start:.0f} s so far ...")

    if not cached:
        announce(late=False)
    thread = threading.Thread(target=beat, name="zerohooks-build-heartbeat", daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        thread.join(timeout=1.0)
        if announced.is_set():
            took = time.monotonic() - start
            _say(
                stream,
                f"built {what} in {took:.0f} s" if ok else f"building {what} failed after {took:.0f} s",
            )


def _wait_notice(host: str) -> Callable[[], None]:
    """Start a thread saying every heartbeat interval that this rank waits for local rank 0."""
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        if done.wait(_QUIET_GRACE_S):
            return
        _say(None, f"waiting for local rank 0 of {host} to build the just-in-time extensions ...")
        while not done.wait(heartbeat_interval()):
            _say(
                None, f"still waiting for local rank 0 of {host}: {time.monotonic() - start:.0f} s so far ..."
            )

    thread = threading.Thread(target=beat, name="zerohooks-build-wait", daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join(timeout=1.0)

    return stop


def _no_op() -> None:
    return None


def local_rank0_first(load: Callable[..., Any]) -> Any:
    """``load()`` on local rank 0 of each machine while the other ranks wait, then
    ``load(build=ok)`` on them, ``ok`` saying whether their machine's local rank 0 succeeded
    (truthy result).  A JIT build then happens once per machine, and a failed one is not retried
    by every rank.  Without an initialised process group (or with one rank) this is ``load()``.
    Every rank of the process group must call it (it gathers one small object from each).
    Waiting ranks say on stderr that they wait, when it lasts more than 3 s."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return load()
    first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    out = load() if first else None
    host = socket.gethostname()
    from zerohooks import watchdog

    stop: Callable[[], None] = _no_op if first else _wait_notice(host)
    try:
        # also the barrier; patient: a local rank 0 may compile for minutes while alive
        seen = watchdog.gather_objects((host, first, bool(out)), "kernel build barrier", patient=True)
    finally:
        stop()
    if first:
        return out
    mine = [ok for h, is_first, ok in seen if h == host and is_first]
    return load(build=mine[0] if mine else True)
