"""mixedlayers keeping a DeepSpeed MoE router in fp32 inside a bf16 model (ZeRO 1 and 2, two
experts, one per rank).

DeepSpeed's gate computes its logits in fp32 from ``wg.weight.float()``: in a bf16 model that is
the bf16 copy of the weight, rounded. Kept in fp32 the router computes with its fp32 master
itself. Oracles: DeepSpeed's own fp32 master of the router weight, the router's element count
for the bytes reduced in fp32, and the same model without mixedlayers for the losses.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from _mixed_common import GAS, STEPS

REL = 2e-3
"""Keeping one 2 x 96 router in fp32 moves the tiny model's losses by bf16 rounding of that
layer only: within 0.2% of the bf16 run over 6 micro-steps."""


@pytest.mark.parametrize("stage", [1, 2])
def test_the_router_computes_with_its_fp32_master(two_ranks: list[dict[str, Any]], stage: int) -> None:
    for rank in two_ranks:
        run = rank["moe_router"][f"z{stage}"]
        bf16, kept = run["bf16"], run["router_fp32"]
        # without mixedlayers the router weight is the master rounded to bf16; kept, it is the master
        assert bf16["dtype"] == "bfloat16" and kept["dtype"] == "float32"
        assert not np.array_equal(bf16["weight"], bf16["master"])
        assert np.array_equal(kept["weight"], kept["master"])
        # the router's gradient is reduced in fp32, everything else in bf16 as before
        (got,) = kept["bytes"].values()
        (ref,) = bf16["bytes"].values()
        numel = kept["router_numel"]
        reductions = STEPS * (
            GAS if stage == 2 else 1
        )  # ZeRO 2 reduces every micro-step, ZeRO 1 at the boundary
        assert got["float32"] == 4 * numel * reductions, got
        assert "float32" not in ref
        assert got["bfloat16"] == ref["bfloat16"] - 2 * numel * reductions
        for a, b in zip(kept["losses"], bf16["losses"], strict=True):
            assert math.isfinite(a) and abs(a - b) <= REL * abs(b), (kept["losses"], bf16["losses"])
