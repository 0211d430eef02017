"""With no plugin section, zerohooks.initialize trains bit-for-bit like deepspeed.initialize."""

from __future__ import annotations

import itertools

import deepspeed
import pytest
import torch

import zerohooks
from zerohooks.testing import distributed
from zerohooks.testing.toy import ds_config, full_params, make_model, train

CASES = [
    (stage, dtype, offload)
    for stage, dtype, offload in itertools.product((0, 1, 2, 3), ("fp32", "bf16", "fp16"), (False, True))
    if not (offload and stage == 0)
]


def _run(init, stage: int, dtype: str, offload: bool) -> tuple[list[float], list[torch.Tensor], dict]:
    model = make_model()
    engine, *_ = init(
        model=model, model_parameters=model.parameters(), config=ds_config(stage, dtype, offload)
    )
    losses = train(engine, steps=3, gas=2)
    att = zerohooks.attachment(engine)
    counted = att.counters.total() if att else {}
    return losses, full_params(engine, stage), counted


@pytest.mark.multirank
@distributed(world_size=2, fp16_on_cpu=True, timeout=600)
def test_no_plugins_is_bit_identical_to_deepspeed() -> None:
    failures = []
    for stage, dtype, offload in CASES:
        ref_losses, ref_params, _ = _run(deepspeed.initialize, stage, dtype, offload)
        losses, params, counted = _run(zerohooks.initialize, stage, dtype, offload)
        case = f"stage={stage} dtype={dtype} offload={offload}"
        if losses != ref_losses:
            failures.append(f"{case}: losses differ {losses} vs {ref_losses}")
        if len(params) != len(ref_params) or not all(
            torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)
        ):
            failures.append(f"{case}: parameters differ")
        if not counted:
            failures.append(f"{case}: no collective bytes were counted")
    assert not failures, "\n".join(failures)
