"""Draw the module import graph of one or more checkouts (read from the code, nothing imported).

    python tools/module_graph.py                                  this checkout
    python tools/module_graph.py --label before=/path/old --label after=.  --out graph
    python tools/module_graph.py --label before=/path/old --label after=. --touch _prepare_sub_group

``--touch NAME`` (repeatable) also lists, per checkout, the source files (tests left out) that
name a DeepSpeed attribute: the files a rename of it in DeepSpeed would make us edit.

For each checkout it prints the counts (modules, edges, cycles, edges from zerohooks to a
plugin, edges between packages) and, with ``--out PREFIX``, writes ``PREFIX.md`` (the counts and
the edges between packages) and ``PREFIX.png``: one panel per checkout, the zerohooks modules in
layers (a module sits above every module it imports), edges in a cycle and edges from zerohooks to
a plugin in red, and each plugin package as one box with its edges into zerohooks.  The edges come
from :mod:`zerohooks.testing.imports` (typing-only imports left out).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "packages" / "zerohooks" / "src"))  # this checkout's, installed or not
from monorepo import plugins  # noqa: E402  (standard library only)

from zerohooks.testing.imports import cycles, edges  # noqa: E402  (zerohooks' core: no DeepSpeed)


def summary(checkout: Path) -> dict[str, object]:
    """Counts and edges of one checkout's ``packages/*/src`` trees."""
    graph = edges(sorted((checkout / "packages").glob("*/src")))
    names = tuple(p.module for p in plugins(checkout))  # the checkout's own plugin packages
    rings = cycles(graph)
    ring_of = {m: k for k, ring in enumerate(rings) for m in ring}
    top = Counter((a.split(".")[0], b.split(".")[0]) for a, b in graph)
    return {
        "graph": graph,
        "cycles": rings,
        "cycle_edges": {(a, b) for a, b in graph if a in ring_of and ring_of[a] == ring_of.get(b)},
        "modules": len({m for e in graph for m in e}),
        "edges": len(graph),
        "zerohooks_to_plugin": sorted(
            (a, b) for a, b in graph if a.startswith("zerohooks") and b.split(".")[0] in names
        ),
        "plugins": names,
        "packages": {f"{a} -> {b}": n for (a, b), n in sorted(top.items()) if a != b},
    }


