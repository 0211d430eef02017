"""The ZeRO-3 NVMe optimizer-swap hooks fire per sub-group and, calling DeepSpeed's default, train
bit-for-bit like DeepSpeed's NVMe offload.  Needs DeepSpeed's async_io op (Debian's libaio-dev)."""

from __future__ import annotations

import os
from typing import Any

import deepspeed
import pytest
import torch

import zerohooks
from zerohooks import SwapOwner, ZeroPlugin
from zerohooks.testing import distributed
from zerohooks.testing.toy import ds_config, full_params


def _aio_available() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:
        return False


pytestmark = pytest.mark.skipif(
    not _aio_available(), reason="DeepSpeed's async_io op is not buildable here (install libaio-dev)"
)


@pytest.fixture(scope="module", autouse=True)
def _build_aio_once() -> None:
    """Build DeepSpeed's async_io op in the parent, so the ranks neither race on nor time out in it."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    AsyncIOBuilder().load(verbose=False)


class _RecordingSwapper(SwapOwner):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def swap_out_gradients(self, optimizer, sub_group_id, offsets, gradients, default) -> None:
        assert len(offsets) == len(gradients) and all(g.dtype == torch.float32 for g in gradients)
        self.calls.append(("swap_out_gradients", sub_group_id))
        default()

    def swap_in(self, optimizer, sub_group_id, default) -> None:
        self.calls.append(("swap_in", sub_group_id))
        default()

    def swap_out(self, optimizer, sub_group_id, default) -> None:
        self.calls.append(("swap_out", sub_group_id))
        default()


class _SwapPlugin(ZeroPlugin):
    name = "swaprec"

    def __init__(self) -> None:
        super().__init__(self.Config())
        self.swapper = _RecordingSwapper()

    def attach(self, registry: Any, ctx: Any) -> None:
        registry.register_swapper(self.swapper, name=self.name)


def _model() -> torch.nn.Module:
    """1.2 M parameters: DeepSpeed swaps only sub-groups of at least 1 MiB (262,144 fp32 values)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(600, 1000), torch.nn.LayerNorm(1000), torch.nn.Linear(1000, 600)
    )


def _train(engine: Any, steps: int, gas: int) -> list[float]:
    rank = int(os.environ["RANK"])
    losses = []
    for s in range(steps):
        for m in range(gas):
            g = torch.Generator().manual_seed(100 * s + 10 * m + rank)
            x = torch.randn(4, 600, generator=g).to(torch.bfloat16)
            loss = (engine(x).float() - x.float()).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def _nvme_config(path: str) -> dict[str, Any]:
    cfg = ds_config(3, "bf16")
    cfg["zero_optimization"].update(
        offload_optimizer={"device": "nvme", "nvme_path": path, "pin_memory": False},
        sub_group_size=300_000,  # two swappable sub-groups per rank
    )
    cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


@pytest.mark.multirank
@distributed(world_size=2, timeout=900)
def test_swap_hooks_fire_per_sub_group_and_keep_deepspeed_numerics(tmp_path) -> None:
    rank = int(os.environ["RANK"])
    model = _model()
    ref, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_nvme_config(str(tmp_path / f"ref{rank}"))
    )
    ref_losses = _train(ref, 2, 2)
    plugin = _SwapPlugin()
    model2 = _model()
    engine, *_ = zerohooks.initialize(
        model=model2,
        model_parameters=model2.parameters(),
        config=_nvme_config(str(tmp_path / f"zh{rank}")),
        plugins=[plugin],
    )
    losses = _train(engine, 2, 2)
    calls = list(plugin.swapper.calls)  # reading the fp32 masters below swaps in too
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(full_params(engine, 3), full_params(ref, 3), strict=True))
    opt = engine.optimizer
    swapped = [i for i in range(len(opt.fp16_groups)) if opt._swappable_optimizer_subgroup(i)]
    assert len(swapped) >= 2, swapped  # DeepSpeed keeps sub-groups under 1 MiB in memory
    seen = {
        ph: sorted(i for p, i in calls if p == ph) for ph in ("swap_out_gradients", "swap_in", "swap_out")
    }
    # gradients go out once per swapped sub-group at each of the 2 boundaries
    assert seen["swap_out_gradients"] == sorted(swapped * 2), seen
    # DeepSpeed also swaps state in and out outside the step (initialising the optimizer state):
    # every swap-in is matched by a swap-out, and each step swaps every swapped sub-group.
    assert seen["swap_in"] == seen["swap_out"], seen
    assert all(seen["swap_in"].count(i) >= 2 for i in swapped) and set(seen["swap_in"]) == set(swapped), seen
