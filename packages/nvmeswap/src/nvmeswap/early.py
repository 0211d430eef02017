"""Stepping swapped sub-groups while backward still runs (``step_in_backward``, issue 37).

At the last micro-step of an accumulation window ZeRO-3 finishes each sub-group's gradients
during backward (in reverse order of the forward).  As soon as a swapped sub-group's gradients
are all recorded, :func:`submit` hands it to a background thread, which reads its master and
moments, steps it, writes its 16-bit partition and writes the new state to the region of its
swap file that is not live (:func:`nvmeswap.swapper.swap_out` with ``staged``), while backward
goes on with the other sub-groups: the disk and the optimizer work overlap backward.

The step is speculative: it assumes DeepSpeed's unscale-and-clip factor for the step is the one
it has when nothing clips (``1 / loss_scale``) and that the step is not skipped.  When
DeepSpeed's step starts its sub-group loop, :func:`settle` compares the factor DeepSpeed now
computes with the one assumed: equal, each staged region becomes the live one (commit); else,
and wherever the window ends without that loop (an overflow or non-finite norm skips the step,
a checkpoint, ``detach``, DeepSpeed's get/set APIs, a forward with no step), :func:`abandon`
undoes it: the optimizer's small state (Adam's step count) is put back, the 16-bit partition is
rewritten from the live region's master, and the step runs as if nothing had happened.  So
losses and weights are those of ``step_in_backward: false`` bit for bit.

A window whose speculative steps are undone read and wrote their state twice.  So after one,
speculation pauses for a number of windows that doubles with each undone window in a row (1, 2,
4, ... at most :data:`MAX_PAUSE`) and starts again at once after a taken one: gradient clipping
that clips in the first steps of a training (DeepSpeed's default ``gradient_clipping`` is 1.0)
costs a few windows' double I/O, not one per step.

All of it lives in one :class:`EarlyState` (``__slots__``); the functions here take it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

from nvmeswap import fused, swapper
from nvmeswap.swapper import SwapState
from zerohooks.adapter import statestore

__all__ = [
    "MAX_PAUSE",
    "EarlyState",
    "abandon",
    "close",
    "drain",
    "end_window",
    "settle",
    "stepped",
    "submit",
]

MAX_PAUSE = 64
"""Most windows speculation pauses for after undone windows in a row."""


class EarlyState:
    """What the speculative steps of one engine know (one window at a time)."""

    __slots__ = (
        "busy",
        "committed",
        "cond",
        "decided",
        "error",
        "failures",
        "fuse",
        "outcome",
        "pause",
        "paused",
        "queue",
        "snapshots",
        "spec_factor",
        "spec_norm",
        "state",
        "steps",
        "thread",
        "touched",
        "undone",
    )

    def __init__(self, state: SwapState, fuse: bool) -> None:
        self.state = state
        self.fuse = fuse
        """Step with the fused Adam kernel (as the plugin's prepare decides for the normal step)."""
        self.cond = threading.Condition()
        self.queue: deque[int] = deque()
        """Sub-groups whose gradients are final, waiting for the thread."""
        self.busy = False
        """The thread is stepping a sub-group now."""
        self.thread: threading.Thread | None = None
        self.touched: list[int] = []
        """Sub-groups this window whose 16-bit partition or optimizer state the thread changed (in order)."""
        self.snapshots: dict[int, dict[str, Any] | None] = {}
        """sub-group -> the optimizer's per-step entries before its speculative step (None: no state yet)."""
        self.committed: set[int] = set()
        """Sub-groups whose speculative step DeepSpeed's step took (its loop skips their step)."""
        self.decided = False
        """This window's speculative steps were committed or undone."""
        self.error: BaseException | None = None
        self.spec_norm: torch.Tensor | None = None
        self.spec_factor: float | None = None
        self.steps = 0
        """Speculative sub-group steps committed so far."""
        self.outcome: str | None = None
        """This window's: ``"taken"``, ``"undone"`` or None (nothing was stepped during backward)."""
        self.failures = 0
        """Windows undone in a row."""
        self.pause = 0
        """Windows left with no speculation (after undone ones)."""
        self.paused = 0
        """Windows with no speculation so far, for the backoff."""
        self.undone = 0
        """Speculative sub-group steps undone so far."""


def stepped(es: EarlyState, index: int) -> bool:
    """Whether DeepSpeed's step finds sub-group ``index`` already stepped (committed)."""
    return index in es.committed


def submit(es: EarlyState, index: int) -> None:
    """Sub-group ``index``'s gradients are final in the boundary backward: step it in the background."""
    if es.decided or es.pause or es.error is not None or index not in es.state.groups:
        return
    if es.spec_factor is None:  # what nothing clipping gives, as DeepSpeed rounds it
        es.spec_norm = torch.zeros((), dtype=torch.float32)
        es.spec_factor = statestore.unscale_factor(es.state.optimizer, es.spec_norm)
    with es.cond:
        es.queue.append(index)
        if es.thread is None:
            es.thread = threading.Thread(target=_worker, args=(es,), name="nvmeswap-early", daemon=True)
            es.thread.start()
        es.cond.notify_all()


def _worker(es: EarlyState) -> None:
    while True:
        with es.cond:
            while not es.queue:
                es.cond.wait()
            index = es.queue.popleft()
            if index < 0:
                return
            es.busy = True
        try:
            if es.error is None:
                with torch.no_grad():
                    _step_one(es, index)
        except BaseException as e:  # reported by settle, in the training thread
            es.error = e
        finally:
            with es.cond:
                es.busy = False
                es.cond.notify_all()


def _step_one(es: EarlyState, index: int) -> None:
    state = es.state
    opt = state.optimizer
    g = state.groups[index]
    es.snapshots[index] = _snapshot(opt.optimizer.state.get(g.master), g.keys)
    es.touched.append(index)
    swapper.swap_in(state, index, prefetch=False)
    with es.cond:  # the next final sub-group is read while this one is stepped
        following = es.queue[0] if es.queue else -1
    if following >= 0:
        swapper.read_next(state, following)
    if fused.usable(es.fuse, opt):
        swapper.sync_gradients(state)
        assert es.spec_factor is not None
        fused.step(state, index, opt.optimizer, statestore.param_group(opt, index), es.spec_factor)
    else:
        statestore.set_master_grad(g.master, swapper.build_gradient(state, index))
        try:
            statestore.unscale_and_step(opt, index, es.spec_norm)
        finally:
            statestore.set_master_grad(g.master, None)
    statestore.bit16_from_master(opt, index)
    swapper.swap_out(state, index, staged=True)


def _snapshot(entries: dict[str, Any] | None, swapped: tuple[str, ...]) -> dict[str, Any] | None:
    """The optimizer's entries for a sub-group that are not swapped (Adam's step count), copied."""
    if entries is None:
        return None
    return {
        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entries.items() if k not in swapped
    }


def _restore(es: EarlyState, index: int) -> None:
    g = es.state.groups[index]
    opt_state = es.state.optimizer.optimizer.state
    saved = es.snapshots.get(index)
    if saved is None:  # its first step: the optimizer had no state for it
        opt_state.pop(g.master, None)
        return
    entries = opt_state[g.master]
    for k in [k for k in entries if k not in g.keys and k not in saved]:
        del entries[k]
    for k, v in saved.items():
        old = entries.get(k)
        if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == v.shape:
            old.copy_(v)
        else:
            entries[k] = v


def drain(es: EarlyState) -> None:
    """Wait until the thread has stepped every sub-group handed to it."""
    with es.cond:
        while es.queue or es.busy:
            es.cond.wait()


def settle(es: EarlyState, commit: bool) -> None:
    """End this window's speculative steps: committed when ``commit`` and DeepSpeed's factor for
    this step is the one assumed, else undone.  A failure of the thread is raised here, after
    every speculative step is undone (the live regions were never written)."""
    if es.decided:
        return
    drain(es)
    es.decided = True
    if not es.touched:
        _raise(es)
        return
    state = es.state
    in_step = commit  # DeepSpeed's sub-group loop follows: it rewrites every 16-bit partition
    if commit and es.error is None:
        factor = statestore.unscale_factor(state.optimizer, statestore.scaled_norm(state.optimizer))
        commit = factor == es.spec_factor
    if commit and es.error is None:
        for i in es.touched:
            g = state.groups[i]
            assert g.staged is not None
            g.checksum, g.generation, g.keys = g.staged
            g.staged, g.region = None, 1 - g.region
            es.committed.add(i)
        es.steps += len(es.touched)
        es.outcome = "taken"
        return
    _undo(es, bit16=not in_step)
    _raise(es)


def _raise(es: EarlyState) -> None:
    error, es.error = es.error, None
    if error is not None:
        raise error


def _undo(es: EarlyState, bit16: bool) -> None:
    """Forget the staged regions and put the optimizer's small state back; ``bit16``: rewrite the
    16-bit partitions from the live masters too (not when DeepSpeed's step loop follows, which
    rewrites them after stepping: no extra read)."""
    state = es.state
    for i in es.touched:
        g = state.groups[i]
        if i in state.resident:  # the thread failed part way through this one: nothing was written
            swapper.swap_out(state, i, write=False)
        g.staged = None
        _restore(es, i)
        if not bit16:
            continue
        swapper.swap_in(state, i, prefetch=False)  # the live region, verified
        try:
            statestore.bit16_from_master(state.optimizer, i)
        finally:
            swapper.swap_out(state, i, write=False)
    es.undone += len(es.touched)
    es.outcome = "undone"


def abandon(es: EarlyState) -> None:
    """Undo this window's speculative steps if DeepSpeed's step has not taken them (a skipped step,
    a checkpoint, detach, the get/set APIs, a forward without a step); nothing otherwise."""
    if es.touched and not es.decided:
        settle(es, commit=False)


def end_window(es: EarlyState) -> None:
    """After the optimizer step (or a skipped one): undo what was not taken, start a new window."""
    abandon(es)
    if es.pause:
        es.pause -= 1
        es.paused += 1
    elif es.outcome == "undone":
        es.failures += 1
        es.pause = min(2 ** (es.failures - 1), MAX_PAUSE)
    elif es.outcome == "taken":
        es.failures = 0
    es.outcome = None
    es.touched.clear()
    es.snapshots.clear()
    es.committed.clear()
    es.decided = False
    es.spec_norm = es.spec_factor = None


def close(es: EarlyState) -> None:
    """Undo what is not committed and stop the thread."""
    try:
        abandon(es)
    finally:
        with es.cond:
            if es.thread is not None:
                es.queue.append(-1)
                es.cond.notify_all()
        if es.thread is not None:
            es.thread.join(timeout=60)
            es.thread = None
