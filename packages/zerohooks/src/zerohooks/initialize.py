"""``zerohooks.initialize``: ``deepspeed.initialize`` with plugins."""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch

from zerohooks.adapter import attach, detach
from zerohooks.config import load_config, split_plugin_sections
from zerohooks.enable import original_initialize
from zerohooks.errors import ConfigError
from zerohooks.hookspec import SetupContext
from zerohooks.plugin import ZeroPlugin
from zerohooks.registry import HookRegistry

__all__ = ["initialize", "setup_context"]


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def setup_context(ds_config: dict[str, Any]) -> SetupContext:
    """What the plugins are told about the run, read from DeepSpeed's part of the config."""
    zero = ds_config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError("zero_optimization must be a JSON object")
    stage = int(zero.get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, not {stage}")
    bf16 = _enabled(ds_config.get("bf16")) or _enabled(ds_config.get("bfloat16"))
    fp16 = _enabled(ds_config.get("fp16"))
    if bf16 and fp16:
        raise ConfigError("both bf16 and fp16 are enabled in the DeepSpeed config; enable one of them")
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    offload = zero.get("offload_optimizer") or {}
    device = offload.get("device") if isinstance(offload, dict) else None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    else:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    return SetupContext(
        config=ds_config,
        zero_stage=stage,
        train_dtype=dtype,
        offload_optimizer=None if device in (None, "none") else str(device),
        world_size=world,
        rank=rank,
    )


def initialize(*args: Any, plugins: Sequence[ZeroPlugin] = (), **kwargs: Any) -> Any:
    """Drop-in for ``deepspeed.initialize``: same arguments, same return tuple.

    Plugin sections (``"accumdtype"``, ``"loco"``, ...) are removed from the config, validated and
    turned into plugins; the plugins prepare the model, DeepSpeed builds the engine, and the
    adapter attaches the plugins' hooks to it.  ``plugins`` adds plugin objects built in code.
    Without any plugin, training is bit-for-bit what ``deepspeed.initialize`` gives.
    """
    ds_initialize = original_initialize()  # DeepSpeed's own function, never a router: no recursion
    bound = inspect.signature(ds_initialize).bind(*args, **kwargs)
    params = bound.arguments
    ds_args = params.get("args")
    source: Any = params.get("config")
    if source is None:
        source = params.pop("config_params", None)
    if source is None and ds_args is not None and getattr(ds_args, "deepspeed_config", None):
        source = ds_args.deepspeed_config
        ds_args = copy.copy(ds_args)
        ds_args.deepspeed_config = None  # the config now travels as a dict
        params["args"] = ds_args
    ds_config = load_config(source)
    enabled = [*split_plugin_sections(ds_config), *plugins]
    names = [p.name for p in enabled]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"plugins {dupes} are enabled twice (config section and plugins= argument)")
    for p in enabled:
        p.peers = tuple(n for n in names if n != p.name)
    for p in enabled:
        p.edit_deepspeed_config(ds_config)
    ctx = setup_context(ds_config)
    registry = HookRegistry()
    for p in enabled:
        p.attach(registry, ctx)
    if params.get("model") is not None:
        params["model"] = registry.run_prepare_model(params["model"], ctx)
    client = params.get("optimizer")
    if registry.prepare_parameters.frozen:
        model = params.get("model")
        if (
            params.get("model_parameters") is None
            and model is not None
            and not isinstance(client, torch.optim.Optimizer)
        ):
            # DeepSpeed would take model.parameters(): hand the hooks the same list
            params["model_parameters"] = list(model.parameters())
        if params.get("model_parameters") is not None:
            params["model_parameters"] = registry.run_prepare_parameters(
                params["model_parameters"], model, ctx
            )
        if isinstance(client, torch.optim.Optimizer):
            # an optimizer object: its param groups take the transform, in place (before any step)
            before = len(client.param_groups)
            groups = list(registry.run_prepare_parameters(list(client.param_groups), model, ctx))
            scheduler = params.get("lr_scheduler")
            if len(groups) != before and scheduler is not None and not callable(scheduler):
                raise ConfigError(
                    f"the plugins split the optimizer's {before} param groups into {len(groups)}, but an "
                    "lr_scheduler object built on the old groups was passed; pass a callable "
                    "(lr_scheduler=lambda opt: ...) or build the scheduler from the optimizer returned by "
                    "zerohooks.initialize"
                )
            client.param_groups[:] = groups
    if source is not None:
        params["config"] = ds_config
    result = ds_initialize(*bound.args, **bound.kwargs)
    engine = result[0]
    attach(engine, registry, ctx, enabled)
    try:
        for p in enabled:
            p.engine_ready(engine, registry)
    except BaseException:
        detach(engine)  # undo every patch and let each plugin release what it made (files, buffers)
        raise
    return result
