"""``grad_accum`` / ``grad_reduc``: DeepSpeed PR #2847's two gradient tensors, per parameter.

DeepSpeed names them as attributes of the parameter (``param.grad_accum``, ``param.grad_reduc``);
accumdtype keeps no state on parameters, so they are functions of the engine and the parameter:

=========  =====================================  ==========================================
stage      ``grad_accum`` (accumulates)            ``grad_reduc`` (is reduced)
=========  =====================================  ==========================================
0          accumdtype's buffer (whole parameter)   the same buffer, at the boundary
1          DeepSpeed's ``param.grad_accum``        the same tensor, at the boundary
           (whole parameter, local sum); after
           the boundary reduction this rank's
           partition of the reduced gradient
2          this rank's partition of the reduced    ``param.grad`` (each micro-step)
           gradient (DeepSpeed's fp32 buffer)
3          this rank's partition (DeepSpeed's      ``param.grad`` (each micro-step)
           ``grad_partitions_flat_buffer``)
=========  =====================================  ==========================================

With the accumulation dtype equal to the model dtype both are ``param.grad`` on stages 0-2 (as in
PR #2847); ZeRO 3 always accumulates in its partitions.  Partition tensors are flat: they cover
the elements :func:`grad_accum_range` of the flattened parameter.
"""

from __future__ import annotations

from typing import Any

import torch

import zerohooks
from accumdtype.state import AccumState, buffer_of
from zerohooks.adapter import gradview

__all__ = ["accum_state", "accumulation_bytes", "grad_accum", "grad_accum_range", "grad_reduc"]


def check_internals(optimizer: Any, stage: int) -> None:
    """Raise :class:`zerohooks.DeepSpeedInternalMissing` now, not at the first accessor call
    (what the adapter's gradient-partition view reads, :mod:`zerohooks.adapter.gradview`)."""
    gradview.check_partition_view(optimizer, stage)


def accum_state(engine: Any) -> AccumState:
    """The :class:`~accumdtype.state.AccumState` of an engine built with accumdtype enabled."""
    att = zerohooks.attachment(engine)
    for plugin in att.plugins if att is not None else ():
        state = getattr(plugin, "state", None)
        if isinstance(state, AccumState) and state.engine is engine:
            return state
    raise ValueError(
        "this engine has no accumdtype attached: build it with zerohooks.initialize and an "
        '"accumdtype" section in the DeepSpeed config'
    )


def _locate(engine: Any, param: Any) -> tuple[torch.Tensor | None, int]:
    state = accum_state(engine)
    plan = state.plan
    if plan.stage == 3:
        found = gradview.accumulated_partition(engine, 3, param)
        return (None, 0) if found is None else found
    if plan.stage == 0:
        buf = buffer_of(state, param)
        return (param.grad if buf is None else buf), 0
    if not plan.separate:
        return param.grad, 0
    separate = gradview.separate_accumulation(param) if plan.stage == 1 else None
    if separate is not None:
        return separate, 0
    found = gradview.accumulated_partition(engine, plan.stage, param)
    return (None, 0) if found is None else found


def grad_accum(engine: Any, param: Any) -> torch.Tensor | None:
    """The tensor that holds this rank's accumulated gradient of ``param`` (see the table above).

    None when nothing is accumulated yet, or when this rank holds no part of ``param``.
    """
    return _locate(engine, param)[0]


def grad_accum_range(engine: Any, param: Any) -> tuple[int, int]:
    """``(start, stop)``: the elements of ``param.flatten()`` that :func:`grad_accum` covers."""
    tensor, start = _locate(engine, param)
    return (start, start) if tensor is None else (start, start + tensor.numel())


def grad_reduc(engine: Any, param: Any) -> torch.Tensor | None:
    """The tensor the next reduction of ``param`` hands to the collective (see the table above)."""
    state = accum_state(engine)
    plan = state.plan
    if plan.stage == 0:
        buf = buffer_of(state, param)
        return param.grad if buf is None else buf
    tensor: torch.Tensor | None = (
        gradview.separate_accumulation(param) if plan.stage == 1 and plan.separate else param.grad
    )
    return tensor


def accumulation_bytes(engine: Any) -> int:
    """Bytes of the accumulation tensors on this rank (parameter elements only, no padding)."""
    state = accum_state(engine)
    total = 0
    for param in state.params:
        tensor = grad_accum(engine, param)
        if tensor is not None:
            total += tensor.numel() * tensor.element_size()
    return total
