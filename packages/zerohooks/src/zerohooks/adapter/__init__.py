"""The DeepSpeed adapter: attaches a sealed registry to an engine, per instance, undoably."""

from __future__ import annotations

import logging
from typing import Any

from zerohooks.adapter import surface
from zerohooks.adapter.base import Attachment, attachment, step_context
from zerohooks.errors import ConfigError
from zerohooks.hookspec import SetupContext
from zerohooks.plugin import ZeroPlugin
from zerohooks.registry import HookRegistry

__all__ = ["Attachment", "attach", "attachment", "detach", "step_context"]


_log = logging.getLogger("zerohooks")

_STAGE_HOOKS = ("micro_step_grad", "reduce_dtype", "reduce_tensor", "gather_dtype")


def _stage_plugins(registry: HookRegistry) -> list[str]:
    """Plugins that registered hooks fired inside a ZeRO optimizer (not only around the step)."""
    summary = registry.summary()
    names = {n for hook in (*_STAGE_HOOKS, "reducer", "gatherer") for n in summary[hook]}
    return sorted(names)


def _expected_optimizer(stage: int) -> type | None:
    """The optimizer class the stage adapter was written for (None: any, ZeRO 0)."""
    if stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        return DeepSpeedZeroOptimizer  # type: ignore[no-any-return]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        return DeepSpeedZeroOptimizer_Stage3  # type: ignore[no-any-return]
    return None


def attach(engine: Any, registry: HookRegistry, setup: SetupContext, plugins: list[ZeroPlugin]) -> Attachment:
    """Attach ``registry`` to ``engine``; the stage is read from the engine.

    DeepSpeed builds other optimizers than the ZeRO one for some configs (``BF16_Optimizer`` for
    bf16 + ZeRO 1 + ``grad_accum_dtype: fp32``, ``DeepSpeedZeRoOffload`` for ZeRO 3 without an
    optimizer, none for inference).  There the stage adapter is not installed: without plugins
    the engine stays as DeepSpeed built it; plugins that hook into the ZeRO optimizer are refused
    with the optimizer's name and the settings that would work.
    """
    if attachment(engine) is not None:
        raise RuntimeError("this engine already has zerohooks attached; detach it first")
    registry.seal()
    att = Attachment(engine, registry, setup, plugins)
    stage = setup.zero_stage
    expected = _expected_optimizer(stage)
    opt = getattr(engine, "optimizer", None)
    stage_ok = expected is None or isinstance(opt, expected)
    if expected is not None and not stage_ok:
        needing = _stage_plugins(registry)
        if needing:
            built = "no optimizer" if opt is None else f"{type(opt).__module__}.{type(opt).__qualname__}"
            raise ConfigError(
                f"the plugins {needing} need DeepSpeed's ZeRO {stage} optimizer ({expected.__name__}), but "
                f"DeepSpeed built {built} for this config. Give deepspeed.initialize an optimizer (an "
                '"optimizer" section or an optimizer object) and do not force another one (e.g. remove '
                "data_types.grad_accum_dtype with bf16 on ZeRO 1, which selects BF16_Optimizer), or disable "
                "these plugins"
            )
    try:
        surface.check(engine, stage, surface.seams_of(plugins))
        att.install_engine_patches()
        if stage_ok:
            if stage == 0:
                from zerohooks.adapter import zero0 as mod
            elif stage in (1, 2):
                from zerohooks.adapter import zero12 as mod  # type: ignore[no-redef]
            else:
                from zerohooks.adapter import zero3 as mod  # type: ignore[no-redef]
            mod.install(att)
    except Exception as e:
        att.detach()
        if plugins or any(registry.summary().values()):
            raise
        # Nothing is attached: the patches only counted bytes and micro-steps. An engine they
        # do not fit (a DeepSpeed internal missing on this instance) stays as DeepSpeed built
        # it rather than fail a run that asked for no plugin.
        att.inert = f"{type(e).__name__}: {e}"
        _log.warning(
            "zerohooks: no plugin enabled and the adapter does not fit this %s (%s); the engine is left "
            "as DeepSpeed built it (no communication counters)",
            type(engine).__name__,
            att.inert,
        )
    except BaseException:
        att.detach()
        raise
    att.register()
    return att


def detach(engine: Any) -> None:
    """Undo everything zerohooks did to ``engine``: it behaves as DeepSpeed built it."""
    att = attachment(engine)
    if att is None:
        raise ValueError("this engine has no zerohooks attachment")
    att.detach()
