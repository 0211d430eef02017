"""zerohooks under Hugging Face Trainer: ``zerohooks.enable()`` before ``Trainer(...)``, plugin
sections in ``TrainingArguments(deepspeed=<dict>)``, 2 gloo ranks on CPU.

Oracles: the model's own parameter counts (bytes each dtype should take, what a bf16 all-reduce
would send), the uninterrupted run (resume), and the same training through
``zerohooks.initialize`` with a hand-written loop.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from _plugin_checks import CHECKS
from conftest import scenario

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

PLUGINS = ["plain", "loco", "accumdtype", "autocastzero", "autocastzero_conv1d", "mixedlayers", "nvmeswap"]


@pytest.mark.parametrize("name", PLUGINS)
def test_plugin_attached_and_effective(trainer_runs: list[dict[str, Any]], name: str) -> None:
    """Each plugin, enabled by its config section alone, is attached to Trainer's engine and does
    what it is for (``autocastzero``: default section, so GPT-2's Conv1D must count as safe;
    ``autocastzero_conv1d``: Conv1D listed explicitly)."""
    for rank in scenario(trainer_runs, name):
        CHECKS[name](rank)


def test_resume_at_odd_step_is_bit_exact(trainer_runs: list[dict[str, Any]]) -> None:
    """gas 2, accumdtype + loco, checkpoint after optimizer step 3 of 5, ``resume_from_checkpoint``:
    the resumed steps 4-5 have the uninterrupted run's losses and weights, bit for bit."""
    from _frameworks_common import GAS
    from _trainer_scenarios import RESUME_STEPS, SAVE_AT

    for rank in scenario(trainer_runs, "resume"):
        full, resumed = rank["full"], rank["resumed"]
        assert sorted(full["plugins"]) == ["accumdtype", "loco"]
        assert len(full["losses"]) == RESUME_STEPS * GAS
        assert resumed["losses"] == full["losses"][SAVE_AT * GAS :]
        assert resumed["params"] == full["params"]
        # resuming that checkpoint without the plugins is a clear error naming them
        assert rank["mismatch"].startswith("CheckpointStateError"), rank["mismatch"]
        assert "['accumdtype', 'loco']" in rank["mismatch"] and "does not enable" in rank["mismatch"]
        # the checkpoint holds the plugins' state next to DeepSpeed's files
        assert any(f.startswith(f"global_step{SAVE_AT}/zerohooks_state_rank") for f in rank["layout"]), rank[
            "layout"
        ]


def test_trainer_equals_hand_loop(trainer_runs: list[dict[str, Any]]) -> None:
    """Trainer (accelerate's boundary-only ``engine.step()``) and ``zerohooks.initialize`` with a
    plain DeepSpeed loop (``engine.step()`` every micro-step) give the same losses, weights and
    per-step collective bytes, on the same batches."""
    from _frameworks_common import GAS, shard_batch

    for r, rank in enumerate(scenario(trainer_runs, "resume")):
        full, hand = rank["full"], rank["hand"]
        expected_batches = [shard_batch(k, r).tolist() for k in range(len(full["batches"]))]
        assert full["batches"] == expected_batches, "Trainer did not feed the batches the hand loop uses"
        assert hand["losses"] == full["losses"]
        assert hand["params"] == full["params"]
        assert hand["steps"] == full["steps"]
        assert len(hand["steps"]) == len(full["losses"]) // GAS


def test_plugin_sections_without_enable(trainer_runs: list[dict[str, Any]]) -> None:
    """Plugin sections with no ``zerohooks.enable()``: documents what happens today (the sections
    reach DeepSpeed, which ignores unknown keys: no attachment, no warning, training runs)."""
    for rank in scenario(trainer_runs, "no_enable"):
        assert not rank["attached"]
        assert rank["sections_in_engine_config"] == ["accumdtype", "loco"]
        assert rank["warnings"] == [] and rank["logs"] == [], (rank["warnings"], rank["logs"])


def test_zero3_models_built_after_training_arguments_use_zero_init(
    trainer_runs: list[dict[str, Any]],
) -> None:
    """Fact for users (mixedlayers refuses zero.Init models): after ``TrainingArguments(deepspeed=
    <ZeRO 3>)``, ``from_pretrained``/``_from_config`` build the model under ``deepspeed.zero.Init``;
    a model constructed directly (``GPT2LMHeadModel(config)``) is not partitioned."""
    for rank in scenario(trainer_runs, "zero3_init"):
        assert rank == {"direct_partitioned": False, "from_config_partitioned": True}


def test_trainer_optimizer_and_scheduler_objects(trainer_runs: list[dict[str, Any]]) -> None:
    """No "optimizer" section: Trainer builds torch's AdamW and its LR scheduler and accelerate
    passes them as objects.  Every plugin attaches and trains (mixedlayers splits param groups:
    Trainer's scheduler comes as a callable, built on the split groups)."""
    from _frameworks_common import GAS

    for rank in scenario(trainer_runs, "hf_objects"):
        for name, got in rank.items():
            assert got["trained"], (name, got.get("error"))
            assert got["attached"] and got["plugins"] == [name], (name, got)
            assert len(got["losses"]) == 2 * GAS and all(math.isfinite(x) for x in got["losses"]), (name, got)
        assert rank["loco"]["reducer"] == "loco"


def test_zero3_init_models_with_plugins(trainer_runs: list[dict[str, Any]]) -> None:
    """ZeRO 3 models built by ``_from_config`` after ``TrainingArguments`` (under zero.Init): loco
    and accumdtype train on them; mixedlayers refuses, naming the Hugging Face ways out."""
    for rank in scenario(trainer_runs, "zero3_init_plugins"):
        ok, refused = rank["loco+accumdtype"], rank["mixedlayers"]
        assert ok["partitioned"] and ok["trained"], ok.get("error")
        assert ok["plugins"] == ["accumdtype", "loco"] and ok["reducer"] == "loco"
        assert refused["partitioned"] and not refused["trained"]
        assert refused["error"].startswith("ConfigError") and "zero.Init" in refused["error"]
        assert "before the TrainingArguments" in refused["error"]
