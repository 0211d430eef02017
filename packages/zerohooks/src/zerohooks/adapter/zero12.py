"""Adapter for ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks.adapter import gather
from zerohooks.adapter.base import Attachment, bind_by_name
from zerohooks.adapter.compat import require_attr, require_attrs

_OPT = "DeepSpeedZeroOptimizer"
_NEEDS = ("gradient_predivide_factor", "dp_process_group", "flatten", "gradient_average")
"""Read by the collective wrappers below, most of them only while training: checked when they
are installed."""


def _ensure_buckets(att: Attachment, opt: Any) -> None:
    """Create IPG buckets for every dtype the ``reduce_dtype`` hooks may choose."""
    buckets = require_attr(opt, "ipg_buckets", _OPT)
    require_attrs(opt, ("communication_data_type", "bit16_groups"), _OPT)
    default = opt.communication_data_type
    bucket_cls = type(next(iter(buckets.values())))
    for group in opt.bit16_groups:
        for p in group:
            dtype = att.comm_dtype(p, default)
            if dtype not in buckets:
                buckets[dtype] = bucket_cls()


_FIT_NEEDS = (
    "setup_buckets",
    "ready_for_gradients",
    "contiguous_gradients",
    "overlap_comm",
    "reduce_bucket_size",
    "_gradient_reduction_buffer_dtype",
)
"""Read (and ``setup_buckets`` wrapped) to size the IPG buffers; optional: without them DeepSpeed's
own sizes stay (memory only)."""


def _bucket_needs(att: Attachment, opt: Any) -> dict[torch.dtype, int]:
    """Elements each IPG bucket can ever hold at once: the gradients routed to its communication
    dtype that go through the contiguous buffer (DeepSpeed sends a gradient larger than
    ``reduce_bucket_size`` on its own), capped at ``reduce_bucket_size``."""
    limit = int(opt.reduce_bucket_size)
    default = opt.communication_data_type
    need: dict[torch.dtype, int] = {}
    for group in opt.bit16_groups:
        for p in group:
            if p.numel() <= limit:
                dtype = att.comm_dtype(p, default)
                need[dtype] = need.get(dtype, 0) + p.numel()
    return {dtype: min(n, limit) for dtype, n in need.items()}


def _fit_bucket_buffers(att: Attachment, opt: Any) -> None:
    """Size each IPG bucket's buffers to what it can hold, once ``reduce_dtype`` hooks split the
    gradients over several buckets.  DeepSpeed gives every bucket ``reduce_bucket_size`` elements
    (500 M by default, two buffers with ``overlap_comm``): a bucket for a few MB of fp32
    LayerNorm gradients took 1 GB of GPU memory (mixedlayers on an H100, benchmarks/RESULTS.md).
    The buckets that need less get buffers of their size instead, allocated in DeepSpeed's place,
    same dtype and device; DeepSpeed flushes a bucket before it would overflow
    ``reduce_bucket_size``, and the bucket never holds more than its gradients.  A bucket staged
    in its own dtype (``att.staged_buckets``, :func:`.seams.stage_buckets_in_own_dtype`) gets its
    buffers here in that dtype, so no buffer is allocated twice."""
    if any(not hasattr(opt, n) for n in _FIT_NEEDS):
        return
    needs = _bucket_needs(att, opt)
    att.bucket_buffers_fitted = True

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def setup_buckets() -> Any:
            buckets = opt.ipg_buckets
            limit = int(opt.reduce_bucket_size)
            ours = [d for d in buckets if needs.get(d, limit) < limit or d in att.staged_buckets]
            if opt.ready_for_gradients or not opt.contiguous_gradients or not ours:
                return original()
            order = list(buckets)
            held = {d: buckets.pop(d) for d in ours}
            try:
                result = original()
                model_dtype = opt._gradient_reduction_buffer_dtype()
                for d, bucket in held.items():
                    device = bucket.buffer[0].device if bucket.buffer else _device()
                    dtype = d if d in att.staged_buckets else model_dtype
                    bucket.buffer.clear()
                    for _ in range(2 if opt.overlap_comm else 1):
                        bucket.buffer.append(torch.empty(needs.get(d, limit), dtype=dtype, device=device))
                    bucket.index = 0
            finally:
                rest = dict(buckets)
                buckets.clear()
                buckets.update((d, held[d] if d in held else rest[d]) for d in order)
            return result

        return setup_buckets

    att.patch(opt, "setup_buckets", make, _OPT)


def _device() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def _patch_by_param(
    att: Attachment, opt: Any, name: str, around: Callable[[Any, Callable[[], Any]], Any]
) -> None:
    """Shadow ``opt.<name>`` (a method taking a ``param`` argument) with ``around(param, call)``,
    where ``call()`` runs DeepSpeed's method with the arguments it was given."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        bind = bind_by_name(original)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return around(bind(*args, **kwargs)["param"], lambda: original(*args, **kwargs))

        return wrapper

    att.patch(opt, name, make, _OPT)


def _install_micro_step(att: Attachment, opt: Any) -> None:
    """``micro_step_grad`` hooks fire for each gradient DeepSpeed processes."""
    if not att.registry.micro_step_grad.frozen:
        return

    def fire_then_process(param: Any, process: Callable[[], Any]) -> Any:
        att.fire_micro_step_grad(param)
        return process()

    _patch_by_param(att, opt, "process_gradients", fire_then_process)


def _install_reduce_tensor(att: Attachment, opt: Any) -> None:
    """``reduce_tensor`` hooks choose the tensor handed to the collective."""
    if att.registry.reduce_tensor.frozen:
        _patch_by_param(
            att, opt, "get_gradient_for_reduction", lambda param, get: att.reduce_tensor(param, get())
        )


