"""The mixedlayers zerohooks plugin: fp32 modules inside a bf16/fp16 model, on every ZeRO stage.

How each piece of DeepSpeed is kept from losing the fp32 modules:

* the engine's cast of every parameter: undone at its ``module.to`` call (:mod:`mixedlayers.state`);
* optimizers flattening each param group into one buffer (FP16_Optimizer, BF16_Optimizer,
  ZeRO 1/2/3): every group is split into a 16-bit and an fp32 group (``prepare_parameters``);
* the gradient collective in the 16-bit communication dtype: the fp32 parameters' gradients
  are reduced in fp32 (``reduce_dtype``); they are accumulated, staged and partitioned in fp32
  (:mod:`mixedlayers.zero12`, DeepSpeed's ``grad_accum_dtype`` on ZeRO 2/3);
* ZeRO 3's single flat buffer of parameter partitions: :mod:`mixedlayers.zero3`;
* fp16 loss scaling: the scaled loss flows through both kinds of modules, and DeepSpeed unscales
  and checks for overflow over every group, fp32 ones included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

import zerohooks
from mixedlayers.casting import explain_dtype_errors, install_boundary_hooks
from mixedlayers.config import (
    MixedLayersConfig,
    add_sharers,
    check_deepspeed_config,
    outermost,
    select_modules,
)
from mixedlayers.state import MixedState, keep_fp32, shadow_module_to, split_param_groups
from mixedlayers.under_autocast import AUTOCAST_PLUGIN, install_autocast_off, record_kept
from mixedlayers.zero3 import restore_zero3
from mixedlayers.zero12 import fp32_accumulation_by_config, install_fp32_accumulation, install_fp32_staging
from zerohooks import ConfigError, PluginConfig, SetupContext, ZeroPlugin
from zerohooks.adapter.dsrules import is_pipeline_model
from zerohooks.adapter.stagenorm import install as install_stage_norm
from zerohooks.dsconfig import set_grad_accum_dtype
from zerohooks.hookspec import GatherDtypeHook, PrepareModelHook, PrepareParametersHook, ReduceDtypeHook
from zerohooks.registry import FIRST, LAST, HookRegistry

__all__ = ["MixedLayersPlugin", "mixed_state"]

# FIRST (prepare_model): select and keep the modules before other plugins wrap the model (their
# wrappers would change module names).  LAST (reduce_dtype): whatever other plugins chose, fp32
# gradients are never reduced in a narrower dtype.


def mixed_state(engine: Any) -> MixedState | None:
    """The :class:`MixedState` of an engine built with mixedlayers, else None."""
    att = zerohooks.attachment(engine)
    for plugin in att.plugins if att is not None else ():
        if isinstance(plugin, MixedLayersPlugin):
            return plugin.state
    return None


class MixedLayersPlugin(ZeroPlugin):
    """Keep chosen modules of a 16-bit model in fp32, with casts at their boundaries."""

    name = "mixedlayers"
    deepspeed_seams = ("separate_accumulation", "stage_buckets", "partition_retype", "stage_norm")
    """The adapter seams this plugin uses (:data:`zerohooks.adapter.surface.SEAMS`)."""
    distribution = "zerohooks-mixedlayers"
    Config = MixedLayersConfig
    cfg: MixedLayersConfig

    def __init__(self, config: PluginConfig) -> None:
        super().__init__(config)
        self.state: MixedState | None = None
        """Created in :meth:`attach`."""
        self._autocast: list[Any] = []
        """Autocast-off contexts of the kept modules running now (with autocastzero)."""

    @property
    def under_autocast(self) -> bool:
        """autocastzero is enabled too: fp32 parameters everywhere, the kept modules compute
        outside autocast (:mod:`mixedlayers.under_autocast`)."""
        return AUTOCAST_PLUGIN in self.peers

    @override
    def edit_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        ctx = self.deepspeed
        if self.under_autocast:
            return  # autocastzero refuses DeepSpeed's bf16/fp16 sections; parameters stay fp32
        check_deepspeed_config(ctx)
        if fp32_accumulation_by_config(ctx):
            # DeepSpeed's own fp32 gradient accumulation (data_types.grad_accum_dtype): ZeRO 1-3
            # otherwise accumulate and partition every gradient in one buffer of the model dtype,
            # which would round the kept parameters' fp32 gradients.  The 16-bit parameters'
            # gradients then accumulate in fp32 too (2 more bytes per parameter of the partition).
            set_grad_accum_dtype(ds_config, "fp32")
        else:
            # fp32 (the only value check_deepspeed_config lets through) would make DeepSpeed build
            # its BF16_Optimizer on bf16 ZeRO 1; engine_ready switches the same accumulation on
            set_grad_accum_dtype(ds_config, None)

    @override
    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        state = self.state = MixedState(self.cfg, ctx.train_dtype)
        if self.under_autocast:
            registry.register_prepare_model(
                _prepare_under_autocast(self.cfg, state, self._autocast), name=self.name, order=FIRST
            )
            registry.register_reduce_dtype(_reduce_dtype(state), name=self.name, order=LAST)
            if ctx.zero_stage == 3:
                registry.register_gather_dtype(_gather_dtype(state), name=self.name, order=LAST)
            return
        registry.register_prepare_model(_prepare_model(self.cfg, state), name=self.name, order=FIRST)
        registry.register_prepare_parameters(_prepare_parameters(state), name=self.name, order=FIRST)
        registry.register_reduce_dtype(_reduce_dtype(state), name=self.name, order=LAST)

    @override
    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        state = self.state
        assert state is not None
        if self.under_autocast:
            return
        stage = engine.zero_optimization_stage()
        att = zerohooks.attachment(engine)
        assert att is not None
        if stage == 3:
            restore_zero3(att, state)
        elif stage in (1, 2):
            if stage == 1 and not fp32_accumulation_by_config(att.setup):
                install_fp32_accumulation(att)
            install_fp32_staging(att)
            if is_pipeline_model(engine.module):
                # a stage without fp32 layers holds one param group fewer than the others
                install_stage_norm(att)
        if not state.modules and not any(p in _PREPARED for p in engine.module.parameters()):
            # (a pipeline stage may hold none of the kept modules: prepared all the same)
            raise RuntimeError(
                "mixedlayers: the model was not prepared (pass model= to zerohooks.initialize)"
            )
        if state.saved:
            raise RuntimeError(
                "mixedlayers: DeepSpeed did not call module.to(device) after casting the model (was "
                "dont_change_device=True passed?), so the fp32 modules could not be restored"
            )
        wrong = [p for p in state.params if p.dtype != torch.float32]
        if wrong:
            raise RuntimeError(
                f"mixedlayers: {len(wrong)} kept parameters are not fp32 after DeepSpeed's init"
            )

    @override
    def close(self) -> None:
        if self.state is not None:
            self.state.release()
        self._autocast.clear()


# -- hook factories ------------------------------------------------------------------------------
_PREPARED = WeakIdKeyDictionary()
"""Every parameter of a model mixedlayers prepared for an engine, by identity (held weakly:
nothing is stored on the parameters, and a parameter that is freed leaves it)."""


def _refuse_prepared_model(model: nn.Module) -> None:
    """A model (or a parameter of it) already prepared for another engine cannot be prepared again.

    DeepSpeed cast (ZeRO 3: partitioned) its parameters for that engine, and the kept modules
    carry that engine's casts; a second engine built on them would crash in DeepSpeed (ZeRO 1/2:
    at the first backward) or be mistaken for a model built under ``deepspeed.zero.Init``."""
    if any(p in _PREPARED for p in model.parameters()):
        raise ConfigError(
            "mixedlayers: this model was already prepared by mixedlayers for another engine (an earlier "
            "zerohooks.initialize on the same model object, or on modules shared with it): DeepSpeed cast "
            "its parameters to the training dtype (ZeRO 3: partitioned them) for that engine, and the kept "
            "modules carry that engine's casts, so a second engine cannot be built on it, even after "
            "zerohooks.detach. Build a new model object for each zerohooks.initialize; to carry the "
            "weights over, save a checkpoint with the first engine and load it into the new one"
        )


def _mark_prepared(model: nn.Module) -> None:
    for p in model.parameters():
        _PREPARED[p] = True


def _matched_on_any_stage(model: nn.Module) -> Callable[[list[bool]], list[bool]] | None:
    """For a pipeline (each rank holds its stage's layers): whether each selector matched on any
    rank (one all-gather over the world, which every rank of a pipeline takes part in)."""
    if not is_pipeline_model(model):
        return None

    def anywhere(local: list[bool]) -> list[bool]:
        found: list[list[bool] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, local)
        return [any(f[i] for f in found if f is not None) for i in range(len(local))]

    return anywhere


def _prepare_model(cfg: MixedLayersConfig, state: MixedState) -> PrepareModelHook:
    def prepare_model(model: nn.Module, ctx: SetupContext) -> nn.Module | None:
        _refuse_prepared_model(model)
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            raise ConfigError(
                "mixedlayers does not support models whose parameters are already partitioned by ZeRO 3 "
                "(built under deepspeed.zero.Init, or given to an earlier deepspeed.initialize): they are "
                "partitioned in the training dtype; build the model normally (a new model object for each "
                "engine), ZeRO 3 partitions it. "
                "Hugging Face: from_pretrained/from_config use zero.Init once a ZeRO 3 TrainingArguments (or "
                "accelerate's zero3_init_flag) exists; build the model before the TrainingArguments, or "
                "construct it directly (e.g. GPT2LMHeadModel(config)), or set zero3_init_flag=False"
            )
        selected = add_sharers(model, select_modules(model, cfg, _matched_on_any_stage(model)))
        keep_fp32(state, model, selected, cfg.keep_buffers)
        state.boundaries = outermost(selected)
        install_boundary_hooks(state)
        explain_dtype_errors(state, model)
        state.handles.append(shadow_module_to(state, model, params=ctx.zero_stage != 3))
        _mark_prepared(model)
        return None

    return prepare_model


def _prepare_under_autocast(
    cfg: MixedLayersConfig, state: MixedState, contexts: list[Any]
) -> PrepareModelHook:
    def prepare_model(model: nn.Module, ctx: SetupContext) -> nn.Module | None:
        _refuse_prepared_model(model)
        selected = add_sharers(model, select_modules(model, cfg, _matched_on_any_stage(model)))
        record_kept(state, selected)
        state.boundaries = outermost(selected)
        install_autocast_off(state, contexts)
        _mark_prepared(model)
        return None

    return prepare_model


def _gather_dtype(state: MixedState) -> GatherDtypeHook:
    def gather_dtype(param: nn.Parameter, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if state.is_fp32(param) else dtype

    return gather_dtype


def _prepare_parameters(state: MixedState) -> PrepareParametersHook:
    def prepare_parameters(model_parameters: Any, model: nn.Module, ctx: SetupContext) -> Any:
        return split_param_groups(state, model_parameters)

    return prepare_parameters


def _reduce_dtype(state: MixedState) -> ReduceDtypeHook:
    def reduce_dtype(param: nn.Parameter, dtype: torch.dtype) -> torch.dtype:
        if state.is_fp32(param) and dtype.itemsize < 4:
            return torch.float32
        return dtype

    return reduce_dtype