def _layers(nodes: set[str], graph: set[tuple[str, str]]) -> dict[str, int]:
    """Layer of each node: 0 for modules importing nothing, else one above what they import
    (cycles cut where a node is met again)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in graph:
        if a in succ and b in succ:
            succ[a].append(b)
    depth: dict[str, int] = {}

    def walk(n: str, seen: frozenset[str]) -> int:
        if n in depth:
            return depth[n]
        below = [walk(m, seen | {n}) for m in succ[n] if m not in seen and m != n]
        depth[n] = 1 + max(below) if below else 0
        return depth[n]

    for n in sorted(nodes):
        walk(n, frozenset())
    return depth


def _node(module: str) -> str:
    """The box a module is drawn in: itself for zerohooks, its package for a plugin."""
    return module if module.split(".")[0] == "zerohooks" else module.split(".")[0]


def _short(name: str) -> str:
    return name.removeprefix("zerohooks.") if name != "zerohooks" else "zerohooks/__init__"


def draw(panels: list[tuple[str, dict[str, object]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(13 * len(panels), 15), squeeze=False)
    for ax, (label, s) in zip(axes[0], panels, strict=True):
        graph: set[tuple[str, str]] = s["graph"]  # type: ignore[assignment]
        red: set[tuple[str, str]] = set(s["cycle_edges"]) | set(s["zerohooks_to_plugin"])  # type: ignore[call-overload]
        zh = {m for e in graph for m in e if m.split(".")[0] == "zerohooks"}
        depth = _layers(zh, graph)
        rows: dict[int, list[str]] = {}
        for n, d in sorted(depth.items()):
            rows.setdefault(d, []).append(n)
        top = max(rows, default=0) + 2
        pos: dict[str, tuple[float, float]] = {}
        for d, names in rows.items():
            for k, n in enumerate(names):
                pos[n] = ((k + 0.5) / len(names), d + (0.25 if k % 2 else 0.0))
        names: tuple[str, ...] = s["plugins"]  # type: ignore[assignment]
        for k, p in enumerate(names):
            pos[p] = ((k + 0.5) / len(names), top)
        # each plugin drawn as one box: its modules' edges collapse onto it
        collapsed = {(_node(a), _node(b)) for a, b in graph}
        red_boxes = {(_node(a), _node(b)) for a, b in red}
        for a, b in sorted(collapsed):
            if a == b or a not in pos or b not in pos:
                continue
            bad = (a, b) in red_boxes
            (x0, y0), (x1, y1) = pos[a], pos[b]
            ax.annotate(
                "",
                xy=(x1, y1),
                xytext=(x0, y0),
                arrowprops={"arrowstyle": "->", "color": "red" if bad else "0.75", "lw": 1.6 if bad else 0.5},
                zorder=2 if bad else 1,
            )
        for n, (x, y) in pos.items():
            plugin = n in names
            ax.text(
                x,
                y,
                n if plugin else _short(n),
                ha="center",
                va="center",
                fontsize=9 if plugin else 6.5,
                bbox={"boxstyle": "round", "fc": "#ffe9b3" if plugin else "#dde8f7", "ec": "0.4", "lw": 0.5},
                zorder=3,
            )
        ax.set_xlim(-0.05, 1.05)
        ax.set_ylim(-0.6, top + 0.6)
        ax.axis("off")
        ax.set_title(
            f"{label}: {s['modules']} modules, {s['edges']} import edges, {len(s['cycles'])} cycle(s), "  # type: ignore[arg-type]
            f"{len(s['zerohooks_to_plugin'])} zerohooks -> plugin edges (red)",  # type: ignore[arg-type]
            fontsize=12,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(panels: list[tuple[str, dict[str, object]]]) -> str:
    lines = ["| | " + " | ".join(label for label, _ in panels) + " |", "|---" * (len(panels) + 1) + "|"]
    for key in ("modules", "edges"):
        lines.append(f"| {key} | " + " | ".join(str(s[key]) for _, s in panels) + " |")
    lines.append("| cycles | " + " | ".join(str(len(s["cycles"])) for _, s in panels) + " |")  # type: ignore[arg-type]
    lines.append(
        "| zerohooks -> plugin edges | "
        + " | ".join(str(len(s["zerohooks_to_plugin"])) for _, s in panels)
        + " |"
    )  # type: ignore[arg-type]
    out = "\n".join(lines)
    for label, s in panels:
        out += f"\n\n{label}: edges between packages: " + ", ".join(
            f"{k} ({v})" for k, v in s["packages"].items()
        )  # type: ignore[attr-defined]
        for ring in s["cycles"]:  # type: ignore[attr-defined]
            out += f"\n{label}: cycle: " + " <-> ".join(ring)
        for a, b in s["zerohooks_to_plugin"]:  # type: ignore[attr-defined]
            out += f"\n{label}: zerohooks imports a plugin: {a} -> {b}"
    return out + "\n"


def _code_names(tree: ast.AST) -> set[str]:
    """Identifiers, attribute names and words of string constants in ``tree``, docstrings and
    comments left out (a patched name is often passed as a string)."""
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out.update(w.strip("'\"`.,:;()") for w in n.value.split())
    return out


def touched(checkout: Path, name: str) -> list[str]:
    """Source files (not tests) of ``checkout``'s packages whose code names ``name``."""
    hits = []
    for path in sorted((checkout / "packages").glob("*/src/**/*.py")):
        text = path.read_text(encoding="utf-8")
        if name in text and name in _code_names(ast.parse(text)):
            hits.append(str(path.relative_to(checkout / "packages")))
    return hits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--label", action="append", default=[], help="NAME=CHECKOUT (repeatable; default: this=.)"
    )
    ap.add_argument("--out", help="write PREFIX.md and PREFIX.png")
    ap.add_argument("--touch", action="append", default=[], help="a DeepSpeed name: files naming it")
    a = ap.parse_args(argv)
    panels = []
    for item in a.label or [f"this={ROOT}"]:
        label, sep, where = item.partition("=")
        if not sep or not (Path(where) / "packages").is_dir():
            ap.error(f"--label {item!r}: expected NAME=CHECKOUT, a folder holding packages/*/src")
        panels.append((label, summary(Path(where).resolve())))
    text = report(panels)
    for name in a.touch:
        for item in a.label or [f"this={ROOT}"]:
            label, _, where = item.partition("=")
            files = touched(Path(where), name)
            pkgs = len({f.split("/")[0] for f in files})
            text += f"\n{label}: {name}: {len(files)} file(s) in {pkgs} package(s): {', '.join(files)}"
    text += "\n" if a.touch else ""
    print(text, end="")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + ".md").write_text(text)
        draw(panels, Path(a.out + ".png"))
        print(f"wrote {a.out}.md and {a.out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
