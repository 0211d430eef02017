"""noxfile.py's demo session reuses an up-to-date venv: the install fingerprint changes with the
packages' pyproject.toml, the constraints, the requirements and the install arguments, and with
nothing else (editable installs follow source changes by themselves)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _noxfile(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Import noxfile.py; with a stand-in for nox (for this test only) when nox is not installed."""
    if "nox" not in sys.modules and importlib.util.find_spec("nox") is None:
        stub = types.ModuleType("nox")

        def decorator(*args: Any, **kwargs: Any) -> Any:
            if args and callable(args[0]) and not kwargs:
                return args[0]
            return lambda f: f

        stub.session = decorator  # type: ignore[attr-defined]
        stub.parametrize = decorator  # type: ignore[attr-defined]
        stub.param = lambda *a, **k: a[0]  # type: ignore[attr-defined]
        stub.options = types.SimpleNamespace()  # type: ignore[attr-defined]
        stub.Session = object  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "nox", stub)
        monkeypatch.setitem(sys.modules, "nox.command", types.ModuleType("nox.command"))
    pytest.importorskip("packaging")
    spec = importlib.util.spec_from_file_location("_noxfile_under_test", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fingerprint_follows_what_decides_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nf = _noxfile(monkeypatch)
    pyproject, constraints, req = (
        tmp_path / n for n in ("pyproject.toml", "constraints.txt", "requirements.txt")
    )
    pyproject.write_text("[project]\nname='a'\n")
    constraints.write_text("torch==2.0\n")
    files = [pyproject, constraints, req]  # req does not exist yet
    first = nf.install_fingerprint(files, ["-r", str(req)])
    assert nf.install_fingerprint(list(reversed(files)), ["-r", str(req)]) == first  # order of files
    (tmp_path / "source.py").write_text("x = 1\n")  # not an input: editable installs follow it
    assert nf.install_fingerprint(files, ["-r", str(req)]) == first
    req.write_text("matplotlib\n")
    second = nf.install_fingerprint(files, ["-r", str(req)])
    assert second != first
    constraints.write_text("torch==2.1\n")
    third = nf.install_fingerprint(files, ["-r", str(req)])
    assert third != second
    pyproject.write_text("[project]\nname='a'\ndependencies=['b']\n")
    assert nf.install_fingerprint(files, ["-r", str(req)]) != third
    assert nf.install_fingerprint(files, ["-r", str(req), "--find-links", "/x"]) != nf.install_fingerprint(
        files, ["-r", str(req)]
    )


def test_venv_up_to_date_needs_a_python_and_the_same_stamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nf = _noxfile(monkeypatch)
    venv = tmp_path / "venv"
    assert not nf.venv_up_to_date(venv, "abc")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert not nf.venv_up_to_date(venv, "abc")  # never installed
    (venv / nf.INSTALL_STAMP).write_text("abc\n")
    assert nf.venv_up_to_date(venv, "abc")
    assert not nf.venv_up_to_date(venv, "abd")
