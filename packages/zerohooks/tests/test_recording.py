"""The recording plugin proves that every phase fires at the right moment with the right tensors."""

from __future__ import annotations

import os

import deepspeed
import pytest
import torch

import zerohooks
from zerohooks.testing import distributed
from zerohooks.testing.recording import RecordingPlugin
from zerohooks.testing.toy import batch, ds_config, full_params, loss_fn, make_model, train

STEPS, GAS = 2, 2


def _oracle_micro_grads(rank: int) -> list[dict[str, torch.Tensor]]:
    """fp32 gradients of loss/GAS for each micro-step of step 0, on an unwrapped copy of the model."""
    model = make_model()
    out = []
    for m in range(GAS):
        model.zero_grad()
        tokens, target = batch(0, m, rank)
        (loss_fn(model, tokens, target) / GAS).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def _check_run(stage: int, dtype: str, tmp: str) -> None:
    rank = int(os.environ["RANK"])
    plugin = RecordingPlugin()
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    names = [n for n, _ in model.named_parameters()]
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(stage, dtype), plugins=[plugin]
    )
    losses = train(engine, STEPS, GAS)
    ev = plugin.events
    case = f"stage {stage} {dtype}"

    # prepare_model: once, first, on the unwrapped fp32 model; then the engine exists.
    assert ev[0].phase == "prepare_model", case
    ready = ev.index(plugin.phases("engine_ready")[0])
    assert all(e.phase in ("prepare_model", "engine_ready", "reduce_dtype") for e in ev[: ready + 1]), case
    assert ev[0].data["model_type"] == "TinyNet" and ev[0].data["dtypes"] == ["torch.float32"], case
    assert plugin.phases("prepare_model") == [ev[0]]

    # before/after step: once per optimizer step, at the boundary, in that order, not skipped.
    steps = [(e.phase, e.global_step) for e in ev if e.phase in ("before_step", "after_step")]
    # after_step sees the step counted: global_step has moved on by one.
    assert steps == [x for s in range(STEPS) for x in (("before_step", s), ("after_step", s + 1))], (
        case,
        steps,
    )
    assert all(e.data["is_boundary"] for e in plugin.phases("before_step")), case
    assert not any(e.data["skipped"] for e in plugin.phases("after_step")), case

    # micro_step_grad: every parameter once per micro-step, all before that step's before_step.
    for s in range(STEPS):
        start = ev.index(plugin.phases("before_step")[s - 1]) if s else 0
        end = ev.index(plugin.phases("before_step")[s])
        window = [e for e in ev[start:end] if e.phase == "micro_step_grad"]
        assert sorted(e.data["name"] for e in window) == sorted(names * GAS), (case, s)

    # ... with the right tensors: DeepSpeed's micro-step gradient (stage 0/1 keep accumulating in
    # param.grad until the boundary; stage 2/3 hand over each micro-step's own gradient).
    oracle = _oracle_micro_grads(rank)
    first = [e for e in plugin.phases("micro_step_grad") if e.global_step == 0]
    expected_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    for m in range(GAS):
        for e in first[m * len(names) : (m + 1) * len(names)]:
            got = e.data["grad"]
            assert got is not None and got.dtype == expected_dtype, (case, e.data["name"])
            want = oracle[m][e.data["name"]] + (oracle[0][e.data["name"]] if (m and stage <= 1) else 0)
            got32 = got.float().reshape(want.shape)
            if dtype == "fp32":
                torch.testing.assert_close(
                    got32, want, rtol=1e-5, atol=1e-7, msg=f"{case} m={m} {e.data['name']}"
                )
            else:  # bf16 forward and backward: compare the whole tensor, a few bf16 ulps (2**-8) of error
                rel = float((got32 - want).norm() / want.norm())
                assert rel < 2e-2, (case, m, e.data["name"], rel)

    # reduce: the recording owner receives every gradient element once per reduction window
    # (stage 0/1: once at the boundary; stage 2/3: each micro-step), in the training dtype.
    reductions = plugin.phases("reduce")
    per_step = {s: sum(e.data["numel"] for e in reductions if e.global_step == s) for s in range(STEPS)}
    windows = 1 if stage <= 1 else GAS
    assert per_step == {s: numel * windows for s in range(STEPS)}, (case, per_step, numel)
    assert {e.data["op"] for e in reductions} == {"reduce_scatter" if stage == 3 else "all_reduce"}, case
    assert {e.data["dtype"] for e in reductions} == {expected_dtype}, case
    # reduce_dtype and reduce_tensor are asked about every parameter that is reduced.
    assert {e.data["name"] for e in plugin.phases("reduce_dtype")} == set(names), case
    assert {e.data["name"] for e in plugin.phases("reduce_tensor") if e.data["name"]} == set(names), case
    # the counters saw the same bytes
    att = zerohooks.attachment(engine)
    assert att is not None
    for step in att.counters.history:
        assert att.counters.step_total(step) == numel * windows * expected_dtype.itemsize, (case, step)

    # the plugin's exact reduction trains like DeepSpeed's own collectives.
    ref_model = make_model()
    ref, *_ = deepspeed.initialize(
        model=ref_model, model_parameters=ref_model.parameters(), config=ds_config(stage, dtype)
    )
    ref_losses = train(ref, STEPS, GAS)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "fp32" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    for a, b in zip(full_params(engine, stage), full_params(ref, stage), strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)

    # plugin state goes into the checkpoint and comes back on load, per rank.
    saved = plugin.state_dict()
    engine.save_checkpoint(tmp, tag="t0")
    assert os.path.exists(os.path.join(tmp, "t0", f"zerohooks_state_rank{rank:05d}.pt"))
    plugin2 = RecordingPlugin()
    model2 = make_model(seed=1)
    engine2, *_ = zerohooks.initialize(
        model=model2, model_parameters=model2.parameters(), config=ds_config(stage, dtype), plugins=[plugin2]
    )
    engine2.load_checkpoint(tmp, tag="t0")
    assert plugin2.loaded_state is not None
    assert plugin2.loaded_state["events"] == saved["events"]
    assert torch.equal(plugin2.loaded_state["marker"], saved["marker"])
    for a, b in zip(full_params(engine2, stage), full_params(engine, stage), strict=True):
        assert torch.equal(a, b), case


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed(world_size=2)
def test_every_phase_fires_in_order(stage: int, tmp_path) -> None:
    _check_run(stage, "fp32", str(tmp_path / "fp32"))
    _check_run(stage, "bf16", str(tmp_path / "bf16"))
