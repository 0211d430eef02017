"""Which parameters are lower-precision safe: by module class (subclasses included) or name glob."""

from __future__ import annotations

import fnmatch

from torch import nn

from autocastzero.config import AutocastZeroConfig
from zerohooks import ConfigError

__all__ = ["safe_parameters"]


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
