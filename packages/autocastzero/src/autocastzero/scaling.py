"""fp16 loss scaling for fp32-parameter training: the plugin's scaler and DeepSpeed's two slots for it.

The scale lives in a :class:`ScaleState`; :func:`update` is the whole dynamic algorithm.  The
adapter's loss-scaler seam (:func:`zerohooks.adapter.seams.own_loss_scaling`) hands that state to
DeepSpeed where it already expects a scaler, so DeepSpeed's own code scales the loss, checks
every gradient for inf/nan across ranks, unscales, skips the step and counts it
(``engine.skipped_steps``, no learning-rate step):

* ZeRO 1-3: :class:`ZeroLossScaler` (the adapter's ``OwnedLossScaler`` under this package's
  name, the one DeepSpeed pickles into checkpoints) replaces the ZeRO optimizer's ``loss_scaler``
  (a static scale of 1 when parameters are fp32).
* ZeRO 0: :class:`Zero0Scaler` checks and unscales the gradients; the adapter puts it in the
  engine's GradScaler slot and reports a skipped step to the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from zerohooks.adapter.seams import OwnedLossScaler

__all__ = [
    "STUCK_STEPS",
    "ScaleState",
    "Zero0Scaler",
    "ZeroLossScaler",
    "grads_overflow",
    "load",
    "save",
    "stuck_message",
    "update",
]

STUCK_STEPS = 10
"""Consecutive skipped steps at the lowest scale the scaler can reach (a static scale, or a dynamic
one at ``min_loss_scale``) after which :func:`stuck_message` reports the run: backing off cannot
help any more, so the run would skip every step from then on without a word."""


class ScaleState:
    """The loss scale and its counters (one per engine)."""

    __slots__ = (
        "dynamic",
        "good_steps",
        "hysteresis",
        "hysteresis_left",
        "min_scale",
        "overflows",
        "scale",
        "skipped_run",
        "steps",
        "stuck_run",
        "window",
    )

    def __init__(
        self, scale: float, dynamic: bool, window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0
    ) -> None:
        self.scale = float(scale)
        """The current loss scale."""
        self.dynamic = dynamic
        """Back off on overflow and grow after :attr:`window` good steps (else a static scale)."""
        self.window = window
        self.hysteresis = hysteresis
        self.hysteresis_left = hysteresis
        """Overflows still tolerated before the scale halves."""
        self.min_scale = float(min_scale)
        self.good_steps = 0
        """Steps without overflow since the last overflow or growth."""
        self.steps = 0
        """Optimizer steps seen (taken or skipped)."""
        self.overflows = 0
        """Steps skipped for inf/nan gradients."""
        self.skipped_run = 0
        """Consecutive steps skipped up to the last one (0 after a step that was taken)."""
        self.stuck_run = 0
        """Of those, the steps skipped at a scale that could not back off further (static, or at
        ``min_scale``)."""

    def update_scale(self, overflow: bool) -> None:
        """:func:`update` (the adapter's ``ScaleOwner`` interface)."""
        update(self, overflow)


def update(state: ScaleState, overflow: bool) -> None:
    """Account one optimizer step (skipped when ``overflow``) and move the scale.

    The rule of DeepSpeed's fp16 ``DynamicLossScaler`` (``consecutive_hysteresis`` false), so
    that an fp16 run keeps its scale trajectory when it moves to fp32 parameters: an overflow
    halves the scale (not below ``min_scale``) once ``hysteresis`` overflows have been tolerated;
    the scale doubles at a good step preceded by a positive multiple of ``window`` good steps
    since the last overflow, which also refills the hysteresis.
    """
    state.steps += 1
    if overflow:
        state.overflows += 1
        state.good_steps = 0
        state.skipped_run += 1
        if not state.dynamic or state.scale <= state.min_scale:
            state.stuck_run += 1
        if state.dynamic:
            if state.hysteresis == 1 or state.hysteresis_left == 1:
                state.scale = max(state.scale / 2.0, state.min_scale)
            else:
                state.hysteresis_left -= 1
        return
    state.skipped_run = state.stuck_run = 0
    stable = state.good_steps
    state.good_steps += 1
    if state.dynamic and stable > 0 and stable % state.window == 0:
        state.hysteresis_left = state.hysteresis
        state.scale *= 2.0


def save(state: ScaleState) -> dict[str, Any]:
    """The state as plain numbers (for checkpoints)."""
    return {name: getattr(state, name) for name in ScaleState.__slots__}


def load(state: ScaleState, saved: dict[str, Any]) -> None:
    """Restore what :func:`save` returned (the skip-run counters of older checkpoints, which lack
    them, restart from 0)."""
    for name in ScaleState.__slots__:
        setattr(state, name, saved.get(name, 0) if name in _NEWER else saved[name])


_NEWER = frozenset({"skipped_run", "stuck_run"})


def stuck_message(state: ScaleState) -> str | None:
    """The warning for a run that skips every step, once per run of skipped steps: when the
    :data:`STUCK_STEPS`-th consecutive step was skipped at the lowest scale the scaler can reach;
    None at every other step."""
    if state.stuck_run != STUCK_STEPS:
        return None
    if state.dynamic:
        where = f"at the minimum scale (min_loss_scale {state.min_scale:g}), which cannot back off further"
        fix = "lower autocastzero.min_loss_scale if the gradients are merely large"
    else:
        where = f"at the static loss_scale {state.scale:g}"
        fix = "use a smaller loss_scale, or 0 for dynamic scaling"
    return (
        f"autocastzero: the last {state.skipped_run} optimizer steps were all skipped for inf/nan gradients "
        f"({state.stuck_run} of them {where}); the loss scale is {state.scale:g} and training makes no "
        "progress. Likely cause: the loss or the gradients are inf/nan at any scale (check the inputs, "
        f"the learning rate, a log or division of zero in the loss), or float16 overflows: {fix}"
    )


def grads_overflow(grads: Iterable[torch.Tensor | None]) -> bool:
    """True when any gradient holds an inf or a nan."""
    flags = [torch.logical_not(torch.isfinite(g).all()) for g in grads if g is not None]
    return bool(torch.stack(flags).any()) if flags else False


class ZeroLossScaler(OwnedLossScaler):
    """The adapter's :class:`~zerohooks.adapter.lossscale.OwnedLossScaler` over a
    :class:`ScaleState` (ZeRO 1-3), under this package's import path: DeepSpeed pickles it into
    its checkpoints, which name it ``autocastzero.scaling.ZeroLossScaler``."""


class Zero0Scaler:
    """ZeRO 0's scaling over a :class:`ScaleState` (the adapter's ``Zero0Scaling`` interface).

    ZeRO 0 all-reduces gradients before the step, so every rank sees the same (possibly
    non-finite) gradients and reaches the same verdict without a collective.  On overflow the
    adapter does not take the optimizer step and has the engine count it as skipped (and not
    step the learning-rate schedule).
    """

    __slots__ = ("_overflow", "_unscaled", "params", "state")

    def __init__(self, state: ScaleState, params: list[torch.nn.Parameter]) -> None:
        self.state = state
        self.params = params
        self._unscaled = False
        self._overflow = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.state.scale

    def unscale_(self) -> None:
        if self._unscaled:
            return
        self._overflow = grads_overflow(p.grad for p in self.params)
        if not self._overflow and self.state.scale != 1.0:
            inv = 1.0 / self.state.scale
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(inv)
        self._unscaled = True

    @property
    def overflowed(self) -> bool:
        """The verdict of the last :meth:`unscale_`."""
        return self._overflow

    def update(self) -> None:
        update(self.state, self._overflow)
        self._unscaled = False
        self._overflow = False

    def get_scale(self) -> float:
        return self.state.scale


def initial_scale(loss_scale: float, initial_scale_power: int) -> tuple[float, bool]:
    """(first scale, dynamic) from the section's ``loss_scale`` and ``initial_scale_power``."""
    if loss_scale > 0:
        return loss_scale, False
    return math.ldexp(1.0, initial_scale_power), True
