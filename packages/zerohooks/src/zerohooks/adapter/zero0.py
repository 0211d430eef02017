"""Adapter for training without ZeRO partitioning (stage 0): the engine all-reduces gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks import watchdog
from zerohooks.adapter.base import Attachment


def install(att: Attachment) -> None:
    engine = att.engine
    reg = att.registry
    counters = att.counters
    params = [p for p in engine.module.parameters() if p.requires_grad]

    if reg.micro_step_grad.frozen:
        for p in params:
            att.keep_handle(p.register_post_accumulate_grad_hook(att.fire_micro_step_grad))

    att.check_default_averaging(float(engine.gradient_predivide_factor()))
    hooked = bool(reg.reducer.owner or reg.reduce_dtype.frozen or reg.reduce_tensor.frozen)

    def reduce(bucket: list[torch.Tensor], dp_group: Any, dp_world_size: Any) -> torch.Tensor | None:
        """The hooked all-reduce of one bucket: the reduced flat tensor when the bucket went whole
        and unchanged in one communication dtype (the caller copies it back, converting, as
        DeepSpeed does its own), else ``None``: every reduced tensor was written in place (the
        ``reduce_tensor`` hooks' replacements, the groups of several communication dtypes)."""
        default = engine.communication_data_type
        by_ptr = {p.grad.data_ptr(): p for p in params if p.grad is not None}
        groups: dict[torch.dtype, list[tuple[torch.Tensor, Any]]] = {}
        for g in bucket:
            p = by_ptr.get(g.data_ptr())
            t = att.reduce_tensor(p, g) if p is not None else g
            if t is None:
                continue
            groups.setdefault(att.comm_dtype(p, default), []).append((t, p))
        world = dist.get_world_size(group=dp_group) if dp_world_size is None else dp_world_size
        only = next(iter(groups.values()), [])
        whole = (
            len(groups) == 1
            and len(only) == len(bucket)
            and all(t is g for (t, _), g in zip(only, bucket, strict=True))
        )
        for dtype, items in groups.items():
            tensors = [t for t, _ in items]
            # flattened and converted in one pass
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
            torch.cat([t.reshape(-1) for t in tensors], out=flat)
            nbytes = flat.numel() * dtype.itemsize
            counters.add("all_reduce", dtype, nbytes)
            if reg.reducer.owner is not None:
                att.owner_all_reduce(flat, dp_group, engine.gradient_average, [p for _, p in items])
            else:
                counters.add_default_wire("all_reduce", dtype, nbytes, dist.get_world_size(group=dp_group))
                watchdog.run(
                    "ZeRO 0 gradient all_reduce",
                    dp_group,
                    lambda: dist.all_reduce(flat, group=dp_group, async_op=True),  # noqa: B023
                )
                if engine.gradient_average:
                    flat.div_(world)
            if whole:
                return flat
            for t, r in zip(tensors, torch.split(flat, [t.numel() for t in tensors]), strict=True):
                t.copy_(r.view_as(t))
        return None

    def count_default(bucket: list[torch.Tensor], dp_group: Any) -> None:
        default = engine.communication_data_type
        nbytes = sum(t.numel() for t in bucket) * default.itemsize
        counters.add("all_reduce", default, nbytes)
        counters.add_default_wire("all_reduce", default, nbytes, dist.get_world_size(group=dp_group))

    def make_bucket(original: Callable[..., Any]) -> Callable[..., Any]:
        def allreduce_bucket(bucket: list[torch.Tensor], dp_group: Any, dp_world_size: Any = None) -> Any:
            if not hooked:
                count_default(bucket, dp_group)
                return original(bucket, dp_group, dp_world_size)
            flat = reduce(bucket, dp_group, dp_world_size)
            # DeepSpeed's callers copy the result back into the bucket: the bucket itself where
            # it was written in place
            return flat if flat is not None else engine.flatten(bucket)

        return allreduce_bucket

    def make_and_copy(original: Callable[..., Any]) -> Callable[..., Any]:
        def allreduce_and_copy(
            small_bucket: list[torch.Tensor], dp_group: Any, dp_world_size: Any = None
        ) -> Any:
            if not hooked:
                return original(small_bucket, dp_group, dp_world_size)
            flat = reduce(small_bucket, dp_group, dp_world_size)
            if flat is None:  # written in place: no flat copy of the bucket to copy back onto itself
                return None
            for buf, synced in zip(small_bucket, engine.unflatten(flat, small_bucket), strict=True):
                buf.copy_(synced)
            return None

        return allreduce_and_copy

    att.patch(engine, "allreduce_bucket", make_bucket, "DeepSpeedEngine")
    att.patch(engine, "allreduce_and_copy", make_and_copy, "DeepSpeedEngine")
