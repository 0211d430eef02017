"""zerohooks.testing.run_distributed: a rank forked by the fork server behaves like a spawned one.

What a rank must take from its caller at the moment of the call (not when the fork server
started): the environment, stdout and stderr (pytest's capture files), the working folder; and
what it must do when it ends: run its ``atexit`` handlers (zerohooks' exit guard, nvmeswap's
swap-file cleanup).  Each start method runs the same checks."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import pytest

from zerohooks.testing import MultiRankError, run_distributed


def _probe(marker_dir: str) -> dict[str, str | None]:
    import torch.distributed as dist

    rank = dist.get_rank()
    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    atexit.register(lambda: Path(marker_dir, f"atexit{rank}").write_text("ran"))
    return {"env": os.environ.get("ZH_HARNESS_PROBE"), "cwd": os.getcwd()}


def _die() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)


@pytest.mark.multirank
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_take_the_callers_env_output_and_run_exit_handlers(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ZEROHOOKS_TEST_START_METHOD", method)
    for value in ("first", "second"):  # the second call must see the changed value too
        monkeypatch.setenv("ZH_HARNESS_PROBE", value)
        out = run_distributed(_probe, 2, args=(str(tmp_path),))
        assert [r["env"] for r in out] == [value, value]
        assert {r["cwd"] for r in out} == {os.getcwd()}
    captured = capfd.readouterr()
    for rank in (0, 1):
        assert captured.out.count(f"stdout of rank {rank}") == 2, captured.out
        assert captured.err.count(f"stderr of rank {rank}") == 2, captured.err
        assert (tmp_path / f"atexit{rank}").read_text() == "ran"


@pytest.mark.multirank
def test_a_rank_that_dies_is_named_with_its_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROHOOKS_TEST_START_METHOD", "forkserver")
    with pytest.raises(MultiRankError, match=r"rank\(s\) \[1\] died without reporting \(exit codes \[3\]\)"):
        run_distributed(_die, 2, timeout=60)


def test_an_unknown_start_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROHOOKS_TEST_START_METHOD", "fork")
    with pytest.raises(ValueError, match="accepted values are forkserver, spawn"):
        run_distributed(_die, 2)


def _dynamo_loaded() -> bool:
    # with DeepSpeed's optimizer check's import of torch._inductor (through its Muon module)
    return "torch._dynamo" in sys.modules and "torch._inductor.compile_fx" in sys.modules


@pytest.mark.multirank
def test_forked_ranks_find_torch_dynamo_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server imports torch._dynamo once (a rank's first torch optimizer needs it: 3-30 s
    a rank on the loaded 2-core machine) and torch._inductor (DeepSpeed's ZeRO optimizer check
    imports it: 1.6-4.3 s a rank); a spawned rank, which starts from nothing, has neither."""
    monkeypatch.setenv("ZEROHOOKS_TEST_START_METHOD", "forkserver")
    assert run_distributed(_dynamo_loaded, 1) == [True]
    monkeypatch.setenv("ZEROHOOKS_TEST_START_METHOD", "spawn")
    assert run_distributed(_dynamo_loaded, 1) == [False]  # the probe can tell the two apart


def _collector_state() -> tuple[int, bool]:
    """How many objects the collector keeps out of its passes, and whether an object made now
    is still collected (a cycle of two objects, dropped)."""
    import gc
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    return gc.get_freeze_count(), gone() is None


@pytest.mark.multirank
def test_ranks_keep_what_the_imports_made_out_of_full_collections() -> None:
    """DeepSpeed calls ``gc.collect()`` in every ZeRO-3 engine it builds; in a rank that imported
    torch, DeepSpeed and torch._dynamo each call walked millions of objects (the conformance
    tests took 115 s, 63 s with them frozen). A rank starts its function with them frozen, and
    what the function makes is still collected."""
    ((frozen, collected),) = run_distributed(_collector_state, 1)
    assert frozen > 100_000, frozen
    assert collected


def _count_runs(folder: str) -> int:
    import torch.distributed as dist

    rank = dist.get_rank()
    with open(os.path.join(folder, f"ran{rank}"), "a") as f:
        f.write("x")
    dist.barrier()
    return rank


@pytest.mark.multirank
def test_a_failed_gloo_connection_starts_the_launch_again_before_anything_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 of the first launch fails to join with gloo's connection error: the launch starts
    again, the function runs once on each rank (not on rank 0 of the failed launch), and stderr
    says why."""
    monkeypatch.setenv(
        "ZEROHOOKS_TEST_RENDEZVOUS_FAULT", f"{tmp_path}:Gloo connectFullMesh failed (injected)"
    )
    assert run_distributed(_count_runs, 2, args=(str(tmp_path),), timeout=120) == [0, 1]
    assert (tmp_path / "done").exists()  # the fault did fire
    assert [(tmp_path / f"ran{r}").read_text() for r in (0, 1)] == ["x", "x"]
    err = capfd.readouterr().err
    assert "rank 1 of 2 could not join the process group" in err and "(2 of 3)" in err, err


@pytest.mark.multirank
def test_another_failure_to_join_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROHOOKS_TEST_RENDEZVOUS_FAULT", f"{tmp_path}:a broken environment (injected)")
    with pytest.raises(MultiRankError, match=r"rank 1 of 2 could not start:(.|\n)*a broken environment"):
        run_distributed(_count_runs, 2, args=(str(tmp_path),), timeout=120)
    assert not list(tmp_path.glob("ran*"))  # rank 0 joined but never ran the function
