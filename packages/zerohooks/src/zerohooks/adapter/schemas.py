"""What the objects of allowed classes in a checkpoint file should look like.

torch's weights-only unpickler builds an allowed class (DeepSpeed's ``LossScaler``) with whatever
state the file gives it: an injected attribute, or a field of the wrong type, loads and fails at
the next step with a ``TypeError``.  :func:`schema` says which attributes an object of a class has
and their types; :mod:`.pickscan` checks a pickle's object states against it before they are
built, and :func:`check_loaded` checks a loaded object (and its nesting depth) after.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Refused", "check_loaded", "known_schemas", "schema"]


class Refused(ValueError):
    """A file refused before it was unpickled (or an object after): the message says what was
    found, the caller says which file."""


_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size)


def schema(cls: type) -> dict[str, tuple[type, ...]] | None:
    """The attributes an object of ``cls`` has and their accepted types, from an instance made
    with its constructor's defaults (DeepSpeed's ``LossScaler`` and ``DynamicLossScaler`` have
    them); None where none can be made (then only the values' types are checked)."""
    if cls in _SCHEMAS:
        return _SCHEMAS[cls]
    found: dict[str, tuple[type, ...]] | None = None
    if not issubclass(cls, enum.Enum) and not dataclasses.is_dataclass(cls):
        try:
            fields = dict(vars(cls()))
        except Exception:
            fields = None
        if fields is not None:
            found = {k: _kinds(v) for k, v in fields.items()}
    _SCHEMAS[cls] = found
    return found


def _kinds(value: Any) -> tuple[type, ...]:
    if isinstance(value, bool):
        return (bool,)
    if isinstance(value, (int, float)):
        return (int, float)
    if value is None:
        return _SCALARS
    return (type(value),)


_SCHEMAS: dict[type, dict[str, tuple[type, ...]] | None] = {}


def known_schemas() -> None:
    """DeepSpeed's ``DynamicLossScaler`` has no default ``init_scale``: its schema by hand
    (DeepSpeed 0.19.8, ``runtime/fp16/loss_scaler.py``)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    if DynamicLossScaler in _SCHEMAS:
        return
    num, flag = (int, float), (bool,)
    _SCHEMAS[DynamicLossScaler] = {
        "cur_scale": num,
        "cur_iter": (int,),
        "last_overflow_iter": (int,),
        "scale_factor": num,
        "scale_window": (int,),
        "min_scale": num,
        "delayed_shift": (int,),
        "cur_hysteresis": (int,),
        "consecutive_hysteresis": flag,
        "raise_error_at_min_scale": flag,
        "dynamic": flag,
        "dtype": (torch.dtype,),
    }


def _fields(obj: Any) -> dict[str, Any]:
    out = dict(getattr(obj, "__dict__", {}))
    for klass in type(obj).__mro__:
        for slot in getattr(klass, "__slots__", ()):
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                out[slot] = getattr(obj, slot)
    return out


def _check_object(obj: Any, classes: tuple[type, ...]) -> str | None:
    """What is wrong with ``obj``, an instance of an allowed class, or None."""
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(obj, enum.Enum):
        return None
    fields = _fields(obj)
    expected = schema(cls)
    if dataclasses.is_dataclass(cls) and expected is None:
        expected = {
            f.name: (int, float) if f.type in ("int", int) else _SCALARS for f in dataclasses.fields(cls)
        }
    for key, value in fields.items():
        if not isinstance(key, str) or not key.isidentifier():
            return f"a {name} with an attribute named {key!r}"
        kinds: tuple[type, ...] | None = (
            expected.get(key) if expected is not None else (*_SCALARS, torch.Tensor, *classes)
        )
        if kinds is None:
            accepted = ", ".join(sorted(expected or {}))
            return f"a {name} with an attribute {key!r} it does not have (its attributes: {accepted})"
        if isinstance(value, bool) and bool not in kinds:
            return f"a {name} whose {key!r} is a bool, not {'/'.join(k.__name__ for k in kinds)}"
        if not isinstance(value, kinds):
            return (
                f"a {name} whose {key!r} is a {type(value).__module__}.{type(value).__qualname__}, "
                f"not {'/'.join(k.__name__ for k in kinds)}"
            )
    if expected is not None:
        missing = sorted(set(expected) - set(fields))
        if missing:
            return f"a {name} without its attribute(s) {', '.join(missing)}"
    return None


def check_loaded(obj: Any, classes: Iterable[type], max_depth: int = 64) -> None:
    """Walk a loaded object once (iteratively, each object once): containers nested deeper than
    ``max_depth``, and instances of ``classes`` whose attributes are not what such an object has
    (an injected attribute, a field of the wrong type), are :class:`Refused` naming them."""
    allowed = tuple(classes)
    known_schemas()
    seen: set[int] = set()
    todo: list[tuple[Any, int, str]] = [(obj, 0, "the file's object")]
    while todo:
        item, depth, where = todo.pop()
        if isinstance(item, (torch.Tensor, *_SCALARS)) or id(item) in seen:
            continue
        seen.add(id(item))
        if depth > max_depth:
            raise Refused(f"containers nested deeper than {max_depth} levels at {where}")
        if isinstance(item, dict):
            todo.extend((v, depth + 1, f"{where}[{k!r}]") for k, v in item.items())
            todo.extend((k, depth + 1, f"a key of {where}") for k in item if not isinstance(k, _SCALARS))
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(item))
        elif allowed and isinstance(item, allowed):
            bad = _check_object(item, allowed)
            if bad:
                raise Refused(f"{bad}, at {where}")
            todo.extend((v, depth + 1, f"{where}.{k}") for k, v in _fields(item).items())
