"""The adapter: detach restores the engine, missing internals and bad settings fail clearly,
fp16 skipped steps reach after_step, and the harness reports failing and hung ranks."""

from __future__ import annotations

import os
import time

import deepspeed
import pytest
import torch

import zerohooks
from zerohooks import ConfigError, DeepSpeedInternalMissing
from zerohooks.adapter import attach
from zerohooks.dsconfig import setup_context
from zerohooks.registry import HookRegistry
from zerohooks.testing import MultiRankError, distributed, run_distributed
from zerohooks.testing.recording import RecordingPlugin
from zerohooks.testing.toy import ds_config, full_params, make_model, train


def _snapshot(obj) -> dict:
    return dict(obj.__dict__)


@pytest.mark.multirank
@distributed(world_size=2)
def test_detach_restores_the_engine() -> None:
    for stage in (0, 1, 3):
        cfg = ds_config(stage)
        model = make_model()
        engine, opt, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        before_engine, before_opt = _snapshot(engine), _snapshot(opt)
        plugin = RecordingPlugin()
        reg = HookRegistry()
        ctx = setup_context(cfg)
        plugin.attach(reg, ctx)
        att = attach(engine, reg, ctx, [plugin])
        assert "_take_model_step" in engine.__dict__ and zerohooks.attachment(engine) is att
        zerohooks.detach(engine)
        assert zerohooks.attachment(engine) is None
        after_engine, after_opt = _snapshot(engine), _snapshot(opt)
        assert after_engine.keys() == before_engine.keys() and after_opt.keys() == before_opt.keys(), stage
        assert all(after_engine[k] is before_engine[k] for k in before_engine), stage
        assert all(after_opt[k] is before_opt[k] for k in before_opt), stage
        # and it trains exactly like an engine zerohooks never touched
        losses = train(engine, 2, 2)
        model2 = make_model()
        ref, *_ = deepspeed.initialize(model=model2, model_parameters=model2.parameters(), config=cfg)
        assert losses == train(ref, 2, 2), stage
        assert all(
            torch.equal(a, b)
            for a, b in zip(full_params(engine, stage), full_params(ref, stage), strict=True)
        )


@pytest.mark.multirank
@distributed(world_size=2)
def test_missing_deepspeed_internal_is_named() -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    saved = DeepSpeedZeroOptimizer.allreduce_bucket
    del DeepSpeedZeroOptimizer.allreduce_bucket  # as if a DeepSpeed release renamed it
    try:
        model = make_model()
        with pytest.raises(
            DeepSpeedInternalMissing, match=r"DeepSpeedZeroOptimizer\.allreduce_bucket.*DeepSpeed 0\.19"
        ):
            zerohooks.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=ds_config(2),
                plugins=[RecordingPlugin()],
            )
        # without a plugin nothing needs it: the engine is left as DeepSpeed built it
        model = make_model()
        engine, *_ = zerohooks.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(2)
        )
        att = zerohooks.attachment(engine)
        assert att is not None and att.inert and "allreduce_bucket" in att.inert
        assert "backward" not in vars(engine) and "process_gradients" not in vars(engine.optimizer)
    finally:
        DeepSpeedZeroOptimizer.allreduce_bucket = saved
    _missing_zero3_internal_is_named()


