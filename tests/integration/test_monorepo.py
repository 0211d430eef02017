"""One place declares a package: its folder ``packages/<name>/`` (pyproject and entry point).
The noxfile's sessions, the GPU bundle and suite, the module graph and zerohooks' catalogue take
their package lists from it (tools/monorepo.py), and a new folder is picked up by all of them."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import monorepo  # noqa: E402

FOLDERS = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
"""The oracle: the folders themselves."""


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _noxfile(monkeypatch: pytest.MonkeyPatch) -> Any:
    """noxfile.py, imported with a stand-in for nox where nox is not importable (its sessions are
    not run here, only its package list read)."""
    if importlib.util.find_spec("nox") is None:
        stub = types.ModuleType("nox")

        def decorator(*args: Any, **kwargs: Any) -> Any:
            return args[0] if args and callable(args[0]) and not kwargs else (lambda f: f)

        stub.session = stub.parametrize = decorator  # type: ignore[attr-defined]
        stub.param = lambda *a, **k: a[0]  # type: ignore[attr-defined]
        stub.options = types.SimpleNamespace()  # type: ignore[attr-defined]
        stub.Session = object  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "nox", stub)
        monkeypatch.setitem(sys.modules, "nox.command", types.ModuleType("nox.command"))
    return _load(ROOT / "noxfile.py", "_noxfile_packages_under_test")


def test_the_noxfile_bundle_and_suite_list_exactly_the_package_folders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert sorted(p.name for p in monorepo.packages()) == FOLDERS
    bundle = _load(ROOT / "tools" / "gpu_bundle.py", "_gpu_bundle_under_test")
    assert sorted(bundle.PACKAGES) == FOLDERS
    suite = _load(ROOT / "tools" / "gpu_suite.py", "_gpu_suite_under_test")
    modules = {(ROOT / "packages" / f / "src").glob("*/__init__.py").__next__().parent.name for f in FOLDERS}
    listed = next(ln for ln in suite.INFO.splitlines() if ln.startswith("MODULES = "))
    assert set(eval(listed.removeprefix("MODULES = "))) == modules
    nf = _noxfile(monkeypatch)
    assert sorted(p.name for p in nf.PACKAGES) == FOLDERS
    assert nf.PACKAGES[0].name == "zerohooks"  # the core's session first


def test_the_catalogue_agrees_with_the_packages_pyprojects() -> None:
    shipped = json.loads((ROOT / monorepo.CATALOGUE).read_text(encoding="utf-8"))
    expected = {}
    for folder in FOLDERS:  # read here directly, not through tools/monorepo.py
        project = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]
        for name in project.get("entry-points", {}).get("zerohooks.plugins", {}):
            expected[name] = project["name"]
    assert shipped == expected, "run: python tools/monorepo.py --write-catalogue"
    assert monorepo.catalogue() == expected
    check = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "monorepo.py"), "--check-catalogue"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr
    from zerohooks.config import KNOWN_PLUGINS

    assert expected == KNOWN_PLUGINS


def test_the_suite_builds_the_plugins_that_declare_kernels() -> None:
    from zerohooks.build import plugin_targets

    installed = set(plugin_targets())  # the plugins whose class declares native extensions
    assert set(monorepo.native_plugins()) == installed & set(monorepo.catalogue())


def test_a_new_package_folder_is_picked_up_everywhere(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "packages" / "zerohooks", tmp_path / "packages" / "zerohooks", ignore=_no_bulk)
    new = tmp_path / "packages" / "newplug"
    (new / "src" / "newplug").mkdir(parents=True)
    (new / "src" / "newplug" / "__init__.py").write_text("")
    (new / "src" / "newplug" / "csrc").mkdir()
    (new / "src" / "newplug" / "csrc" / "k.cpp").write_text("int k() { return 0; }\n")
    (new / "pyproject.toml").write_text(
        '[project]\nname = "zerohooks-newplug"\n\n'
        '[project.entry-points."zerohooks.plugins"]\nnewplug = "newplug.plugin:NewPlugin"\n'
    )
    assert [p.name for p in monorepo.packages(tmp_path)] == ["zerohooks", "newplug"]
    assert monorepo.catalogue(tmp_path) == {"newplug": "zerohooks-newplug"}
    assert monorepo.native_plugins(tmp_path) == ["newplug"]
    graph = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "module_graph.py"), "--label", f"tmp={tmp_path}"],
        capture_output=True,
        text=True,
    )
    assert graph.returncode == 0, graph.stderr
    assert "newplug" not in graph.stdout  # no edge yet: it imports nothing of zerohooks
    (new / "src" / "newplug" / "plugin.py").write_text("from zerohooks import ZeroPlugin\n")
    graph = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "module_graph.py"), "--label", f"tmp={tmp_path}"],
        capture_output=True,
        text=True,
    )
    assert "newplug -> zerohooks (1)" in graph.stdout, graph.stdout


def test_a_package_without_its_module_or_name_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "packages" / "bad"
    bad.mkdir(parents=True)
    (bad / "pyproject.toml").write_text("[project]\n")
    with pytest.raises(ValueError, match=r"\[project\] name is missing"):
        monorepo.packages(tmp_path)
    (bad / "pyproject.toml").write_text('[project]\nname = "zerohooks-bad"\n')
    with pytest.raises(ValueError, match=r"expected exactly one package under src/"):
        monorepo.packages(tmp_path)


def _no_bulk(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("tests", "__pycache__")]
