"""Clean exits on ``gloo``: no ``std::terminate`` from a gloo worker thread at interpreter exit.

The fault (PyTorch's, with or without zerohooks; about 1 launch in 16-40 of a two-rank job on a
loaded machine): each ``gloo`` process group runs its collectives on worker threads
(``pt_gloo_runloop``).  A worker drops its reference to a collective just after the waiting
thread was told it completed.  When that reference is the last one, freeing the collective's
tensors takes the GIL.  If the script has already ended and Python is finalizing, the thread is
ended with a forced unwind, which the C++ frames turn into ``std::terminate``: "terminate called
without an active exception", SIGABRT, a failed job although its work succeeded.

The guard: an :mod:`atexit` handler, registered when zerohooks is imported (so it runs after the
handlers a script registers later, and before finalization), waits until every gloo worker
thread of the process is idle: asleep on its queue (a futex wait without timeout), with no
context switch across a few milliseconds in which the GIL is free.  A worker about to free a
collective is running, waiting for the GIL (which it gets while the guard sleeps), or inside a
collective still in flight (gloo waits with a timeout); an idle worker holds no collective, so
nothing can free one during finalization.  The wait is bounded (:data:`LIMIT_S`); it reads
``/proc`` and does nothing where there is none (not Linux) or no gloo worker.  Exit codes and
exceptions are untouched: the handler only waits.
"""

from __future__ import annotations

import atexit
import os
import platform
import sys
import time

__all__ = ["LIMIT_S", "gloo_workers_busy", "wait_for_gloo_workers"]

LIMIT_S = 10.0
"""The longest the exit handler waits for gloo workers (a collective left in flight at exit)."""

_WORKER = "pt_gloo_runloop"
_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}.get(
    platform.machine().lower()
)
_QUIET_S = 0.005
_TASKS = "/proc/self/task"


def _workers() -> list[str]:
    """Thread ids of this process's gloo worker threads."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() == _WORKER:
                    found.append(tid)
        except OSError:
            continue  # the thread ended
    return found


def _state(tid: str) -> tuple[str, ...] | None:
    """(state, switches, syscall and timeout argument) of one thread; None once it ended."""
    try:
        with open(f"{_TASKS}/{tid}/status") as f:
            status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    except OSError:
        return None
    try:
        with open(f"{_TASKS}/{tid}/syscall") as f:
            call = f.read().split()
    except OSError:
        call = []  # not readable here: judged by its state and switches only
    state = status.get("State", "?").strip()[:1]
    switches = status.get("voluntary_ctxt_switches", "").strip() + "/"
    switches += status.get("nonvoluntary_ctxt_switches", "").strip()
    nr = call[0] if call else "?"
    timeout = call[4] if len(call) > 4 else "?"
    return state, switches, nr, timeout


def _idle(state: tuple[str, ...] | None) -> bool:
    if state is None:
        return True  # ended: holds nothing
    st, _, nr, timeout = state
    if st != "S" or nr == "running":
        return False
    if _FUTEX is None or nr == "?":
        return True  # no syscall to read: asleep and (checked by the caller) not switching
    # an idle worker waits on its queue without a timeout; gloo's waits for peers carry one
    return nr == str(_FUTEX) and timeout == "0x0"


def gloo_workers_busy() -> list[str]:
    """Thread ids of gloo workers that are not idle right now (one look, no waiting)."""
    return [tid for tid in _workers() if not _idle(_state(tid))]


def _gloo_group() -> bool:
    """Whether this process has a gloo process group (True when that cannot be read): none on
    NCCL alone, so there the handler returns after one look at ``/proc`` without sleeping."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not (dist.is_available() and dist.is_initialized()):
            return False
        groups = dist.distributed_c10d._world.pg_map
        return any("gloo" in str(backend).lower() for backend, _ in groups.values())
    except Exception:
        return True


def wait_for_gloo_workers(limit: float = LIMIT_S) -> bool:
    """Wait (at most ``limit`` seconds) until every gloo worker thread is idle: two looks
    ``5 ms`` apart, the GIL free between them, that find the same threads, each asleep on its
    queue and not run in between.  PyTorch starts a group's workers at its first collective, a
    few milliseconds late: with a process group and no worker yet, a few more looks are taken.
    True when they are idle (or there are none), False when the limit passed first."""
    deadline = time.monotonic() + limit
    empty = 0
    while True:
        before = {tid: _state(tid) for tid in _workers()}
        if not before and not _gloo_group():
            return True
        time.sleep(_QUIET_S)  # the GIL is free: a worker waiting for it takes it now
        after = {tid: _state(tid) for tid in _workers()}
        if before.keys() == after.keys() and all(
            _idle(state) and (state is None or before[tid] == state) for tid, state in after.items()
        ):
            empty = empty + 1 if not after else 0
            if after or empty >= 4:
                return True
        if time.monotonic() >= deadline:
            return False


def _at_exit() -> None:
    if not os.path.isdir(_TASKS):
        return
    started = time.monotonic()
    if not wait_for_gloo_workers():
        print(
            f"[zerohooks] exit: a gloo worker thread is still busy after {time.monotonic() - started:.0f} s "
            "(a collective left in flight?); exiting anyway, which may abort the process",
            file=sys.stderr,
            flush=True,
        )


atexit.register(_at_exit)
