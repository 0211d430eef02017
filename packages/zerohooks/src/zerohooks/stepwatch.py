"""A rank stalled anywhere in a training step, DeepSpeed's own collectives included, is reported
within the collective limit, and the surviving ranks raise instead of waiting.

How
    The adapter marks each engine call that runs collectives (``forward``, ``backward``,
    ``step``) with :func:`in_step`: two attribute writes, no collective.  While one is in
    progress, a thread of this process (one per process, ``zerohooks-stepwatch``) reads the
    peers' heartbeats (:mod:`zerohooks.watchdog`, one store round trip every heartbeat interval).
    A peer whose heartbeat did not move for the whole limit (``ZEROHOOKS_COLLECTIVE_TIMEOUT``),
    counted only from this thread's own regular looks (a machine or job that was suspended as a
    whole is not a stalled peer), is stopped, frozen or dead.  Then this rank:

    1. prints the report (the rank, how long it has been silent, where it was when last heard:
       the engine call and the innermost frames of its main thread) and puts it in the store;
    2. shuts down its gloo connections (``shutdown(2)`` on the TCP sockets of its gloo process
       groups, found from the listening ports every rank published at start): the collective the
       main thread waits in fails at once, and the engine call raises
       :class:`~zerohooks.errors.CollectiveTimeoutError` with the report.  Other ranks that lose
       their connection to this one raise the same error, read from the store;
    3. if the main thread is still in that engine call after a grace period (a wait that closed
       connections cannot end), prints the report again and ends the process with
       :data:`STALL_EXIT_CODE`.

    ``ProcessGroupGloo.abort()`` and ``shutdown()`` (torch 2.13) return without ending a
    collective in flight, and a Python exception cannot reach a thread blocked in C++: hence the
    sockets.

Patient waits stay patient: a rank that is alive (building a kernel, writing a checkpoint,
loading data, evaluating on its own) keeps its heartbeat moving, however long it takes; only
silence counts.  zerohooks' own collectives waited on the main thread inside an engine call
(loco's all-to-all and all-gathers, the checkpoint agreements) follow the same rule: they wait
without a limit of their own (:func:`wait`), the watching thread names a silent peer, and prints
every limit which rank the wait is on and where that rank is.  Whatever is alive is bounded by
the process group's own timeout (``init_process_group(timeout=...)``, DeepSpeed's
``init_distributed(timeout=...)``: 30 minutes by default), which gloo applies to every collective,
DeepSpeed's own included: the bound of a wait for a live rank is the same with or without
zerohooks.  A process
that exits cleanly says so in its heartbeat.  gloo only; off with the watchdog
(``ZEROHOOKS_COLLECTIVE_TIMEOUT=off``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from zerohooks import watchdog
from zerohooks.errors import CollectiveTimeoutError

__all__ = ["STALL_EXIT_CODE", "in_step", "start", "wait", "where_main_thread_is"]

STALL_EXIT_CODE = 75
"""Exit code of a rank that found a stalled peer and whose main thread could not be freed."""

_VERDICT = "zerohooks/stall-report"
_LISTEN = "zerohooks/listen/"
_OURS = os.path.dirname(os.path.abspath(__file__)).replace(os.sep, "/") + "/"
_SKIP = ["/torch/distributed/", "/contextlib.py"]
"""Path parts of frames a stall report skips (wrappers around the collective); the adapter adds
DeepSpeed's own (:func:`start`'s ``skip``)."""


def where_main_thread_is(depth: int = 3) -> str:
    """The innermost frames of the main thread, outside torch.distributed and the comm wrappers
    the adapter named (DeepSpeed's) (``get_grad_norm_direct (stage_1_and_2.py:1890) < step (...)``)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    parts: list[str] = []
    innermost = ""
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        path = code.co_filename.replace(os.sep, "/")
        if not innermost:
            innermost = code.co_name
        if not path.startswith(_OURS) and not any(s in path for s in _SKIP):
            parts.append(f"{code.co_name} ({'/'.join(path.split('/')[-2:])}:{frame.f_lineno})")
        frame = frame.f_back
    return (
        f"{innermost} < " if innermost and parts and not parts[0].startswith(innermost) else ""
    ) + " < ".join(parts)


class _Watch:
    """This process's step watch: the phase the main thread is in, and the thread watching peers."""

    def __init__(self, heart: Any, limit: float) -> None:
        self.heart = heart
        self.limit = limit
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.phase = ""
        self.depth = 0
        self.entered = 0.0
        self.left = 0.0
        """When the main thread last returned from an engine call (``phase`` names it)."""
        self.collective: str | None = None
        """The zerohooks collective the main thread waits in under this watch (:func:`wait`)."""
        self.since = 0.0
        self.logged = 0
        """Limits of waiting already told (one line per limit of one wait)."""
        self.verdict: str | None = None
        self.looks: collections.deque[tuple[float, float, float, bool]] = collections.deque(maxlen=32)
        """The last looks taken in an engine call: (time, seconds counted, longest silence, read)."""
        self.stopped = threading.Event()
        self.store = heart.store
        with contextlib.suppress(Exception):
            self.store.set(f"{_LISTEN}{self.rank}", ",".join(map(str, sorted(_listening()))))
        heart.describe = self.describe
        self.thread = threading.Thread(target=self._run, name="zerohooks-stepwatch", daemon=True)
        self.thread.start()

    def describe(self) -> str:
        """Where this rank is, for its heartbeat (read on the heartbeat thread)."""
        if not self.depth:
            if not self.phase:
                return ""
            # a rank that grabs the GIL early in its next call cannot beat again: this says where
            return f"; between engine calls, {time.monotonic() - self.left:.1f} s after {self.phase} returned"
        return f"; in {self.phase} for {time.monotonic() - self.entered:.0f} s, at {where_main_thread_is()}"

    # -- the watching thread ------------------------------------------------------------------
    def _run(self) -> None:
        interval = self.heart.interval
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [f"{watchdog._KEY}{r}" for r in peers]
        last: dict[int, str | None] = {}
        silent = dict.fromkeys(peers, 0.0)
        store_silent = 0.0
        tick = time.monotonic()
        while not self.stopped.wait(interval):
            now = time.monotonic()
            dt, tick = min(now - tick, 2 * interval), now  # a late look (this process starved) counts as two
            if not self.depth or self.verdict is not None:
                continue
            try:
                values = [v.decode() for v in self.store.multi_get(keys)] if self.store.check(keys) else None
                store_silent = 0.0
            except Exception:
                values, store_silent = None, store_silent + dt
            if values is not None:
                for r, v in zip(peers, values, strict=True):
                    moved = last.get(r) != v or v.partition("|")[2].startswith("exited")
                    silent[r] = 0.0 if moved else silent[r] + dt
                    last[r] = v
            stalled = [r for r in peers if silent[r] >= self.limit]
            self.looks.append((now, dt, max(silent.values(), default=0.0), values is not None))
            if self.heart.where.startswith("in ") and self.collective is None:
                continue  # inside a zerohooks collective with a bounded wait: that wait names the rank
            if stalled or store_silent >= self.limit:
                self._fail(stalled, last, store_silent)
            elif self.collective is not None:
                self._still_waiting(now, peers, last)

    def _still_waiting(self, now: float, peers: list[int], last: dict[int, str | None]) -> None:
        """Once per limit of one wait in a zerohooks collective: which ranks it waits on, and where."""
        told = int((now - self.since) // self.limit)
        if told <= self.logged:
            return
        self.logged = told
        collective = self.collective or ""
        late = [r for r in peers if not (last.get(r) or "").partition("|")[2].startswith(f"in {collective}")]
        said = (
            "; ".join(f"rank {r} is alive, {_heard(last.get(r), silent=False)}" for r in late)
            or "every rank is in it"
        )
        pg = _pg_timeout()
        _say(
            f"[zerohooks] rank {self.rank}: still waiting in {collective} after {now - self.since:.0f} s "
            f"(in {self.phase}): {said}. A rank is taken for stalled only when its heartbeat stops for "
            f"{self.limit:g} s"
            + (f"; the process group's timeout ({pg:g} s) bounds the wait" if pg is not None else "")
            + "."
        )

    def _fail(self, stalled: list[int], last: dict[int, str | None], store_silent: float) -> None:
        if stalled:
            said = "; ".join(f"rank {r} was last heard {_heard(last.get(r))}" for r in stalled)
            head = (
                f"Not responding: rank(s) {stalled} (no heartbeat for {self.limit:g} s: the process is stopped, "
                f"frozen or dead; look at its log and its node). {said}."
            )
        else:
            head = (
                f"The rendezvous store has not answered for {store_silent:.0f} s: the process that hosts it (rank 0, "
                "or the launcher's agent) is stopped, frozen or dead."
            )
        during = f"a rank stalled during {self.phase} ({time.monotonic() - self.entered:.1f} s in it)"
        if self.collective is not None:
            during = (
                f"zerohooks collective {self.collective} could not complete: "
                f"{during}, {time.monotonic() - self.since:.1f} s in the collective"
            )
        report = (
            f"rank {self.rank}: {during}. "
            f"{head} This rank stops: its gloo connections are shut down. Set {watchdog.ENV} (seconds, or off) "
            "to change the limit."
        )
        self.verdict = report
        entered = self.entered
        with contextlib.suppress(Exception):
            self.store.set(_VERDICT, report)
        # the connections first, the report after: a stderr that nobody reads (a full pipe)
        # must not keep this rank from failing, nor from exiting below
        _break_gloo_connections(self.store, self.world)
        _say(f"[zerohooks] {report}")
        if (
            not self.stopped.wait(max(5.0, min(60.0, 2 * self.limit)))
            and self.depth
            and self.entered == entered
        ):
            _say(
                f"[zerohooks] rank {self.rank}: still blocked in {self.phase} after its connections were shut "
                f"down; exiting with code {STALL_EXIT_CODE}. {report}"
            )
            os._exit(STALL_EXIT_CODE)

    def stop(self) -> None:
        self.stopped.set()


def _say(text: str, wait: float = 5.0) -> None:
    """Print ``text`` to stderr, waiting for the write at most ``wait`` seconds (a write to a
    full pipe blocks until someone reads it)."""
    writer = threading.Thread(
        target=lambda: print(text, file=sys.stderr, flush=True),
        name="zerohooks-stepwatch-report",
        daemon=True,
    )
    writer.start()
    writer.join(wait)


def _heard(value: str | None, silent: bool = True) -> str:
    """Where a heartbeat value says its rank was: the engine call and frames when it was in one
    (what it last did in zerohooks' own collectives left out), else what the beat says; for a
    ``silent`` rank last heard between engine calls, that it may have stopped early in the next."""
    where = (value or "").partition("|")[2]
    if where.startswith(("start-up; ", "outside zerohooks collectives")):
        _, sep, rest = where.partition("; in ")
        if sep:
            where = "in " + rest
        else:
            _, sep, rest = where.partition("; between engine calls, ")
            if sep:
                where = f"between engine calls, {rest}" + (
                    " (it stopped there or early in its next engine call: a rank that holds the GIL "
                    "cannot beat)"
                    if silent
                    else ""
                )
    return "at start-up" if where in ("", "start-up") else where


def _pg_timeout() -> float | None:
    """The default process group's own timeout in seconds (gloo applies it to every collective)."""
    with contextlib.suppress(Exception):
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    return None


def _sockets() -> dict[int, int]:
    """socket inode -> fd of this process."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/self/fd/{fd}"))
                if m:
                    found[int(m.group(1))] = int(fd)
    return found


def _tcp(mine: dict[int, int]) -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, fd) of this process's TCP sockets."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                col = line.split()
                if len(col) > 9 and int(col[9]) in mine:
                    local, remote = int(col[1].rsplit(":", 1)[1], 16), int(col[2].rsplit(":", 1)[1], 16)
                    rows.append((local, remote, col[3], mine[int(col[9])]))
    return rows


def _store_port() -> int:
    with contextlib.suppress(Exception):
        base = dist.distributed_c10d._get_default_store()
        while hasattr(base, "underlying_store"):
            base = base.underlying_store
        port: Any = getattr(base, "port", None) or os.environ.get("MASTER_PORT", 0)
        return int(port)
    return int(os.environ.get("MASTER_PORT", "0") or 0)


def _listening() -> set[int]:
    """This process's listening TCP ports other than the store's: its gloo groups' listeners."""
    return {local for local, _, state, _ in _tcp(_sockets()) if state == "0A"} - {_store_port()}


def _break_gloo_connections(store: Any, world: int) -> int:
    """Shut down (not close: the fds stay gloo's) this process's gloo TCP connections."""
    ours = _listening()
    theirs: set[int] = set()
    for r in range(world):
        with contextlib.suppress(Exception):
            theirs |= {int(p) for p in store.get(f"{_LISTEN}{r}").decode().split(",") if p}
    store_port = _store_port()
    done = 0
    for local, remote, state, fd in _tcp(_sockets()):
        if state != "01" or store_port in (local, remote):
            continue
        if local in ours or remote in theirs:
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=fd)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    done += 1
                finally:
                    s.detach()
    return done


_watch: _Watch | None = None
_lock = threading.Lock()


def start(skip: tuple[str, ...] = ()) -> None:
    """Start this process's step watch (once), if the watchdog is on and the default group is gloo
    with more than one rank.  Called by the adapter when it attaches to an engine; ``skip``: path
    parts of the framework's comm wrappers, left out of stall reports like torch.distributed."""
    global _watch
    _SKIP.extend(s for s in skip if s not in _SKIP)
    limit = watchdog.collective_timeout()
    if limit is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() != "gloo":
        return
    heart = watchdog._heartbeat(limit)
    if heart is None:
        return
    with _lock:
        if _watch is not None and _watch.heart is heart and _watch.limit == limit:
            return
        if _watch is not None:
            _watch.stop()  # a new process group or limit: watch afresh (exit joins the old thread)
        w = _Watch(heart, limit)
        # a short store timeout for the watching thread's own client: a frozen store host must
        # not hold a look for longer than the limit
        with contextlib.suppress(Exception):
            w.store = watchdog._store(
                dist.distributed_c10d._get_default_store(), timeout=min(5.0, max(1.0, limit / 3))
            )
        _watch = w
        watchdog.join_at_exit(w.stop, w.thread)


def _report_from_store() -> str | None:
    w = _watch
    if w is None:
        return None
    if w.verdict is not None:
        return w.verdict
    with contextlib.suppress(Exception):
        if w.store.check([_VERDICT]):
            return str(w.store.get(_VERDICT).decode())
    return None


def wait(work: Any, what: str) -> bool:
    """Wait for the zerohooks collective ``what`` (``work``: its handle) under the step watch,
    when this is the main thread inside a watched engine call: without a limit of its own (a
    live peer is waited for, the process group's timeout aside), a silent peer ending it with
    :class:`~zerohooks.errors.CollectiveTimeoutError` and the report.  False, without waiting,
    when the step watch does not watch here: the caller bounds the wait itself."""
    w = _watch
    if (
        w is None
        or not w.depth
        or w.verdict is not None
        or w.collective is not None
        or threading.current_thread() is not threading.main_thread()
    ):
        return False
    w.since, w.logged, w.collective = time.monotonic(), 0, what
    try:
        work.wait()
    except RuntimeError as e:
        if isinstance(e, CollectiveTimeoutError):
            raise
        report = _report_from_store()
        if report is None:
            raise  # a peer gone, or the process group's timeout: the caller says which
        raise CollectiveTimeoutError(report) from e
    finally:
        w.collective = None
    return True


@contextlib.contextmanager
def in_step(what: str) -> Iterator[None]:
    """Mark an engine call that runs collectives; a stalled peer found meanwhile turns the
    failure of its collective into :class:`~zerohooks.errors.CollectiveTimeoutError`."""
    w = _watch
    if w is None:
        yield
        return
    if w.depth == 0:
        w.phase, w.entered = what, time.monotonic()
    w.depth += 1
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CollectiveTimeoutError):
            raise
        report = _report_from_store()
        if report is None:
            raise
        raise CollectiveTimeoutError(report) from e
    finally:
        w.depth -= 1
        if w.depth == 0:
            w.left = time.monotonic()


watchdog.use_step_wait(wait)  # zerohooks collectives inside watched engine calls wait through it
