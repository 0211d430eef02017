"""Training with accumdtype on 2 ranks: against DeepSpeed's built-in, checkpoints, no-ops, detach.

The scenarios run in the folder's one 2-rank launch (``conftest.two_ranks``) and return what they
saw; the tests below assert on it.

**Against DeepSpeed's own ``data_types.grad_accum_dtype``** (bf16 model, fp32 accumulation, fp32
reduction, ZeRO 1 and 2, with and without CPU offload).  DeepSpeed runs with
``grad_accum_dtype: fp32`` and ``communication_data_type: fp32`` (the configuration that
measured accurate); accumdtype runs with ``{"dtype": "fp32"}`` only.

* ZeRO 2, and ZeRO 1 with offload: accumdtype hands the same dtypes to the same DeepSpeed code
  (it sets ``grad_accum_dtype`` and chooses the fp32 reduction per parameter): losses and
  parameters must agree bit for bit.
* ZeRO 1 without offload: DeepSpeed swaps in its BF16_Optimizer for this combination, which
  zerohooks cannot attach to; accumdtype keeps DeepSpeedZeroOptimizer and switches on its fp32
  accumulation attribute.  Both sum the same bf16 micro-step gradients in fp32 and reduce in
  fp32 but in different orders (BF16_Optimizer all-reduces one flat buffer, ZeRO 1 reduces
  buckets to the owning rank), so the reduced gradients differ by fp32 roundings (about 1e-8
  relative).  Adam turns that into update differences of the same relative size, so the fp32
  master weights must agree to 1e-6 relative of each tensor's largest element (about 8 fp32
  ulps; measured: about 1e-8).  The bf16 weights are the masters rounded to bf16: a master
  within that distance of a rounding boundary rounds the other way, so they may differ by one
  bf16 ulp (2**-8 relative, bf16 keeps 8 significant bits), never more; the losses, computed
  from the bf16 weights, must agree to 1e-2 relative.
"""

from __future__ import annotations

import os
from typing import Any

import deepspeed
import pytest
import torch
from _accum_common import ds_config, full_params, make_model, micro_step, reference_grads, rel_error, train

import zerohooks
from accumdtype import AccumDtypePlugin, MidWindowCheckpointError
from zerohooks.adapter import attach
from zerohooks.dsconfig import setup_context
from zerohooks.registry import HookRegistry

STEPS, GAS = 3, 4


def _ours(stage: int, model_dtype: str, offload: bool, seed: int = 0, **accum: Any) -> Any:
    """An engine with accumdtype (the section's keys as keyword arguments)."""
    model = make_model(seed)
    engine, *_ = zerohooks.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(stage, model_dtype, offload, GAS, accum=accum),
    )
    return engine


def _deepspeed(stage: int, model_dtype: str, offload: bool, **extra: Any) -> Any:
    model = make_model()
    cfg = ds_config(stage, model_dtype, offload, GAS, **extra)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


# -- scenarios (run on every rank; each returns a list of failures) ------------------------------
def _vs_builtin() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage, offload in ((1, False), (1, True), (2, False), (2, True)):
        ref = _deepspeed(
            stage, "bf16", offload, data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32"
        )
        ref_losses, ref_params = train(ref, STEPS, GAS), full_params(ref, stage)
        ours = _ours(stage, "bf16", offload, dtype="fp32")
        losses, params = train(ours, STEPS, GAS), full_params(ours, stage)
        out[f"{stage}-{offload}"] = _compare(ref, ref_losses, ref_params, ours, losses, params)
    return out


def _compare(
    ref: Any,
    ref_losses: list[float],
    ref_params: list[torch.Tensor],
    ours: Any,
    losses: list[float],
    params: list[torch.Tensor],
) -> dict[str, Any]:
    """Bitwise equality, and the distances the tolerances above are about."""
    n = len(params) // 2  # bf16 module parameters, then the fp32 masters
    return {
        "optimizers": (type(ref.optimizer).__name__, type(ours.optimizer).__name__),
        "bitwise": losses == ref_losses
        and all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)),
        "master_rel": max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(params[n:], ref_params[n:], strict=True)
        ),
        "bf16_ulps": max(
            float(((a.float() - b.float()).abs() / (b.float().abs() * 2.0**-8).clamp_min(1e-30)).max())
            for a, b in zip(params[:n], ref_params[:n], strict=True)
        ),
        "loss_rel": float(
            ((torch.tensor(losses) - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses).abs()).max()
        ),
    }


