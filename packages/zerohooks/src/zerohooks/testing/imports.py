"""The module import graph of source trees, read from their code (``ast``, nothing imported).

    python -m zerohooks.testing.imports packages/*/src            edges "a -> b", then cycles
    python -m zerohooks.testing.imports --packages packages/*/src  edges between packages only

An edge ``a -> b`` is an ``import`` in module ``a`` (at any depth: module level or inside a
function) of module ``b`` of the same trees; ``from p import x`` is an edge to ``p.x`` when that
is a module, else to ``p``.  Imports under ``if TYPE_CHECKING:`` are left out (they never run),
and so is the implicit import of a parent package that importing ``p.x`` runs.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["cycles", "edges", "external", "modules"]


def modules(roots: Iterable[Path]) -> dict[str, Path]:
    """Every module under the source ``roots`` (folders holding top-level packages), by dotted name."""
    out: dict[str, Path] = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts and all(p.isidentifier() for p in parts):
                out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def edges(roots: Iterable[Path]) -> set[tuple[str, str]]:
    """The import edges between the modules of ``roots`` (see the module docstring)."""
    return _read(list(roots))[0]


def external(roots: Iterable[Path]) -> dict[str, set[str]]:
    """Per module of ``roots``, the top-level names it imports from outside ``roots``."""
    return _read(list(roots))[1]


def _read(roots: list[Path]) -> tuple[set[tuple[str, str]], dict[str, set[str]]]:
    mods = modules(roots)
    out: set[tuple[str, str]] = set()
    outside: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                top = t.split(".")[0]
                while t and t not in mods:
                    t = t.rpartition(".")[0]  # import a.b.c of a non-module c: the module a.b
                if t and t != name:
                    out.add((name, t))
                elif not t and top:
                    outside.setdefault(name, set()).add(top)
    return out, outside


def cycles(graph: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each an import cycle)."""
    succ: dict[str, list[str]] = {}
    for a, b in sorted(graph):
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; graphs here are small, recursion depth stays low
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(found)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerohooks.testing.imports", description=__doc__)
    ap.add_argument("roots", nargs="+", type=Path, help="source folders (e.g. packages/*/src)")
    ap.add_argument("--packages", action="store_true", help="edges between top-level packages only")
    args = ap.parse_args(argv)
    graph = edges(args.roots)
    if args.packages:
        graph = {(a.split(".")[0], b.split(".")[0]) for a, b in graph} - {(p, p) for p in modules(args.roots)}
    for a, b in sorted(graph):
        print(f"{a} -> {b}")
    found = cycles(graph)
    for comp in found:
        print(f"cycle: {' <-> '.join(comp)}")
    print(f"{len(graph)} edges, {len(found)} cycles", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
