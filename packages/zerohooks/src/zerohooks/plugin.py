"""Base class of zerohooks plugins and of their config sections."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import pydantic

from zerohooks.strict import STRICT, exact_literal_types

if TYPE_CHECKING:
    from zerohooks.hookspec import SetupContext
    from zerohooks.native import NativeExtension
    from zerohooks.registry import HookRegistry

__all__ = ["PluginConfig", "PluginInUseError", "ZeroPlugin"]

F = TypeVar("F", bound=Callable[..., Any])


class PluginInUseError(RuntimeError):
    """A plugin object was given to a second engine while it still serves another one."""


class PluginConfig(pydantic.BaseModel):
    """Base of every plugin's config section: unknown keys are errors, values are frozen, and
    values are strict JSON (:mod:`zerohooks.strict`: a boolean only from ``true``/``false``, an
    integer only from a JSON integer, a number never from a boolean or a string, finite)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, **STRICT)

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

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _exact_choices(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        if info.field_name is not None:
            exact_literal_types(cls, info.field_name, value)
        return value


class ZeroPlugin:
    """A zerohooks plugin.  Every method is a no-op; subclasses override what they need.

    A plugin is found through the ``zerohooks.plugins`` entry-point group under its ``name``,
    enabled by a top-level section of that name in the DeepSpeed config, and built from that
    section validated by ``Config``.

    One plugin object serves one engine at a time: it holds that engine's state (buffers,
    counters, the hooks it registered).  :meth:`attach` binds it to the engine's registry, and
    :meth:`close` (``zerohooks.detach(engine)``) releases it; handing a bound plugin to another
    ``zerohooks.initialize`` raises :class:`PluginInUseError` before anything is changed.  A
    released plugin may be given to a new engine, where it starts afresh.

    **Guarded methods.**  The binding is kept by this base class around the three methods named
    in :attr:`GUARDED`, whether or not a subclass calls ``super()``: when a subclass defines
    one of them, :meth:`__init_subclass__` replaces it in the subclass by a wrapper
    (``functools.wraps``: same name and docstring, the subclass's own function is its
    ``__wrapped__``).  ``edit_deepspeed_config`` is refused on a plugin bound to another engine
    and makes :attr:`deepspeed` readable while it runs; ``attach`` binds the plugin to the
    registry before the subclass's body runs; ``close`` releases the binding after it, even when
    it raises.  The wrapping is done once, at class creation, and is the same whoever calls the
    method (``zerohooks.initialize``, ``zerohooks.detach`` or a test calling it directly); no
    other method is touched.
    """

    GUARDED: ClassVar[tuple[str, ...]] = ("edit_deepspeed_config", "attach", "close")
    """The methods the base class wraps in every subclass that defines them (see above)."""

    name: ClassVar[str] = ""
    """Config section and entry-point name, e.g. ``"accumdtype"``."""
    distribution: ClassVar[str] = ""
    """The pip distribution that provides the plugin, named in error messages."""
    Config: ClassVar[type[PluginConfig]] = PluginConfig
    """Pydantic model of the config section."""
    native: ClassVar[tuple[NativeExtension, ...]] = ()
    """The plugin's just-in-time C++/CUDA extensions (:class:`zerohooks.native.NativeExtension`),
    which ``python -m zerohooks.build <name>`` builds ahead of time."""
    checkpoint_classes: ClassVar[tuple[type, ...]] = ()
    """Classes of this plugin that DeepSpeed pickles into its own checkpoint files (a loss scaler
    it saves with the optimizer state): ``load_checkpoint`` reads those files with
    ``weights_only=True`` and allows these classes besides DeepSpeed's, for this engine only.
    They must be plain containers that unpickling cannot make run code."""

    cfg: PluginConfig
    """The same object as :attr:`config`; a subclass narrows its type with an annotation
    (``cfg: MyConfig``)."""

    def __init__(self, config: PluginConfig | None = None) -> None:
        if config is None:
            config = type(self).Config()  # every key at its default (a section of {})
        self.config = config
        """The validated config section."""
        if not isinstance(getattr(type(self), "cfg", None), property):  # a subclass's own cfg property wins
            self.cfg = config

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap the :attr:`GUARDED` methods this subclass defines in the base class's binding
        (documented in the class docstring); a method already wrapped is left as it is."""
        super().__init_subclass__(**kwargs)
        for method in ZeroPlugin.GUARDED:
            fn = cls.__dict__.get(method)
            if callable(fn) and not getattr(fn, "_zerohooks_binding", False):
                setattr(cls, method, _GUARDS[method](fn))

    # -- the binding to one engine -----------------------------------------------------------------
    @property
    def peers(self) -> tuple[str, ...]:
        """Names of the other plugins enabled on the same engine, set by ``zerohooks.initialize``
        before :meth:`edit_deepspeed_config` (for plugins whose behaviour depends on a sibling's
        presence without importing it).  Setting it on a plugin bound to another engine raises
        :class:`PluginInUseError`."""
        peers: tuple[str, ...] = self.__dict__.get("_zerohooks_peers", ())
        return peers

    @peers.setter
    def peers(self, value: tuple[str, ...]) -> None:
        self.check_unbound()
        self.__dict__["_zerohooks_peers"] = tuple(value)

    @property
    def deepspeed(self) -> SetupContext:
        """DeepSpeed's part of the config as it stands, read (stage, dtypes, offload,
        accumulation): valid inside :meth:`edit_deepspeed_config`, which may use it instead of
        reading DeepSpeed's keys itself.  After other plugins' edits, before this one's."""
        ds_config = self.__dict__.get("_zerohooks_editing")
        if ds_config is None:
            raise RuntimeError("ZeroPlugin.deepspeed is only available inside edit_deepspeed_config")
        from zerohooks.dsconfig import setup_context

        return setup_context(ds_config)

    def _bound_registry(self) -> HookRegistry | None:
        """The registry of the engine this plugin serves now, or None.

        A registry that was never sealed belongs to a ``zerohooks.initialize`` that failed before
        DeepSpeed built its engine: it binds nothing."""
        ref = self.__dict__.get("_zerohooks_registry")
        registry = ref() if ref is not None else None
        return registry if registry is not None and registry.sealed else None

    @property
    def in_use(self) -> bool:
        """True while the plugin serves an engine (attached, not detached)."""
        return self._bound_registry() is not None

    def check_unbound(self, registry: HookRegistry | None = None) -> None:
        """Raise :class:`PluginInUseError` if this plugin serves an engine other than the one of
        ``registry``."""
        bound = self._bound_registry()
        if bound is None or bound is registry:
            return
        cls = type(self)
        label = f"{self.name!r} plugin" if self.name else "plugin"
        raise PluginInUseError(
            f"the {label} object {cls.__module__}.{cls.__qualname__} at {id(self):#x} is already in use by "
            "another engine (an earlier zerohooks.initialize attached it, and that engine was not "
            "detached). One plugin object holds one engine's state, so sharing it would mix the two "
            f"engines' training. Build a new plugin object for each engine (plugins=[{cls.__qualname__}(...)] "
            "in each zerohooks.initialize call), or zerohooks.detach(<the other engine>) before reusing "
            "this one"
        )

    def _bind(self, registry: HookRegistry) -> None:
        self.check_unbound(registry)
        self.__dict__["_zerohooks_registry"] = weakref.ref(registry)

    def _release(self) -> None:
        self.__dict__.pop("_zerohooks_registry", None)

    # -- what subclasses override ------------------------------------------------------------------
    def edit_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        """Adjust the DeepSpeed config (already a private copy) before DeepSpeed sees it.

        Raise ``zerohooks.ConfigError`` for settings that conflict with the plugin.
        """

    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        """Register hooks.  Called before the model is prepared and DeepSpeed is initialised."""

    def building(self) -> contextlib.AbstractContextManager[None]:
        """A context entered around DeepSpeed's own engine construction (after :meth:`attach`, in
        the thread that calls ``zerohooks.initialize``) and exited when ``deepspeed.initialize``
        returns or raises: for a plugin that must act while DeepSpeed builds its optimizer (e.g.
        not materialising state it will swap out).  The default does nothing."""
        return contextlib.nullcontext()

    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        """The engine exists and the adapter is attached: allocate buffers, read partitions."""

    def check_detach(self) -> None:
        """``zerohooks.detach`` is about to undo everything: raise to refuse it (with an error
        saying why and what to do instead), and the engine stays exactly as it is, every plugin
        attached.  Called on every plugin before any is closed.  The default accepts."""

    def close(self) -> None:
        """The engine is being detached: release resources (files, buffers, threads)."""


