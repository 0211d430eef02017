"""fp16 models, and the lossy combinations run on purpose (``allow_lossy``), on 2 ranks.

Measured in the folder's one 2-rank launch (``conftest.two_ranks``), where DeepSpeed's CPU
accelerator is told to accept fp16.

* fp16 model, fp32 accumulation: within 1e-7 of the float64 oracle on ZeRO 0-3 (fp16 has more
  mantissa than bf16; the reduced gradients still carry DeepSpeed's static loss scale of 128,
  except on ZeRO 0, where DeepSpeed 0.19.8 does not scale the loss at all).
* fp32 model accumulating in bf16 with ``allow_lossy``: it runs, and its error is reported: it
  must be far from fp32 accuracy (about 8e-3 at 64 micro-steps).  On ZeRO 2 DeepSpeed keeps a
  separate accumulation buffer only in fp32, so it accumulates in fp32 there and only the bf16
  reduction loses precision; accumdtype warns about it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
from _accum_common import Probe, ds_config, grad_scale, make_model, micro_step, reference_grads, rel_error

import zerohooks


def _run(stage: int, model_dtype: str, gas: int, accum: dict[str, Any]) -> dict[str, Any]:
    probe = Probe()
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zerohooks.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=ds_config(stage, model_dtype, False, gas, accum=accum),
            plugins=[probe],
        )
    for m in range(gas):
        micro_step(engine, 0, m)
    world = int(os.environ["WORLD_SIZE"])
    ref = reference_grads(model_dtype, gas, world, scale=grad_scale(model_dtype, stage))
    return {
        "rel": rel_error(probe.grads[0], ref),
        "dtypes": sorted(str(d) for d in probe.dtypes),
        "warnings": [str(w.message) for w in caught if "accumdtype" in str(w.message)],
    }


def measure() -> dict[Any, Any]:
    """Run on every rank (by conftest.two_ranks)."""
    out: dict[Any, Any] = {}
    for stage in range(4):
        out[("fp16", stage)] = _run(stage, "fp16", 16, {"dtype": "fp32"})
        out[("lossy", stage)] = _run(stage, "fp32", 64, {"dtype": "bf16", "allow_lossy": True})
    return out


@pytest.fixture(scope="module")
def measured(two_ranks: list[dict[str, Any]]) -> list[dict[Any, Any]]:
    return [r["fp16_lossy"] for r in two_ranks]


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_model_fp32_accumulation(measured: list[dict[Any, Any]], stage: int) -> None:
    for res in measured:
        r = res[("fp16", stage)]
        print(f"ZeRO {stage}, fp16 model, 16 micro-steps: fp32 accumulation relative error {r['rel']:.3g}")
        assert r["rel"] <= 1e-7 and r["dtypes"] == ["torch.float32"], r


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_allowed_lossy_runs_and_its_error_is_reported(measured: list[dict[Any, Any]], stage: int) -> None:
    r0 = measured[0][("lossy", stage)]
    print(f"ZeRO {stage}, fp32 model, bf16 accumulation and reduction, 64 micro-steps: {r0['rel']:.3g}")
    for res in measured:
        assert res[("lossy", stage)]["rel"] > 1e-4, res[("lossy", stage)]
    if stage == 2:
        assert any("ZeRO 2" in w for w in r0["warnings"]), r0["warnings"]
    else:
        assert not r0["warnings"], r0["warnings"]
