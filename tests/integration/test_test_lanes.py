"""tools/test_lanes.py: `bash run.sh test` runs the default sessions in lanes side by side.

The dealing is checked against a brute-force optimum, the command line against what nox parses,
and a whole run against a stand-in `nox` on PATH (a script that logs as nox does with `-ts` and
sleeps): the lanes must overlap in time, every session must run exactly once, a failing lane's
status must come back, SIGTERM must stop every lane, and tools/ci_report.py must read the
prefixed log back into the sessions and lanes that ran."""

from __future__ import annotations

import datetime
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import test_lanes  # noqa: E402
import test_plan  # noqa: E402

_FAKE_NOX = textwrap.dedent(
    """\
    #!{python}
    import datetime, os, sys, time
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    sessions = args[args.index("-s") + 1 : cut]
    def say(text):
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        print(f"nox > [{{now}}] {{text}}", flush=True)
    with open(os.environ["FAKE_NOX_RECORD"], "a") as f:
        f.write(" ".join(args) + "\\n")
    failed = False
    for s in sessions:
        say(f"Running session {{s}}")
        time.sleep(float(os.environ.get("FAKE_NOX_SECONDS", "1")))
        if s == os.environ.get("FAKE_NOX_FAIL"):
            say(f"Session {{s}} failed.")
            failed = True
        else:
            say(f"Session {{s}} was successful.")
    sys.exit(3 if failed else 0)
    """
)


def _fake_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A stand-in ``nox`` first on PATH, two lanes unless ``extra`` says otherwise."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    nox = bin_dir / "nox"
    nox.write_text(_FAKE_NOX.format(python=sys.executable))
    nox.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.update(FAKE_NOX_RECORD=str(tmp_path / "calls.txt"), ZEROHOOKS_TEST_LANES="2")
    env.update(extra)
    return env


def _lanes(args: list[str], env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "tools" / "test_lanes.py"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload, no-any-return]


def test_dealing_is_within_the_longest_session_of_the_best_split() -> None:
    seconds = {"a": 600, "b": 530, "c": 430, "d": 150, "e": 130, "f": 60, "g": 45, "h": 40, "i": 30, "j": 1}
    sessions = list(seconds)
    dealt = test_lanes.deal(sessions, seconds, 2)
    assert sorted(itertools.chain(*dealt)) == sorted(sessions)  # each session exactly once
    longest = max(sum(seconds[s] for s in lane) for lane in dealt)
    best = min(
        max(sum(seconds[s] for s in combo), sum(seconds.values()) - sum(seconds[s] for s in combo))
        for r in range(len(sessions) + 1)
        for combo in itertools.combinations(sessions, r)
    )
    # greedy longest-first is within 4/3 of the optimum, and here within the longest session
    assert best <= longest <= best + max(seconds.values()), (longest, best, dealt)
    assert test_lanes.deal(sessions, seconds, 1) == [sorted(sessions, key=lambda s: -seconds[s])]
    assert test_lanes.deal(["x", "y"], {}, 5) == [["x"], ["y"]]  # no empty lanes; unmeasured count


def test_the_lane_command_puts_sessions_before_pytest_options() -> None:
    cmd = test_lanes.lane_command(["nox"], ["-ts", "--", "-x", "-k", "demo"], ["lint", "typecheck"])
    assert cmd == ["nox", "-ts", "-s", "lint", "typecheck", "--", "-x", "-k", "demo"]
    assert test_lanes.lane_command(["nox"], [], ["lint"]) == ["nox", "-s", "lint"]


@pytest.mark.parametrize(
    ("argv", "plain"),
    [
        ([], False),
        (["-ts"], False),
        (["-ts", "--", "-k", "x"], False),  # -k after -- is pytest's
        (["-s", "lint"], True),
        (["--sessions=lint"], True),
        (["-t", "tests"], True),
        (["-l"], True),
        (["--help"], True),
    ],
)
def test_named_sessions_and_questions_go_to_plain_nox(argv: list[str], plain: bool) -> None:
    assert test_lanes.wants_plain_nox(argv) is plain


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_a_bad_lane_count_is_named_with_what_is_accepted(raw: str) -> None:
    with pytest.raises(SystemExit, match=r"ZEROHOOKS_TEST_LANES='.*' is not a number of lanes.*>= 1"):
        test_lanes.lanes_wanted({"ZEROHOOKS_TEST_LANES": raw})
    assert test_lanes.lanes_wanted({"ZEROHOOKS_TEST_LANES": "3"}) == 3
    assert test_lanes.lanes_wanted({}) == test_lanes.default_lanes()


