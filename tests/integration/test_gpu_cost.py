"""GPU cost guarded on CPU: per optimizer step, each plugin's aten ops and host syncs against its
DeepSpeed equivalent measured in the same launch (benchmarks/bench_gpu_cost.py; budgets in its
docstring and benchmarks/RESULTS.md).  A deliberately wasteful plugin must break the budgets."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu_cost  # noqa: E402

pytestmark = pytest.mark.multirank
STAGES = (2, 3)


@pytest.fixture(scope="module")
def counts() -> dict[int, dict[str, Any]]:
    """Both stages, every run, 2 gloo ranks, one launch (rank 0's counts)."""
    return bench_gpu_cost.measure(list(STAGES))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("plugin", list(bench_gpu_cost.PAIRS))
def test_plugin_within_gpu_cost_budget(counts: dict[int, dict[str, Any]], stage: int, plugin: str) -> None:
    runs = counts[stage]
    equivalent = bench_gpu_cost.PAIRS[plugin]
    p, e = runs[plugin], runs[equivalent]
    # the measurement saw real work on both sides
    assert bench_gpu_cost.total(e, "ops") > 100 and bench_gpu_cost.total(e, "syncs") >= 1
    assert p["fwd_bwd"]["syncs"] == 0, p["fwd_bwd"]["sync_ops"]
    assert bench_gpu_cost.check_pair(plugin, p, equivalent, e) == []
    if plugin == "loco":  # loco did quantize: its kernels ran (once per bucket, or per parameter on ZeRO 3)
        assert bench_gpu_cost.own_kernel_calls(p) >= 2 * 2


@pytest.mark.parametrize("stage", STAGES)
def test_a_wasteful_plugin_breaks_the_budgets(counts: dict[int, dict[str, Any]], stage: int) -> None:
    runs = counts[stage]
    broken = bench_gpu_cost.check_pair("wasteful", runs["wasteful"], "ds-bf16", runs["ds-bf16"])
    assert len(broken) == 2, broken
    assert "forward/backward" in broken[0] and "per step" in broken[1]
    # its syncs are counted exactly: one per micro-step in backward, two before the step
    assert runs["wasteful"]["fwd_bwd"]["syncs"] - runs["ds-bf16"]["fwd_bwd"]["syncs"] == 2
    assert (
        bench_gpu_cost.total(runs["wasteful"], "syncs") - bench_gpu_cost.total(runs["ds-bf16"], "syncs") == 4
    )
