"""fp16 autocast with the plugin's dynamic loss scaling, ZeRO 0-3 (2 ranks).

Rank 1 multiplies one micro-step loss by inf at step 2.  Oracles: snapshots of the parameters and
optimizer state before that step, DeepSpeed's own fp16 ``DynamicLossScaler`` fed the same overflow
sequence, plain fp32 training, and an uninterrupted run for the checkpoint resume.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytestmark = pytest.mark.multirank

STAGES = [0, 1, 2, 3]
FP16_REL = 5e-3
"""fp16 keeps 11 significant bits (relative rounding 2**-12); losses of the first steps move by
about 1e-4 relative to fp32."""


@pytest.mark.parametrize("stage", STAGES)
def test_overflow_skips_step_and_leaves_state_untouched(two_ranks: list[dict[str, Any]], stage: int) -> None:
    for rank in two_ranks:
        res = rank[f"fp16_z{stage}"]
        assert res["skipped"] == 1  # counted by DeepSpeed as skipped ...
        assert res["global_advanced"] == 1  # ... and as a step
        assert res["skip_params_equal"]  # parameters (and fp32 masters) bit-identical
        assert res["skip_state_equal"]  # Adam moments and step counts bit-identical
        assert res["overflows"] == 1


@pytest.mark.parametrize("stage", STAGES)
def test_scale_backs_off_and_grows_like_deepspeed(two_ranks: list[dict[str, Any]], stage: int) -> None:
    for rank in two_ranks:
        res = rank[f"fp16_z{stage}"]
        assert res["scales"] == res["oracle_scales"]
        assert res["scales"][1] == res["scales"][0] / 2  # backed off
        assert res["scales"][2] > res["scales"][1]  # grew again


@pytest.mark.parametrize("stage", STAGES)
def test_training_recovers(two_ranks: list[dict[str, Any]], stage: int) -> None:
    for rank in two_ranks:
        res = rank[f"fp16_z{stage}"]
        assert res["moved_after"]
        assert all(math.isfinite(v) for i, v in enumerate(res["losses"]))
        for a, b in zip(res["losses"][:4], res["fp32_losses"], strict=True):
            assert math.isclose(a, b, rel_tol=FP16_REL), (stage, a, b)


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_resume_is_exact(two_ranks: list[dict[str, Any]], stage: int) -> None:
    for rank in two_ranks:
        res = rank[f"resume_z{stage}"]
        assert res["scale_loaded"] == res["scale_at_save"]
        assert res["resumed"] == res["straight"]
        assert res["final_scales"][0] == res["final_scales"][1]


def test_scale_rule_is_deepspeeds_on_random_overflows(two_ranks: list[dict[str, Any]]) -> None:
    for window, hysteresis, first_diff in two_ranks[0]["scale_rule"]:
        assert first_diff == -1, f"window {window}, hysteresis {hysteresis}: differs at step {first_diff}"


@pytest.mark.parametrize("stage", STAGES)
def test_detach_restores_deepspeeds_scaler_slots(two_ranks: list[dict[str, Any]], stage: int) -> None:
    for rank in two_ranks:
        checks = rank[f"fp16_z{stage}"]["detached"]
        assert checks and all(checks.values()), checks


def test_a_run_that_skips_every_step_is_reported_once(two_ranks: list[dict[str, Any]]) -> None:
    """It used to skip forever without a word; rank 0 now warns when STUCK_STEPS consecutive steps
    were skipped at min_loss_scale (the 12th step: 2 back-off steps first), and only then."""
    from autocastzero.scaling import STUCK_STEPS

    for rank, res in enumerate(two_ranks):
        r = res["always_overflows"]
        assert r["skipped"] == r["steps"] and r["scale"] == 1.0
        if rank:
            assert r["warned"] == []
            continue
        ((step, text),) = r["warned"]
        assert step == 2 + STUCK_STEPS - 1
        assert f"the last {2 + STUCK_STEPS} optimizer steps were all skipped" in text, text
        assert "the loss scale is 1 " in text and "min_loss_scale 1" in text and "inf/nan" in text, text
