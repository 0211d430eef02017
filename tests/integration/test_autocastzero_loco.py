"""autocastzero composed with loco: bf16 autocast with fp32 parameters, 4-bit gradient reduction.

autocastzero chooses each gradient's communication dtype (bf16 for Linear layers, fp32 for the
rest); loco owns the collective and receives the gradients in those dtypes.  Oracles: the same
training with autocastzero alone (loco's 4-bit error-feedback reduction must stay close to it),
and the model's own parameter counts for the dtypes handed to the collective.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from zerohooks.testing import run_distributed

pytestmark = pytest.mark.multirank

STEPS, GAS = 4, 2
REL = 5e-2
"""4-bit codes with error feedback perturb each step's update by a few percent of the gradient;
over 8 micro-steps of the tiny model the losses stay within 5% of the unquantized run."""


def _scenario() -> dict[str, Any]:
    import torch

    import zerohooks
    from zerohooks.testing.toy import ds_config, make_model, train

    out: dict[str, Any] = {}
    for stage in (2, 3):
        for name, sections in (
            ("alone", {"autocastzero": {"dtype": "bfloat16"}}),
            ("loco", {"autocastzero": {"dtype": "bfloat16"}, "loco": {"exact_below": 0}}),
        ):
            model = make_model()
            cfg = ds_config(stage, "fp32", gas=GAS, sections=sections)
            engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            losses = train(engine, STEPS, GAS)
            att = zerohooks.attachment(engine)
            assert att is not None
            safe = sum(
                p.numel()
                for m in model.modules()
                if isinstance(m, torch.nn.Linear)
                for p in m.parameters(recurse=False)
            )
            total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
            if stage == 3:
                safe = sum(
                    p.ds_numel
                    for m in model.modules()
                    if isinstance(m, torch.nn.Linear)
                    for p in m.parameters(recurse=False)
                )
            out[f"z{stage}_{name}"] = {
                "losses": losses,
                "bytes": att.counters.total(),
                "numel": (safe, total),
                "reducer": att.registry.reducer.name,
            }
    return out


def test_autocastzero_with_loco() -> None:
    for rank in run_distributed(_scenario, 2, timeout=600):
        for stage in (2, 3):
            alone, loco = rank[f"z{stage}_alone"], rank[f"z{stage}_loco"]
            assert loco["reducer"] == "loco" and alone["reducer"] is None
            assert all(math.isfinite(v) for v in loco["losses"])
            assert loco["losses"] != alone["losses"]  # loco did quantize
            for a, b in zip(loco["losses"], alone["losses"], strict=True):
                assert math.isclose(a, b, rel_tol=REL), (stage, a, b)
            # loco got the safe modules' gradients in bf16, the rest in fp32, like autocastzero alone
            safe, total = loco["numel"]
            (per_dtype,) = loco["bytes"].values()
            k = per_dtype["bfloat16"] // (2 * safe)
            assert k >= 1 and per_dtype["bfloat16"] == k * 2 * safe
            assert per_dtype["float32"] == k * 4 * (total - safe)
            assert loco["bytes"] == alone["bytes"]
