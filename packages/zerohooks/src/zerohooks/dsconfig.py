"""The one reader of DeepSpeed's part of the config: stage, dtypes, offload, accumulation.

:func:`setup_context` reads a DeepSpeed config (plugin sections already removed) into the frozen
:class:`~zerohooks.hookspec.SetupContext` that ``zerohooks.initialize`` hands every plugin
(``ZeroPlugin.deepspeed`` while it edits the config, ``attach(registry, ctx)`` after);
:func:`engine_context` reads the same from an engine DeepSpeed built.  No plugin reads
DeepSpeed's keys for these settings itself.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerohooks.errors import ConfigError
from zerohooks.hookspec import SetupContext

__all__ = ["engine_context", "setup_context"]


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


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
