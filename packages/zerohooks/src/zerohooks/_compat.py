"""The DeepSpeed versions zerohooks supports, checked when zerohooks is imported."""

from __future__ import annotations

import os
import warnings
from typing import Any

import deepspeed
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from zerohooks.errors import DeepSpeedInternalMissing, UnsupportedDeepSpeedError

__all__ = [
    "DEEPSPEED_SLOW_OPS",
    "SUPPORTED_DEEPSPEED",
    "announce_deepspeed_op_builds",
    "check_deepspeed_version",
    "native_bf16",
    "original_initialize",
    "require_attr",
    "require_attrs",
    "skip_deepspeed_compiles",
    "skip_deepspeed_shm_op",
]

SUPPORTED_DEEPSPEED = SpecifierSet(">=0.19.8,<0.20")
"""DeepSpeed releases whose internals the adapter was written against and tested on."""

_OVERRIDE = "ZEROHOOKS_ALLOW_UNSUPPORTED_DEEPSPEED"

_ORIGINAL_INITIALIZE: Any = deepspeed.initialize
"""``deepspeed.initialize`` as DeepSpeed defined it, taken when zerohooks is first imported."""


def original_initialize() -> Any:
    """DeepSpeed's own ``initialize`` (never a zerohooks router, whatever was assigned later)."""
    return _ORIGINAL_INITIALIZE


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


def announce_deepspeed_op_builds() -> bool:
    """Make DeepSpeed's just-in-time op builds announce themselves (see
    :func:`zerohooks.jit.announce_build`): what, why, how long, how to avoid it, and a heartbeat
    while it builds.  DeepSpeed itself only prints the time once it has finished.  Idempotent;
    False when DeepSpeed's op builder has no ``jit_load`` to wrap."""
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except Exception:
        return False
    original = getattr(OpBuilder, "jit_load", None)
    if original is None:
        return False
    if getattr(original, "_zerohooks_announced", False):
        return True

    import functools

    @functools.wraps(original)
    def jit_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        from zerohooks.jit import announce_build, extension_cached

        name = str(getattr(self, "name", type(self).__name__))
        why, eta, hint = DEEPSPEED_SLOW_OPS.get(
            name,
            ("DeepSpeed builds it just in time", "a minute or more", "python -m zerohooks.build --all"),
        )
        from zerohooks import nativecache

        if nativecache.cache_dir() is None:
            with announce_build(
                f"DeepSpeed's {name} op", why=why, eta=eta, hint=hint, cached=extension_cached(name)
            ):
                return original(self, *args, **kwargs)
        # a build shared by other environments (ZEROHOOKS_NATIVE_CACHE): DeepSpeed's builder
        # imports cpp_extension.load when it runs, so it finds the caching one for this call
        from torch.utils import cpp_extension

        real = cpp_extension.load
        cpp_extension.load = nativecache.caching_load(real)
        try:
            with announce_build(
                f"DeepSpeed's {name} op", why=why, eta=eta, hint=hint, cached=extension_cached(name)
            ):
                return original(self, *args, **kwargs)
        finally:
            cpp_extension.load = real

    jit_load._zerohooks_announced = True  # type: ignore[attr-defined]
    OpBuilder.jit_load = jit_load
    return True


def next_loss_scale(engine: Any) -> float | None:
    """The scale the engine's next loss will be multiplied by (see
    :attr:`zerohooks.StepContext.next_loss_scale`): a loss scaler's ``next_scale`` when it has
    one, else the ZeRO optimizer's ``cur_scale`` / ``loss_scale``; None when it has neither."""
    opt = getattr(engine, "optimizer", None)
    upcoming = getattr(getattr(opt, "loss_scaler", None), "next_scale", None)
    if isinstance(upcoming, (int, float)):
        return float(upcoming)
    for name in ("cur_scale", "loss_scale"):
        try:
            value = getattr(opt, name, None)
        except Exception:  # some optimizers raise from the property outside fp16 mode
            value = None
        if isinstance(value, (int, float)):
            return float(value)
    return None
