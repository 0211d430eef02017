"""tools/ci_report.py: the summary `.ci/run` prints from nox's log and pytest's JUnit files.

The JUnit file is pytest's own (a small test file run by a real pytest), the log has nox's
timestamped lines; the report must count what pytest ran, time each session from the log, order
the slowest tests and warn past the budget."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "ci_report.py"

_TESTS = textwrap.dedent(
    """
    import time
    import pytest

    def test_slow():
        time.sleep(0.6)

    def test_fast():
        pass

    def test_fails():
        assert 1 == 2

    @pytest.mark.skip(reason="no")
    def test_skipped():
        pass
    """
)

_LOG = textwrap.dedent(
    """\
    nox > [2026-01-01 10:00:00,000] Running session tests(zerohooks)
    nox > [2026-01-01 10:00:00,500] Creating virtual environment (uv) using python3 in .nox/tests-zerohooks
    nox > [2026-01-01 10:00:04,500] uv pip install torch==2.13.0 -e packages/zerohooks
    nox > [2026-01-01 10:00:30,000] install took 25.5 s
    nox > [2026-01-01 10:00:31,000] pytest packages/zerohooks/tests
    nox > [2026-01-01 10:03:30,500] Session tests(zerohooks) was successful.
    nox > [2026-01-01 10:03:30,600] Running session lint
    nox > [2026-01-01 10:03:31,600] Session lint failed.
    nox > [2026-01-01 10:03:31,700] Running session typecheck
    nox > [2026-01-01 10:03:41,700] mypy ...
    """
)


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), str(folder), *args], capture_output=True, text=True, timeout=120
    )


def test_report_counts_times_and_orders_what_pytest_ran(tmp_path: Path) -> None:
    (tmp_path / "junit").mkdir()
    tests = tmp_path / "src" / "test_sample.py"
    tests.parent.mkdir()
    tests.write_text(_TESTS)
    junit = tmp_path / "junit" / "tests_zerohooks.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), f"--junitxml={junit}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    (tmp_path / "nox.log").write_text(_LOG)

    out = _run(tmp_path, "--budget-minutes", "25", "--slowest", "2")
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["counts"] == {"run": 4, "passed": 2, "failed": 1, "error": 0, "skipped": 1}
    sessions = {s["name"]: (s["seconds"], s["outcome"]) for s in data["sessions"]}
    assert sessions["tests(zerohooks)"] == (210.5, "success")
    parts = {s["name"]: (s["venv_seconds"], s["install_seconds"]) for s in data["sessions"]}
    assert parts["tests(zerohooks)"] == (4.0, 25.5) and parts["lint"] == (0.0, 0.0)
    assert sessions["lint"] == (1.0, "failed")
    assert sessions["typecheck"] == (10.0, "unfinished")  # cut: no end line
    assert data["total_seconds"] == 221.7  # first to last stamped line
    slowest = out.stdout.split("Slowest 2 tests:")[1]
    rows = [ln for ln in slowest.splitlines() if ln.startswith("| `")]
    assert len(rows) == 2 and "test_slow" in rows[0]
    assert "| tests(zerohooks) | 3.5 min | success | 4.0 s | 25.5 s | 4 |" in out.stdout
    assert "WARNING" not in out.stdout


def test_report_warns_past_the_budget_and_takes_the_given_total(tmp_path: Path) -> None:
    (tmp_path / "nox.log").write_text(_LOG)
    out = _run(tmp_path, "--budget-minutes", "2", "--total-seconds", "1500")
    assert out.returncode == 0, out.stderr
    assert "WARNING: the run took 25.0 min, over the budget of 2.0 min" in out.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["total_seconds"] == 1500.0
    assert (tmp_path / "summary.md").read_text() == out.stdout.rstrip("\n") + "\n"
