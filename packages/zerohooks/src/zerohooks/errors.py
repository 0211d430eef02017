"""Exceptions raised by zerohooks."""

from __future__ import annotations

__all__ = [
    "CheckpointDiskFullError",
    "CheckpointSaveError",
    "CheckpointStateError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DeepSpeedInternalMissing",
    "PluginNotInstalledError",
    "RankFailedError",
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
    """A checkpoint's plugin state cannot be resumed: it does not match the plugins of the engine
    loading it (state saved by plugins that are not enabled now, or plugins enabled now whose
    state is missing), or a rank's state file is damaged, truncated or not a zerohooks file (the
    message names the file and the rank)."""


class CheckpointSaveError(RuntimeError):
    """``save_checkpoint`` failed on at least one rank, and every rank raises it: nothing was
    committed (``latest`` was not moved) and the message names the failing ranks and causes."""


class CheckpointDiskFullError(OSError, CheckpointSaveError):
    """A :class:`CheckpointSaveError` because the checkpoint's file system is full (or over quota).

    An ``OSError`` with ``errno.ENOSPC`` and ``filename`` the checkpoint folder, so code that
    handles a full disk as ``OSError`` catches it too; the message names the folder, the free
    bytes, and the previous checkpoint, which stays intact and named by ``latest``."""


class CollectiveTimeoutError(RuntimeError):
    """A zerohooks collective did not complete within the limit (or a peer went away); the
    message names the operation, this rank and the ranks that did not respond or join."""


class RankFailedError(RuntimeError):
    """Another rank failed a step every rank must pass (start-up, checkpoint save); the message
    names that rank and its error.  This rank stops too rather than wait for it."""
