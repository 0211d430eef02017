"""The ``"mixedlayers"`` config section, and which modules of a model it selects.

:func:`check_deepspeed_config` refuses DeepSpeed settings the plugin cannot honour when the
config is read; :func:`select_modules` resolves the globs and class names against the model
and fails, naming close module names, when one of them matches nothing.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import pydantic
import torch
from torch import nn

from zerohooks import ConfigError, PluginConfig, SetupContext
from zerohooks.strict import StrList

__all__ = ["MixedLayersConfig", "add_sharers", "check_deepspeed_config", "outermost", "select_modules"]

OutputDtype = Literal["input", "train", "fp32"]


class MixedLayersConfig(PluginConfig):
    """The ``"mixedlayers"`` section of the DeepSpeed config."""

    fp32_modules: StrList = ()
    """Globs (``fnmatch``: ``*``, ``?``, ``[..]``) on qualified module names as
    ``model.named_modules()`` gives them, e.g. ``"blocks.*.norm"``, ``"head"``; ``""`` is the
    root module.  Each must match at least one module."""
    fp32_module_types: StrList = ()
    """Module classes whose instances (subclasses included) are kept in fp32: a dotted import path
    (``"torch.nn.LayerNorm"``) or a bare class name (``"LayerNorm"``, matched against the names
    of every class in an instance's MRO).  Each must match at least one module."""
    cast_inputs: bool = True
    """Cast bf16/fp16 floating tensors among a kept module's arguments to fp32 on entry."""
    output_dtype: OutputDtype = "input"
    """Dtype of the floating outputs of a kept module: ``"input"`` (the 16-bit dtype its
    floating inputs had, the training dtype when it had none, e.g. an embedding), ``"train"``
    (always the training dtype) or ``"fp32"`` (left in fp32, e.g. logits of an LM head)."""
    keep_buffers: bool = True
    """Keep the floating buffers of kept modules in fp32 too (DeepSpeed casts buffers only when
    ``data_types.buffer_dtype`` is set)."""

    @pydantic.field_validator("fp32_modules", "fp32_module_types", mode="before")
    @classmethod
    def _strings(cls, value: Any) -> Any:
        if isinstance(value, str):
            return (value,)
        return value

    @pydantic.model_validator(mode="after")
    def _something_selected(self) -> MixedLayersConfig:
        if not self.fp32_modules and not self.fp32_module_types:
            raise ValueError(
                "select at least one module: give fp32_modules (name globs) and/or fp32_module_types "
                '(class names such as "torch.nn.LayerNorm")'
            )
        return self


def check_deepspeed_config(ctx: SetupContext) -> None:
    """Refuse DeepSpeed settings mixedlayers cannot honour."""
    if ctx.train_dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(
            'mixedlayers keeps modules in fp32 inside a 16-bit model: enable DeepSpeed\'s "bf16" or "fp16" '
            "section (the model trains in fp32 otherwise, so there is nothing to keep)"
        )
    if ctx.offload_param is not None:
        raise ConfigError(
            "mixedlayers does not support zero_optimization.offload_param (DeepSpeed keeps one flat "
            "16-bit CPU buffer for all offloaded parameters); use offload_optimizer only"
        )
    if ctx.zero_stage == 3 and ctx.offload_optimizer == "nvme":
        raise ConfigError(
            'mixedlayers does not support ZeRO 3 with offload_optimizer.device "nvme"; use "cpu" or "none"'
        )
    accum = ctx.grad_accum_dtype
    if ctx.zero_stage > 0 and accum not in (None, "fp32", "float32", "float"):
        raise ConfigError(
            f"mixedlayers on ZeRO {ctx.zero_stage} accumulates gradients in fp32; "
            f'data_types.grad_accum_dtype="{accum}" would downcast the fp32 modules\' gradients: '
            'remove it or set it to "fp32"'
        )
    for key in ctx.deepspeed_autocast:
        raise ConfigError(f'mixedlayers cannot be combined with DeepSpeed\'s "{key}" section')
    if ctx.buffer_dtype is not None:
        raise ConfigError(
            "mixedlayers manages buffer dtypes itself (keep_buffers); remove data_types.buffer_dtype"
        )


def _resolve_type(name: str) -> type | None:
    """The class a dotted name imports to, or None for a bare name."""
    if "." not in name:
        return None
    mod_name, _, attr = name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f'mixedlayers.fp32_module_types: cannot import "{name}": {e}') from None
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ConfigError(f'mixedlayers.fp32_module_types: "{name}" is not a torch.nn.Module subclass')
    return obj


