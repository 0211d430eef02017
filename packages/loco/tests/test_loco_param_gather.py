"""loco's two-level parameter all-gather (``parameter_gather``) in real ZeRO 1/2/3 engines.

The oracle is DeepSpeed's own all-gather: the same loco engine with ``parameter_gather:
"deepspeed"`` (and gloo's collectives for its gradient exchanges, ``gloo_exchange:
"collective"``) must give the same losses and weights bit for bit (the all-gather is a lossless
re-routing), while the counters show that loco carried the gathers, each rank sending its
partition once to the other node and its node's partitions once within the node.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _loco_common import ds_config, kernels, make_model, train

import zerohooks
from loco import LocoPlugin
from zerohooks.testing import distributed

NODE = 2


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    kernels()  # in the parent process, before the ranks start


def _run(
    stage: int, dtype: str, gather: str, exchange: str, **zero: Any
) -> tuple[list[float], list[torch.Tensor], LocoPlugin]:
    loco = {
        "hierarchy": "two_level",
        "node_size": NODE,
        "parameter_gather": gather,
        "gloo_exchange": exchange,
    }
    cfg = ds_config(stage, dtype, gas=2, loco=loco)
    cfg["zero_optimization"].update(zero)
    model = make_model(3)
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    att = zerohooks.attachment(engine)
    assert att is not None
    (plugin,) = [p for p in att.plugins if isinstance(p, LocoPlugin)]
    assert att.registry.summary()["gatherer"] == (["loco"] if gather == "two_level" else [])
    two = plugin._two_level
    assert two is not None and two.point_to_point == (exchange == "point_to_point")
    losses = train(engine, 3, 2)
    if stage == 3:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            weights = [p.detach().clone() for p in engine.module.parameters()]
    else:
        weights = [p.detach().clone() for p in engine.module.parameters()]
    zerohooks.detach(engine)
    return losses, weights, plugin


def _backend_is_deepspeeds() -> bool:
    from deepspeed.comm import comm as ds_comm

    return "all_gather_into_tensor" not in vars(ds_comm.cdb)


def _check(stage: int, dtype: str, **zero: Any) -> None:
    case = f"stage {stage} {dtype} {zero}"
    # the oracle also keeps gloo's collectives for loco's gradient exchanges (loco.p2p's are
    # the same rows): both of this rank's results must match bit for bit
    ours, w_ours, plugin = _run(stage, dtype, "two_level", "point_to_point", **zero)
    assert _backend_is_deepspeeds(), f"{case}: the route outlived the engine"
    theirs, w_theirs, other = _run(stage, dtype, "deepspeed", "collective", **zero)
    assert ours == theirs, (case, ours, theirs)
    for a, b in zip(w_ours, w_theirs, strict=True):
        assert torch.equal(a, b), case
    world = torch.distributed.get_world_size()
    for step in plugin.stats.history:
        inter, intra = step.get("params:all_gather_inter", 0), step.get("params:all_gather_intra", 0)
        assert inter > 0, (case, step)
        # each rank sends its partition to the one rank of its index on the other node, and the
        # node's two partitions to the other rank of its node: intra = 2 x inter on 2 x 2
        assert intra == (NODE - 1) * (world // NODE) * inter, (case, step)
    assert all(not k.startswith("params:") for s in other.stats.history for k in s), case


@pytest.mark.multirank
@distributed(world_size=4, timeout=900)
def test_two_level_parameter_gather_is_deepspeeds_bit_for_bit() -> None:
    _check(1, "fp32")  # the fp32 all-gather of the updated partitions
    _check(2, "bf16")  # the same in 16 bits
    _check(3, "fp32")  # every forward/backward gather
    _check(3, "bf16", zero_hpz_partition_size=NODE)  # hpZ: its secondary groups stay DeepSpeed's
