"""The DeepSpeed side of the core: the supported versions (checked when DeepSpeed is first used,
by ``zerohooks.initialize`` and ``zerohooks.enable``), DeepSpeed's own ``initialize``, and the
routing of DeepSpeed's op builds through :mod:`zerohooks.nativecache` (installed explicitly, with
a handle that removes it).

Importing this module imports DeepSpeed but changes nothing in it.  The DeepSpeed-free core
(``zerohooks.hookspec``, ``registry``, ``plugin``, ``config``, ``errors``) never imports it at
module level."""

from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Any

import deepspeed
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from zerohooks.errors import DeepSpeedInternalMissing, UnsupportedDeepSpeedError
from zerohooks.hookspec import next_loss_scale
from zerohooks.registry import RemovableHandle

__all__ = [
    "DEEPSPEED_SLOW_OPS",
    "SUPPORTED_DEEPSPEED",
    "check_deepspeed_version",
    "native_bf16",
    "next_loss_scale",
    "op_builds_routed",
    "original_initialize",
    "require_attr",
    "require_attrs",
    "require_supported_deepspeed",
    "route_deepspeed_op_builds",
    "skip_deepspeed_compiles",
    "skip_deepspeed_shm_op",
]

SUPPORTED_DEEPSPEED = SpecifierSet(">=0.19.8,<0.20")
"""DeepSpeed releases whose internals the adapter was written against and tested on."""

_OVERRIDE = "ZEROHOOKS_ALLOW_UNSUPPORTED_DEEPSPEED"

_ORIGINAL_INITIALIZE: Any = deepspeed.initialize
"""``deepspeed.initialize`` as DeepSpeed defined it, taken when this module is first imported:
before ``zerohooks.initialize`` or ``zerohooks.enable`` exist (both import this module first),
so never one of them."""

_checked = False


def original_initialize() -> Any:
    """DeepSpeed's own ``initialize`` (never a zerohooks router, whatever was assigned later)."""
    return _ORIGINAL_INITIALIZE


def require_supported_deepspeed() -> None:
    """:func:`check_deepspeed_version` on the installed DeepSpeed, once per process: called where
    zerohooks first uses DeepSpeed (``zerohooks.initialize``, ``zerohooks.enable``), not on import."""
    global _checked
    if not _checked:
        check_deepspeed_version(deepspeed.__version__)
        _checked = True


def check_deepspeed_version(version: str) -> None:
    """Raise :class:`UnsupportedDeepSpeedError` unless ``version`` is supported.

    Setting ``ZEROHOOKS_ALLOW_UNSUPPORTED_DEEPSPEED=1`` turns the error into a warning, for
    people trying a newer DeepSpeed at their own risk.
    """
    v = Version(version)
    base = Version(v.base_version)  # 0.19.9.dev0 / +local builds count as their release
    if base in SUPPORTED_DEEPSPEED:
        return
    msg = (
        f"zerohooks supports DeepSpeed {SUPPORTED_DEEPSPEED} but DeepSpeed {version} is installed. "
        f"Install a supported release, e.g. pip install 'deepspeed{SUPPORTED_DEEPSPEED}'"
    )
    if os.environ.get(_OVERRIDE) == "1":
        warnings.warn(msg + f" ({_OVERRIDE}=1 is set: continuing)", RuntimeWarning, stacklevel=2)
        return
    raise UnsupportedDeepSpeedError(msg + f", or set {_OVERRIDE}=1 to try anyway.")


