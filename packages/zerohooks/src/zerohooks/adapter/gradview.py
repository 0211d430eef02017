"""A read-only view of where DeepSpeed's ZeRO optimizers keep a parameter's accumulated gradient.

Plugins that report or save the accumulated gradient (accumdtype's ``grad_accum``) ask here
instead of naming DeepSpeed's partition buffers: ZeRO 1/2's compact fp32 partition buffer (with
``data_types.grad_accum_dtype``), ZeRO 1's separate ``grad_accum`` attribute, ZeRO 3's per-parameter
fp32 gradient partition.  Nothing here changes DeepSpeed's state except :func:`restore_micro_steps`,
the counter DeepSpeed does not restore from a checkpoint.  The names are those of the seam
``gradient_partitions`` of :data:`zerohooks.adapter.surface.SEAMS`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerohooks.adapter import surface

__all__ = [
    "accumulated_partition",
    "check_partition_view",
    "restore_micro_steps",
    "separate_accumulation",
    "staged_in_bucket",
]

_Z3_PARTITIONS = surface.ZERO3_PRIVATE + "param_id_to_grad_partition"


def check_partition_view(optimizer: Any, stage: int) -> None:
    """Raise :class:`zerohooks.DeepSpeedInternalMissing` now, not at the first call, when the
    ZeRO optimizer of ``stage`` lacks what this view reads (the seam ``gradient_partitions``)."""
    if stage in (1, 2, 3):
        owner = surface.ZERO3 if stage == 3 else surface.ZERO12
        surface.check_object(optimizer, owner, stage, "gradient_partitions")


def _z12_partition(opt: Any, param: Any) -> tuple[torch.Tensor, int] | None:
    group = opt._get_param_group_idx(param)
    if not opt._use_compact_grad_partition_buffer(group):
        return None
    built = opt.averaged_gradients.get(group)
    if built is None or getattr(built, "flat_partition", None) is None:
        return None  # nothing accumulated in this window yet (DeepSpeed builds it lazily)
    param_id = opt.get_param_id(param)
    rank = dist.get_rank(group=opt.real_dp_process_group[group])
    starts = opt.grad_start_offset[group][rank]
    if param_id not in starts:
        return None  # no element of this parameter is in this rank's partition
    source = int(starts[param_id])
    dest = int(opt.grad_partition_insertion_offset[group][rank][param_id])
    numel = min(param.numel() - source, int(opt.partition_size[group]) - dest)
    return opt._get_compact_grad_partition_slice(group, rank, param_id, numel), source


def _z3_partition(opt: Any, param: Any) -> tuple[torch.Tensor, int] | None:
    partition = getattr(opt, _Z3_PARTITIONS)[param.ds_id]
    size = param.partition_numel()
    start = opt._get_param_partition_rank(param) * size
    valid = max(0, min(size, param.ds_numel - start))
    if valid == 0:
        return None
    return partition.narrow(0, 0, valid), start


def accumulated_partition(engine: Any, stage: int, param: Any) -> tuple[torch.Tensor, int] | None:
    """``(tensor, first)``: this rank's slice of the ZeRO optimizer's fp32 partition holding
    ``param``'s accumulated gradient, and the element of ``param.flatten()`` it starts at; None
    when nothing is accumulated yet in this window or this rank holds no part of ``param``.
    ZeRO 1/2: the compact partition buffer (separate accumulation only); ZeRO 3: the gradient
    partition.  The tensor is DeepSpeed's own: read it, do not keep it across steps."""
    if stage == 3:
        return _z3_partition(engine.optimizer, param)
    if stage in (1, 2):
        return _z12_partition(engine.optimizer, param)
    raise ValueError(f"accumulated_partition: ZeRO stage {stage} has no partition (1, 2 or 3 is accepted)")


def separate_accumulation(param: Any) -> torch.Tensor | None:
    """ZeRO 1 with separate accumulation: the full-size buffer DeepSpeed accumulates ``param``'s
    gradient in (its ``grad_accum`` attribute), or None."""
    tensor = getattr(param, "grad_accum", None)
    return tensor if isinstance(tensor, torch.Tensor) else None


def staged_in_bucket(engine: Any, param: Any) -> bool:
    """ZeRO 1/2: ``param``'s gradient is copied into the contiguous bucket buffer before the
    collective (contiguous gradients, and it fits in one bucket)."""
    opt = engine.optimizer
    return bool(opt.contiguous_gradients) and param.numel() <= int(opt.reduce_bucket_size)


def restore_micro_steps(engine: Any, value: int) -> None:
    """Set the engine's micro-step counter to a checkpoint's (DeepSpeed saves but does not
    restore it); a restore of DeepSpeed's state, like its own loading, so not undone at detach."""
    engine.micro_steps = int(value)
