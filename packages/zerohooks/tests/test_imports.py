"""The module graph, read from the code (zerohooks.testing.imports): zerohooks imports no plugin,
plugins import zerohooks and never each other, and no modules import each other in a cycle
(typing-only imports aside)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zerohooks.config import KNOWN_PLUGINS, plugin_entry_points
from zerohooks.testing.imports import cycles, edges, external

SRC = Path(__file__).resolve().parents[1] / "src"
REPO_SRCS = sorted(Path(__file__).resolve().parents[2].glob("*/src"))
ZEROHOOKS_NEEDS = {"torch", "deepspeed", "pydantic", "packaging", "hjson"}
"""zerohooks' dependencies (pyproject), and hjson, DeepSpeed's config parser that it reads configs with."""


def test_zerohooks_imports_no_plugin_only_its_dependencies() -> None:
    plugins = set(KNOWN_PLUGINS) | set(plugin_entry_points())
    imported = {(mod, name) for mod, names in external([SRC]).items() for name in names}
    assert not {(m, n) for m, n in imported if n in plugins}
    others = {(m, n) for m, n in imported if n not in sys.stdlib_module_names and n not in ZEROHOOKS_NEEDS}
    assert not others, f"zerohooks imports what it does not depend on: {sorted(others)}"


def test_no_import_cycle_in_zerohooks() -> None:
    assert cycles(edges([SRC])) == []


@pytest.mark.skipif(len(REPO_SRCS) < 2, reason="not a checkout of the monorepo")
def test_no_cycle_and_no_plugin_imports_another_across_the_repository() -> None:
    graph = edges(REPO_SRCS)
    assert cycles(graph) == []
    top = {(a.split(".")[0], b.split(".")[0]) for a, b in graph}
    across = {(a, b) for a, b in top if a != b}
    assert across and all(b == "zerohooks" for _, b in across), sorted(across)


def test_a_cycle_and_a_typing_only_import_are_told_apart(tmp_path: Path) -> None:
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from demo import b\n")
    (pkg / "b.py").write_text("from demo.a import f\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo import a\n")
    (pkg / "d.py").write_text("import torch\nfrom . import c\n")
    graph = edges([tmp_path])
    assert cycles(graph) == [["demo.a", "demo.b"]]
    assert ("demo.c", "demo.a") not in graph and ("demo.d", "demo.c") in graph
    assert external([tmp_path])["demo.d"] == {"torch"}
