"""DeepSpeed's own rules that zerohooks applies to a config before DeepSpeed sees it: the config
keys DeepSpeed defines (so none is taken for a misspelt plugin section), duplicate keys refused
as DeepSpeed refuses them in files, and the optimizers DeepSpeed has tested with ZeRO.  They read
DeepSpeed's modules, so they live in the adapter; the core's config code (:mod:`zerohooks.config`)
calls them when it runs, never on import."""

from __future__ import annotations

import importlib
import re
from typing import Any

from zerohooks.errors import ConfigError

__all__ = [
    "check_deepcompile",
    "check_moe_stage",
    "check_pipeline_stage",
    "check_zero_optimizer",
    "deepspeed_config_keys",
    "is_pipeline_model",
    "refuse_duplicate_keys",
]


def refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An ``object_pairs_hook`` for a JSON parser: the object as a dict, with DeepSpeed's
    duplicate-key refusal (``deepspeed.runtime.config_utils``) applied to it."""
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    return dict(dict_raise_error_on_duplicate_keys(pairs))


def deepspeed_config_keys() -> set[str]:
    """Config key names DeepSpeed defines (its constants modules), so that none is mistaken for a
    misspelt plugin section."""
    keys: set[str] = set()
    for name in (
        "deepspeed.runtime.constants",
        "deepspeed.runtime.config",
        "deepspeed.runtime.precision_config",
    ):
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        keys.update(
            v
            for k, v in vars(module).items()
            if k.isupper() and isinstance(v, str) and re.fullmatch(r"[a-z0-9_]+", v)
        )
    return keys


_ZERO_TESTED_TYPES = ("Adam", "AdamW", "Adagrad", "Lion")
"""The config's ``optimizer.type`` values that DeepSpeed 0.19.8 builds as an optimizer it has
tested with ZeRO (torch's or its own Adam/AdamW, Adagrad, Lion; CPU versions under offload)."""


def check_zero_optimizer(ds_config: dict[str, Any], optimizer: Any, stage: int) -> None:
    """Refuse, before DeepSpeed builds anything, an optimizer DeepSpeed's ZeRO refuses once the
    model is built (its ``AssertionError`` "You are using an untested ZeRO Optimizer"), by
    DeepSpeed's own rule: on ZeRO 1-3 without a true ``"zero_allow_untested_optimizer"``, the
    optimizer's class must be in ``deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS``.
    ``optimizer`` is what ``initialize`` was given: an optimizer object is judged by its class;
    None by the config's ``optimizer.type`` when DeepSpeed would take it from ``torch.optim``
    (``"SGD"``, ``"RMSprop"``...); DeepSpeed's own type names and optimizer callables are left
    to DeepSpeed."""
    if stage == 0 or ds_config.get("zero_allow_untested_optimizer"):
        return  # DeepSpeed's own test is the truth of the value
    import torch.optim
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    def is_tested(cls: type) -> bool:
        # DeepSpeed's own classes are left to it (is_zero_supported_optimizer adds MuonWithAuxAdam
        # when it is asked, and needs the process group to ask)
        return cls in ZERO_SUPPORTED_OPTIMIZERS or cls.__module__.split(".")[0] == "deepspeed"

    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        if is_tested(cls):
            return
        what = f"the optimizer object passed to initialize ({cls.__module__}.{cls.__qualname__})"
    elif optimizer is None:
        section = ds_config.get("optimizer")
        name = section.get("type") if isinstance(section, dict) else None
        if not isinstance(name, str) or name.lower() in DEEPSPEED_OPTIMIZERS:
            return
        found = getattr(torch.optim, name, None)
        if not isinstance(found, type) or is_tested(found):
            return  # no such torch optimizer: DeepSpeed says so in its own words
        what = f'optimizer.type "{name}" (torch.optim.{name})'
    else:
        return
    tested = ", ".join(f'"{t}"' for t in _ZERO_TESTED_TYPES)
    raise ConfigError(
        f"{what} is not an optimizer DeepSpeed has tested with ZeRO (zero_optimization.stage {stage}): "
        f'DeepSpeed refuses it once the model is built unless "zero_allow_untested_optimizer": true. '
        f"Use a tested one (optimizer.type {tested}; or an object of torch.optim.Adam, AdamW or Adagrad, "
        'or DeepSpeed\'s DeepSpeedCPUAdam/FusedAdam), or set "zero_allow_untested_optimizer": true at the '
        "top level of the DeepSpeed config to run it anyway"
    )


def check_moe_stage(model: Any, stage: int, plugins: tuple[str, ...]) -> None:
    """Refuse, before DeepSpeed builds anything, DeepSpeed's native MoE layers
    (``deepspeed.moe.layer.MoE``) on ZeRO 3, which DeepSpeed 0.19.8 refuses once the engine is
    being built (its ``AssertionError`` "Native DeepSpeed MoE is not supported with ZeRO Stage
    3"); ``plugins`` (the enabled ones) are named in the error."""
    import torch
    from deepspeed.moe.layer import MoE

    if stage != 3 or not isinstance(model, torch.nn.Module):
        return
    if not any(isinstance(m, MoE) for m in model.modules()):
        return
    raise ConfigError(
        f"the model holds DeepSpeed MoE layers (deepspeed.moe.layer.MoE) and zero_optimization.stage is 3 "
        f"with the plugins {', '.join(plugins)}: DeepSpeed refuses native MoE on ZeRO 3 once the engine "
        "is built; use ZeRO stage 1 or 2 (nvmeswap, which needs ZeRO 3, then cannot be used: "
        'offload the optimizer with "offload_optimizer": {"device": "cpu"} instead)'
    )


def check_deepcompile(ds_config: dict[str, Any], plugins: tuple[str, ...]) -> None:
    """Refuse DeepCompile (``"compile": {"deepcompile": true}``) beside any plugin.

    DeepCompile moves ZeRO's gradient reduction, parameter gathering and partitioning into
    passes over the compiled graph (``deepspeed.compile``; in DeepSpeed 0.19.8 on CUDA only),
    where none of the DeepSpeed methods the plugins hook runs: a plugin would be bypassed without
    a word (loco's exchange, accumdtype's accumulation, mixedlayers' fp32 reduction) or meet
    buffers it does not know.  Untested, so refused; ``engine.compile()`` without DeepCompile is
    tested with every plugin."""
    section = ds_config.get("compile")
    if not isinstance(section, dict) or not section.get("deepcompile"):
        return
    raise ConfigError(
        f'"compile": {{"deepcompile": true}} with the plugins {", ".join(plugins)}: DeepCompile moves ZeRO\'s '
        "gradient reduction and parameter partitioning into compiled graph passes, where the DeepSpeed "
        "methods these plugins hook never run, so they would be bypassed silently; zerohooks does not run "
        'them together. Set "deepcompile": false and call engine.compile() (tested with every plugin), or '
        "remove the plugins' sections to use DeepCompile"
    )


def is_pipeline_model(model: Any) -> bool:
    """Whether ``model`` is a DeepSpeed pipeline (``deepspeed.pipe.PipelineModule``): a plugin
    that cannot run one asks here instead of naming DeepSpeed's class itself."""
    from deepspeed.pipe import PipelineModule

    return isinstance(model, PipelineModule)


def check_pipeline_stage(model: Any, stage: int, plugins: tuple[str, ...]) -> None:
    """Refuse, before DeepSpeed builds anything, a ``deepspeed.pipe.PipelineModule`` on ZeRO 2 or
    3, which DeepSpeed 0.19.8 refuses while building the engine (its ``AssertionError`` "ZeRO-2
    and ZeRO-3 are incompatible with pipeline parallelism"); ``plugins`` are named in the error."""
    if stage < 2 or not is_pipeline_model(model):
        return
    raise ConfigError(
        f"the model is a DeepSpeed PipelineModule and zero_optimization.stage is {stage} with the plugins "
        f"{', '.join(plugins)}: DeepSpeed refuses pipeline parallelism on ZeRO 2 and 3 once the engine is "
        "built; use ZeRO stage 1 (nvmeswap, which needs ZeRO 3, then cannot be used: offload the "
        'optimizer with "offload_optimizer": {"device": "cpu"} instead)'
    )
