"""Casts at the boundaries of the fp32 modules, as forward hooks.

On entry, bf16/fp16 floating arguments become fp32; on exit, fp32 floating outputs go back to
the surrounding dtype.  Both are ordinary autograd ops, so backward casts the gradients the
other way by itself: the fp32 module sees fp32 gradients and the 16-bit model 16-bit ones.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from mixedlayers.state import MixedState

__all__ = ["cast_floats", "explain_dtype_errors", "install_boundary_hooks", "surrounding_dtype"]

_LOW = (torch.float16, torch.bfloat16)


def cast_floats(obj: Any, src: tuple[torch.dtype, ...], dst: torch.dtype) -> Any:
    """``obj`` with every tensor whose dtype is in ``src`` cast to ``dst`` (through tuples,
    lists, dicts and named tuples; other objects pass through unchanged)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dst) if obj.dtype in src else obj
    if isinstance(obj, tuple):
        items = [cast_floats(x, src, dst) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if type(obj) is list:
        return [cast_floats(x, src, dst) for x in obj]
    if type(obj) is dict:
        return {k: cast_floats(v, src, dst) for k, v in obj.items()}
    return obj


def _first_float(obj: Any) -> torch.dtype | None:
    if isinstance(obj, torch.Tensor):
        return obj.dtype if obj.is_floating_point() else None
    if isinstance(obj, (tuple, list)):
        values: Any = obj
    elif isinstance(obj, dict):
        values = obj.values()
    else:
        return None
    for x in values:
        d = _first_float(x)
        if d is not None:
            return d
    return None


def surrounding_dtype(state: MixedState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype:
    """The dtype outputs return to: that of the first floating input, else the training dtype."""
    if state.output_dtype == "train":
        return state.train_dtype
    if state.output_dtype == "fp32":
        return torch.float32
    d = _first_float(args)
    if d is None:
        d = _first_float(kwargs)
    return state.train_dtype if d is None else d


def install_boundary_hooks(state: MixedState) -> None:
    """Register the entry and exit casts on every outermost fp32 module (handles in ``state``)."""

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state.stack.append(surrounding_dtype(state, args, kwargs))
        if not state.cast_inputs:
            return None
        return cast_floats(args, _LOW, torch.float32), cast_floats(kwargs, _LOW, torch.float32)

    def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        dtype = state.stack.pop() if state.stack else state.train_dtype
        if dtype == torch.float32:
            return None
        return cast_floats(output, (torch.float32,), dtype)

    for module in state.boundaries.values():
        state.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        state.handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))


_MISMATCH = ("dtype", "expected scalar type", "must have the same", "expected both")


def explain_dtype_errors(state: MixedState, model: nn.Module) -> None:
    """A dtype error raised by the model's forward gets a note naming the settings that cause
    it, when ``cast_inputs: false`` or ``output_dtype: "fp32"`` is set: the first hands 16-bit
    inputs to fp32 modules, the second fp32 outputs to the 16-bit layers after them."""
    risky = []
    if not state.cast_inputs:
        risky.append("cast_inputs: false (the kept modules receive 16-bit inputs as they are)")
    if state.output_dtype == "fp32":
        risky.append('output_dtype: "fp32" (the layers after a kept module receive its fp32 outputs)')
    if not risky:
        return
    kept = ", ".join(repr(name) for name in state.boundaries) or "none"

    def note(module: nn.Module, args: Any, output: Any) -> None:
        error = sys.exc_info()[1]  # set only when forward raised (always_call runs this hook then)
        if not isinstance(error, (RuntimeError, TypeError)) or not any(k in str(error) for k in _MISMATCH):
            return
        add = getattr(error, "add_note", None)  # Python >= 3.11
        if add is not None and not any("mixedlayers" in n for n in getattr(error, "__notes__", ())):
            add(
                f"mixedlayers keeps {kept} in fp32 with {'; '.join(risky)}. A dtype mismatch in "
                "forward usually comes from these settings: leave cast_inputs true and output_dtype "
                '"input" (the defaults), or keep the modules around the failing layer in fp32 too.'
            )

    state.handles.append(model.register_forward_hook(note, always_call=True))
