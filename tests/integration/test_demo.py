"""The main job end to end: the demo trains the GPT through zerohooks on 2 ranks, once as the bf16
baseline and once with loco, and writes its report."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from _scripts import run_script

ROOT = Path(__file__).resolve().parents[2]


def _total(step: dict[str, dict[str, int]]) -> int:
    return sum(sum(v.values()) for v in step.values())


@pytest.mark.multirank
def test_demo_trains_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "report"
    args = ["--steps", "30", "--eval-every", "15", "--layers", "2", "--stage", "2", "--dtype", "bf16"]
    r = run_script("examples/train_gpt.py", *args, "--runs", "baseline,loco", "--out", str(out), timeout=900)
    for name in ("loss.png", "comm_bytes.png", "report.md"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    baseline, loco = data["runs"]
    assert (baseline["name"], loco["name"]) == ("baseline", "loco")
    assert baseline["status"] == "ok" and loco["status"] == "ok", loco.get("reason")
    n_params = data["meta"]["n_params"]
    for run in (baseline, loco):
        losses = run["train_loss"]
        assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns
        assert [s for s, _ in run["val_loss"]] == [0, 15, 30]  # a validation point before training
        # the zerohooks counters saw every bf16 gradient element once per step on each rank
        assert run["comm_bytes"] and len(run["comm_bytes"]) == 30, "zerohooks counters missing"
        for step in run["comm_bytes"]:
            assert _total(step) == 2 * n_params * 2, step
        assert run["wire_bytes"] and len(run["wire_bytes"]) == 30
    # the baseline's all-reduce sends 2 (W-1)/W of its input per rank: as much as it hands over on 2 ranks
    for step in baseline["wire_bytes"]:
        assert set(step) == {"all_reduce"} and abs(_total(step) - 2 * n_params * 2) <= 4, step
    # loco sends 4-bit codes and fp32 scales (0.266 of bf16 per hop) and, on the demo's ZeRO 2,
    # reduces each slice to the rank that keeps it: one hop where the all-reduce takes two
    assert {"int4 codes", "float32 scales"} <= set(loco["wire_bytes"][-1]["all_to_all"])
    assert all("all_gather" not in step for step in loco["wire_bytes"])
    ratio = sum(map(_total, loco["wire_bytes"])) / sum(map(_total, baseline["wire_bytes"]))
    assert 0.266 / 2 * 0.95 <= ratio <= 0.266 / 2 * 1.3, ratio

    report = (out / "report.md").read_text()
    # the ratio in the table is the one computed from the counters
    row = next(ln for ln in report.splitlines() if ln.startswith("| loco |"))
    (shown,) = re.findall(r"\| (\d+\.\d+)x \|", row)
    assert abs(float(shown) - ratio) < 1e-3, row
    assert "wire vs baseline" in report and "sent on the wire" in report
    # the report names the command that ran and the wall time of that command
    (command,) = re.findall(r"^Command: `(.*)`", report, flags=re.M)
    assert shlex.split(command) == r.args, command
    (wall,) = re.findall(r"Wall time of this command, from its start to its exit: ([\d.]+) s", report)
    assert data["meta"]["wall_time_final"] is True
    assert float(wall) == data["meta"]["wall_time_s"]
    assert float(wall) >= sum(run["wall_time_s"] for run in data["runs"])
    said = re.findall(r"train_gpt: done in (\d+) s", r.stdout)
    assert said and abs(int(said[-1]) - float(wall)) <= 1, r.stdout[-2000:]
