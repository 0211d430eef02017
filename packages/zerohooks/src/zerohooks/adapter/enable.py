"""Route ``deepspeed.initialize`` through ``zerohooks.initialize`` for the frameworks that call it.

Hugging Face Trainer, Accelerate and Lightning build the engine themselves, looking
``deepspeed.initialize`` up on the module at the moment they call it.  :func:`enable` replaces
that module attribute by a router, so the plugin sections of the config those frameworks pass
are read, exactly as if the script had called ``zerohooks.initialize`` itself.

``zerohooks.initialize`` never calls the module attribute: it calls the function DeepSpeed
defined (:func:`original_initialize`), so it cannot recurse whatever the attribute holds,
including a user's own ``deepspeed.initialize = zerohooks.initialize``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import deepspeed

from zerohooks.adapter.compat import (
    original_initialize,
    require_supported_deepspeed,
    route_deepspeed_op_builds,
)
from zerohooks.adapter.initialize import initialize
from zerohooks.registry import RemovableHandle

__all__ = ["enable", "enabled", "original_initialize"]

_ORIGINAL: Any = original_initialize()

_lock = threading.Lock()
_handles: list[RemovableHandle] = []
_router: Any = None
_builds: RemovableHandle | None = None
"""DeepSpeed's op builds routed while enabled (frameworks call ``deepspeed.init_distributed``,
which builds an op on CPU, before they build the engine)."""


def _make_router() -> Any:
    @functools.wraps(_ORIGINAL)
    def initialize_with_plugins(*args: Any, **kwargs: Any) -> Any:
        return initialize(*args, **kwargs)

    initialize_with_plugins.__zerohooks_router__ = True  # type: ignore[attr-defined]
    return initialize_with_plugins


def enabled() -> bool:
    """True while ``deepspeed.initialize`` routes through ``zerohooks.initialize``."""
    return getattr(deepspeed.initialize, "__zerohooks_router__", False) or _is_ours(deepspeed.initialize)


def _is_ours(fn: Any) -> bool:
    return fn is initialize


def enable() -> RemovableHandle:
    """Make every later ``deepspeed.initialize(...)`` of this process a ``zerohooks.initialize(...)``.

    Call it on every rank before the framework builds its engine (before ``Trainer(...)``,
    ``accelerator.prepare(...)`` or ``trainer.fit(...)``).  Returns a handle: ``handle.remove()``
    (or leaving ``with zerohooks.enable():``) restores DeepSpeed's function once every handle
    taken is removed.  Calling it twice is harmless: the router is installed once.  A
    ``deepspeed.initialize`` that somebody else replaced (neither DeepSpeed's nor ours) is
    refused, since routing through it would silently drop one of the two.

    Checks the installed DeepSpeed first (:class:`~zerohooks.errors.UnsupportedDeepSpeedError`)
    and, while enabled, routes DeepSpeed's op builds through zerohooks
    (:func:`zerohooks.route_deepspeed_op_builds`), undone with the router.
    """
    global _router, _builds
    require_supported_deepspeed()
    with _lock:
        current = deepspeed.initialize
        if not _handles:
            if current is not _ORIGINAL and not _is_ours(current):
                raise RuntimeError(
                    f"deepspeed.initialize has been replaced by {getattr(current, '__module__', '?')}."
                    f"{getattr(current, '__qualname__', current)!r}; zerohooks.enable() would hide it. "
                    "Restore deepspeed.initialize, or call zerohooks.initialize yourself"
                )
            _router = _make_router()
            deepspeed.initialize = _router
            _builds = route_deepspeed_op_builds()

        def remove() -> None:
            global _builds
            with _lock:
                _handles.remove(handle)
                if _handles:
                    return
                if deepspeed.initialize is _router:
                    deepspeed.initialize = _ORIGINAL
                builds, _builds = _builds, None
                if builds is not None:
                    builds.remove()

        handle = RemovableHandle(remove, "zerohooks.enable")
        _handles.append(handle)
        return handle
