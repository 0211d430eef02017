"""The ``"loco"`` section's bounds and the DeepSpeed settings loco refuses, raised by
``zerohooks.initialize`` before DeepSpeed builds anything, naming the key, the value and what is
accepted."""

from __future__ import annotations

from typing import Any

import pytest

import zerohooks
from loco import LocoConfig
from zerohooks import ConfigError
from zerohooks.testing.toy import ds_config, make_model


def _init(cfg: dict[str, Any]) -> None:
    model = make_model()
    zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        # issue #33: reset_T = 10**30 was accepted silently
        ({"reset_T": 10**30}, r"loco\.reset_T: .*got 1000000000000000000000000000000.*<= 2147483647"),
        ({"reset_T": 2**31}, r"loco\.reset_T: .*\(>= 0, <= 2147483647\)"),
        ({"exact_below": 2**48 + 1}, r"loco\.exact_below: .*<= 281474976710656"),
        ({"node_size": 2**16 + 1}, r"loco\.node_size: .*<= 65536"),
    ],
)
def test_values_past_a_bound_are_refused(section: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _init(ds_config(1, sections={"loco": section}))


def test_bounds_themselves_are_accepted() -> None:
    cfg = LocoConfig.model_validate({"reset_T": 2**31 - 1, "exact_below": 2**48, "node_size": 2**16})
    assert (cfg.reset_T, cfg.exact_below, cfg.node_size) == (2**31 - 1, 2**48, 2**16)
