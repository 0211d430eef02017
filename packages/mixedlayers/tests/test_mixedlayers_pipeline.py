"""mixedlayers on a DeepSpeed pipeline (``PipelineModule``, 2 stages, ZeRO 1).

The kept LayerNorm lives on the first stage only, so the stages hold 2 and 1 param groups, the
case where DeepSpeed's ZeRO 1 all-reduced the gradient norm over the stages once per group and
the first step hung; zerohooks' ``stage_norm`` seam reduces it once a step.  Oracles: the stages'
own parameters (fp32 where kept, nowhere else), the plain bf16 pipeline's losses (the fp32
LayerNorm moves them by bf16 rounding of that layer only), and a selection that matches on no
stage, refused on every rank instead of hanging or passing silently.
"""

from __future__ import annotations

from typing import Any

from _mixed_common import STEPS

TOLERANCE = 5e-3
"""An fp32 LayerNorm in the bf16 toy pipeline: its losses within 5e-3 of the all-bf16 run's
(measured 8e-4)."""


def test_the_kept_layer_trains_in_fp32_on_its_stage(two_ranks: list[dict[str, Any]]) -> None:
    runs = [rank["pipeline"] for rank in two_ranks]
    assert sorted(run["kept"]["stage"] for run in runs) == [0, 1]
    for run in runs:
        kept, bf16 = run["kept"], run["bf16"]
        first = kept["stage"] == 0
        assert kept["fp32"] == (["2.bias", "2.weight"] if first else []), kept
        assert kept["groups"] == (2 if first else 1) and bf16["groups"] == 1, (kept, bf16)
        assert kept["stage_norm"] and not bf16["stage_norm"]
        assert len(kept["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(kept["losses"], bf16["losses"], strict=True)) <= TOLERANCE
        assert kept["losses"] != bf16["losses"]  # the fp32 layer shows


def test_a_selection_matching_no_stage_is_refused_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        message = rank["pipeline"]["nowhere"]
        assert message is not None, "a selection matching no stage was accepted"
        assert "torch.nn.Conv2d" in message and "matches no module" in message, message
