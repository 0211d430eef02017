"""zerohooks.native.NativeExtension: the one build-or-load-else-fallback life of every plugin's
kernels (announce, build once per process, verify, warn and fall back, environment switch), and
``python -m zerohooks.build`` building what installed plugins declare.  The compiler call is
faked except in the last test, which compiles a broken source for real."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch.utils.cpp_extension as cpp_extension

from zerohooks import ZeroPlugin
from zerohooks import build as zbuild
from zerohooks.native import NativeExtension


@pytest.fixture(autouse=True)
def _no_shared_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiler is faked here: a build shared by nox's sessions must not stand in for it."""
    monkeypatch.delenv("ZEROHOOKS_NATIVE_CACHE", raising=False)


def _ext(tmp_path: Path, **kw: Any) -> NativeExtension:
    src = tmp_path / "k.cpp"
    src.write_text("int k() { return 1; }\n")
    base: dict[str, Any] = dict(
        owner="demo",
        name="demo_k",
        what="the demo kernel",
        sources=(src,),
        why="a test",
        eta="1 s",
        fallback="the demo reference",
        disable_env=("DEMO_KERNELS", "reference"),
    )
    return NativeExtension(**{**base, **kw})


def test_loads_once_verifies_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "mod")
    seen: list[Any] = []
    ext = _ext(tmp_path, python_module=True, verify=lambda m: seen.append(m))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ext.load() and ext.load()  # the second call does not build again
    assert len(calls) == 1 and calls[0]["name"] == "demo_k" and calls[0]["is_python_module"]
    assert seen == ["mod"] and ext.module == "mod" and ext.available and ext.error is None
    assert ext.build_target == "python -m zerohooks.build demo"


@pytest.mark.parametrize("how", ["build", "verify", "rank0"])
def test_a_failure_warns_once_names_the_fallback_and_sticks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    def broken(**kw: Any) -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", broken if how == "build" else (lambda **kw: None))
    ext = _ext(tmp_path, verify=(lambda m: "wrong bits") if how == "verify" else None)
    with pytest.warns(RuntimeWarning, match=r"^demo: .*demo kernel.*; using the demo reference instead"):
        assert ext.load(build=how != "rank0") is False
    assert not ext.available and ext.module is None
    expected = {"build": "no compiler", "verify": "wrong bits", "rank0": "local rank 0"}[how]
    assert expected in (ext.error or "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ext.load() is False  # decided once per process, no second warning


def test_switched_off_skipped_or_missing_dependency_is_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("must not build"))
    monkeypatch.setenv("DEMO_KERNELS", "reference")
    off = _ext(tmp_path)
    gpu = _ext(tmp_path, name="demo_gpu", disable_env=None, precondition=lambda: "no CUDA device")
    after = _ext(tmp_path, name="demo_after", disable_env=None, needs=(off,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not off.load() and not gpu.load() and not after.load()
    assert off.error == "disabled by DEMO_KERNELS=reference"
    assert gpu.error == "no CUDA device" and gpu.not_applicable() == "no CUDA device"
    assert "the demo kernel (demo_k) is not available" in (after.error or "")


def test_build_targets_are_the_installed_plugins_declarations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: None)
    cpu = _ext(tmp_path, disable_env=None)
    gpu = _ext(tmp_path, name="demo_gpu", disable_env=None, precondition=lambda: "no CUDA device")

    class Demo(ZeroPlugin):
        name = "demo"
        native = (cpu, gpu)

    class Plain(ZeroPlugin):
        name = "plain"

    def fails() -> type[ZeroPlugin]:
        raise ImportError("boom")

    assert zbuild._plugin_target("plain", lambda: Plain) is None  # nothing native: no target
    target = zbuild._plugin_target("demo", lambda: Demo)
    assert target is not None and target.names() == ["demo_k"]  # the GPU one does not apply here
    assert target.run() is None and cpu.available
    bad = zbuild._plugin_target("bad", fails)
    assert bad is not None and "boom" in (bad.run() or "")
    monkeypatch.setattr(zbuild, "plugin_targets", lambda: {"demo": target})
    (result,) = zbuild.build(["demo"], quiet=True)
    assert result.ok and result.built == ("demo_k",)


def test_a_real_compiler_error_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++;\n")
    ext = _ext(tmp_path, name="demo_broken", sources=(src,), disable_env=None)
    with pytest.warns(RuntimeWarning, match="demo: could not build the demo kernel"):
        assert ext.load() is False
    assert ext.error
