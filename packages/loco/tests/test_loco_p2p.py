"""loco's point-to-point all-to-all and all-gather (loco.p2p, used on gloo) against gloo's own
collectives, on real ranks: the same rows, bit for bit, on the whole world and on sub-groups,
with several exchanges in flight at once, and a bounded wait that fails when a peer is late."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from loco import p2p
from zerohooks import watchdog
from zerohooks.errors import CollectiveTimeoutError
from zerohooks.testing import distributed


def _rows(group: object, per_rank: int, salt: int) -> torch.Tensor:
    """This rank's input: distinct values per rank, row and salt."""
    w = dist.get_world_size(group)
    base = torch.arange(w * per_rank, dtype=torch.float32) + 1000 * dist.get_rank() + 0.25 * salt
    return base.to(torch.bfloat16 if salt % 2 else torch.float32)


@pytest.mark.multirank
@distributed(world_size=4)
def test_exchanges_equal_gloo_collectives() -> None:
    groups = {"world": dist.group.WORLD}
    for ranks in ([0, 2], [1, 3], [1, 2, 3]):
        g = dist.new_group(ranks)  # every rank makes every group, in the same order
        if dist.get_rank() in ranks:
            groups[str(ranks)] = g
    for name, group in groups.items():
        assert p2p.preferred(group, torch.empty(1))
        # device memory (a GPU cannot exist here; "meta" is memory that is not the host's): gloo's
        # point-to-point aborts the sender on CUDA tensors, so loco keeps gloo's collectives there
        assert not p2p.preferred(group, torch.empty(1, device="meta"))
        w = dist.get_world_size(group)
        for per_rank in (1, 7, 4096):
            # several exchanges issued before any is waited, waited in reverse order
            issued = []
            for salt in range(3):
                inp = _rows(group, per_rank, salt)
                out = torch.full_like(inp, float("nan"))
                issued.append(("a2a", inp, out, p2p.all_to_all_single(out, inp, group)))
                mine = inp[:per_rank].clone()
                gathered = torch.full((w * per_rank,), float("nan"), dtype=inp.dtype)
                issued.append(("gather", mine, gathered, p2p.all_gather(gathered, mine, group)))
            for _, _, _, ex in reversed(issued):
                assert ex.wait(timeout=datetime.timedelta(seconds=60))
                assert ex.is_completed()
            for kind, inp, out, _ in issued:
                want = torch.empty_like(out)
                if kind == "a2a":
                    dist.all_to_all_single(want, inp, group=group)
                else:
                    dist.all_gather_into_tensor(want, inp, group=group)
                assert torch.equal(out, want), (name, kind, per_rank)


@pytest.mark.multirank
@distributed(world_size=2)
def test_shapes_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split in 2 rows"):
        p2p.all_to_all_single(torch.empty(5), torch.empty(5), dist.group.WORLD)
    with pytest.raises(ValueError, match="expected 2 x"):
        p2p.all_gather(torch.empty(5), torch.empty(3), dist.group.WORLD)


@pytest.mark.multirank
@distributed(world_size=2)
def test_a_late_peer_fails_the_bounded_wait_with_the_ranks_named() -> None:
    inp = torch.arange(2 * 1024, dtype=torch.float32)
    out = torch.empty_like(inp)
    if dist.get_rank() == 1:
        time.sleep(6.0)  # never sends: rank 0 must give up after its 1 s limit
        return
    t0 = time.monotonic()
    with watchdog.set_collective_timeout(1.0), pytest.raises(CollectiveTimeoutError) as caught:
        watchdog.run(
            "loco p2p test", dist.group.WORLD, lambda: p2p.all_to_all_single(out, inp, dist.group.WORLD)
        )
    assert time.monotonic() - t0 < 4.5
    assert "loco p2p test" in str(caught.value) and "within the 1 s limit" in str(caught.value)
