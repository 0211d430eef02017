"""ZeRO 3: a plugin's parameters held in another dtype than the one DeepSpeed partitioned them in.

``DeepSpeedZeroOptimizer_Stage3`` moves every parameter partition into one contiguous buffer of
one dtype while it is constructed (``defragment`` asserts a single dtype).  A plugin that keeps
some parameters in fp32 (mixedlayers) asks :func:`retype_partitions`, once the optimizer exists,
to give each sub-group of those parameters its own flat buffer of the new dtype, filled from the
exact values the plugin remembered, to point the parameters' partitions (and the full value of a
gathered parameter) at it, and to overwrite the fp32 master partitions with the same values.
From then on DeepSpeed's own code sees partitions of the new dtype: the all-gather groups
parameters by dtype, the gathered parameter takes its partition's dtype, and the optimizer copies
updated masters into the new buffer.

Every change is recorded on the engine's :class:`~zerohooks.adapter.base.Attachment`; detach puts
DeepSpeed's own buffers and lists back, holding the current values rounded to their dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks.adapter import surface
from zerohooks.adapter.base import Attachment
from zerohooks.registry import RemovableHandle

__all__ = ["retype_partitions"]


def _partition_of(param: Any, full: torch.Tensor, out: torch.Tensor) -> None:
    """Copy this rank's partition of ``full`` (flattened, zero-padded) into ``out``."""
    n = out.numel()
    rank = dist.get_rank(group=param.ds_process_group)
    start = n * rank
    flat = full.reshape(-1)
    stop = min(start + n, flat.numel())
    out.zero_()
    if stop > start:
        out.narrow(0, 0, stop - start).copy_(flat.narrow(0, start, stop - start))


class _Undo:
    """What :func:`retype_partitions` changed, and how to change it back."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.groups: list[tuple[int, Any, Any]] = []  # (sub-group, DeepSpeed's flat, its list)
        self.params: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (param, partition, data)

    def keep_param(self, p: Any) -> None:
        self.params.append((p, p.ds_tensor.data, p.data))

    def __call__(self) -> None:
        for p, part, data in reversed(self.params):
            part.copy_(p.ds_tensor.data)  # the current values, rounded to DeepSpeed's dtype
            p.ds_tensor.data = part
            if p.data.numel() == 0 or data.numel() == 0:
                p.data = data if p.data.numel() == 0 else p.data.to(data.dtype)
            else:
                data.copy_(p.data.view_as(data))
                p.data = data
        for i, flat, parts in reversed(self.groups):
            self.opt.fp16_partitioned_groups_flat[i] = flat
            self.opt.fp16_partitioned_groups[i] = parts
        self.params.clear()
        self.groups.clear()


def _retype_param(p: Any, part: torch.Tensor, full: torch.Tensor, dtype: torch.dtype) -> None:
    _partition_of(p, full, part)
    p.ds_tensor.data = part
    if p.data.numel() == 0:
        p.data = torch.empty(0, dtype=dtype, device=p.data.device)
    else:  # a gathered (persistent) parameter: its full value
        p.data = full.to(device=p.data.device, dtype=dtype).view(p.ds_shape)


def retype_partitions(
    att: Attachment,
    params: list[Any],
    full_value: Callable[[Any], torch.Tensor],
    user: str,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Hold ``params`` (parameters of a ZeRO-3 engine) in ``dtype``: their partitions, their
    sub-groups' flat buffers and fp32 masters take this rank's part of ``full_value(param)`` (the
    exact value, full shape).  A sub-group must hold only such parameters or none; frozen ones
    (outside the optimizer's groups) are retyped on their own.  ``user``: the plugin asking (named
    in errors; the seam ``partition_retype`` of :data:`zerohooks.adapter.surface.SEAMS` is checked first).  Returns the sub-groups
    changed; undone at detach."""
    opt = att.engine.optimizer
    surface.check_object(opt, surface.ZERO3, 3, "partition_retype")
    chosen = {id(p) for p in params}
    undo = _Undo(opt)
    att.keep_handle(RemovableHandle(undo, f"zerohooks: {user}'s {dtype} ZeRO-3 partitions"))
    changed = 0
    for i, sub_group in enumerate(opt.fp16_groups):
        kept = [id(p) in chosen for p in sub_group]
        if not any(kept):
            continue
        if not all(kept):
            raise RuntimeError(
                f"{user}: ZeRO-3 sub-group {i} mixes {dtype} and other parameters (were the optimizer's "
                "param groups split? pass model_parameters= to zerohooks.initialize)"
            )
        old = opt.fp16_partitioned_groups_flat[i]
        if old is None:
            raise RuntimeError(f"{user}: ZeRO-3 parameter partitions on NVMe are not supported")
        undo.groups.append((i, old, opt.fp16_partitioned_groups[i]))
        flat = torch.zeros(old.numel(), dtype=dtype, device=old.device)
        offset = 0
        for p in sub_group:
            n = p.partition_numel()
            undo.keep_param(p)
            _retype_param(p, flat.narrow(0, offset, n), full_value(p), dtype)
            offset += n
        opt.fp16_partitioned_groups_flat[i] = flat
        opt.fp16_partitioned_groups[i] = [p.ds_tensor for p in sub_group]
        master = opt.fp32_partitioned_groups_flat[i]
        if master is not None:
            master.data.copy_(flat.to(master.device))
        changed += 1
    in_groups = {id(p) for group in opt.fp16_groups for p in group}
    for p in params:  # frozen parameters: partitioned on their own, outside the groups
        if id(p) in in_groups or not hasattr(p, "ds_tensor") or p.ds_tensor.dtype == dtype:
            continue
        undo.keep_param(p)
        part = torch.zeros(p.ds_tensor.numel(), dtype=dtype, device=p.ds_tensor.device)
        _retype_param(p, part, full_value(p), dtype)
    return changed
