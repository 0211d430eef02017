"""A rank stopped (SIGSTOP) at a random moment of training, inside DeepSpeed's own collectives
(ZeRO 1/2 gradient reduction and grad-norm all-reduce, ZeRO 3 parameter all-gathers), is named
by the other rank within the limit, which raises instead of waiting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zerohooks import stepwatch

LIMIT = 3.0
_DRIVER = os.path.join(os.path.dirname(__file__), "stall_trials.py")


def _trials(specs: list[tuple[str, int, int]]) -> list[dict[str, object]]:
    """Run one driver per (stages, trials, seed) side by side; every trial's result."""
    procs = [
        subprocess.Popen(
            [sys.executable, _DRIVER, stages, str(n), str(LIMIT), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for stages, n, seed in specs
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == sum(n for _, n, _ in specs), results
    return results


def _check(results: list[dict[str, object]]) -> None:
    for r in results:
        assert r["error"] == "CollectiveTimeoutError", r
        message = str(r["message"])
        assert message.startswith("rank 0: a rank stalled during DeepSpeedEngine."), r
        assert "Not responding: rank(s) [1]" in message and "rank 1 was last heard" in message, r
        # at least the limit less one heartbeat interval (the last beat comes before the stop)
    assert LIMIT - 0.5 <= float(r["detected_after"]) <= LIMIT + 10, r  # type: ignore[arg-type]


@pytest.mark.multirank
def test_a_rank_stopped_at_random_moments_is_named_within_the_limit() -> None:
    """20 trials over ZeRO 1, 2 and 3 (two drivers side by side), no plugin: only DeepSpeed's own
    collectives run."""
    results = _trials([("1,2,3", 10, 1), ("3,2,1", 10, 2)])
    assert {r["stage"] for r in results} == {1, 2, 3}
    _check(results)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(
    os.environ.get("ZEROHOOKS_LONG_TESTS") != "1", reason="a long sweep: ZEROHOOKS_LONG_TESTS=1"
)
def test_a_longer_sweep_of_stopped_ranks() -> None:
    _check(_trials([("1,2,3", 30, 3), ("3,2,1", 30, 4)]))


def test_where_the_main_thread_is_names_its_frames() -> None:
    """Read from another thread, as the heartbeat reads it, while the main thread waits."""
    import threading

    seen: list[str] = []
    done = threading.Event()

    def look() -> None:
        seen.append(stepwatch.where_main_thread_is(depth=8))
        done.set()

    def waiting_in_a_known_place() -> None:
        threading.Thread(target=look).start()
        assert done.wait(30)

    waiting_in_a_known_place()
    assert "waiting_in_a_known_place (tests/test_stepwatch.py:" in seen[0], seen
