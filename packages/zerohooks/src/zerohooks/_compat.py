"""The DeepSpeed versions zerohooks supports, checked when zerohooks is imported."""

from __future__ import annotations

import os
import warnings
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from zerohooks.errors import DeepSpeedInternalMissing, UnsupportedDeepSpeedError

__all__ = ["SUPPORTED_DEEPSPEED", "check_deepspeed_version", "require_attr", "skip_deepspeed_shm_op"]

SUPPORTED_DEEPSPEED = SpecifierSet(">=0.19.0,<0.20")
"""DeepSpeed releases whose internals the adapter was written against and tested on."""

_OVERRIDE = "ZEROHOOKS_ALLOW_UNSUPPORTED_DEEPSPEED"


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


def skip_deepspeed_shm_op() -> None:
    """Tell DeepSpeed not to JIT-build its shared-memory comm op in this process.

    On CPU, ``deepspeed.init_distributed`` compiles that op (a minute or more, and again for every
    virtual environment) although only DeepSpeed's inference all-reduce uses it; training over
    gloo never does.  DeepSpeed keeps its table of compatible ops as an editable module-level
    dict; a DeepSpeed without that table is left to do what it does.  Call before
    ``init_distributed`` (the test harness, the demo and the benchmarks do).
    """
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except Exception:
        pass


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
