"""Which parameters are lower-precision safe: by module class (subclasses included) or name glob."""

from __future__ import annotations

import fnmatch
import warnings

from torch import nn

from autocastzero.config import AutocastZeroConfig
from zerohooks import ConfigError

__all__ = ["nothing_safe_message", "safe_parameters", "warn_if_nothing_safe"]


def _unmatched(globs: tuple[str, ...], names: list[str], key: str) -> None:
    missing = [g for g in globs if not fnmatch.filter(names, g)]
    if missing:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise ConfigError(
            f"autocastzero.{key}: {missing} match no module of the model; module names are: {shown}"
        )


def safe_parameters(model: nn.Module, cfg: AutocastZeroConfig) -> dict[int, str]:
    """``id(param) -> name`` of every lower-precision-safe parameter of ``model``.

    A module is safe when it is an instance of one of ``cfg.lower_precision_safe_modules`` or its
    name matches ``cfg.lower_precision_safe_names``, and its name matches none of
    ``cfg.fp32_names``.  A module's own parameters (not its children's) follow it.  A parameter
    shared by several modules (tied weights) is safe only when every module holding it is.
    """
    classes = cfg.safe_classes()
    modules = list(model.named_modules())
    names = [n for n, _ in modules if n]
    _unmatched(cfg.lower_precision_safe_names, names, "lower_precision_safe_names")
    _unmatched(cfg.fp32_names, names, "fp32_names")
    verdict: dict[int, bool] = {}
    param_names: dict[int, str] = {}
    for mod_name, module in modules:
        safe = isinstance(module, classes) or any(
            fnmatch.fnmatchcase(mod_name, g) for g in cfg.lower_precision_safe_names
        )
        if safe and any(fnmatch.fnmatchcase(mod_name, g) for g in cfg.fp32_names):
            safe = False
        for p_name, p in module.named_parameters(recurse=False):
            key = id(p)
            verdict[key] = verdict.get(key, True) and safe
            param_names.setdefault(key, f"{mod_name}.{p_name}" if mod_name else p_name)
    return {k: param_names[k] for k, ok in verdict.items() if ok}


def _numel(p: nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO 3 partitions leave numel() at 0


def nothing_safe_message(
    model: nn.Module, cfg: AutocastZeroConfig, safe: dict[int, str], stage: int
) -> str | None:
    """Why ``model`` gets no 16-bit communication, when it has trainable parameters, none of them
    is safe (``safe`` from :func:`safe_parameters`) and the section asks for 16-bit reduction or
    (ZeRO 3) gathering with a non-empty selection; None otherwise."""
    low = cfg.low_precision_reduce or (cfg.low_precision_gather and stage == 3)
    chosen = cfg.lower_precision_safe_modules or cfg.lower_precision_safe_names
    if safe or not low or not chosen:
        return None
    per_class: dict[type[nn.Module], list[int]] = {}  # class -> [elements, modules]
    seen: set[int] = set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for p in own)
        entry = per_class.setdefault(type(module), [0, 0])
        entry[0] += sum(_numel(p) for p in own)
        entry[1] += 1
    if not per_class:
        return None
    top = sorted(per_class.items(), key=lambda kv: -kv[1][0])[:3]
    total = sum(n for n, _ in per_class.values())
    classes = ", ".join(
        f"{cls.__module__}.{cls.__qualname__} ({n / total:.0%} of the parameters, {k} module{'s' * (k != 1)})"
        for cls, (n, k) in top
    )
    what = "reduced" if cfg.low_precision_reduce else "gathered"
    return (
        f"autocastzero: no parameter of the model is lower-precision safe, so every gradient is {what} "
        f"in float32 (the forward still runs under {cfg.dtype} autocast): no module holding parameters "
        "is an instance of lower_precision_safe_modules or matches lower_precision_safe_names (less "
        f"fp32_names and weights tied to other modules). The module classes holding the most "
        f"parameters are {classes}. If they compute in {cfg.dtype} under autocast "
        '(linear layers, convolutions), add their import paths to "autocastzero": '
        '{"lower_precision_safe_modules": [...]} (the list replaces the default), or module-name globs '
        'to "lower_precision_safe_names".'
    )


def warn_if_nothing_safe(model: nn.Module, cfg: AutocastZeroConfig, safe: dict[int, str], stage: int) -> None:
    """A ``RuntimeWarning`` with :func:`nothing_safe_message`, if there is one."""
    text = nothing_safe_message(model, cfg, safe, stage)
    if text is not None:
        warnings.warn(text, RuntimeWarning, stacklevel=3)
