"""ZeRO 1/2: the fp32 gradients are accumulated, staged and partitioned in fp32.

DeepSpeedZeroOptimizer accumulates and partitions every gradient in the model dtype unless
asked for fp32 accumulation (``data_types.grad_accum_dtype``), which mixedlayers sets
(:func:`fp32_accumulation_by_config`), except for a bf16 model on ZeRO 1 without offload, where
DeepSpeed would answer that key with its BF16_Optimizer (one flat bf16 buffer per group, not a
ZeRO optimizer zerohooks attaches to): there the same fp32 accumulation of DeepSpeedZeroOptimizer
is switched on for the instance (:func:`install_fp32_accumulation`, through zerohooks' seam
``accumulate_separately``).

``DeepSpeedZeroOptimizer`` stages gradients in one contiguous buffer per communication dtype
(``ipg_buckets[dtype].buffer``), but allocates every such buffer in the model dtype
(``_gradient_reduction_buffer_dtype``), and points ``param.grad`` at its slice.  The fp32
bucket that the ``reduce_dtype`` hook fills with the kept parameters' gradients would round them
to 16 bits there, before the fp32 collective.  :func:`install_fp32_staging` has the fp32 bucket's
buffers re-allocated in fp32 each time DeepSpeed sets the buckets up (once per backward; zerohooks'
seam ``stage_buckets_in_own_dtype``), sized to what the bucket can ever hold: the parameters
routed to it, at most ``reduce_bucket_size``.
"""

from __future__ import annotations

import torch

from zerohooks import Attachment, SetupContext
from zerohooks.adapter import seams

__all__ = ["fp32_accumulation_by_config", "install_fp32_accumulation", "install_fp32_staging"]


def fp32_accumulation_by_config(ctx: SetupContext) -> bool:
    """Whether DeepSpeed is asked for fp32 accumulation through ``data_types.grad_accum_dtype``."""
    if ctx.zero_stage in (2, 3):
        return True
    if ctx.zero_stage == 1:
        return ctx.train_dtype == torch.float16 or ctx.offload_optimizer is not None
    return False


def install_fp32_accumulation(att: Attachment) -> None:
    """What DeepSpeedZeroOptimizer's constructor sets for ``gradient_accumulation_dtype=fp32``."""
    seams.accumulate_separately(att, torch.float32)


def install_fp32_staging(att: Attachment) -> None:
    """Stage the fp32 bucket in fp32 (this instance, undone on detach) when gradients are staged."""
    seams.stage_buckets_in_own_dtype(att, torch.float32)
