"""The one reader of DeepSpeed's part of the config: stage, dtypes, offload, accumulation.

:func:`setup_context` reads a DeepSpeed config (plugin sections already removed) into the frozen
:class:`~zerohooks.hookspec.SetupContext` that ``zerohooks.initialize`` hands every plugin
(``ZeroPlugin.deepspeed`` while it edits the config, ``attach(registry, ctx)`` after);
:func:`engine_context` reads the same from an engine DeepSpeed built.  No plugin reads
DeepSpeed's keys for these settings itself: what a plugin checks beyond the
:class:`~zerohooks.hookspec.SetupContext` (conflicting sections, ZeRO++ quantization, gradient
averaging) is :func:`read_settings`, and what it edits goes through :func:`set_grad_accum_dtype`
and :func:`set_communication_data_type`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from zerohooks.errors import ConfigError
from zerohooks.hookspec import SetupContext

__all__ = [
    "DeepSpeedSettings",
    "engine_context",
    "read_settings",
    "refuse_universal_load",
    "set_communication_data_type",
    "set_grad_accum_dtype",
    "setup_context",
]


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _check_precision_sections(ds_config: dict[str, Any]) -> None:
    """Refuse a ``"fp16"``, ``"bf16"`` or ``"bfloat16"`` value that is not a JSON object (``"bf16":
    true``): DeepSpeed 0.19.8 reads each as keyword arguments (``DeepSpeedBF16Config(**value)``)
    and fails in its own words (``TypeError: ... argument after ** must be a mapping, not
    bool``), and read here as disabled it would tell the plugins the model trains in fp32.
    ``"bf16": null`` is DeepSpeed's "absent" (it then reads ``"bfloat16"``), so it passes."""
    for key in ("fp16", "bf16", "bfloat16"):
        if key not in ds_config:
            continue
        value = ds_config[key]
        if isinstance(value, dict) or (value is None and key == "bf16"):
            continue
        if key == "bfloat16" and ds_config.get("bf16") is not None:
            continue  # DeepSpeed reads "bfloat16" only when "bf16" is absent
        enabled = "true" if value is True else "false" if value is False else None
        fix = (
            f'write "{key}": {{"enabled": {enabled}}}'
            if enabled is not None
            else f'write "{key}": {{"enabled": true}} (or false), or remove the key'
        )
        shown = enabled if enabled is not None else repr(value)
        raise ConfigError(
            f'"{key}": {shown} in the DeepSpeed config: DeepSpeed reads "{key}" as a JSON object and fails '
            f"on a bare {type(value).__name__} (TypeError: argument after ** must be a mapping); {fix}"
        )


def _stage(zero: Any) -> int:
    if isinstance(zero, bool):  # DeepSpeed's legacy form: "zero_optimization": true is stage 1
        return 1 if zero else 0
    if not isinstance(zero, dict):
        raise ConfigError("zero_optimization must be a JSON object")
    try:
        stage = int(zero.get("stage", 0))
    except (TypeError, ValueError):
        raise ConfigError(
            f"zero_optimization.stage must be 0, 1, 2 or 3, not {zero.get('stage')!r}"
        ) from None
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, not {stage}")
    return stage


def _device(zero: Any, key: str) -> str | None:
    section = (zero.get(key) or {}) if isinstance(zero, dict) else {}
    device = section.get("device") if isinstance(section, dict) else None
    return None if device in (None, "none") else str(device)


def _world_rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def setup_context(ds_config: dict[str, Any]) -> SetupContext:
    """What the plugins are told about the run, read from DeepSpeed's part of the config."""
    _check_precision_sections(ds_config)
    zero = ds_config.get("zero_optimization") or {}
    stage = _stage(zero)
    bf16 = _enabled(ds_config.get("bf16")) or _enabled(ds_config.get("bfloat16"))
    fp16 = _enabled(ds_config.get("fp16"))
    if bf16 and fp16:
        raise ConfigError("both bf16 and fp16 are enabled in the DeepSpeed config; enable one of them")
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    types = ds_config.get("data_types")
    types = types if isinstance(types, dict) else {}
    world, rank = _world_rank()
    return SetupContext(
        config=ds_config,
        zero_stage=stage,
        train_dtype=dtype,
        offload_optimizer=_device(zero, "offload_optimizer"),
        world_size=world,
        rank=rank,
        offload_param=_device(zero, "offload_param"),
        grad_accum_dtype=types.get("grad_accum_dtype"),
        communication_data_type=ds_config.get("communication_data_type"),
        buffer_dtype=types.get("buffer_dtype"),
        deepspeed_autocast=tuple(k for k in ("torch_autocast", "amp") if _enabled(ds_config.get(k))),
    )


def engine_context(engine: Any, ds_config: dict[str, Any]) -> SetupContext:
    """The :class:`SetupContext` of an engine DeepSpeed built from a config that
    :func:`setup_context` does not read (only without plugins: DeepSpeed judges its own config).
    Read from the engine's own accessors, where it has them."""

    def ask(name: str, default: Any) -> Any:
        fn = getattr(engine, name, None)
        return fn() if callable(fn) else default

    dtype = (
        torch.bfloat16
        if ask("bfloat16_enabled", False)
        else torch.float16
        if ask("fp16_enabled", False)
        else torch.float32
    )
    device = getattr(ask("zero_offload_optimizer", None), "device", None)
    device = getattr(device, "value", device)  # DeepSpeed's OffloadDeviceEnum
    world, rank = _world_rank()
    return SetupContext(
        config=ds_config,
        zero_stage=int(ask("zero_optimization_stage", 0)),
        train_dtype=dtype,
        offload_optimizer=None if device in (None, "none") else str(device),
        world_size=world,
        rank=rank,
    )


