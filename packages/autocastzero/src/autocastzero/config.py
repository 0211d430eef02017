"""The ``"autocastzero"`` config section, and the DeepSpeed settings it cannot run with.

Everything here runs when the config is read (``zerohooks.initialize``), before DeepSpeed builds
anything: a conflict is refused with a message that says which key to change.
"""

from __future__ import annotations

import importlib
import math
import sys
from typing import Any, Literal

import pydantic
import torch
from torch import nn

from zerohooks import ConfigError, PluginConfig
from zerohooks.dsconfig import read_settings
from zerohooks.strict import MAX_STEPS, StrList

__all__ = [
    "DEFAULT_SAFE_MODULES",
    "DTYPES",
    "IMPORTED_ONLY_MODULES",
    "MAX_LOSS_SCALE",
    "MIN_LOSS_SCALE",
    "AutocastZeroConfig",
    "check_deepspeed_config",
    "resolve_class",
]

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""The autocast dtypes the section accepts."""

_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
}

DEFAULT_SAFE_MODULES: tuple[str, ...] = (
    "torch.nn.Linear",
    "torch.nn.Conv1d",
    "torch.nn.Conv2d",
    "torch.nn.Conv3d",
    "transformers.pytorch_utils.Conv1D",
)
"""Module classes whose parameters are lower-precision safe by default (subclasses included).
``transformers.pytorch_utils.Conv1D`` is Hugging Face's linear layer with a transposed weight
(GPT-2, OpenAI GPT, ImageGPT, Decision Transformer, CLVP); its other models use
``torch.nn.Linear``."""

IMPORTED_ONLY_MODULES: frozenset[str] = frozenset({"transformers.pytorch_utils.Conv1D"})
"""Third-party classes of :data:`DEFAULT_SAFE_MODULES`, looked up only in modules already
imported: a model cannot hold an instance of a class whose module was never imported, so
autocastzero never imports (or needs) transformers, and a missing one is no error."""

_SCALING_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
_DYNAMIC_KEYS = ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")

MAX_SCALE_POWER = 32
MAX_LOSS_SCALE = 2.0**MAX_SCALE_POWER
"""The largest loss scale accepted (static ``loss_scale``, ``2**initial_scale_power``,
``min_loss_scale``): Megatron-LM's default first scale.  float16 holds at most 65504, so with a
larger scale every float16 gradient above ``65504 / 2**32`` (about 1.5e-5) overflows and the step
is skipped; a scale that stays there (static, or a floor) skips every step."""
MIN_LOSS_SCALE = 2.0**-24
"""The smallest positive loss scale accepted: float16's smallest subnormal.  Below it every
float16 gradient under 1 is flushed to zero (nothing trains, without an overflow to report)."""


def _scale_problem(value: float) -> str | None:
    """Why ``value`` cannot be a loss scale, or None when it is finite and within
    [:data:`MIN_LOSS_SCALE`, :data:`MAX_LOSS_SCALE`]."""
    if math.isnan(value):
        return "nan makes every scaled loss nan: every step would be skipped"
    if value < 0:
        return "a negative scale flips the sign of every gradient"
    if value > MAX_LOSS_SCALE:
        return "float16 gradients overflow at such a scale: every step would be skipped"
    if value < MIN_LOSS_SCALE:
        return "every float16 gradient below 1 would underflow to zero"
    return None


def _is_number(value: Any) -> bool:
    """A JSON number (integer or not), never a boolean or a string."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_SCALE_RANGE = f"from 2**-24 ({MIN_LOSS_SCALE:g}) to 2**{MAX_SCALE_POWER} ({MAX_LOSS_SCALE:.0f})"


def _checked_scale(value: Any, what: str, zero_ok: bool) -> Any:
    """``value`` if it is a loss scale in :data:`_SCALE_RANGE` (or 0 where ``zero_ok``), else a
    ``ValueError`` saying it must be ``what`` followed by "a finite ... number" and why not."""
    if not _is_number(value):
        raise ValueError(
            f"must be {what}a finite JSON number {_SCALE_RANGE}, not a JSON {type(value).__name__}"
        )
    why = None if zero_ok and value == 0 else _scale_problem(value)
    if why is not None:
        raise ValueError(f"must be {what}a finite number {_SCALE_RANGE}: {why}")
    return value


