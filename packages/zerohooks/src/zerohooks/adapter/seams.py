"""Typed seams for the DeepSpeed mechanisms plugins change beyond the hooks of the registry.

Each function changes one DeepSpeed mechanism of one engine, per instance (undone by
``zerohooks.detach``), and is the only place that knows which DeepSpeed attributes carry it
(all listed in :data:`zerohooks.adapter.surface.SURFACE`).  Plugins call them from ``engine_ready`` with
the engine's :class:`~zerohooks.adapter.base.Attachment`:

* gradient hand-off: :func:`accumulate_separately` (DeepSpeed's own separate accumulation buffer
  of ZeRO 1/2), :func:`stage_buckets_in_own_dtype` and :func:`widen_reduction_buffer` (the dtype
  gradients are staged in before the collective);
* loss scaling: :func:`own_loss_scaling` (the scaler DeepSpeed multiplies the loss by and
  unscales with, on every stage, and its overflow check); :func:`steps_may_be_skipped` (whether a
  loss scaler, DeepSpeed's or a plugin's, can skip a step);
* forward: :func:`forward_under_autocast` (the engine's forward under autocast, entered by
  DeepSpeed's own autocast path);
* collective groups: :func:`gradient_groups` (the data-parallel and MoE expert groups gradients
  are reduced over, read only);
* checkpoints: :func:`check_before_save` (refuse ``save_checkpoint`` in a state that cannot be saved);
  :func:`read_checkpoints_mapped` (DeepSpeed's files read memory-mapped, not into RAM).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerohooks.adapter.base import Attachment
from zerohooks.adapter.lossscale import OwnedLossScaler, ScaleOwner, Zero0GradScaler, Zero0Scaling
from zerohooks.adapter.surface import ENGINE, ZERO3, ZERO12
from zerohooks.registry import RemovableHandle

__all__ = [
    "OwnedLossScaler",
    "ScaleOwner",
    "Zero0Scaling",
    "accumulate_separately",
    "check_before_save",
    "forward_under_autocast",
    "gradient_groups",
    "note_optimizer_stepped",
    "own_loss_scaling",
    "read_checkpoints_mapped",
    "stage_buckets_in_own_dtype",
    "steps_may_be_skipped",
    "widen_reduction_buffer",
]

_E = ENGINE.rpartition(".")[2]
_Z12 = ZERO12.rpartition(".")[2]
_Z3 = ZERO3.rpartition(".")[2]


def _constant(value: Any) -> Callable[[Any], Any]:
    return lambda _original: value


def accumulate_separately(att: Attachment, dtype: torch.dtype) -> None:
    """ZeRO 1/2: accumulate gradients in a separate ``dtype`` buffer, as DeepSpeedZeroOptimizer's
    constructor sets it up for ``data_types.grad_accum_dtype`` (where that key cannot be used: a
    bf16 model on ZeRO 1 without offload, for which DeepSpeed builds its BF16_Optimizer instead)."""
    opt = att.engine.optimizer
    att.patch(opt, "gradient_accumulation_dtype", _constant(dtype), _Z12)
    att.patch(opt, "use_separate_grad_accum", _constant(True), _Z12)
    att.patch(opt, "use_grad_accum_attribute", _constant(True), _Z12)


def widen_reduction_buffer(att: Attachment, dtype: torch.dtype) -> None:
    """ZeRO 1/2: stage gradients in a buffer at least as wide as ``dtype`` (DeepSpeed allocates
    the staging buffer in the model dtype)."""

    def make(original: Callable[[], torch.dtype]) -> Callable[[], torch.dtype]:
        def _gradient_reduction_buffer_dtype() -> torch.dtype:
            own = original()
            return dtype if dtype.itemsize > own.itemsize else own

        return _gradient_reduction_buffer_dtype

    att.patch(att.engine.optimizer, "_gradient_reduction_buffer_dtype", make, _Z12)


def stage_buckets_in_own_dtype(att: Attachment, dtype: torch.dtype) -> None:
    """ZeRO 1/2: the staging buffers of the bucket of communication dtype ``dtype`` are ``dtype``
    each time DeepSpeed sets the buckets up (it allocates every bucket's buffers in the model
    dtype), sized to what that bucket can ever hold: the parameters whose communication dtype is
    ``dtype``, at most ``reduce_bucket_size`` elements.  Nothing is installed when gradients are
    not staged (no ``contiguous_gradients``: they are flattened in their own dtype) or no
    parameter is routed to that bucket."""
    opt = att.engine.optimizer
    if not opt.contiguous_gradients:
        return
    routed = [p for group in opt.bit16_groups for p in group if opt.get_param_comm_dtype(p) == dtype]
    if not routed:
        return
    if att.bucket_buffers_fitted:
        # the adapter allocates this bucket's buffers itself, in ``dtype`` and at its size
        att.staged_buckets.add(dtype)
        return
    size = min(int(opt.reduce_bucket_size), sum(p.numel() for p in routed))
    _stage_buckets(att, dtype, size)


def _stage_buckets(att: Attachment, dtype: torch.dtype, size: int) -> None:
    opt = att.engine.optimizer

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def setup_buckets() -> Any:
            out = original()
            bucket = opt.ipg_buckets.get(dtype)
            if bucket is not None:
                for i, buf in enumerate(bucket.buffer):
                    if buf.dtype != dtype:
                        bucket.buffer[i] = torch.empty(size, dtype=dtype, device=buf.device)
            return out

        return setup_buckets

    att.patch(opt, "setup_buckets", make, _Z12)


def own_loss_scaling(
    att: Attachment, *, zero_scaler: OwnedLossScaler, zero0: Zero0Scaling, dynamic: bool
) -> Callable[[], None]:
    """Scale the loss with the plugin's scale on every stage, and check gradients for overflow
    whatever the parameters' dtype (DeepSpeed checks only fp16 ones).

    ``zero_scaler``: an :class:`~zerohooks.adapter.lossscale.OwnedLossScaler` over the plugin's
    :class:`~zerohooks.adapter.lossscale.ScaleOwner`, for ZeRO 1-3 (a plugin may subclass it to
    give the object DeepSpeed pickles into checkpoints its own import path); ``zero0``: the
    plugin's :class:`~zerohooks.adapter.lossscale.Zero0Scaling` for ZeRO 0, put in the engine's
    GradScaler slot by a :class:`~zerohooks.adapter.lossscale.Zero0GradScaler`.  Returns what to
    call after a checkpoint load (DeepSpeed restores its own pickled scaler object on ZeRO 1-3)."""
    engine, opt = att.engine, att.engine.optimizer
    if att.setup.zero_stage == 0:
        att.patch(engine, "torch_autocast_z0_gradscaler", _constant(Zero0GradScaler(zero0)), _E)
        if "overflow" not in vars(opt):
            opt.overflow = False  # read by the engine to count skipped steps

            def remove() -> None:
                vars(opt).pop("overflow", None)

            att.keep_handle(RemovableHandle(remove, "zerohooks: optimizer.overflow"))
        return lambda: None
    what = _Z3 if att.setup.zero_stage == 3 else _Z12
    att.patch(opt, "loss_scaler", _constant(zero_scaler), what)
    att.patch(opt, "dynamic_loss_scale", _constant(dynamic), what)
    if att.setup.zero_stage == 3:

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def _overflow_check_and_loss_scale_update(update_scale: bool = True) -> Any:
                opt.overflow = False
                opt.check_overflow()
                if not update_scale:
                    return opt.overflow
                return opt._loss_scale_update_and_overflow_cleanup()

            return _overflow_check_and_loss_scale_update

        att.patch(opt, "_overflow_check_and_loss_scale_update", make, what)
    else:
        att.patch(opt, "check_grad_overflow", _constant(True), what)

    def reinstall() -> None:
        zero_scaler.in_use = zero_scaler.state.scale
        opt.loss_scaler = zero_scaler

    return reinstall


def steps_may_be_skipped(engine: Any) -> bool:
    """True when a dynamic loss scaler can skip this engine's optimizer steps: DeepSpeed's own
    (fp16 parameters) or one a plugin installed with :func:`own_loss_scaling` on fp32 or bf16
    parameters.  Read once every plugin's ``engine_ready`` has run."""
    opt = getattr(engine, "optimizer", None)
    try:
        dynamic = bool(getattr(opt, "dynamic_loss_scale", False))
    except Exception:  # some optimizer wrappers compute it from state that may not exist yet
        dynamic = False
    return dynamic or getattr(engine, "torch_autocast_z0_gradscaler", None) is not None


