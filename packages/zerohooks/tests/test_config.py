"""Config sections: validation, plugin discovery through entry points, clear errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Literal

import pydantic
import pytest

from zerohooks import ConfigError, PluginConfig, PluginNotInstalledError, ZeroPlugin, available_plugins
from zerohooks.adapter.compat import check_deepspeed_version
from zerohooks.config import load_config, split_plugin_sections
from zerohooks.errors import UnsupportedDeepSpeedError
from zerohooks.strict import StrList


class DemoConfig(PluginConfig):
    """Config of the demo plugin."""

    dtype: str = "fp32"
    """Accumulation dtype."""
    bits: int = 4
    """Bits."""


class DemoPlugin(ZeroPlugin):
    name = "accumdtype"
    distribution = "zerohooks-accumdtype"
    Config = DemoConfig


def test_plugin_section_is_removed_validated_and_built() -> None:
    cfg = {"train_batch_size": 8, "accumdtype": {"dtype": "bf16", "bits": 8}}
    plugins = split_plugin_sections(cfg, {"accumdtype": DemoPlugin})
    assert cfg == {"train_batch_size": 8}
    assert len(plugins) == 1 and plugins[0].config == DemoConfig(dtype="bf16", bits=8)


def test_disabled_section_is_removed_and_not_built() -> None:
    cfg = {"accumdtype": {"enabled": False, "dtype": "bf16"}, "loco": False}
    assert split_plugin_sections(cfg, {"accumdtype": DemoPlugin}) == []
    assert cfg == {}


def test_misspelt_key_names_key_and_accepted_keys() -> None:
    with pytest.raises(ConfigError) as e:
        split_plugin_sections({"accumdtype": {"dtpye": "fp32"}}, {"accumdtype": DemoPlugin})
    msg = str(e.value)
    assert "accumdtype.dtpye" in msg and "did you mean 'dtype'" in msg and "accepted keys: dtype, bits" in msg


def test_bad_value_names_key_and_value() -> None:
    with pytest.raises(ConfigError, match=r"accumdtype\.bits.*got 'four'"):
        split_plugin_sections({"accumdtype": {"bits": "four"}}, {"accumdtype": DemoPlugin})


class StrictDemoConfig(PluginConfig):
    """One field of each JSON type, to test the strict values every plugin config inherits."""

    flag: bool = False
    """A boolean."""
    count: int = pydantic.Field(2, ge=1, le=64)
    """A bounded integer."""
    beta: float = pydantic.Field(0.5, ge=0.0, le=1.0)
    """A bounded number."""
    bits: Literal[4, 8] = 4
    """A choice of integers."""
    names: StrList = ()
    """A list of strings."""


class StrictDemoPlugin(ZeroPlugin):
    name = "demo"
    distribution = "test"
    Config = StrictDemoConfig


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        # strings and numbers for a boolean
        *(("flag", v, "the JSON boolean true or false") for v in ("yes", "no", "true", "false", 0, 1)),
        # booleans, strings and floats for an integer; a huge value past the bound
        *(("count", v, r"a JSON integer \(>= 1, <= 64\)") for v in (True, False, "3", 3.0, 10**30)),
        # booleans, strings and non-finite values for a number
        *(
            ("beta", v, r"a finite JSON number \(>= 0.0, <= 1.0\)")
            for v in (True, False, "0.5", float("nan"))
        ),
        # an equal value of another JSON type for a choice of integers
        *(("bits", v, "one of 4, 8") for v in (4.0, 8.0, "4", True)),
        # not strings in a list of strings, or a bare number
        *(("names", v, "a JSON array of strings") for v in ([1], [True], 3)),
    ],
)
def test_lax_values_are_refused_naming_key_and_accepted_values(
    field: str, value: object, accepted: str
) -> None:
    with pytest.raises(ConfigError, match=rf"demo\.{field}(\.\d+)?: .*accepted: {accepted}") as info:
        split_plugin_sections({"demo": {field: value}}, {"demo": StrictDemoPlugin})
    got = value[0] if isinstance(value, list) else value  # an element is named by its index
    assert f"got {got!r}" in str(info.value)


def test_strict_values_accept_json_types() -> None:
    section = {"flag": True, "count": 64, "beta": 1, "bits": 8, "names": ["a", "b"]}
    (plugin,) = split_plugin_sections({"demo": section}, {"demo": StrictDemoPlugin})
    assert plugin.config == StrictDemoConfig(flag=True, count=64, beta=1.0, bits=8, names=("a", "b"))


def test_missing_plugin_names_the_distribution() -> None:
    with pytest.raises(PluginNotInstalledError, match="pip install zerohooks-loco"):
        split_plugin_sections({"loco": {"bits": 4}}, {})


def test_missing_plugin_says_what_to_run_from_a_checkout() -> None:
    with pytest.raises(PluginNotInstalledError, match=r"checkout.*pip install \./packages/nvmeswap \(") as e:
        split_plugin_sections({"nvmeswap": {}}, {})
    assert "once it is published on PyPI" in str(e.value)


@pytest.mark.parametrize(
    "key", ["lcoo", "Loco", "loco ", "LOCO", "nvme_swap", "accum_dtype", "Mixed-Layers", "autocast"]
)
def test_misspelt_or_recased_section_is_refused_with_the_close_match(key: str) -> None:
    # DeepSpeed would ignore such a key without a word and train without the plugin
    cfg = {"train_batch_size": 8, key: {"bits": 4}}
    with pytest.raises(ConfigError, match=rf'"{key}" section.*did you mean "'):
        split_plugin_sections(cfg, {"accumdtype": DemoPlugin})


@pytest.mark.parametrize(
    "key", ["local_rank", "amp", "bf16", "zero_optimization", "my_own_tool", "data_types"]
)
def test_other_top_level_keys_pass_through(key: str) -> None:
    cfg = {key: {"enabled": True}}
    assert split_plugin_sections(cfg, {"accumdtype": DemoPlugin}) == [] and key in cfg


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        ("plugins", "loco"),
        ("zerohooks", "Accum_Dtype"),
        ("zero_optimization", "loco"),
        ("my_tool", "nvme swap"),
    ],
)
def test_plugin_section_nested_one_level_down_is_refused(outer: str, inner: str) -> None:
    # DeepSpeed ignores an unknown top-level key with all it holds: the plugin would silently
    # stay off (found by tests/integration/test_config_property.py)
    cfg = {"train_batch_size": 8, outer: {inner: {"bits": 4}}}
    with pytest.raises(
        ConfigError, match=rf'"{inner}" section under "{outer}".*move it to the top level as "'
    ):
        split_plugin_sections(cfg, {"accumdtype": DemoPlugin})


def test_plugin_like_keys_nested_in_deepspeed_sections_pass_through() -> None:
    # only a plugin's name in another case or spacing counts one level down, not a close match:
    # DeepSpeed's data_types.grad_accum_dtype is no accumdtype section
    cfg = {"data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 2}}
    assert split_plugin_sections(cfg, {"accumdtype": DemoPlugin}) == [] and "data_types" in cfg


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None, "no"])
def test_enabled_must_be_a_json_boolean(value: object) -> None:
    with pytest.raises(ConfigError, match=r'"accumdtype\.enabled" must be the JSON boolean'):
        split_plugin_sections({"accumdtype": {"enabled": value}}, {"accumdtype": DemoPlugin})


def test_section_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match='"accumdtype" section must be a JSON object'):
        split_plugin_sections({"accumdtype": [1, 2]}, {"accumdtype": DemoPlugin})


def test_config_file_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    good = tmp_path / "good.json"
    good.write_text('{"train_batch_size": 2}')
    assert load_config(good) == {"train_batch_size": 2}


def test_unsupported_deepspeed_versions() -> None:
    check_deepspeed_version("0.19.8")
    check_deepspeed_version("0.19.9.dev0+abc")
    # 0.19.0-0.19.7 lack DeepSpeed internals the adapter or plugins use (test_surface.py names them)
    for bad in ("0.18.9", "0.19.0", "0.19.7", "0.20.0", "1.0.0"):
        with pytest.raises(UnsupportedDeepSpeedError, match=rf"DeepSpeed {bad} is installed.*>=0\.19\.8"):
            check_deepspeed_version(bad)


def test_first_use_refuses_unsupported_deepspeed() -> None:
    """The real path: with DeepSpeed reporting an unsupported version, ``import zerohooks`` works
    (the core needs no DeepSpeed) and ``zerohooks.initialize`` / ``zerohooks.enable``, where
    zerohooks first uses DeepSpeed, refuse before changing anything."""
    code = textwrap.dedent(
        """
        import deepspeed
        deepspeed.__version__ = "0.16.4"
        ds_initialize = deepspeed.initialize
        import zerohooks
        for call in (lambda: zerohooks.initialize(model=None), zerohooks.enable):
            try:
                call()
            except zerohooks.UnsupportedDeepSpeedError as e:
                print("REFUSED", e)
        assert deepspeed.initialize is ds_initialize and not zerohooks.enabled()
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    refused = [ln for ln in r.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(refused) == 2, r.stdout
    assert all("DeepSpeed 0.16.4 is installed" in ln and ">=0.19.8" in ln for ln in refused), refused


def test_entry_point_discovery(tmp_path) -> None:
    """A distribution registering a plugin under ``zerohooks.plugins`` is found and enabled by its section."""
    pkg = tmp_path / "zh_fake_plugin.py"
    pkg.write_text(
        textwrap.dedent("""
        from zerohooks import PluginConfig, ZeroPlugin
        class Cfg(PluginConfig):
            level: int = 1
        class Fake(ZeroPlugin):
            name = "fakeplug"
            distribution = "zh-fake"
            Config = Cfg
    """)
    )
    dist = tmp_path / "zh_fake-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zh-fake\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[zerohooks.plugins]\nfakeplug = zh_fake_plugin:Fake\nbrokenplug = zh_no_such_module:Plugin\n"
    )
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from zerohooks.config import available_plugins, split_plugin_sections
        cfg = {{"fakeplug": {{"level": 3}}, "train_batch_size": 2}}
        (p,) = split_plugin_sections(cfg)  # the broken plugin is installed but not used: no error
        try:
            split_plugin_sections({{"brokenplug": {{}}}})
        except Exception as e:
            print("BROKEN:", e)
        print("fakeplug", type(p).__name__, p.config.level, cfg)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "fakeplug Fake 3 {'train_batch_size': 2}" in r.stdout.strip().splitlines()[-1]
    assert "BROKEN: plugin 'brokenplug' (zh_no_such_module:Plugin, from zh-fake) failed to import" in r.stdout


def test_installed_plugins_load_and_are_zero_plugins() -> None:
    for name, cls in available_plugins().items():
        assert issubclass(cls, ZeroPlugin) and cls.name == name
