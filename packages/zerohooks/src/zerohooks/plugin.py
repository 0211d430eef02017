"""Base class of zerohooks plugins and of their config sections."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import pydantic

if TYPE_CHECKING:
    from zerohooks.hookspec import SetupContext
    from zerohooks.registry import HookRegistry

__all__ = ["PluginConfig", "ZeroPlugin"]


class PluginConfig(pydantic.BaseModel):
    """Base of every plugin's config section: unknown keys are errors, values are frozen."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    auto_aliases: ClassVar[dict[str, str]] = {}
    """Keys whose value ``"auto"`` is read as the given word before validation (the config then
    holds that word).  Plugins document their own words: Hugging Face Trainer and accelerate
    reject any ``"auto"`` in the DeepSpeed config that they cannot fill themselves, so ``"auto"``
    is only an alias for configs handed to DeepSpeed directly."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _read_auto_aliases(cls, data: Any) -> Any:
        if cls.auto_aliases and isinstance(data, dict):
            return {
                k: cls.auto_aliases[k] if v == "auto" and k in cls.auto_aliases else v
                for k, v in data.items()
            }
        return data


class ZeroPlugin:
    """A zerohooks plugin.  Every method is a no-op; subclasses override what they need.

    A plugin is found through the ``zerohooks.plugins`` entry-point group under its ``name``,
    enabled by a top-level section of that name in the DeepSpeed config, and built from that
    section validated by ``Config``.
    """

    name: ClassVar[str] = ""
    """Config section and entry-point name, e.g. ``"accumdtype"``."""
    distribution: ClassVar[str] = ""
    """The pip distribution that provides the plugin, named in error messages."""
    Config: ClassVar[type[PluginConfig]] = PluginConfig
    """Pydantic model of the config section."""
    peers: tuple[str, ...] = ()
    """Names of the other plugins enabled on the same engine, set by ``zerohooks.initialize``
    before :meth:`edit_deepspeed_config` (for plugins whose behaviour depends on a sibling's
    presence without importing it)."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config

    def edit_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        """Adjust the DeepSpeed config (already a private copy) before DeepSpeed sees it.

        Raise ``zerohooks.ConfigError`` for settings that conflict with the plugin.
        """

    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        """Register hooks.  Called before the model is prepared and DeepSpeed is initialised."""

    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        """The engine exists and the adapter is attached: allocate buffers, read partitions."""

    def close(self) -> None:
        """The engine is being detached: release resources (files, buffers, threads)."""
