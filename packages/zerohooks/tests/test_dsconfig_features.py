"""read_settings' fields for the compatibility matrix (sequence parallelism, universal loads) and
the universal-load refusal the plugins share."""

from __future__ import annotations

import pytest

from zerohooks import ConfigError
from zerohooks.dsconfig import read_settings, refuse_universal_load


def test_defaults_when_absent() -> None:
    settings = read_settings({"zero_optimization": {"stage": 2}})
    assert settings.ulysses_size == 1
    assert settings.load_universal is False


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"load_universal": True}, True),
        ({"load_universal": False}, False),
        ({"tag_validation": "Warn"}, False),
        ("not a section", False),
    ],
)
def test_load_universal_read_as_written(section: object, expected: bool) -> None:
    assert read_settings({"checkpoint": section}).load_universal is expected


def test_sequence_parallel_size_read_as_written() -> None:
    assert read_settings({"sequence_parallel_size": 4}).ulysses_size == 4


def test_universal_load_refused_naming_plugin_and_fix() -> None:
    settings = read_settings({"checkpoint": {"load_universal": True}})
    with pytest.raises(ConfigError) as info:
        refuse_universal_load(settings, "myplugin", "its buffers are per rank")
    message = str(info.value)
    for part in ('"load_universal": true', "myplugin", "its buffers are per rank", "regular checkpoint"):
        assert part in message
    refuse_universal_load(read_settings({}), "myplugin", "unused")  # not loading universal: nothing


@pytest.mark.parametrize(
    "section",
    [None, {}, {"deepcompile": False}, {"offload_activation": True}, "not a section"],
)
def test_deepcompile_off_is_not_refused(section: object) -> None:
    from zerohooks.adapter.dsrules import check_deepcompile

    config = {} if section is None else {"compile": section}
    check_deepcompile(config, ("loco",))  # nothing raised


def test_deepcompile_refused_naming_the_plugins_and_the_fix() -> None:
    from zerohooks.adapter.dsrules import check_deepcompile

    with pytest.raises(ConfigError) as info:
        check_deepcompile({"compile": {"deepcompile": True}}, ("loco", "accumdtype"))
    message = str(info.value)
    for part in ('"deepcompile": true', "loco, accumdtype", '"deepcompile": false', "engine.compile()"):
        assert part in message, (part, message)
