"""mixedlayers composed with autocastzero: the kept modules compute in fp32 outside autocast.

With autocastzero every parameter is already fp32 and the engine's forward runs under
``torch.autocast``, so there is no 16-bit copy to keep the modules out of.  Keeping a module in
fp32 then means: its forward runs with autocast switched off (its 16-bit floating inputs cast to
fp32 on entry), and its parameters' gradients are reduced, and on ZeRO 3 all-gathered, in fp32
whatever autocastzero chose for their class.  Outputs stay fp32: the autocast region around the
module casts them where the next operation runs in 16 bits.

Nothing of DeepSpeed's init, param groups or accumulation changes (all parameters are fp32), so
only forward hooks and two dtype hooks are installed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixedlayers.casting import cast_floats
from mixedlayers.state import MixedState

__all__ = ["AUTOCAST_PLUGIN", "install_autocast_off", "record_kept"]

AUTOCAST_PLUGIN = "autocastzero"
"""The plugin whose presence switches mixedlayers to this mode."""

_LOW = (torch.float16, torch.bfloat16)


def record_kept(state: MixedState, modules: dict[str, nn.Module]) -> None:
    """Remember the selected modules and their parameters (already fp32: nothing is cast)."""
    params: dict[int, nn.Parameter] = {}
    for module in modules.values():
        for p in module.parameters():
            params.setdefault(id(p), p)
    state.modules = dict(modules)
    state.params = list(params.values())
    state.param_ids = frozenset(params)


def _device_type() -> str:
    """The device type autocast runs on (the accelerator's, as autocastzero uses it)."""
    from deepspeed.accelerator import get_accelerator

    return str(get_accelerator().device_name())


def install_autocast_off(state: MixedState, contexts: list[Any]) -> None:
    """On every outermost kept module: autocast off and fp32 inputs for its forward.

    ``contexts`` holds the autocast contexts of the modules whose forward is running (entered in
    the pre-hook, left in the post-hook, which also runs when the forward raises)."""

    device = _device_type()

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        off = torch.autocast(device_type=device, enabled=False)
        off.__enter__()
        contexts.append(off)
        if not state.cast_inputs:
            return None
        return cast_floats(args, _LOW, torch.float32), cast_floats(kwargs, _LOW, torch.float32)

    def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if contexts:
            contexts.pop().__exit__(None, None, None)
        return None

    for module in state.boundaries.values():
        state.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        state.handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