def require_attr(obj: Any, name: str, what: str | None = None) -> Any:
    """Return ``getattr(obj, name)`` or raise :class:`DeepSpeedInternalMissing` naming it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        import deepspeed

        owner = what or type(obj).__name__
        raise DeepSpeedInternalMissing(
            f"zerohooks needs {owner}.{name}, which DeepSpeed {deepspeed.__version__} does not have "
            f"(zerohooks supports DeepSpeed {SUPPORTED_DEEPSPEED})."
        ) from None


def require_attrs(obj: Any, names: tuple[str, ...], what: str | None = None) -> None:
    """Raise :class:`DeepSpeedInternalMissing` naming every one of ``names`` that ``obj`` lacks.

    For internals a patch only reads later, while training (inside a wrapped method): checked
    when the adapter attaches, so a DeepSpeed without them fails before the first step with the
    names, never with an ``AttributeError`` in the middle of a backward pass."""
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        import deepspeed

        owner = what or type(obj).__name__
        listed = ", ".join(f"{owner}.{n}" for n in missing)
        raise DeepSpeedInternalMissing(
            f"zerohooks needs {listed}, which DeepSpeed {deepspeed.__version__} does not have "
            f"(zerohooks supports DeepSpeed {SUPPORTED_DEEPSPEED})."
        )


def skip_deepspeed_shm_op() -> None:
    """Tell DeepSpeed not to JIT-build its shared-memory comm op in this process.

    On CPU, ``deepspeed.init_distributed`` compiles that op (about 4 minutes on 2 cores, and
    again for every virtual environment) although only DeepSpeed's inference all-reduce uses it;
    training over gloo never does.  DeepSpeed keeps its table of compatible ops as an editable
    module-level dict; a DeepSpeed without that table is left to do what it does.  Call before
    ``init_distributed``.  Public name: :func:`zerohooks.skip_deepspeed_compiles`.
    """
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except Exception:
        pass


def skip_deepspeed_compiles() -> None:
    """Avoid the C++ builds DeepSpeed would start for us that training does not need.

    Today that is DeepSpeed's shared-memory comm op, which ``deepspeed.init_distributed`` builds
    on CPU (minutes) for inference all-reduces only.  Call it on every rank before
    ``deepspeed.init_distributed`` (or before ``zerohooks.initialize`` when that initialises the
    process group).  DeepSpeed's CPU Adam (``cpu_adam`` / ``fused_adam``, minutes as well) is
    chosen by the config and cannot be skipped from here: put ``"torch_adam": true`` in the
    optimizer's ``params`` (and, with ``offload_optimizer``, ``"zero_force_ds_cpu_optimizer":
    false`` at the top level) to train with torch's own Adam/AdamW instead."""
    skip_deepspeed_shm_op()


def native_bf16(cuda: bool = False) -> bool:
    """Whether bf16 matrix multiplies run natively here: a GPU that supports bf16, or a CPU
    that oneDNN runs bf16 on (AVX-512/AVX512-BF16/AMX).  On an AVX2-only CPU bf16 is emulated,
    several times slower than fp32."""
    import torch

    if cuda:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


DEEPSPEED_SLOW_OPS: dict[str, tuple[str, str, str]] = {
    # op name -> (why it is built, roughly how long on 2 cores, how to avoid or pre-build it)
    "deepspeed_shm_comm": (
        "DeepSpeed's shared-memory all-reduce, built by deepspeed.init_distributed on CPU; "
        "only DeepSpeed's inference uses it",
        "about 4 min on 2 CPU cores",
        "call zerohooks.skip_deepspeed_compiles() before init_distributed (training never uses "
        "it), or build it ahead of time: python -m zerohooks.build deepspeed-shm",
    ),
    "cpu_adam": (
        "DeepSpeed's CPU Adam, for the config's Adam/AdamW with offload_optimizer",
        "about 4-5 min on 2 CPU cores",
        'put "torch_adam": true in the optimizer params and "zero_force_ds_cpu_optimizer": false '
        "in the config (torch's AdamW), or build it ahead of time: python -m zerohooks.build deepspeed-adam",
    ),
    "fused_adam": (
        "DeepSpeed's FusedAdam (its CPU build on a CPU accelerator), for the config's Adam/AdamW",
        "about 4-5 min on 2 CPU cores",
        'put "torch_adam": true in the optimizer params (torch\'s AdamW), or build it ahead of '
        "time: python -m zerohooks.build deepspeed-adam",
    ),
}
"""DeepSpeed's just-in-time ops that take minutes to build, and how to avoid them."""


_route_lock = threading.RLock()
_route_handles: list[RemovableHandle] = []
_route_installed: tuple[Any, Any, Any] | None = None
"""(OpBuilder, DeepSpeed's jit_load, our wrapper) while the routing is installed."""


