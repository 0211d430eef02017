"""The plan of ``bash run.sh test [nox options]``, printed before nox starts: the sessions that
will run and how long each took on the project's 2-core machine (benchmarks/CI_TIME.md).

    python tools/test_plan.py            # the default sessions (nox.options.sessions)
    python tools/test_plan.py -s lint    # the sessions named with -s/--session/--sessions

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


def plan(argv: list[str]) -> str:
    sessions = chosen_sessions(argv) or default_sessions()
    seconds, _ = measured_seconds()
    known = [seconds[s] for s in sessions if s in seconds]
    unknown = [s for s in sessions if s not in seconds]
    lines = [f"run.sh test: {len(sessions)} nox session(s), one after another:"]
    for s in sessions:
        took = seconds.get(s)
        said = "not measured" if took is None else f"{took:.0f} s" if took < 60 else f"{took / 60:.1f} min"
        lines.append(f"  {s:<20} {said}")
    total = sum(known) / 60
    lines.append(
        f"expected: about {total:.0f} min on the project's idle 2-core machine"
        + (f" plus {', '.join(unknown)}" if unknown else "")
        + " (benchmarks/CI_TIME.md; more under load, less with more cores)"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    print(plan(argv), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
