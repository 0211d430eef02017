"""Bounded-time collectives: every multi-rank operation zerohooks or a plugin runs either
completes or fails within a set time, with an error naming the operation and the ranks at fault.

How a stalled rank is named
    Each process that takes part in a bounded collective keeps a heartbeat in the rendezvous
    store (a daemon thread writes a counter and the operation it is in, every ``interval``
    seconds).  When a collective times out (or fails because a peer went away), the waiting rank
    reads the heartbeats of the group twice, ``2 * interval`` apart: a rank whose counter did not
    move is *not responding* (stopped, frozen, or dead); a rank whose counter moved is alive and
    the error says where it is (in which of our collectives, or outside them).

The limit
    ``ZEROHOOKS_COLLECTIVE_TIMEOUT`` (seconds; ``0``, ``off`` or ``none`` turns the watchdog off),
    else :func:`set_collective_timeout`, else :data:`DEFAULT_TIMEOUT_S`.  It applies where the
    waiting happens on the CPU (the ``gloo`` backend).  On NCCL the wait is on a CUDA stream,
    not on the CPU: there PyTorch's own NCCL watchdog (the process group's ``timeout``) applies,
    and zerohooks adds nothing to the collective.

Patient operations
    Start-up barriers behind which one rank may compile a kernel for minutes
    (:func:`zerohooks.jit.local_rank0_first`) wait as long as every missing rank is alive, and
    fail only on a rank that stopped responding.

Inside an engine call
    A collective waited on the main thread inside a watched engine call (``forward``,
    ``backward``, ``step``, ``save_checkpoint``, ``load_checkpoint``: loco's exchanges, the
    checkpoint agreements) is waited for under the step watch (:func:`zerohooks.stepwatch.wait`):
    a live peer busy elsewhere (a rank-0-only evaluation, a long save) is waited for, as in
    DeepSpeed's own collectives, and only a silent one fails the wait.  gloo's point-to-point
    receives cannot wait with a limit and then go on (a timed-out receive closes the pair): such
    a wait has no limit of its own, and the step watch ends it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks.errors import CollectiveTimeoutError, ConfigError, RankFailedError


def _no_step_watch(work: Any, what: str) -> bool:
    return False


_step_wait: Callable[[Any, str], bool] = _no_step_watch
"""How a collective inside a watched engine call waits: :func:`zerohooks.stepwatch.wait`, set by
:mod:`zerohooks.stepwatch` when it is imported (:func:`use_step_wait`; this module does not
import it: stepwatch builds on this one).  False: not inside a watched call, wait here."""


def use_step_wait(wait: Callable[[Any, str], bool]) -> None:
    """Let collectives waited inside a watched engine call wait through ``wait`` (the step watch:
    no limit of its own, ended only for a silent peer)."""
    global _step_wait
    _step_wait = wait


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV",
    "Pending",
    "agree",
    "barrier",
    "begin",
    "collective_timeout",
    "gather_objects",
    "run",
    "set_collective_timeout",
]

DEFAULT_TIMEOUT_S = 600.0
"""Default limit, in seconds, for one zerohooks collective (long enough for a slow first step)."""

ENV = "ZEROHOOKS_COLLECTIVE_TIMEOUT"
"""Environment variable that sets the limit (seconds, or ``off``)."""

_override: list[float | None] = []
_KEY = "zerohooks/heartbeat/"


def collective_timeout() -> float | None:
    """The limit in seconds for one collective, or None when the watchdog is off."""
    raw = os.environ.get(ENV)
    if raw is not None and raw.strip() != "":
        text = raw.strip().lower()
        if text in ("0", "off", "none"):
            return None
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value > 0 and value != float("inf")):
            raise ConfigError(
                f"{ENV}={raw!r} is not a limit: give a positive number of seconds, or 0 / off / none "
                "to turn the watchdog off"
            )
        return value
    return _override[-1] if _override else DEFAULT_TIMEOUT_S


class _TimeoutHandle:
    """Undoes one :func:`set_collective_timeout`; also a context manager."""

    __slots__ = ("_active", "_value")

    def __init__(self, value: float | None) -> None:
        self._value = value
        self._active = True

    def remove(self) -> None:
        if self._active:
            self._active = False
            for i in range(len(_override) - 1, -1, -1):
                if _override[i] is self._value:
                    del _override[i]
                    break

    def __enter__(self) -> _TimeoutHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def set_collective_timeout(seconds: float | None) -> _TimeoutHandle:
    """Set the limit for zerohooks collectives in this process (``None``: no limit).

    The environment variable :data:`ENV`, when set, wins (launchers pass it to every rank).
    Returns a handle whose ``remove()`` (or ``with`` block end) restores the previous limit.
    """
    if seconds is not None and not (0 < seconds < float("inf")):
        raise ConfigError(
            f"collective timeout must be a positive finite number of seconds or None, got {seconds!r}"
        )
    value = None if seconds is None else float(seconds)
    _override.append(value)
    return _TimeoutHandle(value)


class _Heartbeat:
    """This process's heartbeat in the rendezvous store (one per process, a daemon thread)."""

    __slots__ = (
        "count",
        "describe",
        "interval",
        "lock",
        "rank",
        "seq",
        "source",
        "stopped",
        "store",
        "thread",
        "where",
    )

    def __init__(self, rank: int, store: Any, interval: float, source: Any) -> None:
        self.rank = rank
        self.store = store
        self.interval = interval
        self.source = source
        """The process group's default store this heartbeat belongs to (a new group: a new beat)."""
        self.stopped = threading.Event()
        self.where = "start-up"
        self.seq = 0
        self.count = 0
        self.describe: Callable[[], str] | None = None
        """More about where this rank is (the step watch's engine call and frames), or None."""
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._beat, name="zerohooks-heartbeat", daemon=True)
        self._publish()
        self.thread.start()

    def _publish(self) -> None:
        more = ""
        describe = self.describe
        if describe is not None:
            with contextlib.suppress(Exception):
                more = describe()
        with self.lock:
            self.count += 1
            value = f"{self.count}|{self.where}{more}"
        # the store going away must never break training; the census says so
        with contextlib.suppress(Exception):
            self.store.set(f"{_KEY}{self.rank}", value)

    def _beat(self) -> None:
        while not self.stopped.wait(self.interval):
            self._publish()

    def stop(self) -> None:
        self.stopped.set()

    def enter(self, what: str) -> int:
        with self.lock:
            self.seq += 1
            self.where = f"in {what} (#{self.seq})"
            return self.seq

    def leave(self, what: str, seq: int) -> None:
        with self.lock:
            self.where = f"outside zerohooks collectives (last completed: {what} #{seq})"