class _SliceOwners:
    """Who uses each slice of the bucket being all-reduced, for the owner of the collective.

    DeepSpeed's multi-rank bucket path (``use_multi_rank_bucket_allreduce``, the default)
    all-reduces a bucket of slices and each rank keeps the slices of its own partition; the owner
    may then reduce each slice to its owner.  One per attachment: the slices of the multi-rank
    call in progress (calls nest only through ``allreduce_bucket``)."""

    __slots__ = ("_stack",)

    def __init__(self) -> None:
        self._stack: list[list[tuple[int, int]] | None] = []

    @staticmethod
    def _read(small_bucket: Any, ranks: Any) -> list[tuple[int, int]] | None:
        if ranks is None or len(ranks) != len(small_bucket):
            return None
        owners: list[tuple[int, int]] = []
        for t, r in zip(small_bucket, ranks, strict=True):
            if isinstance(r, frozenset):
                r = next(iter(r)) if len(r) == 1 else None
            if not isinstance(r, int):
                return None
            owners.append((t.numel(), r))
        return owners

    def make(self, original: Callable[..., Any]) -> Callable[..., Any]:
        bind = bind_by_name(original)

        def allreduce_and_copy_with_multiple_ranks(*args: Any, **kwargs: Any) -> Any:
            bound = bind(*args, **kwargs)
            self._stack.append(self._read(bound["small_bucket"], bound.get("bucket_ranks")))
            try:
                return original(*args, **kwargs)
            finally:
                self._stack.pop()

        return allreduce_and_copy_with_multiple_ranks

    def current(self, numel: int) -> list[tuple[int, int]] | None:
        """The slices of the bucket of ``numel`` elements being all-reduced, or None."""
        owners = self._stack[-1] if self._stack else None
        return owners if owners is not None and sum(n for n, _ in owners) == numel else None


def _install_bucket(att: Attachment, opt: Any, slices: _SliceOwners | None) -> None:
    """Every gradient collective of ZeRO 1/2 (the IPG path through ``average_tensor`` and the
    non-contiguous fallbacks) ends in ``allreduce_bucket``, one flat tensor per call: counted,
    and handed to the owner of the collective when there is one (``slices`` not None)."""
    counters = att.counters

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        bind = bind_by_name(original)

        def allreduce_bucket(*args: Any, **kwargs: Any) -> Any:
            bound = bind(*args, **kwargs)
            bucket: list[torch.Tensor] = bound["bucket"]
            dtype: torch.dtype = bound["communication_data_type"]
            rank = bound.get("rank")
            process_group = bound.get("process_group")
            collective = "all_reduce" if rank is None else "reduce"
            nbytes = sum(t.numel() for t in bucket) * dtype.itemsize
            counters.add(collective, dtype, nbytes)
            group = opt.dp_process_group if process_group is None else process_group
            if slices is None:
                world = dist.get_world_size(group=group)
                counters.add_default_wire(collective, dtype, nbytes, world)
                return original(*args, **kwargs)
            tensor = opt.flatten(bucket)
            flat = tensor if tensor.dtype == dtype else tensor.to(dtype)
            owners = slices.current(flat.numel()) if rank is None else None
            average = bool(bound.get("divide", True) and opt.gradient_average)
            att.owner_all_reduce(flat, group, average, collective=collective, owners=owners or ())
            if flat is not tensor:
                tensor.copy_(flat)
            return flat

        return allreduce_bucket

    att.patch(opt, "allreduce_bucket", make, _OPT)


def _install_predivide(att: Attachment, opt: Any, owner: bool) -> None:
    """The collective used instead of ``allreduce_bucket`` when ``zero_optimization.reduce_scatter``
    is false: counted, and handed to the owner of the collective when there is one."""
    counters = att.counters

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        bind = bind_by_name(original)

        def gradient_reduction_w_predivide(*args: Any, **kwargs: Any) -> Any:
            bound = bind(*args, **kwargs)
            tensor: torch.Tensor = bound["tensor"]
            dtype: torch.dtype = bound["communication_data_type"]
            nbytes = tensor.numel() * dtype.itemsize
            counters.add("all_reduce", dtype, nbytes)
            if not owner or tensor.numel() == 0:
                world = dist.get_world_size(group=opt.dp_process_group)
                counters.add_default_wire("all_reduce", dtype, nbytes, world)
                return original(*args, **kwargs)
            flat = tensor if tensor.dtype == dtype else tensor.to(dtype)
            att.owner_all_reduce(flat, opt.dp_process_group, bool(opt.gradient_average))
            if flat is not tensor:
                tensor.copy_(flat)
            return flat

        return gradient_reduction_w_predivide

    att.patch(opt, "gradient_reduction_w_predivide", make, _OPT)


def install(att: Attachment) -> None:
    opt = att.engine.optimizer
    reg = att.registry
    require_attrs(opt, _NEEDS, _OPT)
    att.check_default_averaging(float(opt.gradient_predivide_factor))
    _install_micro_step(att, opt)
    if att.patch_comm_dtype(opt, _OPT):
        _ensure_buckets(att, opt)
        _fit_bucket_buffers(att, opt)
    _install_reduce_tensor(att, opt)
    owner = reg.reducer.owner is not None
    att.check_sequence_parallel(require_attr(opt, "sequence_parallel_size", _OPT))
    slices = _SliceOwners() if owner else None
    if slices is not None:
        att.patch(opt, "allreduce_and_copy_with_multiple_ranks", slices.make, _OPT)
    _install_bucket(att, opt, slices)
    _install_predivide(att, opt, owner)
    # the all-gather of the updated partitions after each step (all_gather_dp_groups)
    if reg.gatherer.owner is not None:
        gather.install(att, list(require_attr(opt, "real_dp_process_group", _OPT)))