_QUANTIZED_KEYS = (
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
)


@dataclass(frozen=True)
class DeepSpeedSettings:
    """DeepSpeed's settings a plugin checks its own against, read as written and never judged
    (:func:`read_settings` raises nothing: the plugin names the conflict in its own words)."""

    precision_sections: tuple[tuple[str, bool], ...]
    """The enabled sections of ``"fp16"``, ``"bf16"``, ``"bfloat16"``, in that order, each with
    True when it is the bare ``true`` DeepSpeed itself refuses (``{"enabled": true}``: False)."""
    torch_autocast: bool
    """DeepSpeed's own ``"torch_autocast"`` section is enabled."""
    communication_data_type: Any
    """``communication_data_type`` as written, or None."""
    grad_accum_dtype: Any
    """``data_types.grad_accum_dtype`` as written, or None."""
    quantized: tuple[str, ...]
    """The ZeRO++ quantization keys of ``zero_optimization`` that are on
    (``zero_quantized_weights``, ``zero_quantized_nontrainable_weights``, ``zero_quantized_gradients``)."""
    offload_optimizer: str | None
    """``zero_optimization.offload_optimizer.device`` (``"none"`` read as None)."""
    gradient_predivide_factor: Any
    """``gradient_predivide_factor`` as written (1.0 when absent: DeepSpeed's default)."""
    prescale_gradients: Any
    """``prescale_gradients`` as written (False when absent)."""
    ulysses_size: Any = 1
    """``sequence_parallel_size`` (Ulysses) as written (1 when absent: DeepSpeed's default)."""
    load_universal: bool = False
    """``checkpoint.load_universal`` is true: the engine loads universal checkpoints
    (``ds_to_universal`` output) instead of regular ones."""


def _switched_on(section: Any) -> bool:
    return section is True or _enabled(section)


def read_settings(ds_config: dict[str, Any]) -> DeepSpeedSettings:
    """The :class:`DeepSpeedSettings` of a DeepSpeed config (plugin sections removed)."""
    zero = ds_config.get("zero_optimization") or {}
    zero = zero if isinstance(zero, dict) else {}
    types = ds_config.get("data_types")
    types = types if isinstance(types, dict) else {}
    return DeepSpeedSettings(
        precision_sections=tuple(
            (key, ds_config.get(key) is True)
            for key in ("fp16", "bf16", "bfloat16")
            if _switched_on(ds_config.get(key))
        ),
        torch_autocast=_switched_on(ds_config.get("torch_autocast")),
        communication_data_type=ds_config.get("communication_data_type"),
        grad_accum_dtype=types.get("grad_accum_dtype"),
        quantized=tuple(key for key in _QUANTIZED_KEYS if zero.get(key)),
        offload_optimizer=_device(zero, "offload_optimizer"),
        gradient_predivide_factor=ds_config.get("gradient_predivide_factor", 1.0),
        prescale_gradients=ds_config.get("prescale_gradients", False),
        ulysses_size=ds_config.get("sequence_parallel_size", 1),
        load_universal=_load_universal(ds_config.get("checkpoint")),
    )


def _load_universal(section: Any) -> bool:
    return isinstance(section, dict) and section.get("load_universal") is True


def refuse_universal_load(settings: DeepSpeedSettings, plugin: str, why: str) -> None:
    """Raise a :class:`ConfigError` naming ``plugin`` and ``why`` (one clause) when ``settings``
    load universal checkpoints (``"checkpoint": {"load_universal": true}``), a combination the
    plugins have not been tested with (the compatibility matrix of the top-level README)."""
    if not settings.load_universal:
        return
    raise ConfigError(
        f'"checkpoint": {{"load_universal": true}} is not supported with {plugin}: {why}; load a '
        "regular checkpoint on the same number of ranks, or load the universal checkpoint without "
        f'the "{plugin}" section'
    )


def set_grad_accum_dtype(ds_config: dict[str, Any], name: str | None) -> None:
    """Write ``data_types.grad_accum_dtype`` (a DeepSpeed dtype name such as ``"fp32"``) into a
    plugin's private copy of the config, or remove it for None (and ``data_types`` with it when
    nothing else is left there).  ``data_types`` is replaced by an edited copy (the user's own
    dict is never changed)."""
    types = ds_config.get("data_types")
    if name is not None:
        types = dict(types) if isinstance(types, dict) else {}
        types["grad_accum_dtype"] = name
        ds_config["data_types"] = types
    elif isinstance(types, dict) and "grad_accum_dtype" in types:
        rest = {k: v for k, v in types.items() if k != "grad_accum_dtype"}
        if rest:
            ds_config["data_types"] = rest
        else:
            del ds_config["data_types"]


def set_communication_data_type(ds_config: dict[str, Any], name: str) -> None:
    """Write ``communication_data_type`` (a DeepSpeed dtype name such as ``"fp32"``) into a
    plugin's private copy of the config."""
    ds_config["communication_data_type"] = name
