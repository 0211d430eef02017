"""The plan of ``bash run.sh test [nox options]``, printed before nox starts: the sessions that
will run and how long each took on the project's 2-core machine (benchmarks/CI_TIME.md).

    python tools/test_plan.py            # the default sessions (nox.options.sessions)
    python tools/test_plan.py -s lint    # the sessions named with -s/--session/--sessions

The default sessions run in ZEROHOOKS_TEST_LANES lanes side by side (tools/test_lanes.py); the
plan shows each lane and the longest lane's expected minutes.

Reads noxfile.py and CI_TIME.md as text (no nox needed), so it runs before anything is installed.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI_TIME = ROOT / "benchmarks" / "CI_TIME.md"


def default_sessions() -> list[str]:
    """``nox.options.sessions`` of noxfile.py, with ``tests`` one session per package."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions":
            names = list(ast.literal_eval(node.value))
    packages = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
    out: list[str] = []
    for n in names:
        if n == "tests":  # zerohooks first, as the noxfile orders them
            out += [f"tests({p})" for p in sorted(packages, key=lambda p: p != "zerohooks")]
        else:
            out.append(n)
    return out


def chosen_sessions(argv: list[str]) -> list[str] | None:
    """The sessions named with -s/--session/--sessions (None: the defaults); tags (-t) and
    keywords (-k) are nox's to resolve, and give None."""
    chosen: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-t", "--tags", "-k", "--keywords"):
            return None
        if a in ("-s", "-e", "--session", "--sessions"):
            i += 1
            while i < len(argv) and not argv[i].startswith("-"):
                chosen.append(argv[i])
                i += 1
            continue
        if a.startswith(("--session=", "--sessions=")):
            chosen.append(a.split("=", 1)[1])
        i += 1
    return chosen or None


def measured_seconds() -> tuple[dict[str, float], str]:
    """Seconds per session from CI_TIME.md's table, and the line that says where they come from."""
    try:
        text = CI_TIME.read_text()
    except OSError:
        return {}, ""
    out: dict[str, float] = {}
    for name, value, unit in re.findall(r"^\| ([\w()-]+) \| ([\d.]+) (s|min) \|", text, flags=re.M):
        out[name] = float(value) * (60 if unit == "min" else 1)
    source = next((ln for ln in text.splitlines() if ln.startswith("`CI=true")), "")
    return out, source


def _said(took: float | None) -> str:
    return "not measured" if took is None else f"{took:.0f} s" if took < 60 else f"{took / 60:.1f} min"


def _expected(minutes: str, unknown: list[str]) -> str:
    return (
        f"expected: about {minutes} on the project's idle 2-core machine"
        + (f" plus {', '.join(unknown)}" if unknown else "")
        + " (benchmarks/CI_TIME.md; more under load, less with more cores)"
    )


def plan(argv: list[str], lanes: int = 1) -> str:
    """The sessions and their measured minutes; with ``lanes`` > 1 and no sessions chosen, the
    lanes tools/test_lanes.py deals them to (``lanes`` is its ZEROHOOKS_TEST_LANES)."""
    import test_lanes  # a sibling script; imports this module, so imported here

    chosen = chosen_sessions(argv)
    sessions = chosen or default_sessions()
    seconds, _ = measured_seconds()
    unknown = [s for s in sessions if s not in seconds]
    if lanes > 1 and not test_lanes.wants_plain_nox(argv):
        dealt = test_lanes.deal(sessions, seconds, lanes)
        lines = [f"run.sh test: {len(sessions)} nox session(s) in {len(dealt)} lanes side by side:"]
        sums = []
        for i, lane in enumerate(dealt, start=1):
            sums.append(sum(seconds.get(s, 0.0) for s in lane) / 60)
            lines.append(f"  lane {i}: " + ", ".join(f"{s} ({_said(seconds.get(s))})" for s in lane))
        lines.append(_expected(f"{max(sums):.0f} min (the longest lane)", unknown))
        return "\n".join(lines)
    lines = [f"run.sh test: {len(sessions)} nox session(s), one after another:"]
    for s in sessions:
        lines.append(f"  {s:<20} {_said(seconds.get(s))}")
    total = sum(seconds[s] for s in sessions if s in seconds) / 60
    lines.append(_expected(f"{total:.0f} min", unknown))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import test_lanes

    print(plan(argv, test_lanes.lanes_wanted()), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
