"""Exceptions raised by zerohooks."""

from __future__ import annotations

__all__ = [
    "CheckpointStateError",
    "ConfigError",
    "DeepSpeedInternalMissing",
    "PluginNotInstalledError",
    "UnsupportedDeepSpeedError",
]


class ConfigError(ValueError):
    """A plugin section (or its combination with DeepSpeed's own settings) is invalid."""


class PluginNotInstalledError(ConfigError):
    """The config has a section for a plugin whose distribution is not installed."""


class UnsupportedDeepSpeedError(ImportError):
    """The installed DeepSpeed is outside the range zerohooks supports."""


class DeepSpeedInternalMissing(RuntimeError):
    """A DeepSpeed internal the adapter relies on does not exist in the installed version."""


class CheckpointStateError(RuntimeError):
    """A checkpoint's plugin state does not match the plugins of the engine loading it (state
    saved by plugins that are not enabled now, or plugins enabled now whose state is missing)."""
