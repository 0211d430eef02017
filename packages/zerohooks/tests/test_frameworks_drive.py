"""How frameworks reach the engine: ``zerohooks.enable()`` routing ``deepspeed.initialize``, the
engine driven as accelerate / Hugging Face Trainer drive it (``engine.step()`` only at the
boundary), patched methods keeping their signatures, and checkpoints whose plugin state does not
match the plugins of the run that loads them."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import warnings

import deepspeed
import pytest
import torch

import zerohooks
from zerohooks import CheckpointStateError
from zerohooks.testing import distributed
from zerohooks.testing.recording import RecordingPlugin
from zerohooks.testing.toy import (
    batch,
    ds_config,
    full_params,
    loss_fn,
    make_model,
    train,
    train_like_accelerate,
)

STAGES = (0, 1, 2, 3)


def _engine(stage: int, plugins: list, **kw):
    model = make_model()
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(stage, **kw), plugins=plugins
    )
    return engine


def _trace(plugin: RecordingPlugin) -> list[tuple[str, int, int]]:
    keep = ("micro_step_grad", "reduce", "before_step", "after_step")
    return [(e.phase, e.global_step, e.micro_step) for e in plugin.events if e.phase in keep]


@pytest.mark.multirank
@distributed(world_size=2)
def test_accelerate_loop_sees_the_same_micro_steps_as_the_documented_loop() -> None:
    """Oracle: DeepSpeed's documented loop (backward + step every micro-step), where
    ``engine.micro_steps`` does count backward passes."""
    steps, gas = 3, 2
    for stage in STAGES:
        runs = []
        for drive in (train, train_like_accelerate):
            plugin = RecordingPlugin()
            engine = _engine(stage, [plugin], gas=gas)
            losses = drive(engine, steps, gas)
            runs.append((losses, _trace(plugin), full_params(engine, stage)))
        (ref_losses, ref_trace, ref_params), (losses, trace, params) = runs
        assert losses == ref_losses, stage
        assert trace == ref_trace, stage
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)), stage
        # every backward pass has its own micro-step number, 0 .. steps*gas-1, in both loops
        grads = sorted({m for phase, _, m in trace if phase == "micro_step_grad"})
        assert grads == list(range(steps * gas)), (stage, grads)

        # the window position, step by step, under the accelerate loop
        engine = _engine(stage, [RecordingPlugin()], gas=gas)
        ctx = zerohooks.step_context(engine)
        rank = int(os.environ["RANK"])
        for s in range(2):
            for m in range(gas):
                engine.set_gradient_accumulation_boundary(m == gas - 1)
                engine.backward(loss_fn(engine, *batch(s, m, rank)))
                if m == gas - 1:
                    assert ctx.window_micro_step == gas and ctx.in_window
                    engine.step()
                    assert ctx.window_micro_step == 0 and not ctx.in_window
                else:
                    assert ctx.window_micro_step == m + 1 and ctx.in_window
        assert ctx.micro_step == 2 * gas and ctx.global_step == 2 == engine.global_steps
        # while engine.micro_steps counted the two step() calls only
        assert engine.micro_steps == 2


@pytest.mark.multirank
@distributed(world_size=2)
def test_enable_routes_deepspeed_initialize_without_recursion() -> None:
    original = deepspeed.initialize
    assert not zerohooks.enabled()
    with zerohooks.enable() as handle:
        router = deepspeed.initialize
        assert router is not original and zerohooks.enabled()
        second = zerohooks.enable()  # harmless: the same router stays
        assert deepspeed.initialize is router
        # the router keeps DeepSpeed's signature (frameworks inspect it)
        assert inspect.signature(router) == inspect.signature(original)
        plugin = RecordingPlugin()
        model = make_model()
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(2), plugins=[plugin]
        )
        att = zerohooks.attachment(engine)
        assert att is not None and att.plugins == [plugin]
        train(engine, 1, 2)
        assert plugin.phases("after_step")
        second.remove()
        assert zerohooks.enabled() and handle.active  # one handle still holds it
    assert not handle.active and deepspeed.initialize is original and not zerohooks.enabled()

    # the first thing users try: assigning zerohooks.initialize to deepspeed.initialize
    deepspeed.initialize = zerohooks.initialize
    try:
        model = make_model()
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(0)
        )
        assert zerohooks.attachment(engine) is not None
        # no plugin: bit-for-bit what DeepSpeed gives
        model = make_model()
        ref, *_ = original(model=model, model_parameters=model.parameters(), config=ds_config(0))
        assert train(engine, 2, 2) == train(ref, 2, 2)
        assert zerohooks.enabled()
        with zerohooks.enable():  # enabling over the assignment is harmless too
            assert deepspeed.initialize is not original
    finally:
        deepspeed.initialize = original

    def foreign(*args, **kwargs):
        return original(*args, **kwargs)

    deepspeed.initialize = foreign
    try:
        with pytest.raises(RuntimeError, match=r"deepspeed\.initialize has been replaced by .*foreign"):
            zerohooks.enable()
    finally:
        deepspeed.initialize = original


@pytest.mark.multirank
@distributed(world_size=2)
def test_checkpoint_state_must_match_the_plugins() -> None:
    import tempfile

    root = tempfile.mkdtemp(prefix="zh_ckpt_") if int(os.environ["RANK"]) == 0 else None
    box = [root]
    torch.distributed.broadcast_object_list(box, src=0)
    root = box[0]
    for stage in (0, 2):
        with_state = os.path.join(root, f"with{stage}")
        without = os.path.join(root, f"without{stage}")
        engine = _engine(stage, [RecordingPlugin()])
        # patched methods keep DeepSpeed's signatures (transformers looks for this keyword)
        assert "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters
        assert "load_module_only" in inspect.signature(engine.load_checkpoint).parameters
        train_like_accelerate(engine, 3, 2)  # an odd number of optimizer steps
        engine.save_checkpoint(with_state)
        plain = _engine(stage, [])
        train(plain, 1, 2)
        plain.save_checkpoint(without)

        # state saved by a plugin this run does not enable: refused, naming it
        with pytest.raises(CheckpointStateError, match=r"'recording'.*does not enable"):
            _engine(stage, []).load_checkpoint(with_state)
        # plugins whose state the checkpoint lacks: refused
        with pytest.raises(CheckpointStateError, match=r"saved without them.*zerohooks\.enable"):
            _engine(stage, [RecordingPlugin()]).load_checkpoint(without)
        # weights only: accepted both ways, as DeepSpeed accepts them
        fresh = _engine(stage, [])
        path, _ = fresh.load_checkpoint(with_state, load_module_only=True)
        assert path is not None
        plugin = RecordingPlugin()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path, _ = _engine(stage, [plugin]).load_checkpoint(without, load_module_only=True)
        assert path is not None and plugin.loaded_state is None
        if int(os.environ["RANK"]) == 0:
            assert any("fresh state" in str(w.message) for w in caught)

        # the matching resume restores the window position zerohooks counted
        plugin = RecordingPlugin()
        resumed = _engine(stage, [plugin])
        resumed.load_checkpoint(with_state)
        ctx = zerohooks.step_context(resumed)
        assert plugin.loaded_state is not None
        assert ctx.micro_step == 6 and ctx.window_micro_step == 0 and resumed.global_steps == 3


def test_run_module_runs_a_script_with_enable(tmp_path) -> None:
    """``python -m zerohooks.run SCRIPT ARGS`` and ``-m MODULE``: the script runs as __main__ with
    its own argv and deepspeed.initialize routed."""
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import deepspeed
            import zerohooks
            print("ROUTED", zerohooks.enabled(), __name__, sys.argv[1:], deepspeed.initialize is not None)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "zerohooks.run", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    out = run(str(script), "--lr", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ROUTED True __main__ ['--lr', '3'] True" in out.stdout
    out = run("-m", "probe", "x")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ROUTED True __main__ ['x'] True" in out.stdout
    bad = run(str(tmp_path / "missing.py"))
    assert bad.returncode != 0 and "is not a file" in bad.stderr


@pytest.mark.multirank
@distributed(world_size=2)
def test_engines_without_a_zero_optimizer() -> None:
    """Configs for which DeepSpeed builds another optimizer than the ZeRO one: with no plugin,
    zerohooks.initialize gives what deepspeed.initialize gives; a plugin that hooks into the ZeRO
    optimizer is refused naming what DeepSpeed built.  Oracle: deepspeed.initialize itself."""
    rank = int(os.environ["RANK"])
    # bf16 + ZeRO 1 + grad_accum_dtype fp32: DeepSpeed picks BF16_Optimizer
    cfg = ds_config(1, "bf16", data_types={"grad_accum_dtype": "fp32"})
    engines = []
    for init in (deepspeed.initialize, zerohooks.initialize):
        model = make_model()
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
        engines.append(engine)
    assert type(engines[0].optimizer).__name__ == "BF16_Optimizer"
    assert train(engines[1], 2, 2) == train(engines[0], 2, 2)
    model = make_model()
    with pytest.raises(zerohooks.ConfigError, match=r"'recording'.*BF16_Optimizer.*grad_accum_dtype"):
        zerohooks.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, plugins=[RecordingPlugin()]
        )

    # ZeRO 3 without an optimizer (parameters offloaded to the CPU): DeepSpeedZeRoOffload, inference
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }
    outs = []
    for init in (deepspeed.initialize, zerohooks.initialize):
        engine, *_ = init(model=make_model(), config=cfg)
        tokens, _ = batch(0, 0, rank)
        with torch.no_grad():
            outs.append(engine(tokens).float())
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(zerohooks.ConfigError, match=r"'recording'.*no optimizer|'recording'.*ZeRoOffload"):
        zerohooks.initialize(model=make_model(), config=cfg, plugins=[RecordingPlugin()])
