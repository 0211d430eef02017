"""loco's kernel build goes through zerohooks.jit.announce_build (says what, why, how long, and
how to build ahead of time), without compiling anything here: the compiler call is faked."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loco import ops


def test_the_kernel_build_is_announced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.cpp_extension as cpp_extension

    import zerohooks.jit

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("ZEROHOOKS_NATIVE_CACHE", raising=False)  # no shared build instead of the fake one
    events: list[Any] = []

    @contextlib.contextmanager
    def announce(what: str, **kwargs: Any) -> Iterator[None]:
        events.append(("start", what, kwargs))
        yield
        events.append(("end", what))

    def fake_load(**kwargs: Any) -> None:
        events.append(("compile", kwargs["name"]))

    monkeypatch.setattr(zerohooks.jit, "announce_build", announce)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    ops.extension("cpu")._build()
    assert [e[0] for e in events] == ["start", "compile", "end"]
    _, what, kwargs = events[0]
    assert "loco" in what and ops.build_name("cpu") in what
    assert kwargs["hint"] == "python -m zerohooks.build loco"
    assert "1 min" in kwargs["eta"] and "LOCO_KERNELS=reference" in kwargs["why"]
    assert kwargs["cached"] is False  # nothing in the fresh TORCH_EXTENSIONS_DIR


def test_build_name_is_the_extension_folder() -> None:
    assert ops.build_name("cpu").startswith("loco_cpu_")
    assert ops.build_name("cuda") == "loco_cuda"


def test_loco_declares_its_extensions_for_zerohooks_build() -> None:
    from loco.plugin import LocoPlugin
    from zerohooks import build

    assert LocoPlugin.native == (ops.EXTENSIONS["cpu"], ops.EXTENSIONS["cuda"])
    target = build.plugin_targets()["loco"]
    assert ops.build_name("cpu") in target.names()
