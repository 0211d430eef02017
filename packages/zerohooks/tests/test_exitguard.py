"""The exit guard: a process that loaded zerohooks waits, before Python finalizes, until its gloo
worker threads hold no collective (one freed during finalization aborts the process with
std::terminate); exit codes and exceptions are kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zerohooks.testing import _free_port

_RANK = """
import atexit, os, sys, time

def observe() -> None:  # registered before zerohooks is imported: runs after its exit handler
    from zerohooks import exitguard
    busy = exitguard.gloo_workers_busy()
    print(f"busy at exit: {len(busy)} after {time.monotonic() - T:.2f} s", flush=True)

atexit.register(observe)
import zerohooks
from zerohooks import exitguard

if os.environ["GUARD"] == "off":
    atexit.unregister(exitguard._at_exit)
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    # a collective left in flight: rank 1 joins it 2 s later, while this rank is exiting
    dist.all_gather([torch.empty(4) for _ in range(2)], torch.ones(4), async_op=True)
    T = time.monotonic()
    sys.exit(3)
T = time.monotonic()
if os.environ["JOIN"] == "never":  # alive, never joins: rank 0's exit handler gives up at its limit
    time.sleep(exitguard.LIMIT_S + 8)
    os._exit(0)
time.sleep(float(os.environ["JOIN"]))
dist.all_gather([torch.empty(4) for _ in range(2)], torch.ones(4))
raise ValueError("rank 1 fails after its last collective")
"""


def _launch(guard: str, join: str = "2.0") -> list[tuple[int, str, str]]:
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK],
            env={
                **os.environ,
                "GUARD": guard,
                "JOIN": join,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(r),
                "WORLD_SIZE": "2",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append((p.returncode, stdout, stderr))
    return out


@pytest.mark.multirank
def test_exit_waits_for_gloo_workers_and_keeps_exit_codes() -> None:
    (rc0, out0, err0), (rc1, _, err1) = _launch("on")
    assert rc0 == 3, err0[-3000:]  # sys.exit(3) stays 3
    assert rc1 == 1 and "ValueError: rank 1 fails after its last collective" in err1, err1[-3000:]
    # rank 0's worker was inside the all_gather until rank 1 joined: the guard waited for it
    line = next(ln for ln in out0.splitlines() if ln.startswith("busy at exit"))
    busy, waited = int(line.split()[3]), float(line.split()[5])
    assert busy == 0 and waited >= 1.0, line
    assert "terminate called" not in err0 + err1


@pytest.mark.multirank
def test_without_the_guard_a_worker_is_still_busy_at_finalization() -> None:
    """The control: the same ranks with the handler removed reach finalization with rank 0's
    worker still inside the collective (what the guard's test checks is not vacuous)."""
    (_, out0, err0), _ = _launch("off")
    line = next(ln for ln in out0.splitlines() if ln.startswith("busy at exit"))
    assert int(line.split()[3]) == 1 and float(line.split()[5]) < 1.0, line + err0[-2000:]


@pytest.mark.multirank
def test_the_guard_gives_up_at_its_limit() -> None:
    """A collective that never completes (the peer alive but never joining): the exit waits
    :data:`~zerohooks.exitguard.LIMIT_S`, not longer, and says why."""
    from zerohooks import exitguard

    (_, out0, err0), _ = _launch("on", join="never")
    line = next(ln for ln in out0.splitlines() if ln.startswith("busy at exit"))
    busy, waited = int(line.split()[3]), float(line.split()[5])
    assert busy >= 1 and exitguard.LIMIT_S <= waited < exitguard.LIMIT_S + 5, line
    assert "a gloo worker thread is still busy after 10 s" in err0, err0[-2000:]


_GROUPS = """
import time
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from zerohooks import exitguard
from zerohooks.testing import _free_port

exitguard._QUIET_S = 2.0  # each look's quiet period, magnified: every look taken shows in the time


def timed(what: str) -> None:
    t0 = time.monotonic()
    idle = exitguard.wait_for_gloo_workers()
    print(what, idle, f"{time.monotonic() - t0:.2f}", len(exitguard._workers()), flush=True)


timed("none")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # no gloo: as on NCCL
timed("fake")
dist.destroy_process_group()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
timed("gloo")
dist.destroy_process_group()
"""


def test_without_a_gloo_group_the_guard_takes_no_look() -> None:
    """No process group, or one that is not gloo (NCCL; here PyTorch's fake backend): no gloo
    worker, so the guard returns without one quiet period.  The control: a gloo group's idle
    workers are looked at (one quiet period, magnified to 2 s here)."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    done = subprocess.run([sys.executable, "-c", _GROUPS], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {ln.split()[0]: ln.split()[1:] for ln in done.stdout.splitlines()}
    for what in ("none", "fake"):
        idle, seconds, workers = seen[what]
        assert idle == "True" and workers == "0" and float(seconds) < 1.0, (what, seen)
    idle, seconds, workers = seen["gloo"]
    assert idle == "True" and int(workers) >= 1 and float(seconds) >= 2.0, seen
