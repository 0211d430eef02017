"""The state of mixedlayers for one model: which tensors stay fp32, and keeping them there.

DeepSpeed 0.19.8 casts every floating parameter of the model to the training dtype in
``DeepSpeedEngine._configure_distributed_model`` (``p.data = p.data.to(dtype)``), then moves the
model with ``module.to(device)`` and only afterwards builds its optimizer from the parameters.
:func:`keep_fp32` remembers the fp32 tensor of every kept parameter before DeepSpeed starts;
:func:`restore_fp32` puts them back in place of the 16-bit copies at that ``module.to`` call
(:func:`shadow_module_to`), so the optimizer, ZeRO partitioning and the fp32 masters are built
from the exact fp32 values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixedlayers.config import MixedLayersConfig, OutputDtype

__all__ = ["MixedState", "keep_fp32", "restore_fp32", "shadow_module_to", "split_param_groups"]

_MISSING = object()


class MixedState:
    """Which modules, parameters and buffers are kept in fp32, and what is pending."""

    __slots__ = (
        "boundaries",
        "buffers",
        "cast_inputs",
        "handles",
        "modules",
        "output_dtype",
        "param_ids",
        "params",
        "saved",
        "stack",
        "train_dtype",
    )

    def __init__(self, cfg: MixedLayersConfig, train_dtype: torch.dtype) -> None:
        self.train_dtype = train_dtype
        """The 16-bit dtype the rest of the model trains in."""
        self.output_dtype: OutputDtype = cfg.output_dtype
        """``"input"``, ``"train"`` or ``"fp32"`` (see :class:`MixedLayersConfig`)."""
        self.cast_inputs = cfg.cast_inputs
        """Cast 16-bit floating arguments of a boundary module to fp32."""
        self.modules: dict[str, nn.Module] = {}
        """Every selected module, by qualified name."""
        self.boundaries: dict[str, nn.Module] = {}
        """The outermost selected modules, whose inputs and outputs are cast."""
        self.params: list[nn.Parameter] = []
        """Parameters kept in fp32 (those of the selected modules and their children)."""
        self.param_ids: frozenset[int] = frozenset()
        """``id`` of each kept parameter (the hot-path membership test)."""
        self.buffers: list[torch.Tensor] = []
        """Floating buffers kept in fp32 (when ``keep_buffers``)."""
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(tensor, its fp32 data) to put back after DeepSpeed's cast; emptied once restored."""
        self.stack: list[torch.dtype] = []
        """Surrounding dtype of each boundary module whose forward is running."""
        self.handles: list[Any] = []
        """Forward-hook handles and the ``module.to`` shadow's remover."""

    def is_fp32(self, param: Any) -> bool:
        """Whether ``param`` is one of the kept parameters."""
        return id(param) in self.param_ids

    def release(self) -> None:
        """Remove the forward hooks and forget the pending tensors."""
        for h in reversed(self.handles):
            h.remove()
        self.handles.clear()
        self.saved.clear()
        self.stack.clear()


def keep_fp32(state: MixedState, model: nn.Module, modules: dict[str, nn.Module], keep_buffers: bool) -> None:
    """Make the selected modules' parameters (and buffers) fp32 and remember their fp32 data."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for module in modules.values():
        for p in module.parameters():
            params.setdefault(id(p), p)
        if keep_buffers:
            for b in module.buffers():
                if b.is_floating_point():
                    buffers.setdefault(id(b), b)
    state.modules = dict(modules)
    state.params = list(params.values())
    state.param_ids = frozenset(params)
    state.buffers = list(buffers.values())
    state.saved = []
    for t in (*state.params, *state.buffers):
        if t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()
        if t.is_floating_point():
            state.saved.append((t, t.data))


def restore_fp32(state: MixedState, params: bool = True) -> int:
    """Put the remembered fp32 data back where DeepSpeed cast it; returns how many were cast.

    ``params=False`` restores the buffers only and keeps the parameters' fp32 data pending (ZeRO 3
    partitions the parameters first: :mod:`mixedlayers.zero3` restores them afterwards).
    """
    restored = 0
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t, data in state.saved:
        if not params and isinstance(t, nn.Parameter):
            pending.append((t, data))
        elif t.dtype != torch.float32:
            t.data = data if data.device == t.device else data.to(t.device)
            restored += 1
    state.saved = pending
    return restored


class _Remover:
    __slots__ = ("model", "previous")

    def __init__(self, model: nn.Module, previous: Any) -> None:
        self.model, self.previous = model, previous

    def remove(self) -> None:
        if self.previous is _MISSING:
            self.model.__dict__.pop("to", None)
        else:
            self.model.__dict__["to"] = self.previous
        self.previous = _MISSING


def shadow_module_to(state: MixedState, model: nn.Module, params: bool = True) -> _Remover:
    """Shadow ``model.to`` (this instance only) so its first call restores the fp32 tensors first.

    DeepSpeed's engine calls ``module.to(device)`` right after casting the parameters and before
    building the optimizer.  The shadow removes itself on that first call.  ``params`` is handed
    to :func:`restore_fp32`.
    """
    previous = model.__dict__.get("to", _MISSING)
    original: Callable[..., Any] = model.to
    remover = _Remover(model, previous)

    def to(*args: Any, **kwargs: Any) -> Any:
        remover.remove()
        restore_fp32(state, params)
        return original(*args, **kwargs)

    model.__dict__["to"] = to
    return remover


def split_param_groups(state: MixedState, model_parameters: Any) -> list[dict[str, Any]]:
    """Split every param group into its 16-bit part and its fp32 part (same hyperparameters).

    DeepSpeed's optimizers flatten each group into one buffer of one dtype and take the loss
    scaler's dtype from the first parameter of the first group, so the 16-bit parts come first
    (in the caller's order), then the fp32 parts.  Empty parts are dropped.
    """
    items = list(model_parameters)
    if not items:
        return []
    groups: list[dict[str, Any]]
    if all(isinstance(g, dict) for g in items):
        groups = items
    elif all(isinstance(p, torch.Tensor) for p in items):
        groups = [{"params": items}]
    else:
        raise TypeError(
            "mixedlayers: model_parameters must be an iterable of parameters or of param-group dicts "
            f"(with a 'params' key); got elements of types {sorted({type(x).__name__ for x in items})}"
        )
    low: list[dict[str, Any]] = []
    high: list[dict[str, Any]] = []
    for group in groups:
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        rest = {k: v for k, v in group.items() if k != "params"}
        lo = [p for p in ps if id(p) not in state.param_ids]
        hi = [p for p in ps if id(p) in state.param_ids]
        if lo:
            low.append({**rest, "params": lo})
        if hi:
            high.append({**rest, "params": hi})
    return low + high