_heart: _Heartbeat | None = None
_retired: list[_Heartbeat] = []
"""Heartbeats stopped because the process group or the limit changed, joined at exit with the current one."""
_heart_lock = threading.Lock()


def _namespace() -> str:
    """The prefix of zerohooks' keys in the rendezvous store: ``zh``, with torchrun's restart count
    when there is one (``zh/attempt1``).  A restarted job's ranks reach the same store again (the
    agent's), where the previous attempt's heartbeats and stall report remain: read as this
    attempt's, they would turn any error into that old report."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    return f"zh/attempt{attempt}" if attempt else "zh"


def _store(store: Any, timeout: float = 5.0) -> Any:
    """A client of the rendezvous store ``store`` (``timeout`` seconds per operation, keys under
    :func:`_namespace`), ``None`` if there is none we can reach."""
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        # our own connection with a short timeout: a frozen store host cannot block the census
        try:
            return dist.PrefixStore(
                _namespace(),
                dist.TCPStore(
                    base.host, base.port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
                ),
            )
        except Exception:
            return None
    return dist.PrefixStore(_namespace(), store)


def _heartbeat(timeout: float) -> _Heartbeat | None:
    global _heart
    try:
        source = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    interval = min(5.0, max(0.2, timeout / 10))
    rank = dist.get_rank()
    with _heart_lock:
        if _heart is not None and (
            _heart.source is not source or _heart.interval != interval or _heart.rank != rank
        ):
            _heart.stop()  # the process group was made anew (or the limit changed): beat afresh
            # its thread may still be inside a beat: keep it until it ends, exit joins it
            _retired[:] = [h for h in _retired if h.thread.is_alive()]
            _retired.append(_heart)
            _heart = None
        if _heart is None:
            store = _store(source)
            if store is None:
                return None
            _heart = _Heartbeat(rank, store, interval, source)
        return _heart


_others: list[tuple[Callable[[], None], threading.Thread]] = []


def join_at_exit(stop: Callable[[], None], thread: threading.Thread) -> None:
    """Have :func:`_stop_heartbeat` stop and join another thread that talks to the store."""
    with _heart_lock:
        _others[:] = [(s, t) for s, t in _others if t.is_alive()]
        _others.append((stop, thread))


_STOP_WAIT = 6.0
"""Seconds :func:`_stop_heartbeat` waits for a beat in flight (the store client's own limit is 5 s)."""


def _stop_heartbeat() -> None:
    """Stop this process's heartbeats and wait for their threads (run at interpreter exit).

    A daemon thread still inside the store client's C++ code when the interpreter finalizes is
    ended with a forced unwind, which C++ frames that may not throw turn into ``std::terminate``:
    a rank that trained to the end could abort ("terminate called without an active exception")
    when the store's host had already exited.  Joining the threads first rules that out: the
    current heartbeat's and those of earlier process groups or limits, which may still be inside
    their last beat."""
    global _heart
    with _heart_lock:
        current = _heart
        hearts = [h for h in (*_retired, _heart) if h is not None]
        others = list(_others)
        _heart = None
        _retired.clear()
        _others.clear()
    for heart in hearts:
        heart.stop()
    for stop, _ in others:
        stop()
    deadline = time.monotonic() + _STOP_WAIT  # the beats in flight end together: one wait for all
    for thread in [h.thread for h in hearts] + [t for _, t in others]:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if current is not None and not current.thread.is_alive():
        # a last beat says this rank exited: peers still in a step do not take it for stalled
        current.describe = None
        current.where = "exited"
        current._publish()


atexit.register(_stop_heartbeat)


def _census(heart: _Heartbeat, ranks: list[int]) -> tuple[list[int], dict[int, str]]:
    """(ranks not responding, rank -> where each responsive rank is)."""

    def read() -> dict[int, str | None]:
        seen: dict[int, str | None] = {}
        for r in ranks:
            key = f"{_KEY}{r}"
            try:
                seen[r] = heart.store.get(key).decode() if heart.store.check([key]) else None
            except Exception:
                seen[r] = None
        return seen

    first = read()
    time.sleep(2.5 * heart.interval)
    second = read()
    stalled = [r for r in ranks if second[r] is None or second[r] == first[r]]
    where = {r: (second[r] or "").partition("|")[2] for r in ranks if r not in stalled}
    return stalled, where


def _group_ranks(group: Any) -> list[int]:
    try:
        return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except Exception:
        return list(range(dist.get_world_size()))


def _diagnose(heart: _Heartbeat | None, what: str, seq: int, group: Any, waited: float, cause: str) -> str:
    me = dist.get_rank()
    ranks = _group_ranks(group)
    head = f"rank {me}: zerohooks collective {what} (#{seq}, group of ranks {ranks}) {cause} after {waited:.1f} s"
    if heart is None:
        return head + "; no rendezvous store to ask which rank is at fault"
    stalled, where = _census(heart, [r for r in ranks if r != me])
    lines = [head + "."]
    if stalled:
        lines.append(
            f"Not responding: rank(s) {stalled} (no heartbeat for {2.5 * heart.interval:.1f} s: "
            "the process is stopped, frozen or dead; look at its log and its node)."
        )
    for r, at in sorted(where.items()):
        if not at.startswith(f"in {what} (#{seq})"):
            lines.append(f"Rank {r} is alive but has not joined: it is {at}.")
    if not stalled and all(at.startswith(f"in {what} (#{seq})") for at in where.values()):
        lines.append("Every rank is alive and in this collective: the network or the backend is stuck.")
    lines.append(f"Set {ENV} (seconds, or off) to change the limit.")
    return " ".join(lines)


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET")


class Pending:
    """A collective issued by :func:`begin`: :meth:`wait` waits for it in bounded time (once)."""

    __slots__ = ("group", "heart", "patient", "seq", "t0", "timeout", "waited", "what", "work")

    def __init__(
        self,
        what: str,
        group: Any,
        work: Any,
        heart: _Heartbeat | None,
        seq: int,
        timeout: float | None,
        patient: bool,
    ) -> None:
        self.what, self.group, self.work, self.heart, self.seq = what, group, work, heart, seq
        self.timeout, self.patient = timeout, patient
        self.t0 = time.monotonic()
        self.waited = False

    def wait(self) -> None:
        """Return when the collective completed; :class:`~zerohooks.errors.CollectiveTimeoutError`
        when it did not within the limit (or a peer went away)."""
        if self.waited:
            return
        self.waited = True
        timeout, heart = self.timeout, self.heart
        if timeout is None:
            self.work.wait()
            return
        # the limit counts from the wait: a collective issued early (ZeRO 3 prefetches) and
        # waited after a long stretch of compute is not failed for a merely late peer
        self.t0 = time.monotonic()
        watched = False
        try:
            if self.patient:
                _wait_patiently(self.work, heart, self.what, self.seq, self.group, timeout, self.t0)
            else:
                watched = _step_wait(self.work, f"{self.what} (#{self.seq})")
                if not watched:
                    self.work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            if isinstance(e, CollectiveTimeoutError):
                raise
            waited = time.monotonic() - self.t0
            text = str(e)
            watched = watched or waited >= 1.5 * timeout  # the step watch's wait had no limit of ours
            if watched and "timed out" in text.lower():
                cause = f"was ended by the process group's own timeout ({text.splitlines()[0][:160]})"
            elif "timed out" in text.lower() or waited >= 0.95 * timeout:
                cause = f"did not complete within the {timeout:g} s limit"
            elif any(s in text for s in _PEER_GONE):
                cause = f"failed: a peer went away ({text.splitlines()[0][:160]})"
            else:
                raise
            raise CollectiveTimeoutError(
                _diagnose(heart, self.what, self.seq, self.group, waited, cause)
            ) from e
        finally:
            if heart is not None:
                heart.leave(self.what, self.seq)


def begin(what: str, group: Any, start: Callable[[], Any], *, patient: bool = False) -> Pending:
    """Issue one collective (``start()`` issues it with ``async_op=True`` and returns its work
    handle) and return at once; the returned :class:`Pending`'s ``wait()`` is :func:`run`'s wait,
    bounded from the moment it is called.  For overlapping a collective with work."""
    timeout = collective_timeout()
    if timeout is None or dist.get_backend(group) != "gloo" or dist.get_world_size(group) == 1:
        return Pending(what, group, start(), None, 0, None, patient)
    heart = _heartbeat(timeout)
    seq = heart.enter(what) if heart is not None else 0
    try:
        work = start()
    except BaseException:
        if heart is not None:
            heart.leave(what, seq)
        raise
    return Pending(what, group, work, heart, seq, timeout, patient)


def run(what: str, group: Any, start: Callable[[], Any], *, patient: bool = False) -> None:
    """Run one collective in bounded time.

    ``start()`` issues the collective with ``async_op=True`` and returns its work handle.
    ``what`` names it in errors ("loco all_to_all (inter-node)").  On ``gloo`` the wait is
    bounded by :func:`collective_timeout`; a timeout or a lost peer raises
    :class:`~zerohooks.errors.CollectiveTimeoutError` naming this rank, the operation and the
    ranks at fault.  ``patient=True`` keeps waiting while every missing rank is alive.
    """
    begin(what, group, start, patient=patient).wait()


def _wait_patiently(
    work: Any, heart: _Heartbeat | None, what: str, seq: int, group: Any, timeout: float, t0: float
) -> None:
    next_check = t0 + timeout
    while not work.is_completed():
        time.sleep(0.05)
        if time.monotonic() < next_check:
            continue
        next_check = time.monotonic() + timeout
        if heart is None:
            continue
        stalled, where = _census(heart, [r for r in _group_ranks(group) if r != dist.get_rank()])
        if stalled:
            cause = f"could not complete: a rank stopped responding while it waited {timeout:g} s or more"
            raise CollectiveTimeoutError(_diagnose(heart, what, seq, group, time.monotonic() - t0, cause))
        # an alive rank that never comes is waited for (a long build, a slow disk) but named, so
        # that one stuck elsewhere (a deadlock, a hung input pipeline) shows where it is
        late = [
            f"rank {r} is {at}" for r, at in sorted(where.items()) if not at.startswith(f"in {what} (#{seq})")
        ]
        print(
            f"[zerohooks] rank {dist.get_rank()}: still waiting in {what} after "
            f"{time.monotonic() - t0:.0f} s; every rank is alive"
            + (f", not all in it: {'; '.join(late)}" if late else ", all in it"),
            file=sys.stderr,
            flush=True,
        )
    work.wait()


def barrier(what: str, group: Any = None) -> None:
    """A bounded :func:`torch.distributed.barrier`."""
    run(what, group, lambda: dist.barrier(group=group, async_op=True))


def _device(group: Any) -> torch.device | None:
    """Where the gather's tensors live: NCCL gathers device tensors only (this rank's GPU, by
    ``LOCAL_RANK`` as DeepSpeed picks it, since the engine may not have set the device yet);
    gloo and the rest gather CPU tensors."""
    if dist.get_backend(group) != "nccl":
        return None
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def gather_objects(obj: Any, what: str, group: Any = None, *, patient: bool = False) -> list[Any]:
    """Every rank's picklable ``obj``, in group rank order, gathered in bounded time.

    Each rank's ``what`` travels with its object: ranks that reached two different gathers (one
    failed early, another went on) get :class:`~zerohooks.errors.RankFailedError` naming where
    each rank is, instead of one rank's object read as another's."""
    world = dist.get_world_size(group)
    device = _device(group)
    data = torch.frombuffer(bytearray(pickle.dumps((what, obj))), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    run(
        f"{what} (sizes)",
        group,
        lambda: dist.all_gather(sizes, mine, group=group, async_op=True),
        patient=patient,
    )
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    padded = padded.to(device) if device is not None else padded
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    run(what, group, lambda: dist.all_gather(parts, padded, group=group, async_op=True), patient=patient)
    got = [
        pickle.loads(p.cpu()[: int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes, strict=True)
    ]
    labels = [label for label, _ in got]
    if any(label != what for label in labels):
        ranks = _group_ranks(group)
        where = "; ".join(f"rank {r}: {label}" for r, label in zip(ranks, labels, strict=True))
        raise RankFailedError(
            f"rank {dist.get_rank()}: the ranks reached different zerohooks steps ({where}). A rank that "
            "failed on its own is the usual cause: look for its error in its log"
        )
    return [value for _, value in got]


def _note(error: BaseException, text: str) -> None:
    add = getattr(error, "add_note", None)  # Python >= 3.11
    if add is not None:
        add(text)


def agree(error: BaseException | None, what: str, group: Any = None) -> None:
    """All ranks learn whether any of them failed ``what``; then all fail, or all go on.

    Every rank of ``group`` calls it with the exception it caught (or None).  A rank that failed
    re-raises its own exception; the others raise :class:`~zerohooks.errors.RankFailedError`
    naming the failed rank(s) and their errors, so no rank waits in a later collective for a
    peer that is gone.  Without a process group (or with one rank) it re-raises ``error``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    summary = None if error is None else f"{type(error).__name__}: {error}"
    ranks = _group_ranks(group)
    try:
        reports = gather_objects(summary, f"agreement on {what}", group, patient=True)
    except RankFailedError as diverged:
        if error is None:
            raise
        _note(error, f"[zerohooks] {diverged}")
        raise error from None  # this rank's own failure first; the divergence is its note
    failed = [(r, s) for r, s in zip(ranks, reports, strict=True) if s is not None]
    if error is not None:
        if len(failed) > 1:
            _note(error, f"[zerohooks] {what} failed on ranks {[r for r, _ in failed]}")
        raise error
    if failed:
        listing = "; ".join(f"rank {r}: {s}" for r, s in failed)
        raise RankFailedError(
            f"rank {dist.get_rank()} stops: {what} failed on {len(failed)} of {len(ranks)} rank(s), so "
            f"this rank does not go on alone. {listing}"
        )
