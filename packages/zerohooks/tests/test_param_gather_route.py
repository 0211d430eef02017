"""The parameter-gather owner: DeepSpeed's backend all-gather goes to the owner on the routed
groups only, newest route first, and is DeepSpeed's own again once the routes are removed (by
``zerohooks.detach`` for an engine's routes); the seam ``parameter_gather`` declares it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from typing_extensions import override

from zerohooks import ParameterGatherer, PluginConfig, ZeroPlugin
from zerohooks.adapter import gather, surface
from zerohooks.hookspec import SetupContext
from zerohooks.registry import HookRegistry, OwnerConflictError
from zerohooks.testing import distributed


class _Recording(ParameterGatherer):
    """Gathers as torch does, remembering the groups it served."""

    def __init__(self) -> None:
        self.served: list[Any] = []

    @override
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
        self.served.append(group)
        dist.all_gather_into_tensor(output, input, group=group)


def test_one_owner_per_engine() -> None:
    reg = HookRegistry()
    handle = reg.register_gatherer(_Recording(), name="a")
    with pytest.raises(OwnerConflictError, match=r"parameter all-gather.*'a'.*'b'"):
        reg.register_gatherer(_Recording(), name="b")
    assert reg.summary()["gatherer"] == ["a"]
    handle.remove()
    assert reg.summary()["gatherer"] == []


def _gathered(group: Any, async_op: bool) -> torch.Tensor:
    from deepspeed import comm as ds

    world = dist.get_world_size(group=group)
    mine = torch.full((3,), float(dist.get_rank() + 1))
    out = torch.empty(3 * world)
    handle = ds.all_gather_into_tensor(out, mine, group=group, async_op=async_op)
    if async_op:
        handle.wait()
    return out


@pytest.mark.multirank
@distributed(world_size=2)
def test_routes_serve_their_groups_only_and_come_off() -> None:
    import deepspeed
    from deepspeed.comm import comm as ds_comm

    deepspeed.init_distributed(dist_backend="gloo")
    expected = torch.tensor([1.0, 1, 1, 2, 2, 2])
    other = dist.new_group([0, 1])  # a group nobody routes (as hpZ's secondary groups)
    old, new = _Recording(), _Recording()
    first = gather.route([None], old)  # None: the default group
    second = gather.route([dist.group.WORLD], new)
    assert "all_gather_into_tensor" in vars(ds_comm.cdb)
    assert torch.equal(_gathered(None, async_op=True), expected)
    assert torch.equal(_gathered(other, async_op=False), expected)
    assert new.served == [dist.group.WORLD] and old.served == []  # the newest route serves
    second.remove()
    assert torch.equal(_gathered(dist.group.WORLD, async_op=False), expected)
    assert old.served == [dist.group.WORLD] and len(new.served) == 1
    first.remove()
    assert "all_gather_into_tensor" not in vars(ds_comm.cdb)  # DeepSpeed's method again
    assert torch.equal(_gathered(None, async_op=False), expected)
    assert len(old.served) == 1


class _FinishLater(ParameterGatherer):
    """Gathers in its finish step (a collective of its own, as loco's within-node hop)."""

    @override
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
        src = input.clone()
        return lambda: dist.all_gather_into_tensor(output, src, group=group)


@pytest.mark.multirank
@distributed(world_size=2, timeout=180)
def test_finish_steps_run_in_issue_order_whatever_the_wait_order() -> None:
    """ZeRO 3 waits the handles of one module's parameters in a set's order, which differs
    between ranks; the finish steps must still pair the same gathers on every rank."""
    import deepspeed
    from deepspeed import comm as ds

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    handle = gather.route([None], _FinishLater())
    try:
        outs, handles = [], []
        for k in range(3):  # equal sizes: pairing the wrong gathers would swap data silently
            out = torch.empty(4)
            handles.append(ds.all_gather_into_tensor(out, torch.full((2,), 10.0 * k + rank), async_op=True))
            outs.append(out)
        assert not any(h.is_completed() for h in handles)
        for i in (2, 0, 1) if rank == 0 else (1, 2, 0):
            handles[i].wait()
        assert all(h.is_completed() for h in handles)
        sync = torch.empty(4)
        ds.all_gather_into_tensor(sync, torch.full((2,), 7.0 + rank))  # a synchronous call after them
    finally:
        handle.remove()
    for k, out in enumerate(outs):
        assert torch.equal(out, torch.tensor([10.0 * k, 10.0 * k, 10.0 * k + 1, 10.0 * k + 1])), (k, out)
    assert torch.equal(sync, torch.tensor([7.0, 7.0, 8.0, 8.0]))


class _GatherProbe(ZeroPlugin):
    """Owns the parameter all-gather of its engine (a :class:`_Recording` gatherer)."""

    name = "zh_gather_probe"

    def __init__(self) -> None:
        super().__init__(PluginConfig())
        self.gatherer = _Recording()

    @override
    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        registry.register_gatherer(self.gatherer, name=self.name)


def test_the_backend_all_gather_is_declared_by_the_parameter_gather_seam() -> None:
    declared = [i for i in surface.SEAMS["parameter_gather"] if i.name == "all_gather_into_tensor"]
    assert [(i.owner, i.how) for i in declared] == [(surface.BACKEND, "replace")]


@pytest.mark.multirank
@distributed(world_size=2, timeout=180)
def test_detach_gives_the_backend_its_all_gather_back() -> None:
    """The shadow on DeepSpeed's communication backend lives exactly as long as the attachment:
    an engine whose plugin owns the all-gather routes ZeRO 3's gathers through it, and
    ``zerohooks.detach`` leaves the backend (instance and class) as DeepSpeed made it; the plain
    DeepSpeed engine built afterwards trains to the same losses as one built before (the oracle)."""
    import deepspeed
    from deepspeed.comm import comm as ds_comm

    import zerohooks
    from zerohooks.testing.toy import ds_config, make_model, train

    deepspeed.init_distributed(dist_backend="gloo")
    cls_method = type(ds_comm.cdb).__dict__["all_gather_into_tensor"]
    assert "all_gather_into_tensor" not in vars(ds_comm.cdb)
    model = make_model()
    plain, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    before = train(plain, steps=2, gas=1)

    probe = _GatherProbe()
    model = make_model()
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(3), plugins=[probe]
    )
    assert "all_gather_into_tensor" in vars(ds_comm.cdb)  # shadowed on the instance while attached
    train(engine, steps=1, gas=1)
    assert probe.gatherer.served, "ZeRO 3's all-gathers did not reach the owner"
    zerohooks.detach(engine)
    assert "all_gather_into_tensor" not in vars(ds_comm.cdb)
    assert type(ds_comm.cdb).__dict__["all_gather_into_tensor"] is cls_method  # the class never changed
    served = len(probe.gatherer.served)

    model = make_model()
    again, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    assert train(again, steps=2, gas=1) == before
    assert len(probe.gatherer.served) == served  # nothing reached the detached owner