def _zero0_optimizer_uses_fp32_gradient() -> dict[str, float]:
    """What AdamW consumed at the first ZeRO-0 step, read back from its first moment.

    DeepSpeed's ZeRO-0 bf16 wrapper (FP16_UnfusedOptimizer) takes one AdamW step on zero
    gradients when it is built, so after the first real step exp_avg = (1 - beta1) * g exactly
    as for a fresh AdamW: g = exp_avg / 0.1 is the gradient the optimizer used.  It must be the
    fp32 accumulation (1e-6: the two roundings of the multiply and divide), not a bf16 copy of it
    (which would be about 2**-9 = 2e-3 off).
    """
    world = torch.distributed.get_world_size()
    engine = _ours(0, "bf16", False, dtype="fp32")
    train(engine, 1, GAS)
    inner = engine.optimizer.optimizer
    used = {
        name: inner.state[master]["exp_avg"].double() / 0.1
        for (name, _), master in zip(
            engine.module.named_parameters(),
            (m for g in engine.optimizer.fp32_groups for m in g),
            strict=True,
        )
    }
    return {"rel": rel_error(used, reference_grads("bf16", GAS, world))}


def _zero0_refused_by_deepspeed() -> str:
    try:
        _deepspeed(0, "bf16", False, data_types={"grad_accum_dtype": "fp32"})
    except NotImplementedError as e:
        return f"NotImplementedError: {e}"
    return "DeepSpeed accepted it"


def _resume_mid_window(stage: int, tmp: str) -> dict[str, Any]:
    """Save after 2 of 4 micro-steps of step 1, resume in a fresh engine: bit for bit?"""
    whole = _ours(stage, "bf16", False, dtype="fp32")
    whole_losses = train(whole, 2, GAS)
    first = _ours(stage, "bf16", False, dtype="fp32")
    losses = train(first, 1, GAS) + [micro_step(first, 1, m) for m in range(2)]
    first.save_checkpoint(tmp, tag="mid")
    second = _ours(stage, "bf16", False, seed=1, dtype="fp32")
    second.load_checkpoint(tmp, tag="mid")
    resumed_at = int(second.micro_steps)
    losses += [micro_step(second, 1, m) for m in range(2, GAS)]
    return {
        "losses_equal": losses == whole_losses,
        "params_equal": all(
            torch.equal(a, b)
            for a, b in zip(full_params(second, stage), full_params(whole, stage), strict=True)
        ),
        "resumed_at": resumed_at,
    }


def _refuse_mid_window(stage: int, tmp: str) -> dict[str, Any]:
    engine = _ours(stage, "bf16", False, dtype="fp32")
    train(engine, 1, GAS)
    micro_step(engine, 1, 0)
    try:
        engine.save_checkpoint(tmp, tag="mid")
        error = None
    except MidWindowCheckpointError as e:
        error = str(e)
    return {"error": error, "written": os.path.exists(os.path.join(tmp, "mid"))}


def _resume_at_boundary(stage: int, tmp: str) -> bool:
    whole = _ours(stage, "bf16", False, dtype="fp32")
    whole_losses = train(whole, 2, GAS)
    first = _ours(stage, "bf16", False, dtype="fp32")
    losses = train(first, 1, GAS)
    first.save_checkpoint(tmp, tag="boundary")
    second = _ours(stage, "bf16", False, seed=1, dtype="fp32")
    second.load_checkpoint(tmp, tag="boundary")
    losses += train(second, 1, GAS, first=1)
    same = all(
        torch.equal(a, b) for a, b in zip(full_params(second, stage), full_params(whole, stage), strict=True)
    )
    return losses == whole_losses and same


def _noop_is_deepspeed() -> list[str]:
    """Accumulation dtype = model dtype, reduction dtype = DeepSpeed's: exactly DeepSpeed."""
    bad = []
    for stage, dtype, accum in [(s, "fp32", {}) for s in range(4)] + [(2, "bf16", {"dtype": "bf16"})]:
        ref = _deepspeed(stage, dtype, False)
        ref_losses, ref_params = train(ref, STEPS, GAS), full_params(ref, stage)
        ours = _ours(stage, dtype, False, **accum)
        att = zerohooks.attachment(ours)
        assert att is not None
        hooks = {k: v for k, v in att.registry.summary().items() if v and k != "state"}
        losses, params = train(ours, STEPS, GAS), full_params(ours, stage)
        if (
            hooks
            or losses != ref_losses
            or not all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
        ):
            bad.append(f"ZeRO {stage} {dtype} {accum}: hooks {hooks}, same losses {losses == ref_losses}")
    return bad


