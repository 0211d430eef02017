"""The watchdog on zerohooks collectives: bounded waits that name the stalled rank, and ranks that
agree at start-up so a failure on one reaches all of them."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerohooks
from zerohooks import watchdog
from zerohooks.errors import CollectiveTimeoutError, ConfigError, RankFailedError
from zerohooks.testing import distributed, run_distributed
from zerohooks.testing.recording import RecordingPlugin
from zerohooks.testing.toy import ds_config, make_model, train

LIMIT = 2.0


def test_limit_from_environment_and_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(watchdog.ENV, raising=False)
    assert watchdog.collective_timeout() == watchdog.DEFAULT_TIMEOUT_S
    with watchdog.set_collective_timeout(7):
        assert watchdog.collective_timeout() == 7.0
        monkeypatch.setenv(watchdog.ENV, "12.5")  # the environment (set by launchers) wins
        assert watchdog.collective_timeout() == 12.5
        monkeypatch.setenv(watchdog.ENV, "off")
        assert watchdog.collective_timeout() is None
        monkeypatch.delenv(watchdog.ENV)
    assert watchdog.collective_timeout() == watchdog.DEFAULT_TIMEOUT_S
    for bad in ("-1", "inf", "soon", "nan"):
        monkeypatch.setenv(watchdog.ENV, bad)
        with pytest.raises(ConfigError, match=rf"{watchdog.ENV}=.*positive number of seconds"):
            watchdog.collective_timeout()
    with pytest.raises(ConfigError, match="positive finite"):
        watchdog.set_collective_timeout(0)


@pytest.mark.multirank
@distributed(world_size=2)
def test_bounded_collectives_give_what_plain_ones_give() -> None:
    rank = dist.get_rank()
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)
    plain = x.clone()
    dist.all_reduce(plain)
    bounded = x.clone()
    watchdog.run("test all_reduce", None, lambda: dist.all_reduce(bounded, async_op=True))
    assert torch.equal(plain, bounded)
    assert watchdog.gather_objects({"rank": rank, "x": "y" * rank}, "test gather") == [
        {"rank": 0, "x": ""},
        {"rank": 1, "x": "y"},
    ]
    watchdog.barrier("test barrier")


def _diverged() -> tuple[str, str, list[str]]:
    """Rank 1 failed on its own and went to the agreement; rank 0 went on to another gather."""
    watchdog.set_collective_timeout(30)
    try:
        if dist.get_rank() == 0:
            watchdog.gather_objects({"need": 123}, "disk-space exchange")
        else:
            watchdog.agree(OSError(28, "no space on rank 1"), "plugin set-up")
    except Exception as e:
        return type(e).__name__, str(e), list(getattr(e, "__notes__", []))
    return "none", "", []


@pytest.mark.multirank
def test_ranks_at_different_gathers_fail_naming_where_each_is() -> None:
    (kind0, text0, _), (kind1, text1, notes1) = run_distributed(_diverged, 2, timeout=120)
    assert kind0 == "RankFailedError", (kind0, text0)
    assert "rank 0: disk-space exchange" in text0 and "rank 1: agreement on plugin set-up" in text0
    assert kind1 == "OSError" and "no space on rank 1" in text1  # the failing rank keeps its own error
    assert any("different zerohooks steps" in n for n in notes1), notes1


def _late_joiner() -> tuple[str, float]:
    """Rank 1 is alive but stays out of the collective for longer than the limit."""
    watchdog.set_collective_timeout(LIMIT)
    rank = dist.get_rank()
    watchdog.barrier("first barrier")  # both heartbeats are running from here on
    x = torch.ones(4)
    if rank == 1:
        time.sleep(3 * LIMIT)
    t0 = time.monotonic()
    try:
        watchdog.run("test all_reduce", None, lambda: dist.all_reduce(x, async_op=True))
    except CollectiveTimeoutError as e:
        return str(e), time.monotonic() - t0
    return "completed", time.monotonic() - t0


@pytest.mark.multirank
def test_alive_rank_that_does_not_join_is_named() -> None:
    (message, waited), _ = run_distributed(_late_joiner, 2, timeout=120)
    assert "rank 0: zerohooks collective test all_reduce" in message
    assert f"did not complete within the {LIMIT:g} s limit" in message
    assert "Rank 1 is alive but has not joined: it is outside zerohooks collectives" in message
    assert "Not responding" not in message
    assert LIMIT <= waited < LIMIT + 5, waited


def _patient_with_a_late_joiner() -> str:
    """Rank 1 is alive but stays out of a patient gather for about two limits; rank 0 waits."""
    import contextlib
    import io

    watchdog.set_collective_timeout(LIMIT)
    watchdog.barrier("first barrier")
    if dist.get_rank() == 1:
        time.sleep(2.5 * LIMIT)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        seen = watchdog.gather_objects(dist.get_rank(), "test patient gather", patient=True)
    assert seen == [0, 1]
    return err.getvalue()


@pytest.mark.multirank
def test_a_patient_wait_names_where_an_alive_late_rank_is() -> None:
    err0, _ = run_distributed(_patient_with_a_late_joiner, 2, timeout=120)
    assert "rank 0: still waiting in test patient gather" in err0, err0
    assert "every rank is alive, not all in it: rank 1 is outside zerohooks collectives" in err0, err0


def _new_group_then_late_joiner() -> tuple[str, float, bool]:
    """The process group is destroyed and made anew (a new store) between two uses."""
    from zerohooks.testing import _free_port

    watchdog.set_collective_timeout(LIMIT)
    port = watchdog.gather_objects(_free_port() if dist.get_rank() == 0 else None, "port")[0]
    old = watchdog._heart
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo")
    message, waited = _late_joiner()
    heart = watchdog._heart
    fresh = (
        heart is not None and heart is not old and heart.source is dist.distributed_c10d._get_default_store()
    )
    return message, waited, fresh and old is not None and old.stopped.is_set()


@pytest.mark.multirank
def test_a_new_process_group_gets_a_new_heartbeat() -> None:
    (message, _, fresh), (_, _, fresh1) = run_distributed(_new_group_then_late_joiner, 2, timeout=120)
    assert fresh and fresh1  # the old beat stopped; the new one writes to the new group's store
    assert "Rank 1 is alive but has not joined" in message and "Not responding" not in message, message


def _frozen_peer() -> tuple[str, float]:
    """Rank 1 stops itself (SIGSTOP, as a frozen or swapped-out process); rank 0 must name it."""
    watchdog.set_collective_timeout(LIMIT)
    rank = dist.get_rank()
    pids = watchdog.gather_objects(os.getpid(), "pids")
    x = torch.ones(4)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        watchdog.run("test all_reduce", None, lambda: dist.all_reduce(x, async_op=True))
    except CollectiveTimeoutError as e:
        result = str(e), time.monotonic() - t0
    else:
        result = "completed", time.monotonic() - t0
    if rank == 0:
        os.kill(pids[1], signal.SIGCONT)  # let it finish, so the harness can collect it
    return result


@pytest.mark.multirank
def test_frozen_rank_is_named_within_the_limit() -> None:
    (message, waited), _ = run_distributed(_frozen_peer, 2, timeout=120)
    assert "rank 0: zerohooks collective test all_reduce" in message
    assert "Not responding: rank(s) [1]" in message
    assert LIMIT <= waited < LIMIT + 5, waited


class _FailOn(RecordingPlugin):
    """A plugin that fails on one rank, either before DeepSpeed builds the engine or after."""

    def __init__(self, rank: int, when: str) -> None:
        super().__init__()
        self.fail_rank = rank
        self.when = when

    def _maybe_fail(self, when: str) -> None:
        if when == self.when and dist.get_rank() == self.fail_rank:
            raise OSError(28, f"no space left for the plugin's files on rank {self.fail_rank}")

    def attach(self, registry: Any, ctx: Any) -> None:
        self._maybe_fail("set-up")
        super().attach(registry, ctx)

    def engine_ready(self, engine: Any, registry: Any) -> None:
        self._maybe_fail("engine")
        super().engine_ready(engine, registry)


def _one_rank_fails(when: str) -> tuple[str, str, bool]:
    watchdog.set_collective_timeout(60)
    model = make_model()
    try:
        zerohooks.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(2), plugins=[_FailOn(1, when)]
        )
    except (OSError, RankFailedError) as e:
        failed = (type(e).__name__, str(e))
    else:
        failed = ("none", "")
    # every rank is free and in step afterwards: a plain engine trains on both
    model = make_model()
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=ds_config(2))
    train(engine, 1, 2)
    return failed[0], failed[1], zerohooks.attachment(engine) is not None


@pytest.mark.multirank
@pytest.mark.parametrize("when", ["set-up", "engine"])
def test_a_failure_on_one_rank_reaches_every_rank(when: str) -> None:
    t0 = time.monotonic()
    (kind0, text0, _), (kind1, text1, _) = run_distributed(_one_rank_fails, 2, args=(when,), timeout=240)
    assert kind1 == "OSError" and "no space left" in text1  # the failing rank raises its own error
    assert kind0 == "RankFailedError", (kind0, text0)
    assert "failed on 1 of 2 rank(s)" in text0 and "rank 1: OSError" in text0 and "no space left" in text0
    assert time.monotonic() - t0 < 200


_EXIT_CHILD = """
import atexit, socket, threading, time

