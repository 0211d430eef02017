"""Reading the DeepSpeed config: plugin sections out, validated; DeepSpeed's part passed on."""

from __future__ import annotations

import base64
import copy
import difflib
import json
import os
import re
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import pydantic

from zerohooks.errors import ConfigError, PluginNotInstalledError
from zerohooks.plugin import ZeroPlugin
from zerohooks.strict import accepted

__all__ = [
    "ENTRY_POINT_GROUP",
    "KNOWN_PLUGINS",
    "available_plugins",
    "check_misspelt_sections",
    "load_config",
    "load_plugin",
    "plugin_entry_points",
    "split_plugin_sections",
]

ENTRY_POINT_GROUP = "zerohooks.plugins"
"""Entry-point group under which plugin distributions register their ``ZeroPlugin`` class."""

KNOWN_PLUGINS: dict[str, str] = json.loads(
    (Path(__file__).resolve().parent / "catalogue.json").read_text(encoding="utf-8")
)
"""Section name -> distribution providing it, for the plugins this project publishes, read from
the data file ``catalogue.json`` (no plugin is imported or named in code): a config section
naming one of them while it is not installed is a :class:`PluginNotInstalledError` saying what
to install, instead of a section DeepSpeed would silently ignore.  Installed plugins are found
through their entry points whether they are listed there or not."""


def plugin_entry_points() -> dict[str, EntryPoint]:
    """The installed plugins' entry points (``zerohooks.plugins``), by name; nothing is imported."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_plugin(ep: EntryPoint) -> type[ZeroPlugin]:
    """Import the plugin class of one entry point, checked (:class:`ConfigError` when it fails)."""
    dist = ep.dist.name if ep.dist is not None else KNOWN_PLUGINS.get(ep.name, "?")
    try:
        cls = ep.load()
    except Exception as e:
        raise ConfigError(
            f"plugin {ep.name!r} ({ep.value}, from {dist}) failed to import: {type(e).__name__}: {e}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, ZeroPlugin)):
        raise ConfigError(
            f"entry point {ep.name!r} = {ep.value!r} ({dist}) is not a zerohooks.ZeroPlugin subclass"
        )
    if cls.name != ep.name:
        raise ConfigError(
            f"entry point {ep.name!r} ({dist}) loads a plugin named {cls.name!r}; they must match"
        )
    return cls


def available_plugins() -> dict[str, type[ZeroPlugin]]:
    """Load and return every plugin registered in the ``zerohooks.plugins`` entry-point group.

    ``zerohooks.initialize`` does not call this: it loads only the plugins the config names, so a
    broken plugin that is installed but not used cannot stop training.
    """
    return {name: load_plugin(ep) for name, ep in plugin_entry_points().items()}


def _parse(text: str, where: str, duplicates: bool) -> dict[str, Any]:
    """``text`` parsed as DeepSpeed parses a config: HJSON (JSON plus comments and unquoted keys),
    duplicate keys refused where DeepSpeed refuses them (in files)."""
    import hjson  # type: ignore[import-untyped]  # a dependency of DeepSpeed, without type hints

    from zerohooks.adapter.dsrules import refuse_duplicate_keys

    try:
        if duplicates:
            data = hjson.loads(text, object_pairs_hook=refuse_duplicate_keys)
        else:
            data = hjson.loads(text)
    except ValueError as e:  # hjson.HjsonDecodeError and DeepSpeed's duplicate-key error
        raise ConfigError(f"DeepSpeed config {where} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {where} must hold a JSON object, not {type(data).__name__}")
    return dict(data)


def _base64(config: str) -> dict[str, Any] | None:
    """``config`` decoded as DeepSpeed decodes a config passed as URL-safe base64, or None."""
    try:
        text = base64.urlsafe_b64decode(config).decode("utf-8")
        return _parse(text, "(base64)", duplicates=False)
    except (ValueError, UnicodeDecodeError):  # ConfigError is a ValueError
        return None


def load_config(config: Any) -> dict[str, Any]:
    """A private copy of ``config``, read as ``deepspeed.initialize`` reads it: a dict, a path to a
    JSON (or HJSON) file, or a string holding the config in URL-safe base64 (as the ``deepspeed``
    launcher passes it).  :class:`ConfigError` when it cannot be read."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"DeepSpeed config file {path!r} cannot be read: {e}") from None
            return _parse(text, f"file {path!r}", duplicates=True)
        decoded = _base64(config) if isinstance(config, str) else None
        if decoded is not None:
            return decoded
        raise ConfigError(
            f"DeepSpeed config file {path!r} does not exist (nor is it a base64-encoded config)"
        )
    raise ConfigError(f"config must be a dict or a path to a JSON file, not {type(config).__name__}")


def _format_validation_error(
    section: str, err: pydantic.ValidationError, model: type[pydantic.BaseModel]
) -> str:
    lines = [f'invalid "{section}" section in the DeepSpeed config:']
    fields = list(model.model_fields)
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(section)"
        key = f"{section}.{loc}"
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][-1]), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"  {key}: unknown key{hint}; accepted keys: {', '.join(fields)}")
        else:
            field = str(e["loc"][0]) if e["loc"] else ""
            what = accepted(model, field) if field in model.model_fields else None
            got = e.get("input")
            hint = f"; accepted: {what}" if what else ""
            lines.append(f"  {key}: {e['msg']} (got {got!r}, a JSON {_json_type(got)}){hint}")
    return "\n".join(lines)


