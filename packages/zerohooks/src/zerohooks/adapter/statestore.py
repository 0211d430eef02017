"""ZeRO 3's fp32 optimizer state, held elsewhere by a plugin: the seam ``optimizer_state_store``.

A plugin that keeps the fp32 masters and moments of some sub-groups out of RAM (nvmeswap) asks
here instead of naming DeepSpeed's ZeRO-3 internals:

* where the state lies: each sub-group's size (:func:`sub_group_numels`), its fp32 master
  (:func:`master`), where a parameter's gradient lies in its sub-group (:func:`position`,
  :func:`positions`), the fp32 gradient partitions DeepSpeed keeps per parameter
  (:func:`gradient_partitions`), a sub-group's optimizer param group (:func:`param_group`);
* the fp32 master's storage swapped for another tensor, its gradient set (:func:`set_master`,
  :func:`set_master_grad`): the master keeps its identity (the inner optimizer's param groups and
  state are keyed by it), only what it holds changes;
* the gradient norm DeepSpeed records at the accumulation boundary, recorded for a gradient the
  plugin takes over (:func:`record_gradient_norm`);
* the checkpoint load of the optimizer's state dict replaced while a load runs
  (:func:`rigid_load_replaced`), put back when it ends.

Nothing here keeps anything across steps; the storage swaps are the plugin's, which puts
DeepSpeed's own tensors back when it closes.  The names are those of the seam
``optimizer_state_store`` of :data:`zerohooks.surface.SEAMS`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zerohooks import surface

__all__ = [
    "SEAM",
    "check",
    "gradient_partitions",
    "master",
    "param_group",
    "position",
    "positions",
    "record_gradient_norm",
    "rigid_load_replaced",
    "set_master",
    "set_master_grad",
    "sub_group_numels",
]

SEAM = "optimizer_state_store"
"""The seam's name (a plugin's ``deepspeed_seams``)."""

_GRAD_PARTITIONS = surface.ZERO3_PRIVATE + "param_id_to_grad_partition"
_RIGID = "_rigid_load_state_dict"


def check(opt: Any) -> None:
    """Raise :class:`zerohooks.DeepSpeedInternalMissing` now when ``opt`` (a ZeRO-3 optimizer)
    lacks a name this seam touches."""
    surface.check_object(opt, surface.ZERO3, 3, SEAM)


def sub_group_numels(opt: Any) -> list[int]:
    """The number of elements of each sub-group's partition on this rank."""
    return [int(n) for n in opt.fp16_partitioned_groups_flat_numel]


def master(opt: Any, sub_group: int) -> torch.Tensor:
    """Sub-group ``sub_group``'s fp32 master partition (DeepSpeed's own tensor)."""
    out: torch.Tensor = opt.fp32_partitioned_groups_flat[sub_group]
    return out


def set_master(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Make the fp32 master ``tensor`` hold ``value``'s storage (an empty tensor: none)."""
    tensor.data = value


def set_master_grad(tensor: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Give the fp32 master ``tensor`` the fp32 gradient DeepSpeed's step reads (None: none)."""
    tensor.grad = grad


def gradient_partitions(opt: Any) -> dict[int, torch.Tensor]:
    """DeepSpeed's fp32 gradient partition of each parameter (by ``ds_id``): its own dict, read it."""
    out: dict[int, torch.Tensor] = getattr(opt, _GRAD_PARTITIONS)
    return out


def positions(opt: Any) -> dict[int, Any]:
    """DeepSpeed's own map: parameter id -> (sub-group, offset, numel) of its gradient."""
    out: dict[int, Any] = opt.grad_position
    return out


def position(opt: Any, param: Any) -> tuple[int, int, int]:
    """``(sub_group, offset, numel)``: where ``param``'s gradient lies in its sub-group."""
    i, offset, numel = opt.grad_position[opt.get_param_id(param)]
    return int(i), int(offset), int(numel)


def param_group(opt: Any, sub_group: int) -> dict[str, Any]:
    """The inner optimizer's param group sub-group ``sub_group`` belongs to."""
    out: dict[str, Any] = opt.optimizer.param_groups[opt.sub_group_to_group_id[sub_group]]
    return out


def record_gradient_norm(opt: Any, param: Any, grad: torch.Tensor) -> None:
    """Record ``param``'s gradient norm for the step's clipping, as DeepSpeed does at the boundary
    for a gradient it offloads itself."""
    opt.norm_for_param_grads[opt.get_param_id(param)] = opt._constant_buffered_norm2(grad)


@contextlib.contextmanager
def rigid_load_replaced(opt: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the context, the ZeRO-3 optimizer's load of a checkpoint's state dict is
    ``make(original)`` (called as ``(state_dict, load_optimizer_states=True)``); DeepSpeed's own
    again afterwards, whatever happened."""
    had = _RIGID in vars(opt)
    previous = vars(opt).get(_RIGID)
    setattr(opt, _RIGID, make(getattr(opt, _RIGID)))
    try:
        yield
    finally:
        if had:
            setattr(opt, _RIGID, previous)
        else:
            delattr(opt, _RIGID)
