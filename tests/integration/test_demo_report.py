"""The demo's report compares like with like and overwrites nothing, and run.sh checks its
command before it installs anything.  Fast checks: no ranks are started."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def demo() -> Iterator[dict[str, ModuleType]]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import outdir
        import report
        import report_state
        import runs

        yield {"runs": runs, "outdir": outdir, "report": report, "report_state": report_state}
    finally:
        sys.path.remove(str(EXAMPLES))


# --- like for like -----------------------------------------------------------------------------


def _differences(a: dict, b: dict, path: str = "") -> set[str]:
    """The config keys (dotted) whose values differ between two DeepSpeed config dicts."""
    out: set[str] = set()
    for key in set(a) | set(b):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out |= _differences(va, vb, f"{path}{key}.")
        elif va != vb:
            out.add(f"{path}{key}")
    return out


BASE = {
    "train_micro_batch_size_per_gpu": 16,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
    "fp16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


@pytest.mark.parametrize(
    ("run", "dtype", "first_baseline", "allowed"),
    [
        # nvmeswap: ZeRO 3 with the optimizer state in RAM, differing only by the swap
        ("nvmeswap", "bf16", "zero3", {"nvmeswap", "zero_optimization.offload_optimizer", "zero_force_ds_cpu_optimizer"}),
        ("nvmeswap-ram", "bf16", "zero3", {"nvmeswap", "zero_optimization.offload_optimizer", "zero_force_ds_cpu_optimizer"}),
        # loco: against DeepSpeed's bf16 reduction (the bf16 baseline, or bf16comm in an fp32 model)
        ("loco", "bf16", "baseline", {"loco"}),
        ("loco", "fp32", "bf16comm", {"loco", "communication_data_type"}),
        ("accumdtype", "bf16", "baseline", {"accumdtype"}),
        ("mixedlayers", "bf16", "baseline", {"mixedlayers"}),
        ("mixedlayers", "fp32", "bf16", {"mixedlayers"}),
        ("autocastzero", "bf16", "fp32", {"autocastzero"}),
        ("autocastzero", "fp32", "baseline", {"autocastzero"}),
    ],
)  # fmt: skip
def test_each_plugin_is_compared_with_the_run_that_differs_only_by_it(
    demo: dict[str, ModuleType], run: str, dtype: str, first_baseline: str, allowed: set[str]
) -> None:
    runs = demo["runs"]
    base = json.loads(json.dumps(BASE))
    base["bf16"]["enabled"] = dtype == "bf16"
    baselines = runs.RUNS[run].baselines(dtype, 2)
    assert baselines[0] == first_baseline, baselines
    mine = runs.RUNS[run].config(base)
    theirs = runs.RUNS[baselines[0]].config(base)
    # the oracle: the two configs, compared key by key, differ only in what the plugin changes
    assert _differences(mine, theirs) <= allowed, _differences(mine, theirs)
    assert _differences(mine, theirs), "the run and its baseline are the same configuration"
    # and every default run trains after its baselines (those that can run here)
    default = runs.default_runs(dtype, 2)
    if run in default:
        for b in baselines:
            if runs.left_out_baseline(b) is None:
                assert b in default and default.index(b) < default.index(run), (b, default)


def test_the_old_default_compared_nvmeswap_across_stages(demo: dict[str, ModuleType]) -> None:
    """The check above can fail: nvmeswap against the ZeRO 2 baseline changes the stage too."""
    runs = demo["runs"]
    diff = _differences(runs.RUNS["nvmeswap"].config(BASE), runs.RUNS["baseline"].config(BASE))
    assert "zero_optimization.stage" in diff


def test_ds_nvme_joins_nvmeswaps_comparison_where_it_can_run(demo: dict[str, ModuleType]) -> None:
    runs = demo["runs"]
    assert runs.RUNS["nvmeswap"].baselines("bf16", 2) == ("zero3", "ds-nvme")
    assert runs.RUNS["nvmeswap"].baselines("bf16", 3) == ("baseline", "ds-nvme")  # --stage 3: no zero3 copy
    default = runs.default_runs("bf16", 2)
    assert ("ds-nvme" in default) == (runs.left_out_baseline("ds-nvme") is None), default


def _result(name: str, baselines: list[str], step_ms: list[float], state: dict[str, int]) -> dict:
    return {
        "name": name,
        "status": "ok",
        "baselines": baselines,
        "warmup_steps": 0,
        "step_time_s": [t / 1e3 for t in step_ms],
        "state_bytes": [state, state],
        "zero_stage": 3 if "3" in name or "nvme" in name else 2,
        "load_avg": [2.0, 3.5],
    }


def test_the_report_puts_each_row_against_its_named_baseline(demo: dict[str, ModuleType]) -> None:
    report = demo["report"]
    results = [
        _result("baseline", [], [100, 110, 120, 130], {"parameters": 2000, "optimizer state": 8000}),
        _result("zero3", [], [200, 210, 220, 230], {"parameters": 1000, "optimizer state": 8000}),
        _result("nvmeswap", ["zero3", "ds-nvme"], [400, 410, 420, 430], {"parameters": 1000, "swap buffers": 500}),
        _result("loco", ["bf16comm"], [90, 100, 110, 120], {"parameters": 2000, "optimizer state": 8000, "error buffers": 4000}),
    ]  # fmt: skip
    text = report.plugin_section(results, {"cpu_count": 2})
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ") for ln in text if ln.startswith("| ") and "---" not in ln}
    assert rows["nvmeswap"][1] == "zero3"  # not the ZeRO 2 baseline
    assert (
        "model state 8.79 KiB -> 1.46 KiB/rank (optimizer state -7.81 KiB, swap buffers +500 B)"
        in rows["nvmeswap"][3]
    )
    # median 415 / 215 with the quartiles' range
    assert "step time 1.93x" in rows["nvmeswap"][3]
    # loco's named baseline did not run: the first run, said plainly
    assert rows["loco"][1] == "baseline (not like for like)"
    assert "error buffers +3.91 KiB" in rows["loco"][3]
    assert any("load average was 2.0 to 3.5" in ln for ln in text)


def test_a_ratio_inside_the_steps_spread_is_called_noise(demo: dict[str, ModuleType]) -> None:
    rs = demo["report_state"]
    a = _result("a", [], [100, 140, 100, 140, 100, 140], {})
    b = _result("b", [], [110, 130, 110, 130, 110, 130], {})
    c = _result("c", [], [300, 310, 300, 310, 300, 310], {})
    assert "within the noise" in rs.time_ratio(a, b)
    assert "beyond the steps' spread, still one run each" in rs.time_ratio(c, b)
    assert "load 2.0-3.5 vs 2.0-3.5" in rs.time_ratio(c, b)


def test_the_autocast_row_says_bf16_autocast(demo: dict[str, ModuleType]) -> None:
    """train_gpt names the dtype of an autocast run by its forward, not by its fp32 parameters."""
    text = (EXAMPLES / "train_gpt.py").read_text()
    assert "dtype = f\"{'fp16' if autocast in ('float16', 'fp16') else 'bf16'}-autocast\"" in text
    runs = demo["runs"]
    cfg = runs.RUNS["autocastzero"].config(BASE)
    assert cfg["autocastzero"]["dtype"] == "bfloat16" and not cfg["bf16"]["enabled"]


# --- nothing overwritten -------------------------------------------------------------------------


def test_each_command_gets_its_own_folder_and_latest_follows(
    demo: dict[str, ModuleType], tmp_path: Path
) -> None:
    outdir = demo["outdir"]
    parent = tmp_path / "reports"
    first = outdir.choose(None, False, "default", parent)
    first.mkdir(parents=True)
    (first / "results.json").write_text("{}")
    outdir.point_latest(first, parent)
    second = outdir.choose(None, False, "default", parent)
    assert second != first and not second.exists()
    second.mkdir()
    outdir.point_latest(second, parent)
    assert (parent / "latest").resolve() == second.resolve()
    assert (first / "results.json").read_text() == "{}"  # the first report is still there


def test_out_with_a_report_is_refused_without_force(demo: dict[str, ModuleType], tmp_path: Path) -> None:
    outdir = demo["outdir"]
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(outdir.OutExists, match="--force"):
        outdir.choose(str(tmp_path), False, "x")
    assert outdir.choose(str(tmp_path), True, "x") == tmp_path
    assert outdir.choose(str(tmp_path / "new"), False, "x") == tmp_path / "new"


def test_the_demo_refuses_to_overwrite_before_starting_anything(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text('{"runs": []}')
    cmd = [sys.executable, str(EXAMPLES / "train_gpt.py"), "--runs", "baseline", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "already holds a report" in r.stderr and "--force" in r.stderr
    assert (tmp_path / "results.json").read_text() == '{"runs": []}'
    assert "launching" not in r.stdout


# --- run.sh ---------------------------------------------------------------------------------------


def _bare_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has bash and coreutils but no pip, apt-get, sudo, nox or uv
    (each installer is a script that records that it ran), and whose python has no nox."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "installed.log"
    for tool in ("apt-get", "sudo", "pip", "pip3", "nox", "uv", "dpkg"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\necho {tool} "$@" >> {log}\nexit 1\n')
        script.chmod(0o755)
    python = bin_dir / "python3"
    python.write_text(f'#!/bin/sh\necho python3 "$@" >> {log}\nexit 1\n')
    python.chmod(0o755)
    for tool in ("bash", "dirname", "cat", "id", "printf"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path), "PYTHON": str(python)}


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_run_sh_help_exits_0_and_installs_nothing(tmp_path: Path, flag: str) -> None:
    env = _bare_path(tmp_path)
    r = subprocess.run(
        ["bash", str(ROOT / "run.sh"), flag], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "usage: bash run.sh COMMAND" in r.stdout
    for command in ("demo", "examples", "test", "gpu-bundle"):
        assert f"  {command} " in r.stdout
    assert not (tmp_path / "installed.log").exists(), (tmp_path / "installed.log").read_text()


def test_run_sh_names_an_unknown_command_and_the_commands(tmp_path: Path) -> None:
    env = _bare_path(tmp_path)
    r = subprocess.run(
        ["bash", str(ROOT / "run.sh"), "dmeo"], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 2
    assert "unknown command 'dmeo'" in r.stderr and "demo, examples, test, gpu-bundle" in r.stderr
    assert not (tmp_path / "installed.log").exists()


def test_run_sh_goes_on_to_install_for_a_real_command(tmp_path: Path) -> None:
    """The check above can fail: a known command does reach the install step (apt-get as root,
    else the stand-in python asked for nox; each stand-in records its call and fails)."""
    env = _bare_path(tmp_path)
    r = subprocess.run(
        ["bash", str(ROOT / "run.sh"), "demo"], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode != 0
    calls = (tmp_path / "installed.log").read_text()
    assert "apt-get" in calls or "python3 -m" in calls, calls


def test_the_test_command_prints_its_plan_first() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "test_plan.py"), "-s", "lint", "integration"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0
    ci = (ROOT / "benchmarks" / "CI_TIME.md").read_text()
    # the last table of sessions is the one the plan reads (a session's row starts with its name)
    minutes = float(re.findall(r"^\| integration \| ([0-9.]+) min", ci, flags=re.M)[-1])
    lint_s = float(re.findall(r"^\| lint \| ([0-9.]+) s", ci, flags=re.M)[-1])
    assert "2 nox session(s)" in r.stderr and f"integration          {minutes:.1f} min" in r.stderr
    # the expectation is the sum of both sessions (12.5 min + 1.3 s says "about 13", not 12)
    assert f"about {minutes + lint_s / 60:.0f} min" in r.stderr
    full = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "test_plan.py")],
        capture_output=True,
        text=True,
        env={**os.environ, "ZEROHOOKS_TEST_LANES": "2"},
    )
    assert "tests(zerohooks)" in full.stderr and "typecheck" in full.stderr
    # two lanes (the default on 4 CPUs or more): each named with its sessions, the longest expected
    assert "in 2 lanes side by side" in full.stderr and "lane 2: " in full.stderr, full.stderr
    text = (ROOT / "run.sh").read_text()
    assert text.index("tools/test_plan.py") < text.index('exec "$PYTHON" tools/test_lanes.py "$@"')


def test_the_report_names_the_baselines_not_trained(demo: dict[str, ModuleType]) -> None:
    import train_gpt

    args = train_gpt.parse_args(["--runs", "nvmeswap,loco", "--dtype", "bf16"])
    left = train_gpt.baselines_left_out(args)
    assert left["zero3"] == "nvmeswap's baseline, not in --runs"
    assert left["baseline"] == "loco's baseline, not in --runs"
    lines = demo["report_state"].left_out_lines({"baselines_left_out": left})
    assert "- baseline `zero3` not trained here: nvmeswap's baseline, not in --runs." in lines
    args = train_gpt.parse_args(["--runs", "zero3,nvmeswap,baseline,loco", "--dtype", "bf16"])
    assert set(train_gpt.baselines_left_out(args)) <= {"ds-nvme"}