def _json_type(value: Any) -> str:
    """The JSON type of a parsed value, as a user wrote it."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return (
        "array"
        if isinstance(value, (list, tuple))
        else "object"
        if isinstance(value, dict)
        else type(value).__name__
    )


def _normalised(key: str) -> str:
    return re.sub(r"[\s_\-]", "", key.lower())


def _deepspeed_keys() -> set[str]:
    """DeepSpeed's own config keys (:func:`zerohooks.adapter.dsrules.deepspeed_config_keys`), or
    none where DeepSpeed cannot be imported (then no key is taken for DeepSpeed's)."""
    try:
        from zerohooks.adapter.dsrules import deepspeed_config_keys
    except ImportError:
        return set()
    return deepspeed_config_keys()


def check_misspelt_sections(ds_config: Mapping[str, Any], names: set[str]) -> None:
    """Refuse a top-level key that is neither DeepSpeed's nor a plugin's but is a plugin's name in
    another case or spacing (``"Loco"``, ``"loco "``, ``"nvme_swap"``) or a close misspelling
    (``"lcoo"``), and a plugin's name (in any case or spacing) nested one level down
    (``"plugins": {"loco": {...}}``, ``"zero_optimization": {"loco": {...}}``): DeepSpeed would
    ignore it (or refuse it in its own words) and the run would train without the plugin."""
    plugins = sorted(names | set(KNOWN_PLUGINS))
    candidates = {_normalised(p): p for p in plugins}
    ds_keys: set[str] | None = None
    for key, value in ds_config.items():
        if not isinstance(key, str) or key in candidates.values():
            continue
        if isinstance(value, Mapping):
            for inner in value:
                if isinstance(inner, str) and _normalised(inner) in candidates:
                    raise ConfigError(
                        f'the DeepSpeed config has a "{inner}" section under "{key}" ("{key}.{inner}"): '
                        "plugin sections are top-level keys of the DeepSpeed config, and nested there it would "
                        f'not enable the plugin; move it to the top level as "{candidates[_normalised(inner)]}"'
                    )
        norm = _normalised(key)
        close = (
            [candidates[norm]]
            if norm in candidates
            else difflib.get_close_matches(norm, candidates, n=1, cutoff=0.75)
        )
        if not close:
            continue
        ds_keys = _deepspeed_keys() if ds_keys is None else ds_keys
        if key in ds_keys:
            continue
        match = candidates.get(close[0], close[0])
        raise ConfigError(
            f'the DeepSpeed config has a top-level "{key}" section, which is neither a DeepSpeed setting nor a '
            f'plugin section (DeepSpeed would ignore it and train without the plugin); did you mean "{match}"? '
            f"Plugin sections are spelt exactly: {', '.join(plugins)}"
        )


def _check_enabled(key: str, section: Any) -> None:
    if isinstance(section, dict) and "enabled" in section and not isinstance(section["enabled"], bool):
        raise ConfigError(
            f'"{key}.enabled" must be the JSON boolean true or false, not {section["enabled"]!r} '
            f"({type(section['enabled']).__name__}); leave it out to enable the plugin"
        )


def split_plugin_sections(
    ds_config: dict[str, Any], plugins: Mapping[str, type[ZeroPlugin]] | None = None
) -> list[ZeroPlugin]:
    """Remove plugin sections from ``ds_config`` (in place) and build the enabled plugins.

    A section is a plugin's when its key is an installed plugin's name or one of
    :data:`KNOWN_PLUGINS`.  A known section whose plugin is not installed raises
    :class:`PluginNotInstalledError` naming the distribution.  A section may be ``false`` or
    ``{"enabled": false}`` to leave the plugin off (``enabled`` must be a JSON boolean).  A
    top-level key that is a plugin's name in another case or spacing, or a close misspelling of
    one, and not a DeepSpeed key, is a :class:`ConfigError` with the close match, as is a plugin's
    name nested one level down (``"plugins": {"loco": {...}}``).
    """
    eps = plugin_entry_points() if plugins is None else {}
    names = set(plugins) if plugins is not None else set(eps)
    check_misspelt_sections(ds_config, names)
    built: list[ZeroPlugin] = []
    for key in sorted(set(ds_config) & (names | set(KNOWN_PLUGINS))):
        section = ds_config.pop(key)
        _check_enabled(key, section)
        if section is False or (isinstance(section, dict) and section.get("enabled", True) is False):
            continue
        if key not in names:
            raise PluginNotInstalledError(
                f'the DeepSpeed config has a "{key}" section but the {key} plugin is not installed. '
                f"From a checkout of the zerohooks repository: pip install ./packages/"
                f"{KNOWN_PLUGINS[key].removeprefix('zerohooks-')} (distribution {KNOWN_PLUGINS[key]}; "
                f"pip install {KNOWN_PLUGINS[key]} once it is published on PyPI). Or remove the section, "
                f'or set "{key}": false'
            )
        cls = plugins[key] if plugins is not None else load_plugin(eps[key])
        if section is True:
            section = {}
        if not isinstance(section, dict):
            raise ConfigError(
                f'"{key}" section must be a JSON object (or true/false), not {type(section).__name__}'
            )
        section = {k: v for k, v in section.items() if k != "enabled"}
        try:
            cfg = cls.Config.model_validate(section)
        except pydantic.ValidationError as e:
            raise ConfigError(_format_validation_error(key, e, cls.Config)) from None
        built.append(cls(cfg))
    return built
