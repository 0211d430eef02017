"""autocastzero composed with loco: bf16 autocast with fp32 parameters, 4-bit gradient reduction.

autocastzero chooses each gradient's communication dtype (bf16 for Linear layers, fp32 for the
rest); loco owns the collective and receives the gradients in those dtypes.  Oracles: the same
training with autocastzero alone (loco's 4-bit error-feedback reduction must stay close to it),
and the model's own parameter counts for the dtypes handed to the collective.  With float16
autocast, a step skipped by autocastzero's loss scaler must leave loco's error buffers as they were
before the step (rescaled to the backed-off loss scale), as DeepSpeed's own fp16 mode does.
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


def _fp16_skip_scenario() -> dict[str, Any]:
    import os

    import torch

    import zerohooks
    from zerohooks.testing.toy import batch, ds_config, loss_fn, make_model, train

    rank = int(os.environ["RANK"])
    model = make_model()
    auto = {"dtype": "float16", "initial_scale_power": 8, "hysteresis": 1}  # first overflow halves
    sections = {"autocastzero": auto, "loco": {"exact_below": 0}}
    cfg = ds_config(2, "fp32", gas=GAS, sections=sections)
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    att = zerohooks.attachment(engine)
    assert att is not None
    (loco,) = [p for p in att.plugins if p.name == "loco"]
    train(engine, 2, GAS)
    # plain lists: tensors would cross the process boundary through shared memory
    before = {k: (b.data.tolist(), b.scale.tolist()) for k, b in loco.state.buffers.items()}
    scale_before, skipped_before = loco.state.loss_scale, engine.skipped_steps
    for m in range(GAS):  # step 2: rank 1's last micro-step loss is inf
        tokens, target = batch(2, m, rank)
        loss = loss_fn(engine, tokens, target)
        if m == GAS - 1 and rank == 1:
            loss = loss * torch.tensor(float("inf"))
        engine.backward(loss)
        engine.step()
    after = {k: (b.data.tolist(), b.scale.tolist()) for k, b in loco.state.buffers.items()}
    scale_after = loco.state.loss_scale
    later = train(engine, 2, GAS, first=3)
    return {
        "skipped": engine.skipped_steps - skipped_before,
        "scales": (scale_before, scale_after),
        "before": before,
        "after": after,
        "later": later,
    }


def test_fp16_skip_restores_loco_error_buffers() -> None:
    for rank in run_distributed(_fp16_skip_scenario, 2, timeout=600):
        assert rank["skipped"] == 1
        old, new = rank["scales"]
        assert new == old / 2, rank["scales"]  # dynamic scaling backed off
        before, after = rank["before"], rank["after"]
        assert before and set(after) == set(before), "loco's error buffers were dropped on the skip"
        for key, (data, scale) in before.items():
            assert after[key][0] == data, key
            assert after[key][1] == [v * (new / old) for v in scale], key
        assert all(math.isfinite(v) for v in rank["later"])
