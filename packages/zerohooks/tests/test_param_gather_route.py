"""The parameter-gather owner: DeepSpeed's backend all-gather goes to the owner on the routed
groups only, newest route first, and is DeepSpeed's own again once the routes are removed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from typing_extensions import override

from zerohooks import ParameterGatherer
from zerohooks.adapter import gather
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