def forward_under_autocast(att: Attachment, dtype: torch.dtype) -> None:
    """Run the engine's forward under ``torch.autocast(<DeepSpeed's accelerator>, dtype)``,
    entered by DeepSpeed itself, as for its own ``torch_autocast`` section.

    DeepSpeed's ``engine.forward`` (``runtime/torch_autocast.autocast_if_enabled``) decides the
    forward's autocast from ``engine.torch_autocast_enabled()`` and ``torch_autocast_dtype()``, and
    turns off an autocast it finds already on when its own is not enabled. It asks
    ``torch.is_autocast_enabled()``, which reads CUDA's autocast: an autocast entered around the
    engine's forward survived on CPU and was switched off on a GPU, where the whole forward ran in
    fp32 (GPU suite, H100, 2026-11-27: autocastzero's step 1.42x DeepSpeed's ``torch_autocast``,
    fp32 GEMMs in its profile). So the engine answers those two questions with ``dtype``, on
    this instance only; nothing else of DeepSpeed reads them after the engine is built (its
    ``torch_autocast`` set-up, the parameters' ``comm_dtype`` and the ZeRO-0 ``GradScaler``, ran
    in the constructor, from the config, and stays off). The forward is then DeepSpeed's own
    autocast path: the same code, the same ``torch.compile`` graph as ``torch_autocast``."""

    att.patch(att.engine, "torch_autocast_enabled", _constant(lambda: True), _E)
    att.patch(att.engine, "torch_autocast_dtype", _constant(lambda: dtype), _E)


