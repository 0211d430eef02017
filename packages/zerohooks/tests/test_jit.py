"""zerohooks.jit.local_rank0_first on 2 gloo ranks of one machine: local rank 0 builds first,
the others wait and follow its result."""

from __future__ import annotations

import time

import torch.distributed as dist

from zerohooks.jit import local_rank0_first
from zerohooks.testing import run_distributed


def _calls(rank0_ok: bool) -> tuple[list[tuple[int, bool]], object]:
    """The (rank, build) of each load call on this rank, and what local_rank0_first returned;
    rank 0's load fails when ``rank0_ok`` is false."""
    rank = dist.get_rank()
    calls: list[tuple[int, bool]] = []

    def load(build: bool = True) -> object:
        calls.append((rank, build))
        return "built" if (rank0_ok or rank != 0) and build else None

    return calls, local_rank0_first(load)


def test_the_other_ranks_follow_local_rank0s_result() -> None:
    for rank0_ok in (True, False):
        (calls0, out0), (calls1, out1) = run_distributed(_calls, 2, args=(rank0_ok,), timeout=120)
        assert calls0 == [(0, True)]  # rank 0 builds, once
        assert calls1 == [(1, rank0_ok)]  # rank 1 builds only if rank 0 succeeded
        assert out0 == out1 == ("built" if rank0_ok else None)


def _finish_times() -> float:
    """When this rank's load returned; rank 0's is slow, so a rank that did not wait returns first."""
    rank = dist.get_rank()

    def load(build: bool = True) -> float:
        if rank == 0:
            time.sleep(1.0)
        return time.time()

    return float(local_rank0_first(load))


def test_the_other_ranks_load_after_local_rank0_finished() -> None:
    t0, t1 = run_distributed(_finish_times, 2, timeout=120)
    assert t1 >= t0


def test_without_a_process_group_it_is_load() -> None:
    assert local_rank0_first(lambda build=True: ("called", build)) == ("called", True)
