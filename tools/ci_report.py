"""Where the test command's time goes: sessions, tests, counts, against a budget.

    python tools/ci_report.py reports/ci              # after `.ci/run` (it calls this itself)
    python tools/ci_report.py reports/ci --budget-minutes 25 --slowest 20

Reads what `.ci/run` leaves in the folder:

- ``nox.log``: nox's output with timestamps (``nox -ts``), for each session's wall time (venv,
  installs, kernel builds and pytest together) and its outcome; lines of sessions run side by
  side come prefixed ``[lane N] `` (tools/test_lanes.py), each lane read as its own sequence;
- ``junit/*.xml``: one JUnit file per pytest run (the nox test sessions write them), for every
  test's wall time (setup, call and teardown) and outcome.

Prints the total, each session's time, the slowest tests and the number of tests run, passed,
failed and skipped, with a warning (not a failure: shared machines are noisy) when the run took
longer than the budget; writes ``summary.md`` and ``summary.json`` beside the inputs, the list of
every test executed included, so two runs can be compared test for test.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

_STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]"
_START = re.compile(rf"^nox > {_STAMP} Running session (.+?)\s*$")
_END = re.compile(rf"^nox > {_STAMP} Session (.+?) (was successful|failed|skipped|aborted)")
_ANY = re.compile(rf"^nox > {_STAMP} ")
_VENV = re.compile(rf"^nox > {_STAMP} Creating virtual environment")
_INSTALL = re.compile(rf"^nox > {_STAMP} install took ([0-9.]+) s")
_LANE = re.compile(r"^\[lane (\d+)\] ")


@dataclass
class Session:
    """One nox session as the log shows it."""

    name: str
    seconds: float
    outcome: str
    venv_seconds: float = 0.0
    """Creating its virtual environment (from nox's line to the next one)."""
    install_seconds: float = 0.0
    """Installing packages into it (the noxfile's "install took" lines)."""
    lane: int = 0
    """The lane it ran in when sessions ran side by side (tools/test_lanes.py); 0: no lanes."""


@dataclass
class Test:
    """One test case of a JUnit file."""

    session: str
    nodeid: str
    seconds: float
    outcome: str  # passed, failed, error, skipped


@dataclass
class Report:
    """Everything the summary prints."""

    total_seconds: float | None
    budget_seconds: float
    sessions: list[Session] = field(default_factory=list)
    tests: list[Test] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {"run": len(self.tests), "passed": 0, "failed": 0, "error": 0, "skipped": 0}
        for t in self.tests:
            out[t.outcome] += 1
        return out


def _time(stamp: str) -> dt.datetime:
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")


def read_sessions(log: Path) -> tuple[list[Session], float | None]:
    """Sessions in the order they ended, and the seconds from the first to the last stamped line.
    Lines prefixed ``[lane N] `` belong to lane N's nox; each lane has its own current session."""
    sessions: list[Session] = []
    started: dict[str, tuple[dt.datetime, int]] = {}
    parts: dict[str, list[float]] = {}  # session -> [venv seconds, install seconds]
    current: dict[int, str] = {}  # lane -> its running session
    venv_since: dict[int, dt.datetime] = {}
    first = last = None
    for raw in log.read_text(encoding="utf-8", errors="replace").splitlines():
        lane_m = _LANE.match(raw)
        lane = int(lane_m.group(1)) if lane_m else 0
        line = raw[lane_m.end() :] if lane_m else raw
        stamp = _ANY.match(line)
        if stamp:
            now = _time(stamp.group(1))
            first = min(first, now) if first else now
            last = max(last, now) if last else now
            since = venv_since.get(lane)
            if since is not None and lane in current and not _VENV.match(line):
                parts[current[lane]][0] += (now - since).total_seconds()
                del venv_since[lane]
        m = _START.match(line)
        if m:
            current[lane] = m.group(2)
            started[m.group(2)] = (_time(m.group(1)), lane)
            parts[m.group(2)] = [0.0, 0.0]
            continue
        m = _VENV.match(line)
        if m and lane in current:
            venv_since[lane] = _time(m.group(1))
            continue
        m = _INSTALL.match(line)
        if m and lane in current:
            parts[current[lane]][1] += float(m.group(2))
            continue
        m = _END.match(line)
        if m and m.group(2) in started:
            name = m.group(2)
            when, lane = started.pop(name)
            seconds = (_time(m.group(1)) - when).total_seconds()
            outcome = {"was successful": "success"}.get(m.group(3), m.group(3))
            sessions.append(Session(name, seconds, outcome, *parts.get(name, [0.0, 0.0]), lane=lane))
    for name, (when, lane) in started.items():  # cut by the time limit: no end line
        seconds = ((last or when) - when).total_seconds()
        sessions.append(Session(name, seconds, "unfinished", *parts.get(name, [0.0, 0.0]), lane=lane))
    total = (last - first).total_seconds() if first and last else None
    return sessions, total


def read_tests(folder: Path) -> list[Test]:
    """Every test case of every JUnit file in ``folder`` (the file's stem names the session)."""
    tests: list[Test] = []
    for path in sorted(folder.glob("*.xml")):
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:  # a run killed while pytest wrote it
            print(
                f"ci_report: {path} is not readable JUnit XML ({e}); its tests are not counted",
                file=sys.stderr,
            )
            continue
        for case in root.iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed"}.get(child.tag, child.tag)
                    break
            module = case.get("classname", "")
            nodeid = (
                f"{module.replace('.', '/')}.py::{case.get('name', '?')}" if module else case.get("name", "?")
            )
            tests.append(Test(path.stem, nodeid, float(case.get("time") or 0.0), outcome))
    return tests


def _fmt(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def render(report: Report, slowest: int) -> str:
    """The summary as markdown (printed and written)."""
    lines = ["# Test run: where the time went", ""]
    total = report.total_seconds
    budget = report.budget_seconds
    if total is not None:
        lines.append(f"Total: **{_fmt(total)}** (budget {_fmt(budget)}).")
        if total > budget:
            lines.append(
                f"\n**WARNING: the run took {_fmt(total)}, over the budget of {_fmt(budget)}.** "
                "Look at the slowest sessions and tests below before adding more."
            )
    c = report.counts()
    lines += [
        "",
        f"Tests: {c['run']} run, {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
        f"{c['skipped']} skipped.",
        "",
    ]
    lanes = sorted({s.lane for s in report.sessions} - {0})
    if lanes:
        lines += [
            f"Sessions ran side by side in {len(lanes)} lanes (tools/test_lanes.py); "
            "a session's time is its own wall time, stretched by the lane beside it.",
            "",
        ]
    lines += [
        "| session | time | outcome | venv | installs | tests | test time | the rest (builds, collection) |"
        + (" lane |" if lanes else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if lanes else ""),
    ]
    for s in report.sessions:
        mine = [t for t in report.tests if t.session == _safe(s.name)]
        test_time = sum(t.seconds for t in mine)
        rest = max(0.0, s.seconds - s.venv_seconds - s.install_seconds - test_time)
        lines.append(
            f"| {s.name} | {_fmt(s.seconds)} | {s.outcome} | {_fmt(s.venv_seconds)} | "
            f"{_fmt(s.install_seconds)} | {len(mine)} | {_fmt(test_time)} | {_fmt(rest)} |"
            + (f" {s.lane} |" if lanes else "")
        )
    lines += ["", f"Slowest {slowest} tests:", "", "| test | session | time | outcome |", "|---|---|---|---|"]
    for t in sorted(report.tests, key=lambda t: -t.seconds)[:slowest]:
        lines.append(f"| `{t.nodeid}` | {t.session} | {_fmt(t.seconds)} | {t.outcome} |")
    return "\n".join(lines) + "\n"


def _safe(name: str) -> str:
    """A session name as the noxfile names its JUnit file."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="what .ci/run wrote: nox.log and junit/")
    ap.add_argument("--budget-minutes", type=float, default=25.0, help="warn above this (default 25)")
    ap.add_argument("--slowest", type=int, default=20, help="how many of the slowest tests to list")
    ap.add_argument(
        "--total-seconds",
        type=float,
        help="the whole run's wall time (default: first to last line of nox.log)",
    )
    args = ap.parse_args(argv)
    log = args.folder / "nox.log"
    sessions, total = read_sessions(log) if log.is_file() else ([], None)
    if args.total_seconds is not None:
        total = args.total_seconds
    report = Report(total, args.budget_minutes * 60, sessions, read_tests(args.folder / "junit"))
    text = render(report, args.slowest)
    print(text)
    (args.folder / "summary.md").write_text(text, encoding="utf-8")
    data = asdict(report) | {"counts": report.counts()}
    (args.folder / "summary.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
