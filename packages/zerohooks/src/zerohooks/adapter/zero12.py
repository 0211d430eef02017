"""Adapter for ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks._compat import require_attr, require_attrs
from zerohooks.adapter import gather
from zerohooks.adapter.base import Attachment
from zerohooks.errors import ConfigError

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
    ``reduce_bucket_size``, and the bucket never holds more than its gradients."""
    if any(not hasattr(opt, n) for n in _FIT_NEEDS) or not hasattr(opt, "_gradient_reduction_buffer_dtype"):
        return
    needs = _bucket_needs(att, opt)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def setup_buckets() -> Any:
            buckets = opt.ipg_buckets
            limit = int(opt.reduce_bucket_size)
            small = [d for d in buckets if needs.get(d, limit) < limit]
            if opt.ready_for_gradients or not opt.contiguous_gradients or not small:
                return original()
            order = list(buckets)
            held = {d: buckets.pop(d) for d in small}
            try:
                result = original()
                dtype = opt._gradient_reduction_buffer_dtype()
                for d, bucket in held.items():
                    device = bucket.buffer[0].device if bucket.buffer else _device()
                    bucket.buffer.clear()
                    for _ in range(2 if opt.overlap_comm else 1):
                        bucket.buffer.append(torch.empty(needs[d], dtype=dtype, device=device))
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


def install(att: Attachment) -> None:
    opt = att.engine.optimizer
    reg = att.registry
    counters = att.counters
    require_attrs(opt, _NEEDS, _OPT)
    att.check_default_averaging(float(opt.gradient_predivide_factor))

    if reg.micro_step_grad.frozen:

        def make_process(original: Callable[..., Any]) -> Callable[..., Any]:
            def process_gradients(param: Any, i: int) -> Any:
                att.fire_micro_step_grad(param)
                return original(param, i)

            return process_gradients

        att.patch(opt, "process_gradients", make_process, _OPT)

    if att.patch_comm_dtype(opt, _OPT):
        _ensure_buckets(att, opt)
        _fit_bucket_buffers(att, opt)

    if reg.reduce_tensor.frozen:

        def make_tensor(original: Callable[..., Any]) -> Callable[..., Any]:
            def get_gradient_for_reduction(param: Any) -> Any:
                return att.reduce_tensor(param, original(param))

            return get_gradient_for_reduction

        att.patch(opt, "get_gradient_for_reduction", make_tensor, _OPT)

    owner = reg.reducer.owner is not None
    if owner and require_attr(opt, "sequence_parallel_size", _OPT) > 1:
        raise ConfigError(
            f"{reg.reducer.name!r} owns the gradient collective, which does not support sequence parallelism"
        )

    # Who uses each slice of the bucket being all-reduced: DeepSpeed's multi-rank bucket path
    # (use_multi_rank_bucket_allreduce, the default) all-reduces a bucket of slices and each rank
    # keeps the slices of its own partition; the owner may then reduce each slice to its owner.
    slice_owners: list[list[tuple[int, int]] | None] = []

    def make_multi(original: Callable[..., Any]) -> Callable[..., Any]:
        def allreduce_and_copy_with_multiple_ranks(small_bucket: Any, *args: Any, **kwargs: Any) -> Any:
            ranks = kwargs.get("bucket_ranks", args[4] if len(args) > 4 else None)
            owners: list[tuple[int, int]] | None = []
            for t, r in zip(small_bucket, ranks or (), strict=False):
                if isinstance(r, frozenset):
                    r = next(iter(r)) if len(r) == 1 else None
                if not isinstance(r, int) or owners is None:
                    owners = None
                    continue
                owners.append((t.numel(), r))
            if ranks is None or len(ranks) != len(small_bucket):
                owners = None
            slice_owners.append(owners)
            try:
                return original(small_bucket, *args, **kwargs)
            finally:
                slice_owners.pop()

        return allreduce_and_copy_with_multiple_ranks

    if owner:
        att.patch(opt, "allreduce_and_copy_with_multiple_ranks", make_multi, _OPT)

    def make_bucket(original: Callable[..., Any]) -> Callable[..., Any]:
        # Every gradient collective of ZeRO 1/2 (the IPG path through average_tensor and the
        # non-contiguous fallbacks) ends in allreduce_bucket: one flat tensor per call.
        def allreduce_bucket(
            bucket: list[torch.Tensor],
            communication_data_type: torch.dtype,
            rank: int | None = None,
            log: Any = None,
            divide: bool = True,
            process_group: Any = None,
        ) -> Any:
            numel = sum(t.numel() for t in bucket)
            collective = "all_reduce" if rank is None else "reduce"
            nbytes = numel * communication_data_type.itemsize
            counters.add(collective, communication_data_type, nbytes)
            group = opt.dp_process_group if process_group is None else process_group
            if not owner:
                world = dist.get_world_size(group=group)
                counters.add_default_wire(collective, communication_data_type, nbytes, world)
                return original(bucket, communication_data_type, rank, log, divide, process_group)
            tensor = opt.flatten(bucket)
            flat = tensor if tensor.dtype == communication_data_type else tensor.to(communication_data_type)
            owners = slice_owners[-1] if slice_owners and rank is None else None
            if owners is not None and sum(n for n, _ in owners) != flat.numel():
                owners = None
            average = bool(divide and opt.gradient_average)
            att.owner_all_reduce(flat, group, average, collective=collective, owners=owners or ())
            if flat is not tensor:
                tensor.copy_(flat)
            return flat

        return allreduce_bucket

    att.patch(opt, "allreduce_bucket", make_bucket, _OPT)

    def make_predivide(original: Callable[..., Any]) -> Callable[..., Any]:
        # Used instead of the above when zero_optimization.reduce_scatter is false.
        def gradient_reduction_w_predivide(tensor: torch.Tensor, communication_data_type: torch.dtype) -> Any:
            nbytes = tensor.numel() * communication_data_type.itemsize
            counters.add("all_reduce", communication_data_type, nbytes)
            if not owner or tensor.numel() == 0:
                world = dist.get_world_size(group=opt.dp_process_group)
                counters.add_default_wire("all_reduce", communication_data_type, nbytes, world)
                return original(tensor, communication_data_type)
            flat = tensor if tensor.dtype == communication_data_type else tensor.to(communication_data_type)
            att.owner_all_reduce(flat, opt.dp_process_group, bool(opt.gradient_average))
            if flat is not tensor:
                tensor.copy_(flat)
            return flat

        return gradient_reduction_w_predivide

    att.patch(opt, "gradient_reduction_w_predivide", make_predivide, _OPT)
    # the all-gather of the updated partitions after each step (all_gather_dp_groups)
    if reg.gatherer.owner is not None:
        gather.install(att, list(require_attr(opt, "real_dp_process_group", _OPT)))
