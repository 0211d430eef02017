"""mixedlayers under real 2-rank DeepSpeed training, ZeRO 0-3, bf16 and fp16, CPU offload.

The scenarios run in the folder's one 2-rank launch (``conftest.two_ranks``, see
``_mixed_common``); each test asserts on one aspect of every case:

* the kept parameters are fp32 after init, after training and after a checkpoint round trip,
  the others in the training dtype;
* their fp32 masters start from the exact fp32 initial values (no 16-bit round trip);
* their gradients at the first boundary equal a plain-torch fp32 reference to fp32 rounding
  (a 16-bit reduction or accumulation would be off by about 2**-8);
* the loss tracks an all-fp32 run of the same stage;
* a run resumed from a checkpoint continues as the uninterrupted run did, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _mixed_common import CASES, KEPT, case_name

pytestmark = pytest.mark.multirank

NAMES = [case_name(*c) for c in CASES]


def _cases(two_ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in two_ranks]


def _expected_dtypes(name: str) -> dict[str, str]:
    low = "bfloat16" if "bf16" in name else "float16"
    params = ("emb.weight", "fc1.weight", "fc1.bias", *KEPT)
    return {n: "float32" if n in KEPT else low for n in params}


@pytest.mark.parametrize("name", NAMES)
def test_kept_parameters_stay_fp32(two_ranks: list[dict[str, Any]], name: str) -> None:
    expected = _expected_dtypes(name)
    for res in _cases(two_ranks, name):
        assert res["dtypes_init"] == expected
        assert res["dtypes_trained"] == expected
        assert res["dtypes_loaded"] == expected


@pytest.mark.parametrize("name", NAMES)
def test_masters_start_from_exact_fp32_values(two_ranks: list[dict[str, Any]], name: str) -> None:
    for res in _cases(two_ranks, name):
        assert res["masters_init_exact"] == dict.fromkeys(KEPT, True)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_fp32_reference(two_ranks: list[dict[str, Any]], name: str) -> None:
    for res in _cases(two_ranks, name):
        grads, ref = res["grads"], res["ref_grads"]
        assert set(grads) == set(KEPT)
        for n in KEPT:
            g, r = torch.as_tensor(grads[n]), torch.as_tensor(ref[n])
            # fp16: the boundary gradient carries DeepSpeed's loss scale (256) or not, depending on
            # the optimizer wrapper; a power of two rescales exactly, so divide it out.
            scale = 2.0 ** round(torch.log2((g * r).sum() / (r * r).sum()).item())
            assert scale in ((1.0,) if "bf16" in name else (1.0, 1 / 256)), scale
            err = (g / scale - r).abs().max().item() / r.abs().max().item()
            # fp32 accumulation and reduction of 4 terms: a few fp32 ulps (2**-23 ~ 1.2e-7)
            assert err < 2e-6, f"{name} {n}: relative error {err:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_loss_tracks_fp32_run(two_ranks: list[dict[str, Any]], name: str) -> None:
    for res in _cases(two_ranks, name):
        mixed, fp32 = torch.tensor(res["losses"]), torch.tensor(res["fp32_losses"])
        assert torch.isfinite(mixed).all()
        # The 16-bit embedding and fc1 round activations (bf16 keeps 8 bits): the losses agree
        # to a few 1e-3; a model that stopped training or updated wrongly drifts by 1e-1.
        assert (mixed - fp32).abs().max().item() < 3e-2, (mixed.tolist(), fp32.tolist())


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip(two_ranks: list[dict[str, Any]], name: str) -> None:
    for res in _cases(two_ranks, name):
        assert all(res["masters_loaded_equal"].values()), res["masters_loaded_equal"]
        uninterrupted, resumed = res["resumed_losses"]
        assert resumed == uninterrupted


def test_optimizers_are_deepspeeds(two_ranks: list[dict[str, Any]]) -> None:
    """Each stage keeps DeepSpeed's own optimizer wrapper (nothing is replaced)."""
    for name in NAMES:
        expected = {
            "0": "FP16_UnfusedOptimizer",
            "1": "DeepSpeedZeroOptimizer",
            "2": "DeepSpeedZeroOptimizer",
            "3": "DeepSpeedZeroOptimizer_Stage3",
        }[name[1]]
        assert _cases(two_ranks, name)[0]["optimizer"] == expected


def test_detach_removes_boundary_casts(two_ranks: list[dict[str, Any]]) -> None:
    for res in _cases(two_ranks, "detach"):
        # Attached: the LayerNorm receives fp32; detached: the bf16 activation reaches it as is
        # and torch refuses the mixed LayerNorm.
        assert res["seen"][0] == "float32"
        assert res["hooks"][0] - res["hooks"][1] == 2  # the entry and exit casts
        assert not res["to_shadowed"]
        assert res["seen"][-1] == "float64", "the forward should fail without the casts"
        assert res["seen"][-2] == "bfloat16", "after detach the LayerNorm gets the bf16 activation as is"
        assert res["error"]
        assert res["kept_modules"] == ["fc2", "norm"]
        assert res["staging_patch"] == (True, True)  # ZeRO 2's setup_buckets, patched then restored
        assert res["state_after_detach"]
        z3 = res["z3_retype"]  # ZeRO 3: the partition retype is undone too
        assert z3["kept"] > 0 and "float32" in z3["attached"] and "bfloat16" in z3["attached"]
        assert z3["after"] == ["bfloat16"] * len(z3["after"])
        assert z3["rounded"], "DeepSpeed's bf16 partitions should hold the trained fp32 values, rounded"
        assert z3["in_flat"], "each partition should be a view of DeepSpeed's flat buffer again"


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_kept_parameters(two_ranks: list[dict[str, Any]], stage: int) -> None:
    for res in _cases(two_ranks, "frozen"):
        r = res[f"z{stage}"]
        assert r["dtypes"] == _expected_dtypes("bf16")
        assert r["norm_unchanged"] == {"norm.weight": True, "norm.bias": True}
        assert torch.isfinite(torch.tensor(r["losses"])).all()


def test_client_optimizer_object_is_split(two_ranks: list[dict[str, Any]]) -> None:
    for res in _cases(two_ranks, "client_optimizer"):
        assert res["groups"] == 2
        assert res["dtypes"] == _expected_dtypes("bf16")
        assert torch.isfinite(torch.tensor(res["losses"])).all()


@pytest.mark.parametrize("stage", [2, 3])
def test_second_initialize_on_the_same_model_is_refused(two_ranks: list[dict[str, Any]], stage: int) -> None:
    """It crashed inside DeepSpeed at the first backward (ZeRO 2) or was refused as a zero.Init
    model (ZeRO 3); now it is refused for what it is, before anything changes."""
    for res in _cases(two_ranks, "reinit"):
        r = res[f"z{stage}"]
        assert r["error"].startswith(
            "ConfigError: mixedlayers: this model was already prepared by mixedlayers for another engine"
        ), r["error"]
        assert "Build a new model object" in r["error"] and "zero.Init" not in r["error"]
        assert r["losses"] == r["reference"]  # the first engine trains on untouched
