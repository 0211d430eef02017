"""The demo's comparisons complete: ``--runs all`` reports every registered run, trained or skipped
with the reason (runs that cannot run here do not end the comparison, and runs of one launch do
not collide: nvmeswap's runs each find their swap folder free), and the default demo compares the
baseline with the plugins, each run in its own processes.  A tiny model for 2 steps on 2 ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--layers", "1", "--d-model", "32",
    "--heads", "2", "--micro-batch", "2", "--seq-len", "32", "--data-mb", "0.25", "--dtype", "bf16",
]  # fmt: skip


def _demo(out: Path, *argv: str) -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *TINY, "--out", str(out), *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def _registered() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import runs

        return dict(runs.RUNS)
    finally:
        sys.path.remove(str(ROOT / "examples"))


@pytest.mark.multirank
def test_runs_all_reports_every_registered_run(tmp_path: Path) -> None:
    data, report = _demo(tmp_path / "all", "--runs", "all", "--same-process")
    registered = _registered()
    by_name = {r["name"]: r for r in data["runs"]}
    assert list(by_name) == list(registered)  # every run, in registration order
    for name, r in by_name.items():
        assert r["status"] in ("ok", "skipped"), (name, r.get("status"), r.get("reason"))
        if r["status"] == "skipped":
            assert r["reason"], name
            assert f"`{name}` skipped: {r['reason']}" in report
        else:
            assert len(r["train_loss"]) == 2 and r["peak_memory_bytes"] > 0, name
        assert f"| {name} |" in report, name
    # one machine, 2 ranks: the two-level reduction cannot run, and says why
    assert by_name["loco-2level"]["status"] == "skipped"
    assert "two nodes" in by_name["loco-2level"]["reason"]
    # the second nvmeswap run of the process found its own folder free (the first released its lock)
    for name in ("nvmeswap", "nvmeswap-ram"):
        assert by_name[name]["status"] == "ok", by_name[name].get("reason")
        assert by_name[name]["disk_bytes_per_step"]["written"] > 0
    assert by_name["mixedlayers"]["param_dtypes"].get("float32", 0) > 0
    assert by_name["bf16"]["param_dtypes"].get("float32", 0) == 0


@pytest.mark.multirank
def test_default_demo_compares_the_plugins_one_process_per_run(tmp_path: Path) -> None:
    data, report = _demo(tmp_path / "default")
    names = [r["name"] for r in data["runs"]]
    assert names[0] == "baseline" and len(names) >= 2, names
    assert data["meta"]["one_process_per_run"] is True
    table = report[report.index("## What each run changed") :].split("\n\n")[1].splitlines()
    plugin_rows = [ln for ln in table[2:] if not ln.startswith("| baseline |")]
    assert len(plugin_rows) >= 1, table
    by_name = {r["name"]: r for r in data["runs"]}
    if "loco" in by_name:  # 4-bit codes: a fraction of the baseline's bytes on the wire
        loco_row = next(ln for ln in plugin_rows if ln.startswith("| loco |"))
        assert "bytes on the wire" in loco_row, loco_row
    if "accumdtype" in by_name:  # bf16 model: gradients handed over in fp32
        assert by_name["accumdtype"]["comm_dtypes"] == ["float32"]
        assert by_name["baseline"]["comm_dtypes"] == ["bfloat16"]
    assert "`--runs all` adds" in report
    # like against like: nvmeswap's row is against ZeRO 3 with the optimizer in RAM, trained before it
    if "nvmeswap" in by_name:
        assert names.index("zero3") < names.index("nvmeswap"), names
        row = next(ln for ln in plugin_rows if ln.startswith("| nvmeswap |"))
        assert row.split(" | ")[1] == "zero3", row
        state = by_name["nvmeswap"]["state_bytes"][0]
        assert state["swap buffers"] > 0 and "master parameters" not in state, state
    if "autocastzero" in by_name:
        assert by_name["autocastzero"]["dtype"] == "bf16-autocast"