def test_the_default_is_two_lanes_from_two_cpus_then_one_per_two_cpus() -> None:
    assert [test_lanes.default_lanes(n) for n in (1, 2, 3, 4, 5, 6, 16)] == [1, 2, 2, 2, 2, 3, 3]


def test_lanes_run_side_by_side_and_the_report_reads_them(tmp_path: Path) -> None:
    env = _fake_env(tmp_path, FAKE_NOX_SECONDS="0.5")
    start = time.monotonic()
    done = _lanes(["-ts", "--", "-x"], env)
    took = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    sessions = test_plan.default_sessions()
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("-ts -s ") and c.endswith(" -- -x") for c in calls), calls
    ran = [s for c in calls for s in c.split(" -- ")[0].split()[2:]]
    assert sorted(ran) == sorted(sessions)
    # side by side: the lanes' sessions overlap in time, and the run takes the longest lane's time
    longest = max(len(c.split(" -- ")[0].split()[2:]) for c in calls)
    assert longest < len(sessions) and took < 0.5 * longest + 1.5, (took, longest)
    lines = done.stdout.splitlines()
    spans: dict[str, list[datetime.datetime]] = {}
    for ln in lines:
        stamp = re.search(r"^(\[lane \d\]) nox > \[([^\]]+)\]", ln)
        if stamp:
            when = datetime.datetime.strptime(stamp.group(2), "%Y-%m-%d %H:%M:%S,%f")
            spans.setdefault(stamp.group(1), []).append(when)
    assert len(spans) == 2 and max(min(t) for t in spans.values()) < min(max(t) for t in spans.values()), (
        spans
    )
    assert all(ln.startswith(("[lane 1] ", "[lane 2] ", "test_lanes: lane ")) for ln in lines), lines
    # the report reads the interleaved lanes back
    folder = tmp_path / "ci"
    (folder / "junit").mkdir(parents=True)
    (folder / "nox.log").write_text(done.stdout)
    report = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "ci_report.py"), str(folder)], capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    data = json.loads((folder / "summary.json").read_text())
    got = {s["name"]: s for s in data["sessions"]}
    assert sorted(got) == sorted(sessions)
    assert all(s["outcome"] == "success" and 0.4 < s["seconds"] < 5 for s in got.values()), got
    # each lane's sessions as test_lanes announced them (the stand-ins record in whatever order
    # their processes start, not in lane order)
    said = [ln.split(": ", 2) for ln in lines if ln.startswith("test_lanes: lane ")]
    lane_of = {
        s: int(head.split()[-1])
        for _, head, cmd in said
        for s in cmd.split(" -- ")[0].split(" -s ")[1].split()
    }
    assert {n: s["lane"] for n, s in got.items()} == lane_of
    assert "ran side by side in 2 lanes" in report.stdout and "| lane |" in report.stdout
    # the whole run (the longest lane's sessions), not the sum of the sessions
    assert data["total_seconds"] < sum(s["seconds"] for s in got.values()) * (longest + 0.5) / len(sessions)


def test_a_failing_lane_fails_the_run_and_the_other_lane_still_runs(tmp_path: Path) -> None:
    env = _fake_env(tmp_path, FAKE_NOX_SECONDS="0.1", FAKE_NOX_FAIL="lint")
    done = _lanes([], env)
    assert done.returncode == 3, done.stdout
    assert "failed with exit status 3" in done.stdout and "lint" in done.stdout
    ran = done.stdout.count("was successful.") + done.stdout.count("failed.")
    assert ran == len(test_plan.default_sessions()), done.stdout


def test_one_lane_or_named_sessions_run_plain_nox(tmp_path: Path) -> None:
    env = _fake_env(tmp_path, FAKE_NOX_SECONDS="0", ZEROHOOKS_TEST_LANES="1")
    done = _lanes(["-s", "lint"], env)
    assert done.returncode == 0 and "[lane" not in done.stdout, done.stdout
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["-s lint"]


def test_sigterm_stops_every_lane(tmp_path: Path) -> None:
    env = _fake_env(tmp_path, FAKE_NOX_SECONDS="60")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "test_lanes.py")],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    seen = 0
    while seen < 2:  # both lanes are running their first session
        line = proc.stdout.readline()
        assert line, "the lanes ended before they started a session"
        seen += "Running session" in line
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=40) == 124
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 2
    still = subprocess.run(["pgrep", "-f", str(tmp_path / "bin" / "nox")], capture_output=True, text=True)
    assert still.stdout.strip() == "", still.stdout
