"""The autocastzero zerohooks plugin: autocast forward, per-parameter communication dtypes, fp16 scaling."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

import zerohooks
from autocastzero.config import AutocastZeroConfig, check_deepspeed_config
from autocastzero.scaling import (
    ScaleState,
    Zero0Scaler,
    ZeroLossScaler,
    initial_scale,
    load,
    save,
    stuck_message,
)
from autocastzero.select import safe_parameters, warn_if_nothing_safe
from zerohooks import PluginConfig, SetupContext, StepContext, ZeroPlugin
from zerohooks.adapter import seams
from zerohooks.dsconfig import read_settings, refuse_universal_load
from zerohooks.hookspec import AfterStepHook, GatherDtypeHook, PrepareModelHook, ReduceDtypeHook
from zerohooks.registry import HookRegistry

__all__ = ["AutocastState", "AutocastZeroPlugin", "ScaleCheckpoint", "autocast_state", "warn_if_slow_here"]

_slow_warned = False


def warn_if_slow_here(device_type: str, dtype: torch.dtype) -> bool:
    """Warn once per process when autocast to ``dtype`` is emulated on this hardware: bfloat16 on
    a CPU without native bf16 matrix multiply (no AVX-512 / AVX512-BF16 / AMX, e.g. AVX2 only).
    True when it warned (now or before)."""
    global _slow_warned
    if _slow_warned:
        return True
    from zerohooks.adapter.compat import native_bf16

    if device_type != "cpu" or dtype != torch.bfloat16 or native_bf16(cuda=False):
        return False
    _slow_warned = True
    warnings.warn(
        "autocastzero: this CPU has no native bf16 matrix multiply (no AVX512-BF16/AMX; capability "
        f"{torch.backends.cpu.get_cpu_capability()}), so bfloat16 autocast is emulated and runs several "
        "times slower than fp32 (measured 5x a step on an AVX2 CPU). Train in fp32 without the "
        '"autocastzero" section here, or use a GPU or a CPU with AVX512-BF16/AMX.',
        RuntimeWarning,
        stacklevel=3,
    )
    return True


class AutocastState:
    """What the plugin knows about one engine."""

    __slots__ = ("device_type", "dtype", "engine", "safe", "scale", "stage")

    def __init__(self, dtype: torch.dtype, stage: int, scale: ScaleState | None) -> None:
        self.dtype = dtype
        """The autocast dtype."""
        self.stage = stage
        """ZeRO stage of the engine."""
        self.scale = scale
        """fp16 loss scale (None for bfloat16)."""
        self.safe: dict[int, str] = {}
        """``id(param) -> name`` of the lower-precision-safe parameters."""
        self.engine: Any = None
        self.device_type = "cpu"
        """``torch.autocast`` device type (DeepSpeed's accelerator)."""


def autocast_state(engine: Any) -> AutocastState:
    """The :class:`AutocastState` of an engine built with the plugin."""
    att = zerohooks.attachment(engine)
    for p in att.plugins if att is not None else ():
        if isinstance(p, AutocastZeroPlugin) and p.state is not None:
            return p.state
    raise ValueError("this engine was not built with the autocastzero plugin")


class ScaleCheckpoint:
    """The fp16 loss scale in checkpoints (plugin state, one file per rank)."""

    __slots__ = ("reinstall", "state")

    def __init__(self, state: ScaleState, reinstall: Callable[[], None]) -> None:
        self.state = state
        self.reinstall = reinstall

    def state_dict(self) -> dict[str, Any]:
        return save(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load(self.state, state)
        self.reinstall()


class AutocastZeroPlugin(ZeroPlugin):
    """torch.autocast with fp32 parameters; 16-bit communication for lower-precision-safe modules."""

    name = "autocastzero"
    deepspeed_seams = ("forward", "loss_scaling")
    """The adapter seams this plugin uses (:data:`zerohooks.adapter.surface.SEAMS`)."""
    distribution = "zerohooks-autocastzero"
    Config = AutocastZeroConfig
    cfg: AutocastZeroConfig
    checkpoint_classes = (ScaleState, ZeroLossScaler)  # DeepSpeed saves the ZeRO loss scaler it was given

    def __init__(self, config: PluginConfig | None = None) -> None:
        super().__init__(config)
        self.state: AutocastState | None = None
        """Created in :meth:`attach`."""

    @override
    def edit_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        if self.cfg.dtype == "float16":  # bfloat16 keeps no state: DeepSpeed's universal load is all
            refuse_universal_load(
                read_settings(ds_config),
                "autocastzero",
                'with "dtype": "float16" its loss scaler is saved in its own per-rank state, which '
                "ds_to_universal does not convert (bfloat16 keeps no state and is supported)",
            )
        check_deepspeed_config(self.cfg, ds_config)

    @override
    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        cfg = self.cfg
        scale = None
        if cfg.dtype == "float16":
            first, dynamic = initial_scale(cfg.loss_scale, cfg.initial_scale_power)
            scale = ScaleState(first, dynamic, cfg.loss_scale_window, cfg.hysteresis, cfg.min_loss_scale)
        state = self.state = AutocastState(cfg.torch_dtype, ctx.zero_stage, scale)
        registry.register_prepare_model(_prepare(state, cfg), name=self.name)
        if cfg.low_precision_reduce:
            registry.register_reduce_dtype(_reduce_dtype(state), name=self.name)
        if cfg.low_precision_gather and ctx.zero_stage == 3:
            registry.register_gather_dtype(_gather_dtype(state), name=self.name)
        if scale is not None:
            registry.register_after_step(_report_stuck(state), name=self.name)

    @override
    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        from deepspeed.accelerator import get_accelerator

        state = self.state
        assert state is not None
        att = zerohooks.attachment(engine)
        assert att is not None
        state.engine = engine
        state.device_type = get_accelerator().device_name()
        if getattr(engine, "global_rank", 0) == 0:
            warn_if_slow_here(state.device_type, state.dtype)
        if not state.safe:
            state.safe = safe_parameters(engine.module, self.cfg)
            if getattr(engine, "global_rank", 0) == 0:  # once per engine, not once per rank
                warn_if_nothing_safe(engine.module, self.cfg, state.safe, state.stage)
        seams.forward_under_autocast(att, state.dtype)
        if state.scale is not None:
            reinstall = self._install_scaler(engine, att, state.stage, state.scale)
            registry.register_state(ScaleCheckpoint(state.scale, reinstall), name=self.name)

    def _install_scaler(self, engine: Any, att: Any, stage: int, scale: ScaleState) -> Callable[[], None]:
        """Put the plugin's scaler where DeepSpeed looks for one; returns how to put it back after a
        checkpoint load (DeepSpeed restores the ZeRO optimizer's pickled scaler object)."""
        params = [p for p in engine.module.parameters() if p.requires_grad] if stage == 0 else []
        scaler = ZeroLossScaler(scale)
        return seams.own_loss_scaling(
            att, zero_scaler=scaler, zero0=Zero0Scaler(scale, params), dynamic=scale.dynamic
        )

    @override
    def close(self) -> None:
        if self.state is not None:
            self.state.engine = None


# -- hook factories ----------------------------------------------------------------------------
def _prepare(state: AutocastState, cfg: AutocastZeroConfig) -> PrepareModelHook:
    def prepare_model(model: torch.nn.Module, ctx: SetupContext) -> None:
        state.safe = safe_parameters(model, cfg)

    return prepare_model


def _reduce_dtype(state: AutocastState) -> ReduceDtypeHook:
    def reduce_dtype(param: torch.nn.Parameter, dtype: torch.dtype) -> torch.dtype:
        return state.dtype if id(param) in state.safe else dtype

    return reduce_dtype


def _gather_dtype(state: AutocastState) -> GatherDtypeHook:
    def gather_dtype(param: torch.nn.Parameter, dtype: torch.dtype) -> torch.dtype:
        return state.dtype if id(param) in state.safe else dtype

    return gather_dtype


def _report_stuck(state: AutocastState) -> AfterStepHook:
    """Warn (rank 0, once per run of skipped steps) when every step is being skipped and backing
    off the scale cannot help any more (:func:`autocastzero.scaling.stuck_message`)."""

    def after_step(ctx: StepContext, skipped: bool) -> None:
        scale = state.scale
        message = stuck_message(scale) if scale is not None and skipped else None
        if message is not None and getattr(state.engine, "global_rank", 0) == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    return after_step