def _routed_jit_load(original: Any) -> Any:
    """DeepSpeed's ``OpBuilder.jit_load`` announcing the build (:func:`zerohooks.jit.announce_build`:
    what, why, how long, how to avoid it, a heartbeat) and, with ``ZEROHOOKS_NATIVE_CACHE`` set,
    building through :func:`zerohooks.nativecache.caching_load` (a build shared by environments,
    never stale)."""

    @functools.wraps(original)
    def jit_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        from zerohooks import nativecache
        from zerohooks.jit import announce_build, extension_cached

        name = str(getattr(self, "name", type(self).__name__))
        why, eta, hint = DEEPSPEED_SLOW_OPS.get(
            name,
            ("DeepSpeed builds it just in time", "a minute or more", "python -m zerohooks.build --all"),
        )
        announced = announce_build(
            f"DeepSpeed's {name} op", why=why, eta=eta, hint=hint, cached=extension_cached(name)
        )
        if nativecache.cache_dir() is None:
            with announced:
                return original(self, *args, **kwargs)
        # DeepSpeed's builder looks cpp_extension.load up when it runs: the caching one is put
        # there for this call only, and the real one put back when the build returns
        from torch.utils import cpp_extension

        real = cpp_extension.load
        cpp_extension.load = nativecache.caching_load(real)
        try:
            with announced:
                return original(self, *args, **kwargs)
        finally:
            cpp_extension.load = real

    jit_load.__zerohooks_routed__ = True  # type: ignore[attr-defined]
    return jit_load


def op_builds_routed() -> bool:
    """Whether DeepSpeed's op builds are routed now (some :func:`route_deepspeed_op_builds`
    handle is active)."""
    with _route_lock:
        return _route_installed is not None


def route_deepspeed_op_builds() -> RemovableHandle:
    """Route DeepSpeed's just-in-time op builds (``OpBuilder.jit_load``) through zerohooks until
    the returned handle is removed: each build announces itself (DeepSpeed only prints the time
    once it has finished) and, with ``ZEROHOOKS_NATIVE_CACHE`` set, goes through
    :mod:`zerohooks.nativecache`.

    The only change zerohooks makes to a DeepSpeed class outside an engine's attachment, and
    never on import: ``zerohooks.initialize`` holds a handle while it runs (DeepSpeed builds its
    ops while it builds the engine), ``zerohooks.enable`` one until its own handle is removed,
    ``python -m zerohooks.build`` one while it builds.  Handles nest: DeepSpeed's ``jit_load``
    is put back when the last one is removed (``handle.remove()``, or leaving ``with``).  A
    DeepSpeed without ``OpBuilder.jit_load`` is left as it is (the handle does nothing)."""
    global _route_installed
    with _route_lock:
        if _route_installed is None:
            try:
                from deepspeed.ops.op_builder.builder import OpBuilder
            except Exception:
                return RemovableHandle(lambda: None, "zerohooks: DeepSpeed op builds (no OpBuilder)")
            original = OpBuilder.__dict__.get("jit_load")
            if original is None:
                return RemovableHandle(lambda: None, "zerohooks: DeepSpeed op builds (no jit_load)")
            wrapper = _routed_jit_load(original)
            OpBuilder.jit_load = wrapper
            _route_installed = (OpBuilder, original, wrapper)

        def remove() -> None:
            global _route_installed
            with _route_lock:
                _route_handles.remove(handle)
                if _route_handles or _route_installed is None:
                    return
                owner, original, wrapper = _route_installed
                _route_installed = None
                if owner.__dict__.get("jit_load") is wrapper:
                    owner.jit_load = original
                else:  # somebody wrapped ours since: theirs stays, ours can no longer be taken out
                    warnings.warn(
                        "OpBuilder.jit_load was replaced after zerohooks routed it; zerohooks' "
                        "routing stays under the replacement",
                        RuntimeWarning,
                        stacklevel=3,
                    )

        handle = RemovableHandle(remove, "zerohooks: DeepSpeed op builds routed")
        _route_handles.append(handle)
        return handle
