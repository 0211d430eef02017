"""zerohooks: a typed hook registry for DeepSpeed ZeRO and the adapter that fires it.

``zerohooks.initialize`` replaces ``deepspeed.initialize``; plugins found through the
``zerohooks.plugins`` entry-point group are enabled by their section in the DeepSpeed config.
"""

from __future__ import annotations

import deepspeed as _deepspeed

from zerohooks.__about__ import __version__
from zerohooks._compat import (
    SUPPORTED_DEEPSPEED,
    announce_deepspeed_op_builds,
    check_deepspeed_version,
    next_loss_scale,
    skip_deepspeed_compiles,
)

check_deepspeed_version(_deepspeed.__version__)
announce_deepspeed_op_builds()  # DeepSpeed's minutes-long JIT builds say so when they start

from zerohooks import exitguard, watchdog  # noqa: E402  (exitguard: gloo exits without std::terminate)
from zerohooks.adapter import Attachment, attachment, detach, step_context  # noqa: E402
from zerohooks.adapter.dsfiles import trust_checkpoint_code  # noqa: E402
from zerohooks.config import ENTRY_POINT_GROUP, KNOWN_PLUGINS, available_plugins  # noqa: E402
from zerohooks.counters import CommCounters  # noqa: E402
from zerohooks.enable import enable, enabled  # noqa: E402
from zerohooks.errors import (  # noqa: E402
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
from zerohooks.hookspec import (  # noqa: E402
    GradientReducer,
    ParameterGatherer,
    ReduceBucket,
    SetupContext,
    StepContext,
)
from zerohooks.initialize import initialize  # noqa: E402
from zerohooks.plugin import PluginConfig, PluginInUseError, ZeroPlugin  # noqa: E402
from zerohooks.registry import FIRST, LAST, HookRegistry, OwnerConflictError, RemovableHandle  # noqa: E402

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
    "skip_deepspeed_compiles",
    "step_context",
    "trust_checkpoint_code",
    "watchdog",
]
