"""``zerohooks.adapter.stagenorm``: ZeRO 1/2's gradient norm reduced over a pipeline's stages once
a step instead of once per param group.

The oracle is DeepSpeed's own norm on the same 2-stage pipeline (one param group a stage, where
DeepSpeed's per-group reduction does not hang): with the reduction moved, every step's global
gradient norm is DeepSpeed's to rounding, and with clipping (the norm decides every update) the
losses follow.  A stage norm left unreduced (each stage its own norm) fails it: the two stages'
norms differ by far more.  The plugin case that hung without it (stages with 2 and 1 param
groups: mixedlayers' fp32 LayerNorm on the first stage) is the compatibility matrix's pipeline
rows (``tests/integration/test_compat_matrix.py``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import zerohooks
from zerohooks.adapter import stagenorm
from zerohooks.testing import run_distributed
from zerohooks.testing.toy import batch, ds_config, make_model, pipeline_layers, train

GAS, STEPS, CLIP = 2, 3, 0.05


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), target)


def _pipeline(install: bool) -> dict[str, Any]:
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(
        layers=pipeline_layers(make_model(mult=4)), num_stages=2, loss_fn=_loss, partition_method="uniform"
    )
    cfg = ds_config(1, "bf16", gas=GAS, lr=0.5, gradient_clipping=CLIP, train_batch_size=4 * GAS)
    engine, *_ = zerohooks.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    att = zerohooks.attachment(engine)
    assert att is not None
    installed = stagenorm.install(att) if install else False
    patched = "scaled_global_norm" in vars(engine.optimizer)
    losses, norms = [], []
    for s in range(STEPS):
        losses.append(float(engine.train_batch(iter([batch(s, m, 0) for m in range(GAS)]))))
        norms.append(float(engine.get_global_grad_norm()))
    zerohooks.detach(engine)
    return {
        "installed": installed,
        "patched": patched,
        "undone": "scaled_global_norm" not in vars(engine.optimizer),
        "losses": losses,
        "norms": norms,
        "stage": engine.stage_id,
    }


def _run() -> dict[str, Any]:
    # a plain engine first: after a pipeline engine DeepSpeed's process-wide groups are the pipeline's
    model = make_model()
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=list(model.parameters()), config=ds_config(1, "bf16")
    )
    att = zerohooks.attachment(engine)
    assert att is not None
    plain = stagenorm.install(att)
    train(engine, 1, 2)
    zerohooks.detach(engine)
    return {"plain": plain, "deepspeed": _pipeline(False), "ours": _pipeline(True)}


@pytest.mark.multirank
def test_norm_over_the_stages_is_deepspeeds() -> None:
    ranks = run_distributed(_run, 2)
    assert sorted(r["ours"]["stage"] for r in ranks) == [0, 1]
    for rank in ranks:
        ours, theirs = rank["ours"], rank["deepspeed"]
        assert rank["plain"] is False  # no model-parallel group: nothing installed
        assert ours["installed"] and ours["patched"] and ours["undone"], ours
        assert not theirs["patched"], theirs
        for a, b in zip(ours["norms"], theirs["norms"], strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (ours["norms"], theirs["norms"])
        # the norms are above the clipping limit: they set every update's size
        assert min(theirs["norms"]) > 2 * CLIP, theirs["norms"]
        assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)) <= 1e-3
    # both stages report the one global norm
    assert ranks[0]["ours"]["norms"] == ranks[1]["ours"]["norms"]
