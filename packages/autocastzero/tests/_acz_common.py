"""The multi-rank scenarios of the autocastzero tests (imported by the spawned ranks too).

Each scenario returns plain data; the test modules assert on it.  Oracles: DeepSpeed's own
``torch_autocast`` (same model, batches and optimizer), plain fp32 training, parameter counts of
the model, and snapshots taken before a step that must be skipped.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerohooks.testing.toy import ds_config, full_params, make_model, train

STAGES = (0, 1, 2, 3)
STEPS, GAS = 3, 2
FP16_SECTION: dict[str, Any] = {
    "dtype": "float16",
    "initial_scale_power": 8,
    "loss_scale_window": 2,
    "hysteresis": 1,
}
"""fp16 settings of the tests: scale 256, doubling after 2 good steps, halving at every overflow."""


def build(stage: int, sections: dict[str, Any] | None = None, **extra: Any) -> Any:
    import zerohooks

    model = make_model()
    cfg = ds_config(stage, "fp32", gas=GAS, sections=sections, **extra)
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def deepspeed_autocast(stage: int, dtype: str = "bfloat16") -> Any:
    """An engine with DeepSpeed's own ``torch_autocast`` (run these last: DeepSpeed keeps a
    process-wide flag once one exists)."""
    import deepspeed

    model = make_model()
    cfg = ds_config(stage, "fp32", gas=GAS, torch_autocast={"enabled": True, "dtype": dtype})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def counted_bytes(engine: Any) -> dict[str, dict[str, int]]:
    import zerohooks

    att = zerohooks.attachment(engine)
    assert att is not None
    return att.counters.total()


def safe_numel(engine: Any) -> tuple[int, int]:
    """(elements of lower-precision-safe parameters, all elements), from the model itself."""
    safe = total = 0
    for module in engine.module.modules():
        for p in module.parameters(recurse=False):
            n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
            total += n
            if isinstance(module, torch.nn.Linear):
                safe += n
    return safe, total


def optimizer_state(engine: Any, stage: int) -> list[torch.Tensor]:
    opt = engine.optimizer if stage == 0 else engine.optimizer.optimizer
    out = []
    for st in opt.state.values():
        out += [v.detach().clone() for v in st.values() if torch.is_tensor(v)]
    return out


def gathered_vs_master(engine: Any) -> list[tuple[str, bool, float, float]]:
    """ZeRO 3: per parameter (name, safe, max |gathered - bf16(master)|, max |gathered - master|)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from autocastzero import autocast_state

    safe = autocast_state(engine).safe
    named = list(engine.module.named_parameters())
    masters = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in named}
    out = []
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        for n, p in named:
            g = p.detach()
            m = masters[n]
            rounded = m.to(torch.bfloat16).to(g.dtype)
            out.append((n, id(p) in safe, float((g - rounded).abs().max()), float((g - m).abs().max())))
    return out


def scenario_bf16(stage: int) -> dict[str, Any]:
    """autocastzero bf16, plain fp32 and (ZeRO 1-3) DeepSpeed torch_autocast: losses and bytes."""
    out: dict[str, Any] = {}
    engine = build(stage, {"autocastzero": {"dtype": "bfloat16"}})
    out["params_fp32"] = all(p.dtype == torch.float32 for p in engine.module.parameters())
    out["losses"] = train(engine, STEPS, GAS)
    out["bytes"] = counted_bytes(engine)
    out["numel"] = safe_numel(engine)
    if stage == 3:
        out["gathered"] = gathered_vs_master(engine)
    import zerohooks

    zerohooks.detach(engine)
    out["detached_forward"] = "forward" in vars(engine)
    fp32 = build(stage)
    out["fp32_losses"] = train(fp32, STEPS, GAS)
    out["fp32_bytes"] = counted_bytes(fp32)
    return out


def scenario_fp16(stage: int) -> dict[str, Any]:
    """fp16 autocast with dynamic scaling; rank 1 injects an inf in the loss of step 2."""
    from autocastzero import autocast_state
    from zerohooks.testing.toy import batch, loss_fn

    rank = int(os.environ.get("RANK", "0"))
    out: dict[str, Any] = {}
    engine = build(stage, {"autocastzero": FP16_SECTION})
    scale = autocast_state(engine).scale
    assert scale is not None
    losses = train(engine, 2, GAS)
    out["scales"] = [scale.scale]
    before_p = full_params(engine, stage)
    before_s = optimizer_state(engine, stage)
    skipped0, global0 = engine.skipped_steps, engine.global_steps
    for m in range(GAS):
        tokens, target = batch(2, m, rank)
        loss = loss_fn(engine, tokens, target)
        if m == GAS - 1 and rank == 1:
            loss = loss * torch.tensor(float("inf"))
        engine.backward(loss)
        engine.step()
    after_p = full_params(engine, stage)
    after_s = optimizer_state(engine, stage)
    out["skip_params_equal"] = len(before_p) == len(after_p) and all(
        torch.equal(a, b) for a, b in zip(before_p, after_p, strict=True)
    )
    out["skip_state_equal"] = len(before_s) == len(after_s) > 0 and all(
        torch.equal(a, b) for a, b in zip(before_s, after_s, strict=True)
    )
    out["skipped"] = engine.skipped_steps - skipped0
    out["global_advanced"] = engine.global_steps - global0
    out["scales"].append(scale.scale)
    losses += train(engine, 4, GAS, first=3)
    after_recovery = full_params(engine, stage)
    out["moved_after"] = any(not torch.equal(a, b) for a, b in zip(after_p, after_recovery, strict=True))
    out["scales"].append(scale.scale)
    out["overflows"] = scale.overflows
    out["losses"] = losses
    fp32 = build(stage)
    ref = train(fp32, 2, GAS)
    # the reference skips nothing: its step 2 is what the fp16 run skipped; compare steps 0-1
    out["fp32_losses"] = ref
    return out


def all_two_rank_scenarios() -> dict[str, Any]:
    """Every 2-rank scenario, in one launch."""
    res: dict[str, Any] = {}
    for stage in STAGES:
        res[f"bf16_z{stage}"] = scenario_bf16(stage)
    for stage in STAGES:
        res[f"fp16_z{stage}"] = scenario_fp16(stage)
    # DeepSpeed's own torch_autocast last: it sets process-wide flags
    for stage in (1, 2, 3):
        engine = deepspeed_autocast(stage)
        res[f"ds_z{stage}"] = {"losses": train(engine, STEPS, GAS)}
    return res
