"""Loading a universal checkpoint (``ds_to_universal`` output) with plugins that keep state.

The converter copies DeepSpeed's files only, so the folder holds no zerohooks plugin-state file:
a provider with ``load_universal()`` is told so on every rank (and the weights are DeepSpeed's:
the resumed losses equal the uninterrupted run's, the oracle); a provider without it is a
``CheckpointStateError`` on every rank naming the plugin and what to do instead (without the
check, the load would succeed and the plugin would silently keep fresh state).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerohooks
from zerohooks import CheckpointStateError, ZeroPlugin
from zerohooks.adapter.universal import to_universal
from zerohooks.testing import run_distributed
from zerohooks.testing.toy import ds_config, make_model, train

GAS, STAGE, SAVED, RESUMED = 2, 2, 2, 1


class Counting(ZeroPlugin):
    """State that does not change training (a step count); ``universal`` adds ``load_universal``."""

    name = "counting"
    distribution = "test"

    def __init__(self, universal: bool) -> None:
        super().__init__(self.Config())
        self.steps = 0
        self.told: list[str] = []
        if universal:
            self.load_universal = self._load_universal

    def attach(self, registry: Any, ctx: Any) -> None:
        registry.register_after_step(self._after, name=self.name)
        registry.register_state(self, name=self.name)

    def _after(self, ctx: Any, skipped: bool) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": torch.tensor(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.told.append("load_state_dict")

    def _load_universal(self) -> None:
        self.told.append("load_universal")


def _engine(universal_plugin: bool, load_universal: bool) -> tuple[Any, Counting]:
    plugin = Counting(universal_plugin)
    cfg = ds_config(STAGE, **({"checkpoint": {"load_universal": True}} if load_universal else {}))
    model = make_model()
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, plugins=[plugin]
    )
    return engine, plugin


def _run(tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    engine, _ = _engine(True, False)
    train(engine, SAVED, GAS)
    engine.save_checkpoint(tmp, tag="t")
    continued = train(engine, RESUMED, GAS, first=SAVED)
    if rank == 0:
        to_universal(tmp, "t")
    dist.barrier()
    out: dict[str, Any] = {"continued": continued}
    engine, plugin = _engine(True, True)
    path, _ = engine.load_checkpoint(os.path.join(tmp, "universal"))
    out["path"] = path
    out["told"] = plugin.told
    out["resumed"] = train(engine, RESUMED, GAS, first=SAVED)
    engine, plugin = _engine(False, True)
    try:
        engine.load_checkpoint(os.path.join(tmp, "universal"))
    except CheckpointStateError as e:
        out["refused"] = str(e)
    return out


@pytest.mark.multirank
def test_universal_load_tells_providers_or_refuses(tmp_path: Any) -> None:
    for rank in run_distributed(_run, 2, args=(str(tmp_path),)):
        assert rank["path"] is not None
        assert rank["told"] == ["load_universal"], rank["told"]
        assert rank["resumed"] == rank["continued"]
        message = rank.get("refused")
        assert message is not None, "a provider without load_universal was loaded from a universal checkpoint"
        for part in ("['counting']", "universal checkpoint", "load a regular checkpoint"):
            assert part in message, (part, message)


SUB_GROUP = 1000
"""``zero_optimization.sub_group_size`` for the ZeRO-3 test: the toy model's 3.8 k parameters
fall into several sub-groups (DeepSpeed's default, 1e9, gives one)."""


def _zero3(load_universal: bool, through_zerohooks: bool) -> Any:
    import deepspeed

    extra = {"checkpoint": {"load_universal": True}} if load_universal else {}
    cfg = ds_config(
        3,
        "bf16",
        optimizer={"type": "AdamW", "params": {"lr": 0.5, "eps": 1.0, "torch_adam": True}},
        zero_optimization={"stage": 3, "sub_group_size": SUB_GROUP},
        **extra,
    )
    model = make_model()
    init = zerohooks.initialize if through_zerohooks else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=list(model.parameters()), config=cfg)
    return engine


def _steps(engine: Any) -> list[Any]:
    opt = engine.optimizer
    return [opt.optimizer.state[m]["step"] for m in opt.fp32_partitioned_groups_flat]


def _run_zero3(tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    engine = _zero3(False, True)
    train(engine, SAVED, GAS)
    engine.save_checkpoint(tmp, tag="t")
    out: dict[str, Any] = {"continued": train(engine, 2, GAS, first=SAVED)}
    if rank == 0:
        to_universal(tmp, "t")
    dist.barrier()
    for name, ours in (("deepspeed", False), ("zerohooks", True)):
        engine = _zero3(True, ours)
        engine.load_checkpoint(os.path.join(tmp, "universal"))
        steps = _steps(engine)
        out[name] = {
            "sub_groups": len(steps),
            "distinct": len({id(s) for s in steps}),
            "steps": [float(s) for s in steps],
            "resumed": train(engine, 2, GAS, first=SAVED),
        }
        if ours:
            zerohooks.detach(engine)
    return out


@pytest.mark.multirank
def test_zero3_universal_load_gives_each_sub_group_its_own_step(tmp_path: Any) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 universal load puts one ``step`` tensor into every sub-group's
    state; torch's AdamW increments it once per sub-group, so the second resumed step leaves the
    uninterrupted run.  The oracle is the uninterrupted run: an engine built by zerohooks (no
    plugin) resumes it exactly; plain DeepSpeed, loading the same folder, is shown to share the
    counter and to drift (if a DeepSpeed release mends it, the second half says so and can go)."""
    for rank in run_distributed(_run_zero3, 2, args=(str(tmp_path),)):
        ours, theirs = rank["zerohooks"], rank["deepspeed"]
        assert ours["sub_groups"] > 1, ours  # the case that matters: several sub-groups
        assert ours["distinct"] == ours["sub_groups"], ours
        assert ours["steps"] == [float(SAVED)] * ours["sub_groups"], ours
        assert ours["resumed"] == rank["continued"], (ours, rank["continued"])
        assert theirs["distinct"] == 1, f"DeepSpeed no longer shares the step counter: {theirs}"
        assert theirs["resumed"][:GAS] == rank["continued"][:GAS], theirs
        assert theirs["resumed"] != rank["continued"], theirs
