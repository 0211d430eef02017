"""Loss-scaler state owned by a plugin, put where DeepSpeed looks for a scaler.

A plugin that scales the loss itself (autocastzero's fp16 scaling of fp32 parameters) owns only
the scale and its rule (a :class:`ScaleOwner`); the DeepSpeed-facing objects are here:

* ZeRO 1-3: :class:`OwnedLossScaler`, a DeepSpeed ``LossScalerBase`` over the owner's state, for
  the ZeRO optimizer's ``loss_scaler`` slot;
* ZeRO 0: :class:`Zero0GradScaler`, the ``torch.amp.GradScaler`` interface the engine calls in
  its ``torch_autocast_z0_gradscaler`` slot, over the owner's :class:`Zero0Scaling`; it reports a
  skipped step to the engine through ``optimizer.overflow`` (which
  :func:`zerohooks.adapter.seams.own_loss_scaling` records and detach removes).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

__all__ = ["OwnedLossScaler", "ScaleOwner", "Zero0GradScaler", "Zero0Scaling"]


class ScaleOwner(Protocol):
    """The loss scale a plugin owns (one per engine)."""

    scale: float
    """The scale the next loss will be multiplied by."""
    dynamic: bool
    """The scale moves (backs off on overflow, grows after good steps)."""

    def update_scale(self, overflow: bool) -> None:
        """Account one optimizer step (skipped when ``overflow``, the all-rank verdict) and move
        :attr:`scale`."""


class Zero0Scaling(Protocol):
    """What a plugin does on ZeRO 0, where its own gradients are checked and unscaled (the
    engine all-reduces them before the step, so every rank reaches the same verdict)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current scale."""

    def unscale_(self) -> None:
        """Check the gradients for inf/nan and divide them by the scale (once per step)."""

    @property
    def overflowed(self) -> bool:
        """The verdict of the last :meth:`unscale_`."""

    def update(self) -> None:
        """Move the scale after the step, and forget the verdict."""

    def get_scale(self) -> float:
        """The current scale."""


class OwnedLossScaler(LossScalerBase):  # type: ignore[misc]
    """DeepSpeed's loss-scaler interface over a :class:`ScaleOwner` (ZeRO 1-3 optimizers).

    DeepSpeed scales the loss with :meth:`scale_loss`, divides gradients by ``cur_scale`` and calls
    :meth:`update_scale` once per step with its all-rank overflow verdict.  DeepSpeed 0.19.8 calls
    ``update_scale`` *before* it divides the gradients by ``cur_scale``, so a scale that grows at a
    step would under-weight that step's gradients by half: ``cur_scale`` therefore stays the scale
    the current gradients were made with until the next loss is scaled.  DeepSpeed pickles this
    object into its checkpoints (attributes ``state``, ``dynamic``, ``in_use``).
    """

    def __init__(self, state: ScaleOwner) -> None:  # no super().__init__: the scale is the state's
        self.state = state
        self.dynamic = state.dynamic
        self.in_use = state.scale

    @property
    def cur_scale(self) -> float:
        return float(self.in_use)

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.state.scale = self.in_use = float(value)

    @property
    def next_scale(self) -> float:
        """The scale the next loss will be multiplied by (``cur_scale`` lags it until then).

        Plugins that keep state in loss-scaled units (loco's error-feedback buffers) read this
        after a step to rescale to the next step's gradients."""
        return float(self.state.scale)

    def update_scale(self, overflow: bool) -> None:
        self.state.update_scale(bool(overflow))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self.in_use = self.state.scale
        return loss * self.in_use

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}(scale={self.state.scale}, dynamic={self.dynamic})"


class Zero0GradScaler:
    """The GradScaler interface DeepSpeed's engine calls on ZeRO 0 (``scale``, ``unscale_``,
    ``step``, ``update``), over a plugin's :class:`Zero0Scaling`.  On overflow the optimizer step
    is not taken and ``optimizer.overflow`` tells the engine to count it as skipped (and not to
    step the learning-rate schedule)."""

    __slots__ = ("owner",)

    def __init__(self, owner: Zero0Scaling) -> None:
        self.owner = owner

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.owner.scale(loss)

    def unscale_(self, optimizer: Any) -> None:
        self.owner.unscale_()

    def step(self, optimizer: Any) -> None:
        self.owner.unscale_()
        overflow = bool(self.owner.overflowed)
        optimizer.overflow = overflow
        if not overflow:
            optimizer.step()

    def update(self) -> None:
        self.owner.update()

    def get_scale(self) -> float:
        return float(self.owner.get_scale())

    def is_enabled(self) -> bool:
        return True
