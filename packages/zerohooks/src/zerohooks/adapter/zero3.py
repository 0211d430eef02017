"""Adapter for ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks.adapter import gather, surface
from zerohooks.adapter.base import Attachment
from zerohooks.adapter.compat import require_attr, require_attrs
from zerohooks.errors import ConfigError
from zerohooks.hookspec import ReduceBucket
from zerohooks.registry import RemovableHandle

_OPT = "DeepSpeedZeroOptimizer_Stage3"
_MANGLE = surface.ZERO3_PRIVATE
_BUCKET_NEEDS = ("communication_data_type", "contiguous_gradients", "fp16_groups", "reduce_bucket_size")
"""Read by :func:`_ensure_buckets`."""
_COLLECTIVE_NEEDS = (
    "contiguous_gradients",
    "reduce_scatter",
    "gradient_predivide_factor",
    "dp_process_group",
    "_get_param_partition_group",
    "_gradient_averaging_world_size",
    "gradient_accumulation_dtype",
)
"""Read by the reduce-scatter wrappers of :func:`_install_collectives`, most of them only while
training: checked when they are installed."""


def _ensure_buckets(att: Attachment, opt: Any) -> None:
    """One IPG bucket per communication dtype the hooks chose, each buffer sized for the
    parameters reduced in that dtype.

    DeepSpeed sizes every bucket's contiguous buffer at ``reduce_bucket_size`` elements; a bucket
    holds at most the gradients of the distinct parameters reduced in its dtype (it is flushed
    when full and at the end of each backward), so ``min(reduce_bucket_size, their numel)`` is
    enough.  Without this a model whose parameters are split between two dtypes (autocastzero,
    mixedlayers) would pay for two full-size buffers, most of one of them never used."""
    buckets = require_attr(opt, "ipg_buckets", _OPT)
    require_attrs(opt, _BUCKET_NEEDS, _OPT)
    default = opt.communication_data_type
    bucket_cls = type(next(iter(buckets.values())))
    device = next(iter(buckets.values())).buffer.device if opt.contiguous_gradients else None
    needed: dict[torch.dtype, int] = {}
    for group in opt.fp16_groups:
        for p in group:
            dtype = att.comm_dtype(p, default)
            needed[dtype] = needed.get(dtype, 0) + int(p.ds_numel)
    for dtype in needed:
        if dtype not in buckets:
            buckets[dtype] = bucket_cls()
    if not opt.contiguous_gradients:
        return
    limit = int(opt.reduce_bucket_size)
    for dtype, bucket in buckets.items():
        size = min(limit, needed.get(dtype, 0))
        if bucket.buffer is None or (bucket.elements == 0 and bucket.buffer.numel() > size):
            bucket.buffer = torch.empty(size, dtype=dtype, device=device)
    original = buckets.get(default)

    def restore() -> None:  # detached, every parameter is reduced in DeepSpeed's dtype again
        if original is not None and original.buffer is not None and original.buffer.numel() < limit:
            original.buffer = torch.empty(limit, dtype=default, device=device)

    att.keep_handle(RemovableHandle(restore, "zerohooks: IPG bucket sizes"))


def _install_grad_hooks(att: Attachment, opt: Any) -> None:
    reg = att.registry
    if reg.micro_step_grad.frozen:

        def make_ready(original: Callable[..., Any]) -> Callable[..., Any]:
            def reduce_ready_partitions_and_remove_grads(param: Any) -> Any:
                att.fire_micro_step_grad(param)
                return original(param)

            return reduce_ready_partitions_and_remove_grads

        att.patch(opt, "reduce_ready_partitions_and_remove_grads", make_ready, _OPT)

    if att.patch_comm_dtype(opt, _OPT):
        _ensure_buckets(att, opt)


def _install_collectives(att: Attachment, opt: Any) -> None:
    reg = att.registry
    counters = att.counters
    owner = reg.reducer.owner is not None
    hooked = owner or bool(reg.reduce_tensor.frozen)
    require_attrs(opt, _COLLECTIVE_NEEDS, _OPT)
    if hooked and opt.contiguous_gradients and not opt.reduce_scatter:
        raise ConfigError(
            "zero_optimization.reduce_scatter=false is not supported with plugins that own or replace the "
            "reduced gradient tensor; remove reduce_scatter (default true)"
        )
    att.check_default_averaging(float(opt.gradient_predivide_factor))
    att.check_sequence_parallel(require_attr(opt, "sequence_parallel_size", _OPT))
    from deepspeed.runtime.comm import coalesced_collectives

    reduce_scatter_coalesced = require_attr(
        coalesced_collectives, "reduce_scatter_coalesced", "deepspeed.runtime.comm.coalesced_collectives"
    )

    def make_scatter(original: Callable[..., Any]) -> Callable[..., Any]:
        def avg_scatter_grads(params: list[Any], communication_data_type: torch.dtype) -> Any:
            nbytes = sum(p.grad.numel() for p in params) * communication_data_type.itemsize
            counters.add("reduce_scatter", communication_data_type, nbytes)
            group = opt._get_param_partition_group(params[0]) if params else opt.dp_process_group
            world = dist.get_world_size(group=group)
            reports = counters.wire_reports
            if not hooked:
                counters.add_default_wire("reduce_scatter", communication_data_type, nbytes, world)
                return original(params, communication_data_type)
            tensors = []
            for p in params:
                t = att.reduce_tensor(p, p.grad)
                if t is None:
                    raise RuntimeError(
                        f"a reduce_tensor hook returned None for a ZeRO-3 parameter (ds_id {p.ds_id})"
                    )
                tensors.append(t if t.dtype == communication_data_type else t.to(communication_data_type))
            if owner:
                bucket = ReduceBucket(
                    "reduce_scatter", tensors, params, communication_data_type, group, world, True
                )
                parts = reg.reducer.owner.reduce(bucket)  # type: ignore[union-attr]
                if parts is None or len(parts) != len(tensors):
                    raise RuntimeError(
                        f"{reg.reducer.name!r} must return one partition per tensor for reduce_scatter"
                    )
            else:
                parts = reduce_scatter_coalesced(tensors, group)
            if counters.wire_reports == reports:  # DeepSpeed's collective, or an owner that reported nothing
                counters.add_default_wire("reduce_scatter", communication_data_type, nbytes, world)
            averaging = opt._gradient_averaging_world_size(params, world)
            if averaging != world:
                parts = [g.mul(world / float(averaging)) for g in parts]
            acc = opt.gradient_accumulation_dtype
            return [g if g.dtype == acc else g.to(acc) for g in parts]

        return avg_scatter_grads

    att.patch(opt, _MANGLE + "avg_scatter_grads", make_scatter, _OPT)

    def make_contiguous(original: Callable[..., Any]) -> Callable[..., Any]:
        def avg_scatter_contiguous_grads(buffer: torch.Tensor, communication_data_type: torch.dtype) -> Any:
            nbytes = buffer.numel() * communication_data_type.itemsize
            counters.add("all_reduce", communication_data_type, nbytes)
            world = dist.get_world_size(group=opt.dp_process_group)
            counters.add_default_wire("all_reduce", communication_data_type, nbytes, world)
            return original(buffer, communication_data_type)

        return avg_scatter_contiguous_grads

    att.patch(opt, _MANGLE + "avg_scatter_contiguous_grads", make_contiguous, _OPT)


class _GatherDtypes:
    """The all-gather dtypes set on ZeRO-3 parameters, and their removal on detach.

    DeepSpeed 0.19.8 reads a parameter's all-gather dtype from its ``comm_dtype`` attribute (the
    attribute its ``torch_autocast`` sets; ``partition_parameters.get_allgather_dtype``), on
    every gather path; it is the only per-parameter switch, so the adapter sets it here, per
    parameter of this engine only, and restores what was there on detach.
    """

    __slots__ = ("_previous",)

    def __init__(self) -> None:
        self._previous: list[tuple[Any, Any]] = []

    def set(self, param: Any, dtype: torch.dtype) -> None:
        self._previous.append((param, param.__dict__.get(_GATHER_ATTR, _UNSET)))
        setattr(param, _GATHER_ATTR, dtype)

    def remove(self) -> None:
        for param, previous in reversed(self._previous):
            if previous is _UNSET:
                param.__dict__.pop(_GATHER_ATTR, None)
            else:
                setattr(param, _GATHER_ATTR, previous)
        self._previous.clear()


_GATHER_ATTR = "comm_dtype"
_UNSET = object()


def _install_gather_dtypes(att: Attachment, opt: Any) -> None:
    hooks = att.registry.gather_dtype.frozen
    if not hooks:
        return
    from deepspeed.runtime.zero import partition_parameters

    require_attr(partition_parameters, "get_allgather_dtype", "deepspeed.runtime.zero.partition_parameters")
    dtypes = _GatherDtypes()
    att.keep_handle(dtypes)
    # every partitioned parameter of the module, frozen ones included (they are gathered too)
    for p in att.engine.module.parameters():
        if not hasattr(p, "ds_tensor"):
            continue
        own = p.ds_tensor.dtype
        dtype = own
        for fn in hooks:
            dtype = fn(p, dtype)
        if dtype != own:
            dtypes.set(p, dtype)


def install(att: Attachment) -> None:
    opt = att.engine.optimizer
    _install_gather_dtypes(att, opt)
    _install_grad_hooks(att, opt)
    _install_collectives(att, opt)
    _install_gatherer(att)


def _install_gatherer(att: Attachment) -> None:
    """Route the forward/backward parameter all-gathers (each parameter's ``ds_process_group``;
    hpZ's secondary groups are left to DeepSpeed) to the gatherer, if one is registered."""
    if att.registry.gatherer.owner is None:
        return
    groups: list[Any] = []
    for p in att.engine.module.parameters():
        g = getattr(p, "ds_process_group", None)
        if hasattr(p, "ds_tensor") and all(g is not k for k in groups):
            groups.append(g)
    gather.install(att, groups)
