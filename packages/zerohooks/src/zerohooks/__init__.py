"""zerohooks: a typed hook registry for DeepSpeed ZeRO and the adapter that fires it.

``zerohooks.initialize`` replaces ``deepspeed.initialize``; plugins found through the
``zerohooks.plugins`` entry-point group are enabled by their section in the DeepSpeed config.

Importing zerohooks imports no DeepSpeed and changes nothing in it.  The core (hook specs,
registry, plugin base, plugin config, errors) is imported here; the names that need DeepSpeed
(``initialize``, ``enable``, the adapter's, ...) are imported when first used (module
``__getattr__``) from :mod:`zerohooks.adapter`, the only part of zerohooks that names DeepSpeed's
internals, and the installed DeepSpeed's version is checked by ``initialize`` and ``enable``,
where zerohooks first uses it.  The one thing import does register is the exit guard
(:mod:`zerohooks.exitguard`): an ``atexit`` handler that waits for idle gloo workers, registered
at import so that it runs after the handlers a script registers later.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from zerohooks import exitguard  # gloo exits without std::terminate (an atexit handler; no DeepSpeed)
from zerohooks.__about__ import __version__
from zerohooks.config import ENTRY_POINT_GROUP, KNOWN_PLUGINS, available_plugins
from zerohooks.errors import (
    CheckpointDiskFullError,
    CheckpointSaveError,
    CheckpointStateError,
    CollectiveTimeoutError,
    ConfigError,
    DeepSpeedInternalMissing,
    PluginNotInstalledError,
    RankFailedError,
    UnsupportedDeepSpeedError,
)
from zerohooks.hookspec import (
    GradientReducer,
    ParameterGatherer,
    ReduceBucket,
    SetupContext,
    StepContext,
    next_loss_scale,
)
from zerohooks.plugin import PluginConfig, PluginInUseError, ZeroPlugin
from zerohooks.registry import FIRST, LAST, HookRegistry, OwnerConflictError, RemovableHandle

_LAZY: dict[str, str] = {
    "SUPPORTED_DEEPSPEED": "zerohooks.adapter.compat",
    "route_deepspeed_op_builds": "zerohooks.adapter.compat",
    "skip_deepspeed_compiles": "zerohooks.adapter.compat",
    "Attachment": "zerohooks.adapter",
    "attachment": "zerohooks.adapter",
    "detach": "zerohooks.adapter",
    "step_context": "zerohooks.adapter",
    "trust_checkpoint_code": "zerohooks.adapter.dsfiles",
    "CommCounters": "zerohooks.counters",
    "enable": "zerohooks.adapter.enable",
    "enabled": "zerohooks.adapter.enable",
    "initialize": "zerohooks.adapter.initialize",
}
"""Public names that need DeepSpeed (or torch), by the module they come from: imported on first use."""

_MOVED = {"surface": "zerohooks.adapter.surface"}
"""Modules that moved into the adapter (the DeepSpeed side), still reachable as ``zerohooks.<name>``."""


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is not None:
        try:
            value = getattr(importlib.import_module(where), name)
        except ImportError as e:
            if (e.name or "").split(".")[0] != "deepspeed" and "deepspeed" not in str(e):
                raise
            raise ImportError(
                f"zerohooks.{name} needs DeepSpeed, which cannot be imported here ({e}); the core "
                "(hookspec, registry, plugin, config, errors) works without it. Install zerohooks' "
                "DeepSpeed: pip install zerohooks (it pins a supported release)",
                name=e.name,
            ) from e
        globals()[name] = value
        return value
    if name in _MOVED:
        return importlib.import_module(_MOVED[name])
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # a submodule (zerohooks.watchdog, zerohooks.adapter, ...), as an eager import bound them
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'zerohooks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ENTRY_POINT_GROUP",
    "FIRST",
    "KNOWN_PLUGINS",
    "LAST",
    "SUPPORTED_DEEPSPEED",
    "Attachment",
    "CheckpointDiskFullError",
    "CheckpointSaveError",
    "CheckpointStateError",
    "CollectiveTimeoutError",
    "CommCounters",
    "ConfigError",
    "DeepSpeedInternalMissing",
    "GradientReducer",
    "HookRegistry",
    "OwnerConflictError",
    "ParameterGatherer",
    "PluginConfig",
    "PluginInUseError",
    "PluginNotInstalledError",
    "RankFailedError",
    "ReduceBucket",
    "RemovableHandle",
    "SetupContext",
    "StepContext",
    "UnsupportedDeepSpeedError",
    "ZeroPlugin",
    "__version__",
    "attachment",
    "available_plugins",
    "detach",
    "enable",
    "enabled",
    "exitguard",
    "initialize",
    "next_loss_scale",
    "route_deepspeed_op_builds",
    "skip_deepspeed_compiles",
    "step_context",
    "trust_checkpoint_code",
    "watchdog",
]