def _checked(fn: F) -> F:
    """``edit_deepspeed_config`` refused on a plugin bound to another engine; :attr:`ZeroPlugin.deepspeed`
    reads the config it edits while it runs."""

    @functools.wraps(fn)
    def edit_deepspeed_config(self: ZeroPlugin, ds_config: dict[str, Any]) -> None:
        self.check_unbound()
        outer = self.__dict__.get("_zerohooks_editing")  # set when a subclass calls super()
        self.__dict__["_zerohooks_editing"] = ds_config
        try:
            fn(self, ds_config)
        finally:
            if outer is None:
                self.__dict__.pop("_zerohooks_editing", None)
            else:
                self.__dict__["_zerohooks_editing"] = outer

    edit_deepspeed_config._zerohooks_binding = True  # type: ignore[attr-defined]
    return edit_deepspeed_config  # type: ignore[return-value]


def _binding(fn: F) -> F:
    """``attach`` binds the plugin to the registry first (refused if bound to another engine)."""

    @functools.wraps(fn)
    def attach(self: ZeroPlugin, registry: HookRegistry, ctx: SetupContext) -> None:
        self._bind(registry)
        fn(self, registry, ctx)

    attach._zerohooks_binding = True  # type: ignore[attr-defined]
    return attach  # type: ignore[return-value]


def _releasing(fn: F) -> F:
    """``close`` releases the plugin, even when the plugin's own close fails."""

    @functools.wraps(fn)
    def close(self: ZeroPlugin) -> None:
        try:
            fn(self)
        finally:
            self._release()

    close._zerohooks_binding = True  # type: ignore[attr-defined]
    return close  # type: ignore[return-value]


_GUARDS: dict[str, Callable[[Any], Any]] = {
    "edit_deepspeed_config": _checked,
    "attach": _binding,
    "close": _releasing,
}
"""The wrapper of each of :attr:`ZeroPlugin.GUARDED`."""

# the base class's own methods carry the same guards (a subclass that does not override one)
ZeroPlugin.edit_deepspeed_config = _checked(ZeroPlugin.edit_deepspeed_config)  # type: ignore[method-assign]
ZeroPlugin.attach = _binding(ZeroPlugin.attach)  # type: ignore[method-assign]
ZeroPlugin.close = _releasing(ZeroPlugin.close)  # type: ignore[method-assign]
