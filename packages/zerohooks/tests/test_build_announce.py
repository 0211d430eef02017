"""Slow builds say so: zerohooks.jit.announce_build (start line, heartbeat, end line), the
waiting ranks' notice, DeepSpeed's op builds announced, and ``python -m zerohooks.build``."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import zerohooks
from zerohooks import build as zbuild
from zerohooks import jit
from zerohooks.adapter import compat as _compat
from zerohooks.testing import run_distributed


def test_a_build_says_what_why_how_long_and_beats_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROHOOKS_HEARTBEAT_S", "0.1")
    out = io.StringIO()
    with jit.announce_build("the fake kernel", why="a test needs it", eta="about 1 s", stream=out):
        time.sleep(0.45)
    lines = out.getvalue().splitlines()
    first = lines[0]
    assert "building the fake kernel" in first and "a test needs it" in first and "about 1 s" in first
    assert jit.AOT_COMMAND in first  # how to build it ahead of time
    beats = [line for line in lines if "still building the fake kernel" in line]
    assert len(beats) >= 2, lines
    assert lines[-1].endswith("s") and "built the fake kernel in" in lines[-1]


def test_a_failed_build_says_so_and_raises() -> None:
    out = io.StringIO()
    with (
        pytest.raises(RuntimeError, match="boom"),
        jit.announce_build("x", why="y", eta="z", hint="do this", stream=out),
    ):
        raise RuntimeError("boom")
    assert "Faster next time: do this" in out.getvalue()
    assert "building x failed after" in out.getvalue()


def test_a_cached_build_is_quiet_unless_it_is_slow_after_all(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    with jit.announce_build("quick", why="y", eta="z", cached=True, stream=out):
        pass
    assert out.getvalue() == ""
    monkeypatch.setattr(jit, "_QUIET_GRACE_S", 0.05)
    with jit.announce_build("slow after all", why="y", eta="z", cached=True, stream=out):
        time.sleep(0.3)
    assert "rebuilding slow after all" in out.getvalue()
    assert "built slow after all in" in out.getvalue()


def test_extension_cached_looks_in_torch_extensions_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert jit.extension_build_dir("ext") == tmp_path / "ext"
    assert not jit.extension_cached("ext")
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "ext_v1.so").write_bytes(b"")
    assert jit.extension_cached("ext")


def _waiting_rank_output() -> str:
    jit._QUIET_GRACE_S = 0.1
    captured = io.StringIO()
    real, sys.stderr = sys.stderr, captured
    try:
        jit.local_rank0_first(lambda build=True: time.sleep(0.6 if dist.get_rank() == 0 else 0) or True)
    finally:
        sys.stderr = real
    return captured.getvalue()


def test_the_waiting_ranks_say_they_wait_for_local_rank0() -> None:
    out0, out1 = run_distributed(_waiting_rank_output, 2, timeout=120)
    assert "waiting for local rank 0" not in out0
    assert "waiting for local rank 0" in out1


def test_deepspeed_op_builds_are_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from deepspeed.ops.op_builder.builder import OpBuilder

    calls: list[str] = []

    def fake_jit_load(self: Any, verbose: bool = True) -> str:
        calls.append(self.name)
        return "module"

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(OpBuilder, "jit_load", fake_jit_load)

    class Shm:
        name = "deepspeed_shm_comm"

    with _compat.route_deepspeed_op_builds(), _compat.route_deepspeed_op_builds():  # nested: wrapped once
        assert OpBuilder.jit_load.__wrapped__ is fake_jit_load  # type: ignore[attr-defined]
        assert OpBuilder.jit_load(Shm()) == "module"  # type: ignore[arg-type]
    assert OpBuilder.jit_load is fake_jit_load  # put back by the last handle
    assert calls == ["deepspeed_shm_comm"]
    err = capsys.readouterr().err
    assert "building DeepSpeed's deepspeed_shm_comm op" in err
    assert "zerohooks.skip_deepspeed_compiles()" in err and "about 4 min" in err


def test_skip_deepspeed_compiles_is_public(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed.ops

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)
    zerohooks.skip_deepspeed_compiles()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    assert "skip_deepspeed_compiles" in zerohooks.__all__


def test_native_bf16_is_a_bool() -> None:
    assert isinstance(_compat.native_bf16(cuda=False), bool)


def test_build_reports_what_where_and_skips_what_is_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ran: list[str] = []
    fake = zbuild.Target(
        "fake", "a fake kernel", "zerohooks", lambda: ["fake_ext"], lambda: ran.append("x") or None
    )
    broken = zbuild.Target("broken", "a broken one", "zerohooks", lambda: ["b"], lambda: "no compiler")
    absent = zbuild.Target("absent", "not installed", "no_such_module_zh", lambda: [], lambda: None)
    monkeypatch.setattr(zbuild, "TARGETS", {"fake": fake, "broken": broken, "absent": absent})
    monkeypatch.setattr(zbuild, "plugin_targets", dict)  # no real plugin is built here
    res = {r.target: r for r in zbuild.build()}
    assert ran == ["x"]
    assert res["fake"].ok and res["fake"].where == (str(tmp_path / "fake_ext"),)
    assert not res["broken"].ok and res["broken"].error == "no compiler"
    assert res["absent"].ok and res["absent"].skipped  # default selection: skipped, not failed
    err = capsys.readouterr().err
    assert "[1/3] fake: ready in" in err and "[2/3] broken: FAILED" in err and "absent: skipped" in err
    assert not zbuild.build(["absent"], quiet=True)[0].ok  # named explicitly: a failure
    with pytest.raises(ValueError, match="unknown build target"):
        zbuild.build(["nope"])
    assert zbuild.main(["fake"]) == 0
    assert zbuild.main(["broken"]) == 1
    assert zbuild.main(["--list"]) == 0
    assert "fake_ext not built" in capsys.readouterr().out


def test_every_real_target_names_its_extensions() -> None:
    assert {"deepspeed-shm", "deepspeed-adam"} <= set(zbuild.TARGETS)
    assert "deepspeed_shm_comm" in zbuild.TARGETS["deepspeed-shm"].names()
    # the installed plugins with native extensions are targets too, found through entry points
    from zerohooks.config import load_plugin, plugin_entry_points

    declared = {n for n, ep in plugin_entry_points().items() if load_plugin(ep).native}
    assert set(zbuild.plugin_targets()) == declared
    assert declared <= set(zbuild.targets())
