"""The monorepo's packages, read from ``packages/*/pyproject.toml``: the one place a package is
declared (standard library only, so the noxfile and every tool can import it).

    python tools/monorepo.py                      list the packages (folder, distribution, module, plugins)
    python tools/monorepo.py --check-catalogue    fail when zerohooks/catalogue.json disagrees with packages/*
    python tools/monorepo.py --write-catalogue    regenerate zerohooks/catalogue.json from packages/*

A package is a folder ``packages/<name>/`` holding a ``pyproject.toml`` and ``src/<module>/``; a
plugin package registers its plugin class in the ``zerohooks.plugins`` entry-point group of that
pyproject (``[project.entry-points."zerohooks.plugins"]``).  The noxfile's sessions, the GPU
bundle and suite (``tools/gpu_bundle.py``, ``tools/gpu_suite.py``), the module graph
(``tools/module_graph.py``) and zerohooks' ``catalogue.json`` all take their package list from
:func:`packages`; nothing else names them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox depends on tomli on Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, no-redef, unused-ignore]

__all__ = [
    "CORE",
    "ENTRY_POINT_GROUP",
    "ROOT",
    "Package",
    "catalogue",
    "native_plugins",
    "packages",
    "plugins",
]

ROOT = Path(__file__).resolve().parents[1]
CORE = "zerohooks"
"""The shared package (hook registry and DeepSpeed adapter); every other package is a plugin."""
ENTRY_POINT_GROUP = "zerohooks.plugins"
"""The entry-point group plugins register in (``zerohooks.config.ENTRY_POINT_GROUP``)."""
CATALOGUE = Path("packages") / CORE / "src" / CORE / "catalogue.json"
"""zerohooks' list of the plugins this project publishes, relative to the checkout."""


@dataclass(frozen=True)
class Package:
    """One ``packages/<name>/`` folder, as its ``pyproject.toml`` declares it."""

    name: str
    """The folder's name (``tests(<name>)`` in nox)."""
    path: Path
    """``packages/<name>``."""
    dist: str
    """The distribution name (``pip install <dist>``): ``[project] name``."""
    module: str
    """The import name: the one package folder under ``src/``."""
    entry_points: tuple[tuple[str, str], ...]
    """The ``zerohooks.plugins`` entry points: (plugin name, ``module:Class``)."""
    extras: tuple[str, ...]
    """The optional-dependency groups (``[project.optional-dependencies]``), sorted."""

    @property
    def rel(self) -> str:
        return f"packages/{self.name}"

    @property
    def src(self) -> Path:
        return self.path / "src"

    @property
    def tests(self) -> Path:
        return self.path / "tests"

    @property
    def is_core(self) -> bool:
        return self.name == CORE

    @property
    def native(self) -> bool:
        """Whether the package ships C++/CUDA sources (kernels ``python -m zerohooks.build`` builds)."""
        return any(f.suffix in (".cpp", ".cu") for f in self.src.rglob("*") if f.is_file())


def _read(folder: Path) -> Package:
    pyproject = folder / "pyproject.toml"
    data: dict[str, Any] = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = data.get("project", {})
    dist = project.get("name")
    if not isinstance(dist, str) or not dist:
        raise ValueError(f"{pyproject}: [project] name is missing; every package names its distribution")
    modules = sorted(p.name for p in (folder / "src").glob("*/__init__.py") for p in [p.parent])
    if len(modules) != 1:
        raise ValueError(
            f"{folder}: expected exactly one package under src/ (src/<module>/__init__.py), found {modules}"
        )
    eps = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    return Package(
        name=folder.name,
        path=folder,
        dist=dist,
        module=modules[0],
        entry_points=tuple(sorted((str(k), str(v)) for k, v in eps.items())),
        extras=tuple(sorted(project.get("optional-dependencies", {}))),
    )


def packages(root: Path = ROOT) -> list[Package]:
    """Every ``packages/*/`` of the checkout ``root`` with a ``pyproject.toml``: zerohooks first,
    then the plugins by name."""
    found = [_read(p.parent) for p in sorted((root / "packages").glob("*/pyproject.toml"))]
    return sorted(found, key=lambda p: (not p.is_core, p.name))


def plugins(root: Path = ROOT) -> list[Package]:
    """The plugin packages (every package but zerohooks)."""
    return [p for p in packages(root) if not p.is_core]


def native_plugins(root: Path = ROOT) -> list[str]:
    """The plugins (entry-point names) whose packages ship kernels: ``python -m zerohooks.build``'s
    default targets."""
    return [name for p in plugins(root) if p.native for name, _ in p.entry_points]


def catalogue(root: Path = ROOT) -> dict[str, str]:
    """What ``catalogue.json`` must hold: plugin (entry-point) name -> distribution, for every
    plugin package of the checkout."""
    out: dict[str, str] = {}
    for pkg in plugins(root):
        for name, _ in pkg.entry_points:
            if name in out:
                raise ValueError(f"plugin {name!r} is registered by both {out[name]} and {pkg.dist}")
            out[name] = pkg.dist
    return dict(sorted(out.items()))


def catalogue_text(root: Path = ROOT) -> str:
    return json.dumps(catalogue(root), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check-catalogue", action="store_true", help="fail when catalogue.json is stale")
    mode.add_argument("--write-catalogue", action="store_true", help="regenerate catalogue.json")
    a = ap.parse_args(argv)
    path = ROOT / CATALOGUE
    if a.write_catalogue:
        path.write_text(catalogue_text(), encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
        return 0
    if a.check_catalogue:
        if path.read_text(encoding="utf-8") != catalogue_text():
            print(
                f"{path.relative_to(ROOT)} disagrees with packages/*/pyproject.toml; "
                "run: python tools/monorepo.py --write-catalogue",
                file=sys.stderr,
            )
            return 1
        return 0
    for p in packages():
        eps = ", ".join(f"{n} = {v}" for n, v in p.entry_points) or "-"
        print(f"{p.rel:<24} {p.dist:<24} {p.module:<14} {eps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
