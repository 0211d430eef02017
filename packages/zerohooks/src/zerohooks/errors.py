"""Exceptions raised by zerohooks."""

from __future__ import annotations

__all__ = ["ConfigError", "DeepSpeedInternalMissing", "PluginNotInstalledError", "UnsupportedDeepSpeedError"]


class ConfigError(ValueError):
    """A plugin section (or its combination with DeepSpeed's own settings) is invalid."""


class PluginNotInstalledError(ConfigError):
    """The config has a section for a plugin whose distribution is not installed."""


class UnsupportedDeepSpeedError(ImportError):
    """The installed DeepSpeed is outside the range zerohooks supports."""


class DeepSpeedInternalMissing(RuntimeError):
    """A DeepSpeed internal the adapter relies on does not exist in the installed version."""