def report() -> None:  # registered before zerohooks is imported: runs after its exit handler
    alive = [t.name for t in threading.enumerate() if t.name == "zerohooks-heartbeat" and t.is_alive()]
    print("alive at exit:", alive, flush=True)

atexit.register(report)
import torch.distributed as dist
from zerohooks import watchdog

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
heart = watchdog._heartbeat(2.0)
assert heart is not None and heart.thread.is_alive()


class SlowStore:  # a beat that takes a while (a loaded store host)
    entered = threading.Event()

    def set(self, key: str, value: str) -> None:
        self.entered.set()
        time.sleep(1.5)


heart.store = SlowStore()
assert SlowStore.entered.wait(30)  # the heartbeat is inside a beat...
newer = watchdog._heartbeat(3.0)  # ...when a new limit replaces it
assert newer is not None and newer is not heart and heart.stopped.is_set() and heart.thread.is_alive()
print("beating", flush=True)
"""


def test_the_heartbeat_thread_is_joined_before_the_interpreter_exits() -> None:
    """A daemon heartbeat left inside the store client's C++ code at interpreter exit can abort the
    process (std::terminate); zerohooks joins it at exit, before finalization: the current one and
    one replaced (new limit) while inside a beat."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXIT_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "beating" in done.stdout and "alive at exit: []" in done.stdout, done.stdout + done.stderr[-2000:]


def test_store_keys_are_per_torchrun_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarts a failed job with the same store (its agent's): what the previous attempt
    left there (its heartbeats, a stall report) is not read by the next one."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    report = "zerohooks/stall-report"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    watchdog._store(server).set(report, "attempt 0 found rank 1 stalled")
    assert watchdog._store(server).check([report])  # the same attempt reads it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not watchdog._store(server).check([report])
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert not watchdog._store(server).check([report])  # a plain launch: its own keys too
