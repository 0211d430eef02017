"""The accumdtype zerohooks plugin: wires the plan of :mod:`accumdtype.config` to the hooks."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import zerohooks
from accumdtype.access import check_internals
from accumdtype.checkpoint import AccumCheckpoint, check_save
from accumdtype.config import AccumDtypeConfig, Plan, apply_plan, dtype_name, make_plan
from accumdtype.state import AccumState, accumulate, end_window, hand_to_optimizer, reduction_tensor
from zerohooks import ConfigError, PluginConfig, SetupContext, StepContext, ZeroPlugin
from zerohooks.adapter import gradview, seams
from zerohooks.adapter.dsrules import is_pipeline_model
from zerohooks.hookspec import (
    AfterStepHook,
    BeforeStepHook,
    MicroStepGradHook,
    PrepareModelHook,
    ReduceTensorHook,
)
from zerohooks.registry import FIRST, LAST, HookRegistry

__all__ = ["FIRST", "LAST", "AccumDtypePlugin"]

# FIRST: the tensor to reduce is accumdtype's baseline, which a compressing plugin may
# deliberately transform; the gradients handed to the optimizer must be in place before others
# look at them.  LAST: taking over ``param.grad`` at a micro-step; zeroing the buffers after the step.


class AccumDtypePlugin(ZeroPlugin):
    """Gradient accumulation and reduction dtypes independent of the model dtype."""

    name = "accumdtype"
    deepspeed_seams = (
        "separate_accumulation",
        "widen_reduction_buffer",
        "check_before_save",
        "gradient_partitions",
    )
    """The adapter seams this plugin uses (:data:`zerohooks.adapter.surface.SEAMS`)."""
    distribution = "zerohooks-accumdtype"
    Config = AccumDtypeConfig
    cfg: AccumDtypeConfig

    def __init__(self, config: PluginConfig | None = None) -> None:
        super().__init__(config)
        self.plan: Plan | None = None
        """Decided in :meth:`edit_deepspeed_config`."""
        self.state: AccumState | None = None
        """The engine's state, created in :meth:`attach`."""

    # -- before DeepSpeed ---------------------------------------------------------------------
    def edit_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        self.plan = make_plan(self.cfg, self.deepspeed)
        apply_plan(self.plan, ds_config)

    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        plan = self.plan
        if plan is None or plan.stage != ctx.zero_stage:
            raise RuntimeError(
                "accumdtype: attach() before edit_deepspeed_config() (use zerohooks.initialize)"
            )
        state = self.state = AccumState(plan)
        name = self.name
        if plan.mechanism == "own":
            registry.register_prepare_model(_refuse_pipeline(plan), name=name)
            registry.register_micro_step_grad(_micro_step(state), name=name, order=LAST)
            registry.register_reduce_tensor(_reduce_tensor(state), name=name, order=FIRST)
            registry.register_before_step(_before_step(state), name=name, order=FIRST)
            registry.register_after_step(_after_step(state), name=name, order=LAST)
        if plan.wide_ipg_buffer:
            registry.register_reduce_tensor(_z2_bypass_tensor(state), name=name, order=FIRST)
        registry.register_state(AccumCheckpoint(state), name=name)

    # -- DeepSpeed built the engine -------------------------------------------------------------
    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        plan, state = self.plan, self.state
        assert plan is not None and state is not None
        att = zerohooks.attachment(engine)
        assert att is not None
        state.bind(engine, engine.module.parameters(), own_buffers=plan.mechanism == "own")
        opt = engine.optimizer
        check_internals(opt, plan.stage)
        if plan.mechanism == "deepspeed_flag":
            # DeepSpeed is only asked for it for fp16 models: for bf16 it builds BF16_Optimizer
            seams.accumulate_separately(att, plan.accum_dtype)
        if plan.wide_ipg_buffer:
            seams.widen_reduction_buffer(att, plan.reduce_dtype)
        seams.check_before_save(att, lambda: check_save(state))
        if plan.warnings and engine.global_rank == 0:
            for text in plan.warnings:
                warnings.warn(f"accumdtype: {text}", RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        if self.state is not None:
            self.state.release()


# -- hook factories: each closes over the state and calls a pure function -----------------------
def _micro_step(state: AccumState) -> MicroStepGradHook:
    def micro_step_grad(param: torch.nn.Parameter, ctx: StepContext) -> None:
        accumulate(state, param)

    return micro_step_grad


def _refuse_pipeline(plan: Plan) -> PrepareModelHook:
    """ZeRO 0 with this plugin's own buffers: refuse a DeepSpeed pipeline before it is built.

    DeepSpeed's pipeline engine does not reduce ``param.grad`` there: for a bf16 model it builds
    its own bf16 optimizer, which copies ``param.grad`` into its buffers after each backward and
    reduces and steps from them; the buffers here take ``param.grad`` over at every micro-step,
    so that optimizer finds no gradient and fails in its norm (probed: "stack expects a non-empty
    TensorList" inside DeepSpeed).  ZeRO 1 trains pipelines, with data parallelism too.
    """

    def prepare_model(model: torch.nn.Module, ctx: SetupContext) -> torch.nn.Module | None:
        if is_pipeline_model(model):
            raise ConfigError(
                "accumdtype does not support a DeepSpeed pipeline (the model is a PipelineModule) on "
                f"ZeRO 0 (zero_optimization.stage 0) with {dtype_name(plan.accum_dtype)} accumulation of a "
                f"{dtype_name(plan.model_dtype)} model: DeepSpeed's pipeline engine reduces gradients its own way "
                "there (for a bf16 model in its own optimizer, which never sees accumdtype's buffers and fails "
                "inside DeepSpeed; other model dtypes untested); use "
                'zero_optimization.stage 1 (accumdtype trains pipelines there), or remove the "accumdtype" '
                "section"
            )
        return None

    return prepare_model


def _reduce_tensor(state: AccumState) -> ReduceTensorHook:
    def reduce_tensor(param: torch.nn.Parameter, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return reduction_tensor(state, param, tensor)

    return reduce_tensor


def _before_step(state: AccumState) -> BeforeStepHook:
    def before_step(ctx: StepContext) -> None:
        hand_to_optimizer(state)

    return before_step


def _after_step(state: AccumState) -> AfterStepHook:
    def after_step(ctx: StepContext, skipped: bool) -> None:
        end_window(state)

    return after_step


def _z2_bypass_tensor(state: AccumState) -> ReduceTensorHook:
    """ZeRO 2: gradients that skip the (widened) contiguous bucket are reduced from a wide copy.

    DeepSpeed divides the tensor it reduces by the world size in that tensor's dtype before
    converting it to the communication dtype; for a 16-bit gradient that rounds every
    micro-step unless the world size is a power of two.
    """
    reduce = state.plan.reduce_dtype

    def reduce_tensor(param: torch.nn.Parameter, tensor: torch.Tensor | None) -> torch.Tensor | None:
        engine = state.engine
        if tensor is None or engine is None or tensor.dtype.itemsize >= reduce.itemsize:
            return tensor
        if gradview.staged_in_bucket(engine, param):
            return tensor  # staged in the widened bucket buffer
        return tensor.to(reduce)

    return reduce_tensor
