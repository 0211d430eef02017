"""ZeRO 1/2 under a DeepSpeed pipeline: the gradient norm reduced over the stages once.

DeepSpeed's ZeRO 1/2 optimizer computes the gradient norm group by group
(``scaled_global_norm`` calls ``get_grad_norm_direct`` per param group), and each group's sum of
squares is all-reduced over the data-parallel group, then over the model-parallel group, which
for a ``PipelineModule`` spans the pipeline stages.  When the stages hold different numbers of
param groups (a plugin that splits the groups by dtype, with fp32 layers on one stage only),
they issue different numbers of those collectives and the first step hangs.

:func:`install` makes the stage reduction one collective for all groups: the stage's own norm is
computed with the model-parallel reduction held back (DeepSpeed's code, the group's data-parallel
reduction and its filters unchanged), its square is summed over the model-parallel group once,
and the square root taken.  The norm equals DeepSpeed's up to rounding; an invalid norm (inf or
NaN gradients, which DeepSpeed combines into ``inf``) on any stage is ``inf`` on every stage, as
before.  Undone at detach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks.adapter import surface
from zerohooks.adapter.base import Attachment

__all__ = ["SEAM", "install"]

SEAM = "stage_norm"
"""The seam of :data:`zerohooks.adapter.surface.SEAMS` this module implements."""


def _stages(opt: Any) -> Any | None:
    """The model-parallel group DeepSpeed reduces each group's norm over (None: no reduction)."""
    group = getattr(opt, "model_parallel_group", None)
    if group is None or dist.get_world_size(group=group) <= 1:
        return None
    return group


def install(att: Attachment) -> bool:
    """On a ZeRO 1/2 engine whose optimizer reduces the gradient norm over a model-parallel group
    (a pipeline's stages), reduce it once per step instead of once per param group.  Returns
    whether anything was installed (nothing on other engines)."""
    opt = att.engine.optimizer
    if att.setup.zero_stage not in (1, 2):
        return False
    surface.check_object(opt, surface.ZERO12, att.setup.zero_stage, SEAM)
    stages = _stages(opt)
    if stages is None:
        return False

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def scaled_global_norm(*args: Any, **kwargs: Any) -> Any:
            opt.model_parallel_group = None  # DeepSpeed then skips the per-group reduction
            try:
                local = original(*args, **kwargs)
            finally:
                opt.model_parallel_group = stages
            norm = local if isinstance(local, torch.Tensor) else torch.tensor(float(local))
            square = norm.detach().float().pow(2)  # inf stays inf: invalid on any stage, invalid on all
            dist.all_reduce(square, op=dist.ReduceOp.SUM, group=stages)
            return square.sqrt().to(norm.dtype)

        return scaled_global_norm

    att.patch(opt, "scaled_global_norm", make, "DeepSpeedZeroOptimizer")
    return True
