"""loco with DeepSpeed MoE on 8 gloo ranks in 2 nodes of 4: the experts' gradients reduced within
their expert-data-parallel groups, two-level (each group has 2 ranks on each node).

DeepSpeed's groups for 2 experts (``ep_size`` 2) on 8 ranks: ranks 0 2 4 6 hold expert 0 and
1 3 5 7 expert 1; nodes of 4 put 2 of each group on each node.  The oracle is plain bf16
DeepSpeed with the same model and batches."""

from __future__ import annotations

import warnings
from typing import Any

import deepspeed
import pytest
import torch
import torch.distributed as dist
from _loco_common import gathered, kernels

import zerohooks
from loco import LocoPlugin
from zerohooks.adapter import seams
from zerohooks.testing import distributed
from zerohooks.testing.toy import MoENet, ds_config, moe_parameters, train

STEPS, GAS = 4, 2
LOCO = {"hierarchy": "two_level", "node_size": 4, "exact_below": 0}


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    kernels()  # in the parent process, before the ranks start


def _run(stage: int, loco: dict[str, Any] | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MoENet()
    cfg = ds_config(stage, "bf16", gas=GAS, sections={"loco": loco} if loco else None)
    init = zerohooks.initialize if loco else deepspeed.initialize
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = init(model=model, model_parameters=moe_parameters(model), config=cfg)
        losses = train(engine, STEPS, GAS)
    data, group = seams.gradient_groups(engine)
    assert dist.get_process_group_ranks(data) == list(range(8))
    (expert,) = model.moe.deepspeed_moe.experts.deepspeed_experts
    out: dict[str, Any] = {
        "losses": losses,
        "group": dist.get_process_group_ranks(group),
        "expert": expert.weight.detach().float(),
        "others": [p.detach().float() for n, p in model.named_parameters() if "deepspeed_experts" not in n],
        "warnings": [str(w.message) for w in caught if "reduced flat" in str(w.message)],
    }
    if loco:
        (plugin,) = [p for p in zerohooks.attachment(engine).plugins if isinstance(p, LocoPlugin)]
        used = plugin._topologies  # the topology the reducer took for each group it reduced
        out["expert_topology"] = used.get(group)
        out["stats"] = plugin.stats.last_step()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 2])
@distributed(world_size=8, timeout=900)
def test_expert_groups_reduced_two_level_on_8_ranks(stage: int) -> None:
    me = dist.get_rank()
    base, loco = _run(stage, None), _run(stage, LOCO)
    group = loco["group"]
    assert group == list(range(me % 2, 8, 2)) == base["group"]
    topo = loco["expert_topology"]
    assert topo is not None, "the expert group's gradients did not go through loco"
    assert (topo.two_level, topo.world, topo.nodes, topo.node_size) == (True, 4, 2, 2)
    assert topo.rank == group.index(me)
    assert loco["warnings"] == []
    stats = loco["stats"]
    assert stats.get("wire:all_to_all_inter", 0) > 0 and 0 < stats["wire_bytes"] < stats["bf16_wire_bytes"]
    # each expert's replicas end equal (reduced over its group), the two experts apart; the rest
    # of the model equal on all 8 ranks
    replicas = gathered(loco["expert"])
    assert all(torch.equal(replicas[r], loco["expert"]) for r in group)
    assert not torch.equal(replicas[0], replicas[1])
    for p in loco["others"]:
        assert all(torch.equal(q, p) for q in gathered(p))
    # against plain bf16 DeepSpeed, the mean loss over the ranks, every micro-step
    mean = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    got, want = mean(loco["losses"]), mean(base["losses"])
    dist.all_reduce(got)
    dist.all_reduce(want)
    gap = float((got - want).abs().max()) / 8
    assert gap < 0.04, (gap, (got / 8).tolist(), (want / 8).tolist())
