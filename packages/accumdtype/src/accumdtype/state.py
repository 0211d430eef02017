"""Algorithm state of one engine and the pure functions that act on it.

The state is a ``__slots__`` object held by the plugin; nothing is stashed on parameters.  The
functions below implement the accumulation this plugin owns (ZeRO 0, where DeepSpeed 0.19.8
raises ``NotImplementedError`` for any accumulation dtype other than the model's):

* :func:`accumulate`, at each micro-step, adds ``param.grad`` into the parameter's buffer (in
  the accumulation dtype) and drops ``param.grad``, so autograd starts the next micro-step fresh;
* :func:`reduction_tensor` hands the buffer to DeepSpeed's all-reduce at the boundary, which
  reduces it in place (in the reduction dtype);
* :func:`hand_to_optimizer` gives the reduced buffer to the optimizer as ``param.grad``;
* :func:`end_window` zeroes the buffers once the optimizer step (or its skip) is over.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from accumdtype.config import Plan

__all__ = ["AccumState", "accumulate", "buffer_of", "end_window", "hand_to_optimizer", "reduction_tensor"]


class AccumState:
    """Everything accumdtype knows about one engine."""

    __slots__ = ("buffers", "engine", "index", "params", "plan")

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        """The decisions taken for this engine (:class:`accumdtype.config.Plan`)."""
        self.engine: Any = None
        """The DeepSpeedEngine, once built."""
        self.params: list[torch.nn.Parameter] = []
        """Trainable parameters, in module order."""
        self.index: dict[int, int] = {}
        """``id(param)`` -> position in :attr:`params` (and :attr:`buffers`)."""
        self.buffers: list[torch.Tensor] = []
        """This plugin's accumulation buffers, one per parameter (ZeRO 0 with a separate dtype
        only; empty otherwise: DeepSpeed holds the accumulation)."""

    def bind(self, engine: Any, params: Iterable[torch.nn.Parameter], own_buffers: bool) -> None:
        """Attach to ``engine``; allocate zeroed buffers when this plugin owns the accumulation."""
        self.engine = engine
        self.params = [p for p in params if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        dtype = self.plan.accum_dtype
        self.buffers = [torch.zeros_like(p, dtype=dtype) for p in self.params] if own_buffers else []

    def release(self) -> None:
        """Drop every reference (the engine is being detached)."""
        self.engine = None
        self.params, self.index, self.buffers = [], {}, []


def buffer_of(state: AccumState, param: Any) -> torch.Tensor | None:
    """The plugin's buffer of ``param`` (None when DeepSpeed accumulates)."""
    i = state.index.get(id(param))
    return None if i is None or not state.buffers else state.buffers[i]


def accumulate(state: AccumState, param: Any) -> None:
    """Add this micro-step's ``param.grad`` into the buffer and drop ``param.grad``.

    As DeepSpeed does for its ``grad_accum`` tensors, the gradient is converted to the
    accumulation dtype first, then added (for fp32 accumulation of 16-bit gradients the
    conversion is exact and the sum is rounded once per micro-step, in fp32).
    """
    buf = buffer_of(state, param)
    grad = param.grad
    if buf is None or grad is None:
        return
    buf.add_(grad.view(buf.shape).to(buf.dtype))
    param.grad = None


def reduction_tensor(state: AccumState, param: Any, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor DeepSpeed reduces for ``param``: the buffer when the plugin owns it."""
    buf = buffer_of(state, param)
    return tensor if buf is None else buf


def hand_to_optimizer(state: AccumState) -> None:
    """At the boundary, after the reduction: make the reduced buffers the optimizer's gradients.

    A wider buffer (fp32 for a 16-bit model) becomes the storage of ``param.grad`` so that
    DeepSpeed's fp16/bf16 optimizer wrapper copies it to its fp32 master gradients without a
    round trip through 16 bits (the wrapper reads ``param.grad`` and converts it to fp32).  A
    buffer that is not wider is copied into ``param.grad``.
    """
    for param, buf in zip(state.params, state.buffers, strict=True):
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if buf.dtype.itemsize > param.dtype.itemsize:
            param.grad.data = buf
        else:
            param.grad.copy_(buf.view(param.grad.shape))


def end_window(state: AccumState) -> None:
    """After the optimizer step (taken or skipped): zero the buffers for the next window."""
    for param, buf in zip(state.params, state.buffers, strict=True):
        grad = param.grad
        if grad is not None and grad.dtype != param.dtype:
            param.grad = None  # never let autograd accumulate into the borrowed buffer
        buf.zero_()