def _missing_zero3_internal_is_named() -> None:
    """ZeRO 3 with a plugin owning the collective: an internal the reduce-scatter wrapper only
    calls while training is checked when the engine is built (it was an AttributeError in the
    middle of the first backward)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    saved = Stage3._gradient_averaging_world_size
    del Stage3._gradient_averaging_world_size
    try:
        model = make_model()
        with pytest.raises(
            DeepSpeedInternalMissing,
            match=r"DeepSpeedZeroOptimizer_Stage3\._gradient_averaging_world_size, which DeepSpeed 0\.19",
        ):
            zerohooks.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=ds_config(3),
                plugins=[RecordingPlugin()],
            )
    finally:
        Stage3._gradient_averaging_world_size = saved


@pytest.mark.multirank
@distributed(world_size=2, fp16_on_cpu=True)
def test_fp16_overflow_reaches_after_step_as_skipped() -> None:
    for stage in (0, 2, 3):
        plugin = RecordingPlugin()
        model = make_model()
        engine, *_ = zerohooks.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=ds_config(stage, "fp16", gas=1),
            plugins=[plugin],
        )
        rank = int(os.environ["RANK"])
        deepspeed_scales = []
        for step in range(3):
            tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(step + rank))
            loss = engine(tokens).float().pow(2).mean()
            if step == 1:
                loss = loss * float("inf")  # overflow on every rank: the step must be skipped
            engine.backward(loss)
            engine.step()
            deepspeed_scales.append(float(engine.optimizer.loss_scale))
        skipped = [e.data["skipped"] for e in plugin.phases("after_step")]
        assert skipped == [False, True, False], (stage, skipped)
        assert engine.skipped_steps == 1
        # the scale after_step hooks see is the one DeepSpeed's optimizer reports after the step
        scales = [e.data["next_loss_scale"] for e in plugin.phases("after_step")]
        assert scales == deepspeed_scales and scales[0] > 1, (stage, scales, deepspeed_scales)


def test_conflicting_precision_sections() -> None:
    with pytest.raises(ConfigError, match="both bf16 and fp16"):
        setup_context({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="stage must be 0, 1, 2 or 3"):
        setup_context({"zero_optimization": {"stage": 4}})
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage must be 0, 1, 2 or 3, not 'three'"):
        setup_context({"zero_optimization": {"stage": "three"}})


def _fails_on_rank1() -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("boom on purpose")
    return 7


def _hangs_on_rank1() -> None:
    if int(os.environ["RANK"]) == 1:
        time.sleep(600)
    torch.distributed.barrier()


def test_harness_reports_the_failing_rank_with_its_traceback() -> None:
    with pytest.raises(MultiRankError, match=r"(?s)rank 1 of 2 failed.*_fails_on_rank1.*boom on purpose"):
        run_distributed(_fails_on_rank1, 2, timeout=120)


def test_harness_times_out_a_hung_collective() -> None:
    start = time.monotonic()
    with pytest.raises(MultiRankError, match=r"did not finish within 25s"):
        run_distributed(_hangs_on_rank1, 2, timeout=25)
    assert time.monotonic() - start < 60


def test_harness_returns_results_in_rank_order() -> None:
    assert run_distributed(_rank_times_ten, 3, timeout=120) == [0, 10, 20]


def _rank_times_ten() -> int:
    return int(os.environ["RANK"]) * 10


def _backend_and_threads() -> tuple[str, int]:
    return torch.distributed.get_backend(), torch.get_num_threads()


def test_harness_backend_and_threads() -> None:
    assert run_distributed(_backend_and_threads, 2, timeout=120, threads=2) == [("gloo", 2)] * 2
    with pytest.raises(ValueError, match=r'backend must be "gloo" or "nccl", got \'mpi\''):
        run_distributed(_rank_times_ten, 2, backend="mpi")


@pytest.mark.multirank
@distributed(world_size=2)
def test_config_from_json_path_and_from_args(tmp_path) -> None:
    """The config may come as a JSON path or through ``args.deepspeed_config``, as with DeepSpeed."""
    import argparse
    import json

    path = tmp_path / f"ds{os.environ['RANK']}.json"
    path.write_text(json.dumps(ds_config(2, "bf16")))
    ref_model = make_model()
    ref, *_ = deepspeed.initialize(model=ref_model, model_parameters=ref_model.parameters(), config=str(path))
    ref_losses = train(ref, 2, 2)
    m1 = make_model()
    e1, *_ = zerohooks.initialize(model=m1, model_parameters=m1.parameters(), config=str(path))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=int(os.environ["RANK"]))
    m2 = make_model()
    e2, *_ = zerohooks.initialize(args=args, model=m2, model_parameters=m2.parameters())
    assert args.deepspeed_config == str(path)  # the caller's args are not modified
    assert train(e1, 2, 2) == ref_losses
    assert train(e2, 2, 2) == ref_losses
