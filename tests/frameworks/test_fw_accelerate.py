"""zerohooks under accelerate: ``zerohooks.enable()`` before ``accelerator.prepare(...)``, plugin
sections in ``DeepSpeedPlugin(hf_ds_config=<dict>)``, accelerate's own accumulation loop
(``accelerator.accumulate`` / ``accelerator.backward``), 2 gloo ranks on CPU."""

from __future__ import annotations

from typing import Any

import pytest
from _plugin_checks import CHECKS
from conftest import scenario

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

PLUGINS = ["plain", "loco", "accumdtype", "autocastzero", "mixedlayers", "nvmeswap"]


@pytest.mark.parametrize("name", PLUGINS)
def test_plugin_attached_and_effective(accelerate_runs: list[dict[str, Any]], name: str) -> None:
    for rank in scenario(accelerate_runs, name):
        CHECKS[name](rank)


def test_save_state_load_state_at_odd_step_is_bit_exact(accelerate_runs: list[dict[str, Any]]) -> None:
    """gas 2, accumdtype + loco, ``save_state`` after optimizer step 3 of 5, ``load_state`` in a
    fresh Accelerator and engine: steps 4-5 bit for bit the uninterrupted run's, and both equal
    ``zerohooks.initialize`` with a plain DeepSpeed loop."""
    from _accelerate_scenarios import RESUME_STEPS, SAVE_AT
    from _frameworks_common import GAS

    for rank in scenario(accelerate_runs, "resume"):
        full, resumed, hand = rank["full"], rank["resumed"], rank["hand"]
        assert sorted(full["plugins"]) == ["accumdtype", "loco"]
        assert len(full["losses"]) == RESUME_STEPS * GAS
        assert resumed["losses"] == full["losses"][SAVE_AT * GAS :]
        assert resumed["params"] == full["params"]
        assert hand["losses"] == full["losses"] and hand["params"] == full["params"]
        assert any("zerohooks_state_rank" in f for f in rank["layout"]), rank["layout"]


def test_plugin_sections_without_enable(accelerate_runs: list[dict[str, Any]]) -> None:
    """Documents today's behaviour: without enable() the sections are silently ignored."""
    for rank in scenario(accelerate_runs, "no_enable"):
        assert not rank["attached"]
        assert rank["sections_in_engine_config"] == ["accumdtype", "loco"]