def check_before_save(att: Attachment, check: Callable[[], None]) -> None:
    """Call ``check()`` before every ``engine.save_checkpoint``; it raises to refuse the save."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            check()
            return original(*args, **kwargs)

        return save_checkpoint

    att.patch(att.engine, "save_checkpoint", make, _E)


def read_checkpoints_mapped(att: Attachment) -> None:
    """Read this engine's DeepSpeed optimizer-state files with ``torch.load(..., mmap=True)``
    (trusted or weights-only alike, :mod:`zerohooks.adapter.dsfiles`; the model-states file, with
    the user's ``client_state``, is read as usual): the tensors DeepSpeed loads are views
    of the file's pages, which the kernel can drop and read again, so a checkpoint bigger than
    the RAM loads, as long as the plugin moves them elsewhere one piece at a time (nvmeswap's
    optimizer state, 12 bytes a parameter)."""
    att.map_checkpoint_reads = True


def gradient_groups(engine: Any) -> list[Any]:
    """The process groups DeepSpeed reduces this rank's gradients over: its data-parallel group
    (the world, or part of it beside pipeline or tensor parallelism) and, for a model with MoE
    layers, its expert-data-parallel groups (the ranks holding the same experts).  Read only: for a
    gradient collective's owner that prepares per-group state before the first step (DeepSpeed
    keeps each rank's own groups only: gather them to know every rank's)."""
    out = [engine.data_parallel_group]
    if engine.has_moe_layers:
        out += [g for g in engine.expert_data_parallel_group.values() if g not in out]
    return out


def note_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's learning-rate schedulers that ``optimizer`` took a step that did not go
    through ``optimizer.step()`` (a plugin's fused kernel updating the parameters itself): they
    wrap ``step`` and warn when the schedule steps first."""
    optimizer._opt_called = True  # type: ignore[attr-defined]
