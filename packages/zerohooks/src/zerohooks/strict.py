"""Strict JSON values for plugin config sections, shared by every plugin.

:class:`zerohooks.PluginConfig` validates in pydantic's strict mode with finite numbers only
(:data:`STRICT`), so a value is taken only when its JSON type is the field's:

* a boolean only from JSON ``true``/``false`` (never ``"yes"``, ``"no"``, ``"true"``, ``0``, ``1``);
* an integer only from a JSON integer (never ``true``, ``4.0``, ``"4"``), a choice of integers
  (``Literal[4, 8]``) included (:func:`exact_literal_types`);
* a number from a JSON integer or number, never from ``true``/``false`` or a string, never
  ``NaN``/``Infinity``;
* a string only from a JSON string.

A list of strings (:data:`StrList`) comes from a JSON array of strings.  Upper bounds are each
plugin's (``pydantic.Field(le=...)``), documented per field.  :func:`accepted` describes what a
field accepts, in the words a refusal uses.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any

import pydantic

__all__ = ["MAX_NUMEL", "MAX_STEPS", "STRICT", "StrList", "accepted", "exact_literal_types"]

STRICT = pydantic.ConfigDict(strict=True, allow_inf_nan=False)
"""The validation settings every plugin config inherits."""

MAX_STEPS = 2**31 - 1
"""Upper bound of every field counted in optimizer steps (a period, a window, a count of
steps): a run of 2**31 steps takes 250 days at 10 ms a step, and a period longer than the run
means the same as never, which each such field spells otherwise (0, or its default)."""

MAX_NUMEL = 2**48
"""Upper bound of every field counted in tensor elements (a size threshold): no tensor has
2**48 elements (256 TiB at one byte each), so this bound already means "every tensor"."""

StrList = Annotated[tuple[str, ...], pydantic.Strict(False)]
"""A JSON array of strings (held as a tuple); each element must be a JSON string."""


def _literal_choices(annotation: Any) -> tuple[Any, ...]:
    """The values of the ``Literal`` types in ``annotation`` (through ``Annotated``, unions)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return typing.get_args(annotation)
    if origin is Annotated:
        return _literal_choices(typing.get_args(annotation)[0])
    return tuple(c for arg in typing.get_args(annotation) for c in _literal_choices(arg))


def exact_literal_types(model: type[pydantic.BaseModel], field: str, value: Any) -> None:
    """Refuse ``value`` for a choice field when it equals a choice but has another JSON type
    (``4.0`` or ``true`` for ``Literal[1, 4, 8]``, which pydantic would take even in strict mode)."""
    info = model.model_fields.get(field)
    if info is None:
        return
    choices = _literal_choices(info.annotation)
    if any(type(value) is not type(c) and value == c for c in choices):
        raise ValueError(
            f"must be one of {', '.join(map(repr, choices))}, not {value!r} ({type(value).__name__})"
        )


def _describe(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in schema:
        return _describe(defs.get(schema["$ref"].rsplit("/", 1)[-1], {}), defs)
    if "anyOf" in schema:
        return " or ".join(dict.fromkeys(_describe(s, defs) for s in schema["anyOf"]))
    if "enum" in schema:
        return "one of " + ", ".join(_json(v) for v in schema["enum"])
    if "const" in schema:
        return _json(schema["const"])
    kind = schema.get("type")
    if kind == "boolean":
        return "the JSON boolean true or false"
    if kind == "null":
        return "null"
    if kind == "string":
        least = schema.get("minLength")
        return "a non-empty JSON string" if least else "a JSON string"
    if kind == "array":
        return f"a JSON array of {_describe(schema.get('items', {}), defs).removeprefix('a JSON ')}s"
    if kind in ("integer", "number"):
        text = "a JSON integer" if kind == "integer" else "a finite JSON number"
        bounds = [
            f"{word} {_json(schema[key])}"
            for key, word in (
                ("minimum", ">="),
                ("exclusiveMinimum", ">"),
                ("maximum", "<="),
                ("exclusiveMaximum", "<"),
            )
            if key in schema
        ]
        if "multipleOf" in schema:
            bounds.append(f"a multiple of {_json(schema['multipleOf'])}")
        return text + (f" ({', '.join(bounds)})" if bounds else "")
    return "a valid value"


def _json(value: Any) -> str:
    if value is True or value is False or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value) if isinstance(value, str) else str(value)


def accepted(model: type[pydantic.BaseModel], field: str) -> str | None:
    """What ``model``'s field ``field`` accepts, in words (None when it cannot be told)."""
    try:
        schema = model.model_json_schema()
    except Exception:  # a field type without a JSON schema
        return None
    prop = schema.get("properties", {}).get(field)
    if prop is None:
        return None
    return _describe(prop, schema.get("$defs", {}))