def _type_matches(module: nn.Module, name: str, cls: type | None) -> bool:
    if cls is not None:
        return isinstance(module, cls)
    return any(k.__name__ == name for k in type(module).__mro__)


def _close(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=5, cutoff=0.5)
    if not close:
        close = candidates[:8]
    return ", ".join(repr(c) for c in close)


def select_modules(
    model: nn.Module, cfg: MixedLayersConfig, anywhere: Callable[[list[bool]], list[bool]] | None = None
) -> dict[str, nn.Module]:
    """The modules to keep in fp32, by qualified name, in ``named_modules`` order.

    A glob or class name that matches nothing raises :class:`~zerohooks.ConfigError` listing
    close module names (or class names).  ``anywhere`` (a pipeline, whose stages each hold some
    of the layers): given whether each glob, then each class name, matched here, whether it
    matched on any stage; only what matches on no stage is an error (on every rank alike).
    """
    named = list(model.named_modules())
    names = [n for n, _ in named]
    glob_hits = [[n for n in names if fnmatch.fnmatchcase(n, glob)] for glob in cfg.fp32_modules]
    type_hits = []
    for type_name in cfg.fp32_module_types:
        cls = _resolve_type(type_name)
        type_hits.append([n for n, m in named if _type_matches(m, type_name, cls)])
    local = [bool(hits) for hits in glob_hits + type_hits]
    matched = anywhere(local) if anywhere is not None else local
    chosen: set[str] = set()
    for glob, hits, ok in zip(cfg.fp32_modules, glob_hits, matched[: len(glob_hits)], strict=True):
        if not ok:
            raise ConfigError(
                f'mixedlayers.fp32_modules: "{glob}" matches no module of {type(model).__name__}; '
                f"close module names: {_close(glob, [n for n in names if n])}"
            )
        chosen.update(hits)
    for type_name, hits, ok in zip(cfg.fp32_module_types, type_hits, matched[len(glob_hits) :], strict=True):
        if not ok:
            present = {
                k.__name__: f"{k.__module__}.{k.__qualname__}"
                for _, m in named
                for k in type(m).__mro__
                if issubclass(k, nn.Module) and k is not nn.Module
            }
            close = difflib.get_close_matches(type_name.rpartition(".")[2], list(present), n=5, cutoff=0.5)
            listed = ", ".join(repr(present[c]) for c in (close or sorted(present)[:8]))
            raise ConfigError(
                f'mixedlayers.fp32_module_types: "{type_name}" matches no module of '
                f"{type(model).__name__}; its module classes close to it: {listed}"
            )
        chosen.update(hits)
    return {n: m for n, m in named if n in chosen}


def add_sharers(model: nn.Module, selected: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """``selected`` plus every module that directly owns a parameter of a selected module.

    A tied weight (an LM head sharing the token embedding's) is one parameter: kept in fp32 for
    one owner, it is fp32 for all, so every owner needs the boundary casts.
    """
    kept = {id(p) for m in selected.values() for p in m.parameters()}
    out = dict(selected)
    for name, module in model.named_modules():
        if name not in out and any(id(p) in kept for p in module.parameters(recurse=False)):
            out[name] = module
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return dict(sorted(out.items(), key=lambda kv: order[kv[0]]))


def outermost(selected: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The selected modules that no other selected module contains (their boundaries are cast)."""
    inner: set[int] = set()
    for module in selected.values():
        for child in _descendants(module):
            inner.add(id(child))
    return {n: m for n, m in selected.items() if id(m) not in inner}


def _descendants(module: nn.Module) -> Iterator[nn.Module]:
    for _, child in module.named_modules():
        if child is not module:
            yield child
