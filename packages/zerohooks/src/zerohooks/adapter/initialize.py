"""``zerohooks.initialize``: ``deepspeed.initialize`` with plugins."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch

from zerohooks import watchdog
from zerohooks.adapter import attach, attachment, detach
from zerohooks.adapter.compat import (
    original_initialize,
    require_supported_deepspeed,
    route_deepspeed_op_builds,
)
from zerohooks.adapter.dsrules import (
    check_deepcompile,
    check_moe_stage,
    check_pipeline_stage,
    check_zero_optimizer,
)
from zerohooks.config import load_config, split_plugin_sections
from zerohooks.dsconfig import engine_context, setup_context
from zerohooks.errors import ConfigError
from zerohooks.hookspec import SetupContext
from zerohooks.plugin import ZeroPlugin
from zerohooks.registry import HookRegistry

__all__ = ["initialize", "setup_context"]


def _names_plugin(ds_config: dict[str, Any]) -> bool:
    """Whether the config has a section named exactly after a plugin (installed or not)."""
    from zerohooks.config import KNOWN_PLUGINS, plugin_entry_points

    keys = set(ds_config)
    return bool(keys & KNOWN_PLUGINS.keys()) or bool(
        keys & plugin_entry_points().keys()
    )  # entry points read once


def _init_distributed(params: dict[str, Any], ds_initialize: Any) -> None:
    """The process group, set up as ``deepspeed.initialize`` sets it up first thing, so ranks can
    agree on the plugins' set-up before DeepSpeed's own collectives start."""
    if params.get("model") is None:
        return  # DeepSpeed refuses the call before touching the process group
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        # one process (or a launcher that sets no WORLD_SIZE, e.g. MPI): nobody to agree with
        # before DeepSpeed runs; DeepSpeed sets the group up itself, after the config is judged
        return
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    defaults = inspect.signature(ds_initialize).parameters
    comm.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=params.get("distributed_port", defaults["distributed_port"].default),
        dist_init_required=params.get("dist_init_required", defaults["dist_init_required"].default),
    )


def _prepare(
    params: dict[str, Any], ds_config: dict[str, Any], plugins: Sequence[ZeroPlugin]
) -> tuple[list[ZeroPlugin], HookRegistry, SetupContext | None]:
    """The enabled plugins, their registry and context; the model, parameters and optimizer in
    ``params`` prepared by their hooks (everything before DeepSpeed builds the engine)."""
    enabled = [*split_plugin_sections(ds_config), *plugins]
    names = [p.name for p in enabled]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"plugins {dupes} are enabled twice (config section and plugins= argument)")
    for p in enabled:
        p.peers = tuple(n for n in names if n != p.name)
    for p in enabled:
        p.edit_deepspeed_config(ds_config)
    ctx: SetupContext | None
    try:
        ctx = setup_context(ds_config)
    except ConfigError:
        if enabled:
            raise
        ctx = None  # no plugin to tell: DeepSpeed judges its own config (it may accept it)
    if ctx is not None and enabled:
        # DeepSpeed's "untested ZeRO Optimizer" assertion, said before anything is built
        check_zero_optimizer(ds_config, params.get("optimizer"), ctx.zero_stage)
        check_moe_stage(params.get("model"), ctx.zero_stage, tuple(names))
        check_pipeline_stage(params.get("model"), ctx.zero_stage, tuple(names))
        check_deepcompile(ds_config, tuple(names))
    registry = HookRegistry()
    if ctx is not None:
        for p in enabled:
            p.attach(registry, ctx)
        if params.get("model") is not None:
            params["model"] = registry.run_prepare_model(params["model"], ctx)
    client = params.get("optimizer")
    if ctx is not None and registry.prepare_parameters.frozen:
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
    return enabled, registry, ctx


def initialize(*args: Any, plugins: Sequence[ZeroPlugin] = (), **kwargs: Any) -> Any:
    """Drop-in for ``deepspeed.initialize``: same arguments, same return tuple.

    Plugin sections (``"accumdtype"``, ``"loco"``, ...) are removed from the config, validated and
    turned into plugins; the plugins prepare the model, DeepSpeed builds the engine, and the
    adapter attaches the plugins' hooks to it.  ``plugins`` adds plugin objects built in code.
    Without any plugin, training is bit-for-bit what ``deepspeed.initialize`` gives.

    With plugins on several ranks, the ranks agree twice (before DeepSpeed builds the engine and
    after the plugins attach): a failure on one rank is raised on every rank, naming the rank
    (:class:`~zerohooks.errors.RankFailedError` on the others), instead of leaving them waiting
    in DeepSpeed's first collective.

    The installed DeepSpeed is checked against :data:`zerohooks.SUPPORTED_DEEPSPEED` first
    (:class:`~zerohooks.errors.UnsupportedDeepSpeedError`), and DeepSpeed's op builds are routed
    through zerohooks while the call runs (:func:`zerohooks.route_deepspeed_op_builds`; put back
    when it returns or raises).
    """
    require_supported_deepspeed()
    with route_deepspeed_op_builds():
        return _initialize(args, plugins, kwargs)


def _initialize(args: tuple[Any, ...], plugins: Sequence[ZeroPlugin], kwargs: dict[str, Any]) -> Any:
    ds_initialize = original_initialize()  # DeepSpeed's own function, never a router: no recursion
    bound = inspect.signature(ds_initialize).bind(*args, **kwargs)
    params = bound.arguments
    ds_args: Any = params.get("args")
    source: Any = params.get("config")
    if source is None:
        source = params.pop("config_params", None)
    from_args = source is None and ds_args is not None and getattr(ds_args, "deepspeed_config", None)
    if from_args:
        source = ds_args.deepspeed_config
    try:
        ds_config = load_config(source)
    except ConfigError:
        if plugins:
            raise
        # a config zerohooks cannot read has no plugin section and DeepSpeed cannot read it
        # either: DeepSpeed raises its own error, as without zerohooks
        return ds_initialize(*args, **kwargs)
    wants = bool(plugins) or _names_plugin(ds_config)
    if wants:
        _init_distributed(params, ds_initialize)
    failure: Exception | None = None
    try:
        enabled, registry, ctx = _prepare(params, ds_config, plugins)
    except Exception as e:
        failure = e
    if wants:
        watchdog.agree(failure, "the plugins' set-up in zerohooks.initialize")
    elif failure is not None:
        raise failure
    with contextlib.ExitStack() as building:
        for p in enabled:
            building.enter_context(p.building())
        result = _build(ds_initialize, bound, params, ds_args, source, ds_config, from_args)
    engine = result[0]
    if ctx is None:
        ctx = engine_context(engine, ds_config)
    failure = None
    try:
        attach(engine, registry, ctx, enabled)
        for p in enabled:
            p.engine_ready(engine, registry)
    except Exception as e:
        failure = e
    try:
        if wants:
            watchdog.agree(failure, "attaching the plugins to the engine")
        elif failure is not None:
            raise failure
    except BaseException:
        if attachment(engine) is not None:
            detach(engine)  # undo every patch and let each plugin release what it made (files, buffers)
        else:
            # the adapter refused the engine before installing anything (e.g. a plugin that needs
            # the ZeRO optimizer DeepSpeed did not build): the plugins attached to the sealed
            # registry must still close, or they would stay bound to an engine nobody holds
            for p in enabled:
                with contextlib.suppress(Exception):
                    p.close()
        raise
    return result


def _build(
    ds_initialize: Any,
    bound: inspect.BoundArguments,
    params: dict[str, Any],
    ds_args: Any,
    source: Any,
    ds_config: dict[str, Any],
    from_args: Any,
) -> Any:
    """DeepSpeed's own ``initialize`` on the edited config."""
    if from_args:
        # DeepSpeed refuses a config in both args and config=: hand it over in config= and lift
        # it from the caller's args for the call only (DeepSpeed writes args.local_rank back
        # into the caller's own object, as without zerohooks)
        params["config"] = ds_config
        try:
            ds_args.deepspeed_config = None
            result = ds_initialize(*bound.args, **bound.kwargs)
        finally:
            ds_args.deepspeed_config = source
    else:
        if source is not None:
            params["config"] = ds_config
        result = ds_initialize(*bound.args, **bound.kwargs)
    return result


_engine_context = engine_context  # the name earlier tests use
