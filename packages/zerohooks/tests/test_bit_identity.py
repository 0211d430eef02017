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


def _run(
    init, stage: int, dtype: str, offload: bool = False, plugins: list | None = None, **extra
) -> tuple[list[float], list[torch.Tensor], dict]:
    model = make_model()
    kwargs = {} if plugins is None else {"plugins": plugins}
    engine, *_ = init(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(stage, dtype, offload, **extra),
        **kwargs,
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


@pytest.mark.multirank
@distributed(world_size=2, fp16_on_cpu=True, timeout=600)
def test_zero0_hooks_that_change_nothing_are_bit_identical_to_deepspeed() -> None:
    """ZeRO 0 with reduce_dtype / reduce_tensor hooks that change nothing (so zerohooks, not
    DeepSpeed, flattens and reduces each bucket, and DeepSpeed copies the result back), with and
    without a plugin owning the all-reduce (an exact one): bit for bit DeepSpeed's training, in
    each model dtype and with gradients communicated in bf16."""
    from zerohooks.testing.recording import RecordingConfig, RecordingPlugin

    failures = []
    for dtype, comm in (("fp32", None), ("bf16", None), ("fp16", None), ("fp32", "bf16")):
        extra = {} if comm is None else {"communication_data_type": comm}
        ref_losses, ref_params, _ = _run(deepspeed.initialize, 0, dtype, **extra)
        for own in (False, True):
            plugin = RecordingPlugin(RecordingConfig(own_reducer=own, keep_grads=False))
            losses, params, _ = _run(zerohooks.initialize, 0, dtype, plugins=[plugin], **extra)
            case = f"dtype={dtype} communication_data_type={comm} owned={own}"
            if losses != ref_losses:
                failures.append(f"{case}: losses differ {losses} vs {ref_losses}")
            if not all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)):
                failures.append(f"{case}: parameters differ")
    assert not failures, "\n".join(failures)
