"""ZeRO 3: turning the kept parameters' partitions back into fp32 after DeepSpeed built them.

``DeepSpeedZeroOptimizer_Stage3`` moves every parameter partition into one contiguous buffer of
one dtype while it is constructed (``defragment`` asserts a single dtype), so the kept
parameters enter it in the training dtype.  Because mixedlayers splits the param groups by
dtype, every ZeRO-3 sub-group is either all 16-bit or all kept; once the optimizer exists,
:func:`restore_zero3` gives each kept sub-group its own fp32 flat buffer filled from the exact
fp32 values remembered before DeepSpeed's cast, points the parameters' partitions at it, and
overwrites the fp32 master partitions with the same exact values.  From then on DeepSpeed's own
code sees fp32 partitions: the all-gather groups parameters by dtype, the gathered parameter
takes its partition's dtype, and the optimizer copies updated masters into the fp32 buffer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mixedlayers.state import MixedState
from zerohooks import surface

__all__ = ["restore_zero3"]


def _check(opt: Any) -> None:
    """mixedlayers' entries of :data:`zerohooks.surface.SURFACE` on the ZeRO-3 optimizer."""
    surface.check_object(opt, surface.ZERO3, 3, "mixedlayers")


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


def restore_zero3(opt: Any, state: MixedState) -> int:
    """Make the kept parameters' ZeRO-3 partitions and masters fp32; returns sub-groups changed."""
    _check(opt)
    saved = {id(t): data for t, data in state.saved}
    changed = 0
    for i, sub_group in enumerate(opt.fp16_groups):
        kept = [state.is_fp32(p) for p in sub_group]
        if not any(kept):
            continue
        if not all(kept):
            raise RuntimeError(
                f"mixedlayers: ZeRO-3 sub-group {i} mixes kept and 16-bit parameters (were the optimizer's "
                "param groups split? pass model_parameters= to zerohooks.initialize)"
            )
        old = opt.fp16_partitioned_groups_flat[i]
        if old is None:
            raise RuntimeError("mixedlayers: ZeRO-3 parameter partitions on NVMe are not supported")
        flat = torch.zeros(old.numel(), dtype=torch.float32, device=old.device)
        offset = 0
        for p in sub_group:
            n = p.partition_numel()
            part = flat.narrow(0, offset, n)
            _partition_of(p, saved[id(p)], part)
            p.ds_tensor.data = part
            if p.data.numel() == 0:
                p.data = torch.empty(0, dtype=torch.float32, device=p.data.device)
            else:  # a gathered (persistent) parameter: its full fp32 value
                p.data = saved[id(p)].to(p.data.device).view(p.ds_shape)
            offset += n
        opt.fp16_partitioned_groups_flat[i] = flat
        opt.fp16_partitioned_groups[i] = [p.ds_tensor for p in sub_group]
        master = opt.fp32_partitioned_groups_flat[i]
        if master is not None:
            master.data.copy_(flat.to(master.device))
        changed += 1
    in_groups = {id(p) for group in opt.fp16_groups for p in group}
    frozen: list[Any] = [p for p in state.params if id(p) not in in_groups]  # ZeRO-3 attributes
    for p in frozen:  # frozen kept parameters: partitioned on their own, outside the groups
        if not hasattr(p, "ds_tensor") or p.ds_tensor.dtype == torch.float32:
            continue
        part = torch.zeros(p.ds_tensor.numel(), dtype=torch.float32, device=p.ds_tensor.device)
        _partition_of(p, saved[id(p)], part)
        p.ds_tensor.data = part
        if p.data.numel() == 0:
            p.data = torch.empty(0, dtype=torch.float32, device=p.data.device)
        else:
            p.data = saved[id(p)].to(p.data.device).view(p.ds_shape)
    state.saved = [(t, d) for t, d in state.saved if id(t) not in {id(p) for p in state.params}]
    return changed
