"""ZeRO 1/2: the fp32 gradients are accumulated, staged and partitioned in fp32.

DeepSpeedZeroOptimizer accumulates and partitions every gradient in the model dtype unless
asked for fp32 accumulation (``data_types.grad_accum_dtype``), which mixedlayers sets
(:func:`fp32_accumulation_by_config`), except for a bf16 model on ZeRO 1 without offload, where
DeepSpeed would answer that key with its BF16_Optimizer (one flat bf16 buffer per group, not a
ZeRO optimizer zerohooks attaches to): there the same fp32 accumulation of DeepSpeedZeroOptimizer
is switched on for the instance (:func:`install_fp32_accumulation`).

``DeepSpeedZeroOptimizer`` stages gradients in one contiguous buffer per communication dtype
(``ipg_buckets[dtype].buffer``), but allocates every such buffer in the model dtype
(``_gradient_reduction_buffer_dtype``), and points ``param.grad`` at its slice.  The fp32
bucket that the ``reduce_dtype`` hook fills with the kept parameters' gradients would round them
to 16 bits there, before the fp32 collective.  :func:`install_fp32_staging` re-allocates the fp32
bucket's buffers in fp32 each time DeepSpeed sets the buckets up (once per backward), sized to
what the bucket can ever hold: the parameters routed to it, at most ``reduce_bucket_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerohooks import Attachment, SetupContext

__all__ = ["fp32_accumulation_by_config", "install_fp32_accumulation", "install_fp32_staging"]

_OPT = "DeepSpeedZeroOptimizer"


def fp32_accumulation_by_config(ctx: SetupContext) -> bool:
    """Whether DeepSpeed is asked for fp32 accumulation through ``data_types.grad_accum_dtype``."""
    if ctx.zero_stage in (2, 3):
        return True
    if ctx.zero_stage == 1:
        return ctx.train_dtype == torch.float16 or ctx.offload_optimizer is not None
    return False


def install_fp32_accumulation(att: Attachment, opt: Any) -> None:
    """What DeepSpeedZeroOptimizer's constructor sets for ``gradient_accumulation_dtype=fp32``."""
    att.patch(opt, "gradient_accumulation_dtype", lambda _: torch.float32, _OPT)
    att.patch(opt, "use_separate_grad_accum", lambda _: True, _OPT)
    att.patch(opt, "use_grad_accum_attribute", lambda _: True, _OPT)


def install_fp32_staging(att: Attachment, opt: Any) -> None:
    """Patch ``opt.setup_buckets`` (this instance, undone on detach) when gradients are staged."""
    if not opt.contiguous_gradients:
        return  # gradients are flattened in their own dtype at reduction time
    routed = [p for group in opt.bit16_groups for p in group if opt.get_param_comm_dtype(p) == torch.float32]
    if not routed:
        return
    size = min(int(opt.reduce_bucket_size), sum(p.numel() for p in routed))

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def setup_buckets() -> Any:
            out = original()
            bucket = opt.ipg_buckets.get(torch.float32)
            if bucket is not None:
                for i, buf in enumerate(bucket.buffer):
                    if buf.dtype != torch.float32:
                        bucket.buffer[i] = torch.empty(size, dtype=torch.float32, device=buf.device)
            return out

        return setup_buckets

    att.patch(opt, "setup_buckets", make, _OPT)
