"""A plugin that registers every hook and records when each fires and with what tensors.

Used by the tests to prove that the adapter fires each phase at the right moment on every ZeRO
stage; useful to plugin authors to see what their hooks will receive.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerohooks.hookspec import GradientReducer, ReduceBucket, SetupContext, StepContext
from zerohooks.plugin import PluginConfig, ZeroPlugin
from zerohooks.registry import HookRegistry

__all__ = ["Event", "RecordingConfig", "RecordingPlugin"]


@dataclasses.dataclass
class Event:
    """One hook call."""

    phase: str
    global_step: int
    micro_step: int
    data: dict[str, Any]


class RecordingConfig(PluginConfig):
    """Config of the recording plugin."""

    own_reducer: bool = True
    """Own the gradient collective (an exact all-reduce / reduce-scatter done by the plugin)."""
    keep_grads: bool = True
    """Keep a copy of every micro-step gradient (memory grows with steps: tests only)."""


class _RecordingReducer(GradientReducer):
    def __init__(self, plugin: RecordingPlugin) -> None:
        self.plugin = plugin

    def reduce(self, bucket: ReduceBucket) -> list[torch.Tensor] | None:
        self.plugin._record(
            "reduce",
            None,
            op=bucket.op,
            dtype=bucket.dtype,
            average=bucket.average,
            numel=sum(t.numel() for t in bucket.tensors),
            nparams=len(bucket.params),
        )
        if bucket.op == "all_reduce":
            (flat,) = bucket.tensors
            dist.all_reduce(flat, group=bucket.group)
            if bucket.average:
                flat.div_(bucket.world_size)
            return None
        rank = dist.get_rank(group=bucket.group)
        out = []
        for t in bucket.tensors:
            full = t.detach().reshape(-1).clone()
            dist.all_reduce(full, group=bucket.group)
            full.div_(bucket.world_size)
            c = math.ceil(full.numel() / bucket.world_size)
            out.append(full[rank * c : min((rank + 1) * c, full.numel())].clone())
        return out


class RecordingPlugin(ZeroPlugin):
    """Records every hook call in :attr:`events`; its state is the number of events."""

    name = "recording"
    distribution = "zerohooks"
    Config = RecordingConfig

    def __init__(self, config: PluginConfig | None = None) -> None:
        super().__init__(config)
        self.events: list[Event] = []
        self.ctx: StepContext | None = None
        self.name_of_param: dict[int, str] = {}
        self.loaded_state: dict[str, Any] | None = None

    def _record(self, phase: str, ctx: StepContext | None, **data: Any) -> None:
        c = ctx or self.ctx
        self.events.append(Event(phase, c.global_step if c else -1, c.micro_step if c else -1, data))

    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        cfg = self.config
        assert isinstance(cfg, RecordingConfig)
        registry.register_prepare_model(self._prepare, name=self.name)
        registry.register_micro_step_grad(self._micro, name=self.name)
        registry.register_reduce_dtype(self._dtype, name=self.name)
        registry.register_reduce_tensor(self._tensor, name=self.name)
        registry.register_before_step(self._before, name=self.name)
        registry.register_after_step(self._after, name=self.name)
        registry.register_state(self, name=self.name)
        if cfg.own_reducer:
            registry.register_reducer(_RecordingReducer(self), name=self.name)

    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        from zerohooks.adapter import step_context

        self.ctx = step_context(engine)
        self._record("engine_ready", None, engine_type=type(engine).__name__)

    def _prepare(self, model: nn.Module, ctx: SetupContext) -> None:
        self.name_of_param = {id(p): n for n, p in model.named_parameters()}
        self._record(
            "prepare_model",
            None,
            model_type=type(model).__name__,
            dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        )

    def _micro(self, param: nn.Parameter, ctx: StepContext) -> None:
        grad = param.grad
        keep = grad.detach().clone() if (grad is not None and self.config.keep_grads) else None  # type: ignore[attr-defined]
        self._record("micro_step_grad", ctx, name=self.name_of_param.get(id(param)), grad=keep)

    def _dtype(self, param: nn.Parameter, dtype: torch.dtype) -> torch.dtype:
        self._record("reduce_dtype", None, name=self.name_of_param.get(id(param)), dtype=dtype)
        return dtype

    def _tensor(self, param: nn.Parameter, tensor: torch.Tensor | None) -> torch.Tensor | None:
        self._record(
            "reduce_tensor",
            None,
            name=self.name_of_param.get(id(param)),
            numel=None if tensor is None else tensor.numel(),
        )
        return tensor

    def _before(self, ctx: StepContext) -> None:
        self._record("before_step", ctx, is_boundary=ctx.is_boundary)

    def _after(self, ctx: StepContext, skipped: bool) -> None:
        self._record("after_step", ctx, skipped=skipped, next_loss_scale=ctx.next_loss_scale)

    def phases(self, phase: str) -> list[Event]:
        """Events of one phase, in order."""
        return [e for e in self.events if e.phase == phase]

    def state_dict(self) -> dict[str, Any]:
        return {
            "events": len(self.events),
            "marker": torch.arange(4, dtype=torch.float32) * (1 + len(self.events)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded_state = state