def _detach_restores() -> list[str]:
    """Attach (with the per-instance patches of ZeRO 0/1/2), detach: the engine is DeepSpeed's."""
    bad = []
    for stage in (0, 1, 2):
        cfg = ds_config(stage, "bf16", False, GAS)
        plugin = AccumDtypePlugin(AccumDtypePlugin.Config(dtype="fp32"))
        plugin.edit_deepspeed_config(cfg)  # what DeepSpeed sees (its dtype keys, where set)
        model = make_model()
        engine, opt, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        before = (dict(engine.__dict__), dict(opt.__dict__))
        reg, ctx = HookRegistry(), setup_context(cfg)
        plugin.attach(reg, ctx)
        attach(engine, reg, ctx, [plugin])
        plugin.engine_ready(engine, reg)
        zerohooks.detach(engine)
        for was, now in zip(before, (engine.__dict__, opt.__dict__), strict=True):
            if was.keys() != now.keys() or any(now[k] is not v for k, v in was.items()):
                bad.append(
                    f"ZeRO {stage}: detach left {sorted(k for k in now if k not in was or now[k] is not was[k])}"
                )
        if plugin.state is not None and plugin.state.buffers:
            bad.append(f"ZeRO {stage}: buffers kept after detach")
        ref = _deepspeed(
            stage,
            "bf16",
            False,
            **{k: v for k, v in cfg.items() if k in ("data_types", "communication_data_type")},
        )
        if train(engine, 2, GAS) != train(ref, 2, GAS):
            bad.append(f"ZeRO {stage}: the detached engine does not train like DeepSpeed")
    return bad


def scenarios(tmp: str) -> dict[str, Any]:
    """Run on every rank (by conftest.two_ranks); ``tmp`` is shared by the ranks."""
    return {
        "vs_builtin": _vs_builtin(),
        "zero0_deepspeed": _zero0_refused_by_deepspeed(),
        "zero0_used": _zero0_optimizer_uses_fp32_gradient(),
        "resume_mid": {s: _resume_mid_window(s, os.path.join(tmp, f"mid{s}")) for s in (0, 1)},
        "refuse_mid": {s: _refuse_mid_window(s, os.path.join(tmp, f"refuse{s}")) for s in (2, 3)},
        "resume_boundary": _resume_at_boundary(3, os.path.join(tmp, "boundary3")),
        "noop": _noop_is_deepspeed(),
        "detach": _detach_restores(),
    }


@pytest.fixture(scope="module")
def seen(two_ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["training"] for r in two_ranks]


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["1-False", "1-True", "2-False", "2-True"])
def test_matches_deepspeed_grad_accum_dtype(seen: list[dict[str, Any]], case: str) -> None:
    for res in seen:
        r = res["vs_builtin"][case]
        print(f"ZeRO {case}: {r}")
        assert r["optimizers"][1] == "DeepSpeedZeroOptimizer", r
        if r["optimizers"][0] == "BF16_Optimizer":
            assert r["master_rel"] <= 1e-6, r
            assert r["bf16_ulps"] <= 1.0 + 1e-6, r
            assert r["loss_rel"] <= 1e-2, r
        else:
            assert r["bitwise"], r


@pytest.mark.multirank
def test_zero0_deepspeed_raises_accumdtype_trains(seen: list[dict[str, Any]]) -> None:
    """DeepSpeed 0.19.8 raises for bf16 + fp32 accumulation without ZeRO; with accumdtype the
    optimizer steps on the fp32 gradient.  (ZeRO 0 cannot be compared with ZeRO 1's optimizer:
    DeepSpeed's ZeRO-0 wrapper steps AdamW once at construction, which changes bias correction
    and applies weight decay once: measured first update 0.744 * lr instead of lr.)"""
    for res in seen:
        assert res["zero0_deepspeed"].startswith("NotImplementedError: unsupported mix"), res[
            "zero0_deepspeed"
        ]
        r = res["zero0_used"]
        print(f"ZeRO 0: gradient AdamW used vs float64 oracle: {r}")
        assert r["rel"] <= 1e-6, r


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 1])
def test_checkpoint_inside_window_resumes_bit_for_bit(seen: list[dict[str, Any]], stage: int) -> None:
    for res in seen:
        r = res["resume_mid"][stage]
        assert r["resumed_at"] == GAS + 2, r
        assert r["losses_equal"] and r["params_equal"], r


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_inside_window_refused(seen: list[dict[str, Any]], stage: int) -> None:
    for res in seen:
        r = res["refuse_mid"][stage]
        assert (
            r["error"] is not None and f"ZeRO {stage}" in r["error"] and "micro-step 1 of 4" in r["error"]
        ), r
        assert not r["written"], "the refused checkpoint left files behind"


@pytest.mark.multirank
def test_checkpoint_at_boundary_resumes_bit_for_bit(seen: list[dict[str, Any]]) -> None:
    assert all(res["resume_boundary"] for res in seen)


@pytest.mark.multirank
def test_same_dtypes_is_exactly_deepspeed(seen: list[dict[str, Any]]) -> None:
    for res in seen:
        assert not res["noop"], "\n".join(res["noop"])


@pytest.mark.multirank
def test_detach_restores_the_engine(seen: list[dict[str, Any]]) -> None:
    for res in seen:
        assert not res["detach"], "\n".join(res["detach"])