def resolve_class(path: str) -> type[nn.Module]:
    """``"torch.nn.Linear"`` -> the class; ValueError naming the problem otherwise."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted import path such as 'torch.nn.Linear'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{path!r}: cannot import module {module_name!r} ({e})") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{path!r} is not a torch.nn.Module subclass")
    return cls


def _imported_class(path: str) -> type[nn.Module] | None:
    """The class at ``path`` if its module is already imported, else None (nothing imported)."""
    module_name, _, class_name = path.rpartition(".")
    cls = getattr(sys.modules.get(module_name), class_name, None)
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


class AutocastZeroConfig(PluginConfig):
    """The ``"autocastzero"`` section of the DeepSpeed config."""

    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    """Autocast dtype of the forward pass, and the communication dtype of lower-precision-safe
    modules (``bf16``/``fp16`` are accepted too)."""

    lower_precision_safe_modules: StrList = DEFAULT_SAFE_MODULES
    """Dotted import paths of module classes whose parameters are lower-precision safe.  A module
    matches when it is an instance of a listed class, subclasses included.  Default:
    :data:`DEFAULT_SAFE_MODULES` (torch's Linear and Conv1d/2d/3d, transformers' ``Conv1D``)."""

    lower_precision_safe_names: StrList = ()
    """``fnmatch`` globs of module names (as in ``model.named_modules()``, e.g. ``"blocks.*.mlp.*"``)
    whose own parameters are lower-precision safe, in addition to the classes above.  Every glob
    must match at least one module."""

    fp32_names: StrList = ()
    """Globs of module names whose parameters stay fp32 in communication even when their class or
    name says safe (checked last).  Every glob must match at least one module."""

    low_precision_reduce: bool = True
    """Reduce (all-reduce / reduce-scatter) the gradients of safe parameters in ``dtype``;
    False reduces every gradient in fp32."""

    low_precision_gather: bool = True
    """ZeRO 3: all-gather safe parameters in ``dtype`` (the gathered parameter is fp32 again,
    holding the ``dtype``-rounded value); False gathers in fp32."""

    loss_scale: float = 0.0
    """float16 only: a static loss scale (finite, from 2**-24 to 2**32: :data:`MIN_LOSS_SCALE`,
    :data:`MAX_LOSS_SCALE`), or 0 for dynamic loss scaling."""

    initial_scale_power: int = pydantic.Field(default=16, ge=0, le=MAX_SCALE_POWER)
    """float16 dynamic scaling: the first loss scale is ``2**initial_scale_power`` (0 to 32)."""

    loss_scale_window: int = pydantic.Field(default=1000, ge=1, le=MAX_STEPS)
    """float16 dynamic scaling: the scale doubles at each step preceded by a multiple of this many
    steps without overflow (DeepSpeed's ``loss_scale_window`` rule).  1 to 2**31 - 1
    (``zerohooks.strict.MAX_STEPS``): a window longer than any run never grows the scale, which a
    static ``loss_scale`` says plainly."""

    hysteresis: int = pydantic.Field(default=2, ge=1, le=MAX_STEPS)
    """float16 dynamic scaling: overflowing steps tolerated before the scale halves (every one is
    skipped); 1 halves at every overflow.  Refilled when the scale grows.  1 to 2**31 - 1
    (``zerohooks.strict.MAX_STEPS``): more would skip every step of a run without ever backing
    off."""

    min_loss_scale: float = 1.0
    """float16 dynamic scaling: the scale never goes below this (finite, from 2**-24 to the first
    scale ``2**initial_scale_power``)."""

    @pydantic.field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        key = str(value).lower()
        return _ALIASES.get(key, value)

    @pydantic.field_validator("loss_scale", mode="before")
    @classmethod
    def _static_scale(cls, value: Any) -> Any:
        return _checked_scale(value, "0 (dynamic loss scaling) or a static scale, ", zero_ok=True)

    @pydantic.field_validator("min_loss_scale", mode="before")
    @classmethod
    def _floor(cls, value: Any) -> Any:
        return _checked_scale(value, "", zero_ok=False)

    @pydantic.field_validator("lower_precision_safe_modules")
    @classmethod
    def _importable(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if path not in IMPORTED_ONLY_MODULES:
                resolve_class(path)
        return value

    @pydantic.model_validator(mode="after")
    def _scaling_needs_fp16(self) -> AutocastZeroConfig:
        if self.dtype == "bfloat16":
            given = [k for k in _SCALING_KEYS if k in self.model_fields_set]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only apply to dtype float16 (bfloat16 needs no loss scaling); "
                    "remove them or set dtype to float16"
                )
            return self
        if self.loss_scale > 0:
            given = [k for k in _DYNAMIC_KEYS if k in self.model_fields_set]
            if given:
                raise ValueError(
                    f"the dynamic-scaling keys {', '.join(given)} would be ignored: loss_scale is "
                    f"{self.loss_scale:g}, a static scale; remove them, or set loss_scale to 0 for dynamic "
                    "scaling"
                )
        elif self.min_loss_scale > math.ldexp(1.0, self.initial_scale_power):
            raise ValueError(
                f"min_loss_scale ({self.min_loss_scale:g}) is above the first loss scale "
                f"2**initial_scale_power ({math.ldexp(1.0, self.initial_scale_power):g}); the scale could "
                "never back off. Lower min_loss_scale or raise initial_scale_power"
            )
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a torch dtype."""
        return DTYPES[self.dtype]

    def safe_classes(self) -> tuple[type[nn.Module], ...]:
        """The classes of :attr:`lower_precision_safe_modules`: imported, except those of
        :data:`IMPORTED_ONLY_MODULES`, present only when their module already is."""
        out: list[type[nn.Module]] = []
        for path in self.lower_precision_safe_modules:
            cls = _imported_class(path) if path in IMPORTED_ONLY_MODULES else resolve_class(path)
            if cls is not None:
                out.append(cls)
        return tuple(out)


def check_deepspeed_config(cfg: AutocastZeroConfig, ds: dict[str, Any]) -> None:
    """Refuse DeepSpeed settings that conflict with ``cfg``; each message names the key to change.
    DeepSpeed's settings are read by :func:`zerohooks.dsconfig.read_settings`."""
    settings = read_settings(ds)
    problems: list[str] = []
    for key, bare in settings.precision_sections:
        problems.append(
            f'"{key}" is enabled{" (a bare true)" if bare else ""}: autocastzero keeps '
            "fp32 parameters and runs the forward under torch.autocast instead; remove the "
            f'"{key}" section (or set "enabled": false) and choose the autocast dtype with '
            '"autocastzero": {"dtype": ...}'
        )
    if settings.torch_autocast:
        problems.append(
            '"torch_autocast" is enabled: that is DeepSpeed\'s own autocast, which autocastzero replaces; '
            'remove the "torch_autocast" section'
        )
    comm = settings.communication_data_type
    if comm is not None:
        problems.append(
            f'"communication_data_type" is {comm!r}: autocastzero chooses the reduction dtype per '
            f"parameter ({cfg.dtype} for safe modules, float32 for the rest); remove "
            '"communication_data_type" (or set "low_precision_reduce": false for fp32 everywhere)'
        )
    accum = settings.grad_accum_dtype
    if accum is not None and str(accum).lower() not in ("fp32", "float32", "float", "torch.float32"):
        problems.append(
            f'"data_types.grad_accum_dtype" is {accum!r} but the parameters are fp32: DeepSpeed only '
            "fails on that mix when training starts; remove it (gradients accumulate in fp32)"
        )
    for key in settings.quantized:
        problems.append(
            f'"zero_optimization.{key}" is on: quantized ZeRO++ communication ignores the '
            f"per-parameter dtypes of autocastzero; remove it"
        )
    device = settings.offload_optimizer
    if cfg.dtype == "float16" and device is not None:
        problems.append(
            f'"zero_optimization.offload_optimizer.device" is {device!r}: float16 loss scaling with '
            'an offloaded optimizer is not supported; use dtype "bfloat16" or remove the offload'
        )
    if problems:
        raise ConfigError(
            'the "autocastzero" section conflicts with the DeepSpeed config:\n  ' + "\n  ".join(problems)
        )
