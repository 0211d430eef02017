"""Adapter for training without ZeRO partitioning (stage 0): the engine all-reduces gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks import watchdog
from zerohooks.adapter.base import Attachment, bind_by_name


class _Reduction:
    """The engine's gradient all-reduce of one ZeRO-0 engine, through the registry's hooks."""

    def __init__(self, att: Attachment) -> None:
        self.att = att
        self.engine = att.engine
        self.params = [p for p in att.engine.module.parameters() if p.requires_grad]
        reg = att.registry
        self.hooked = bool(reg.reducer.owner or reg.reduce_dtype.frozen or reg.reduce_tensor.frozen)
        """Any hook changes the reduction (else it is only counted)."""

    def _groups(self, bucket: list[torch.Tensor]) -> dict[torch.dtype, list[tuple[torch.Tensor, Any]]]:
        """The bucket's tensors (after the ``reduce_tensor`` hooks) by communication dtype."""
        att = self.att
        default = self.engine.communication_data_type
        by_ptr = {p.grad.data_ptr(): p for p in self.params if p.grad is not None}
        groups: dict[torch.dtype, list[tuple[torch.Tensor, Any]]] = {}
        for g in bucket:
            p = by_ptr.get(g.data_ptr())
            t = att.reduce_tensor(p, g) if p is not None else g
            if t is None:
                continue
            groups.setdefault(att.comm_dtype(p, default), []).append((t, p))
        return groups

    def _all_reduce(
        self, flat: torch.Tensor, items: list[tuple[torch.Tensor, Any]], dp_group: Any, world: int
    ) -> None:
        att, engine = self.att, self.engine
        nbytes = flat.numel() * flat.dtype.itemsize
        att.counters.add("all_reduce", flat.dtype, nbytes)
        if att.registry.reducer.owner is not None:
            att.owner_all_reduce(flat, dp_group, engine.gradient_average, [p for _, p in items])
            return
        att.counters.add_default_wire("all_reduce", flat.dtype, nbytes, dist.get_world_size(group=dp_group))
        watchdog.run(
            "ZeRO 0 gradient all_reduce",
            dp_group,
            lambda: dist.all_reduce(flat, group=dp_group, async_op=True),
        )
        if engine.gradient_average:
            flat.div_(world)

    def reduce(self, bucket: list[torch.Tensor], dp_group: Any, dp_world_size: Any) -> torch.Tensor | None:
        """The hooked all-reduce of one bucket: the reduced flat tensor when the bucket went whole
        and unchanged in one communication dtype (the caller copies it back, converting, as
        DeepSpeed does its own), else ``None``: every reduced tensor was written in place (the
        ``reduce_tensor`` hooks' replacements, the groups of several communication dtypes)."""
        groups = self._groups(bucket)
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
            self._all_reduce(flat, items, dp_group, world)
            if whole:
                return flat
            for t, r in zip(tensors, torch.split(flat, [t.numel() for t in tensors]), strict=True):
                t.copy_(r.view_as(t))
        return None

    def count_default(self, bucket: list[torch.Tensor], dp_group: Any) -> None:
        default = self.engine.communication_data_type
        nbytes = sum(t.numel() for t in bucket) * default.itemsize
        self.att.counters.add("all_reduce", default, nbytes)
        self.att.counters.add_default_wire("all_reduce", default, nbytes, dist.get_world_size(group=dp_group))

    def make_bucket(self, original: Callable[..., Any]) -> Callable[..., Any]:
        bind = bind_by_name(original)

        def allreduce_bucket(*args: Any, **kwargs: Any) -> Any:
            bound = bind(*args, **kwargs)
            bucket, dp_group = bound["bucket"], bound["dp_group"]
            if not self.hooked:
                self.count_default(bucket, dp_group)
                return original(*args, **kwargs)
            flat = self.reduce(bucket, dp_group, bound.get("dp_world_size"))
            # DeepSpeed's callers copy the result back into the bucket: the bucket itself where
            # it was written in place
            return flat if flat is not None else self.engine.flatten(bucket)

        return allreduce_bucket

    def make_and_copy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        bind = bind_by_name(original)

        def allreduce_and_copy(*args: Any, **kwargs: Any) -> Any:
            if not self.hooked:
                return original(*args, **kwargs)
            bound = bind(*args, **kwargs)
            small_bucket = bound["small_bucket"]
            flat = self.reduce(small_bucket, bound["dp_group"], bound.get("dp_world_size"))
            if flat is None:  # written in place: no flat copy of the bucket to copy back onto itself
                return None
            for buf, synced in zip(small_bucket, self.engine.unflatten(flat, small_bucket), strict=True):
                buf.copy_(synced)
            return None

        return allreduce_and_copy


def install(att: Attachment) -> None:
    engine = att.engine
    reduction = _Reduction(att)
    if att.registry.micro_step_grad.frozen:
        for p in reduction.params:
            att.keep_handle(p.register_post_accumulate_grad_hook(att.fire_micro_step_grad))
    att.check_default_averaging(float(engine.gradient_predivide_factor()))
    att.patch(engine, "allreduce_bucket", reduction.make_bucket, "DeepSpeedEngine")
    att.patch(engine, "allreduce_and_copy", reduction.make_and_copy, "DeepSpeedEngine")
