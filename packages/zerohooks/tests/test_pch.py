"""zerohooks.pch: a many-source C++ build parses the shared header once (gcc's precompiled
header), compiles what it compiled before, and falls back to the plain compile whenever the
precompiled header cannot be made or used.

A small header of the test's own stands in for ``torch/extension.h`` (``ZEROHOOKS_PCH_HEADER``),
so each compile takes a second, not torch's 48.  Whether a compile used the precompiled header
is read from gcc's dependency file: a header gcc parsed is listed there, one it took from the
precompiled header is not (and ``-H`` marks the ``.gch`` it loaded with ``!``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerohooks import _pchcc, nativecache, pch

pytestmark = pytest.mark.skipif(
    pch.applies([Path(f"s{i}.cpp") for i in range(pch.MIN_SOURCES)]) is not None,
    reason=f"precompiled headers do not apply here: {pch.applies([Path(f's{i}.cpp') for i in range(4)])}",
)

HEADER = textwrap.dedent(
    """
    #pragma once
    #include <map>
    #include <string>
    #include <vector>
    typedef int zh_thing;
    template <class T> T zh_sum(const std::vector<T>& v) { T s{}; for (const auto& x : v) s += x; return s; }
    """
)


def _sources(folder: Path, n: int = 4) -> list[Path]:
    (folder / "inc").mkdir(parents=True)
    (folder / "inc" / "zh_pch_demo.h").write_text(HEADER)
    out = []
    for i in range(n):
        src = folder / f"s{i}.cpp"
        src.write_text(
            f"#include <stdio.h>\n#include <zh_pch_demo.h>\nint f{i}() {{ return zh_sum(std::vector<int>{{{i}, 1}}); }}\n"
        )
        out.append(src)
    return out


def _compile(src: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """One compile as torch's ninja file writes it, through whatever ``CXX`` names now."""
    obj = src.with_suffix(".o")
    cmd = [
        os.environ["CXX"],
        "-MMD",
        "-MF",
        f"{obj}.d",
        *flags,
        "-I",
        str(src.parent / "inc"),
        "-O0",
        "-fPIC",
    ]
    return subprocess.run([*cmd, "-c", str(src), "-o", str(obj)], capture_output=True, text=True, check=False)


def _parsed_header(src: Path) -> bool:
    """Whether gcc parsed the demo header for ``src`` (listed in its dependency file)."""
    return "zh_pch_demo.h" in Path(f"{src.with_suffix('.o')}.d").read_text()


def test_split_keeps_the_flags_that_shape_the_header() -> None:
    args = ["-MMD", "-MF", "a.o.d", "-DX=1", "-Iinc", "-O0", "-g", "-c", "a.cpp", "-o", "a.o", "-fPIC"]
    assert _pchcc.split(args) == ["-DX=1", "-Iinc", "-O0", "-g", "-fPIC"]
    assert _pchcc.split(["--version"]) is None  # not a compile
    assert _pchcc.split(["a.o", "b.o", "-shared", "-o", "x.so"]) is None  # a link
    assert _pchcc.split(["-c", "a.cpp", "b.cpp"]) is None  # two sources
    assert _pchcc.split(["-c", "a.cu", "-o", "a.o"]) is None  # not C++
    assert _pchcc.split(["-x", "c++", "-c", "a.cpp"]) is None  # a language of its own
    assert _pchcc.split(["-E", "-c", "a.cpp"]) is None


def test_every_source_takes_the_header_precompiled_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = _sources(tmp_path)
    monkeypatch.setenv(_pchcc.HEADER, "zh_pch_demo.h")
    with pch.precompiled_torch_header(sources, folder=tmp_path / "cache") as on:
        assert on
        wrapper = os.environ["CXX"]
        assert Path(wrapper).name == "g++" and str(tmp_path / "cache") in wrapper
        for src in sources:
            done = _compile(src, "-H")
            assert done.returncode == 0, done.stderr
            assert not _parsed_header(src), src  # taken from the precompiled header
            assert any(ln.startswith("! ") and ln.endswith("pch.h.gch") for ln in done.stderr.splitlines())
        made = list((tmp_path / "cache").glob("zerohooks-pch-*/pch/*/pch.h.gch"))
        assert len(made) == 1  # one header for the four compiles (same flags)
    assert os.environ.get("CXX") != wrapper  # put back
    assert not list((tmp_path / "cache").glob("zerohooks-pch-*"))  # removed with its 1 GB
    # the same compiles as given parse the header: what the check above would see without it
    plain = _sources(tmp_path / "plain")
    monkeypatch.setenv("CXX", shutil.which("c++") or "c++")
    for src in plain:
        assert _compile(src).returncode == 0 and _parsed_header(src)
    for ours, theirs in zip(sources, plain, strict=True):  # the same functions defined
        assert _symbols(ours.with_suffix(".o")) == _symbols(theirs.with_suffix(".o"))


def _symbols(obj: Path) -> list[str]:
    out = subprocess.run(["nm", "--defined-only", "-C", str(obj)], capture_output=True, text=True, check=True)
    return sorted(ln.split(" ", 2)[-1] for ln in out.stdout.splitlines() if " T " in ln or " W " in ln)


def test_a_source_at_odds_with_the_header_compiles_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source that does not include the header and declares one of its names otherwise: with
    the header in front of it the compile fails, so the wrapper compiles it again as given."""
    sources = _sources(tmp_path)
    odd = tmp_path / "odd.cpp"
    odd.write_text("struct zh_thing { int x; };\nint odd() { zh_thing t{3}; return t.x; }\n")
    monkeypatch.setenv(_pchcc.HEADER, "zh_pch_demo.h")
    with pch.precompiled_torch_header([*sources, odd], folder=tmp_path / "cache"):
        assert _compile(sources[0]).returncode == 0 and not _parsed_header(sources[0])
        done = _compile(odd)
        assert done.returncode == 0, done.stderr
        assert "error" not in done.stderr  # the failed try's messages are not shown
        assert "odd()" in _symbols(odd.with_suffix(".o"))
        broken = tmp_path / "broken.cpp"
        broken.write_text("int broken( { return 1; }\n")
        done = _compile(broken)  # a source that does not compile at all still fails, with its error
        assert done.returncode != 0 and "broken.cpp" in done.stderr


def test_a_header_that_does_not_precompile_leaves_the_compiles_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = _sources(tmp_path)
    (tmp_path / "inc" / "zh_bad.h").write_text("#error not this one\n")
    monkeypatch.setenv(_pchcc.HEADER, "zh_bad.h")
    with pch.precompiled_torch_header(sources, folder=tmp_path / "cache"):
        for src in sources:
            done = _compile(src)
            assert done.returncode == 0, done.stderr
            assert _parsed_header(src)
        (failed,) = (tmp_path / "cache").glob("zerohooks-pch-*/pch/*/failed")
        assert "not this one" in failed.read_text()  # tried once, the reason kept for the others


def test_where_it_does_not_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    four = [tmp_path / f"s{i}.cpp" for i in range(4)]
    assert pch.applies(four) is None
    assert "3 sources" in str(pch.applies(four[:3]))
    assert "C++" in str(pch.applies([*four[:3], tmp_path / "k.cu"]))
    assert "C++" in str(pch.applies(four, with_cuda=True))
    fake = tmp_path / "clang++"
    fake.write_text('#!/bin/sh\necho "clang version 18.0.0"\n')
    fake.chmod(0o755)
    assert "not gcc" in str(pch.applies(four, cxx=str(fake)))
    assert "one executable" in str(pch.applies(four, cxx="ccache g++"))
    monkeypatch.setenv(pch.SWITCH, "0")
    assert pch.SWITCH in str(pch.applies(four))
    before = os.environ.get("CXX")
    with pch.precompiled_torch_header(four) as on:
        assert not on and os.environ.get("CXX") == before


_PYMOD = """
#include <Python.h>
#include <zh_pch_demo.h>
int f1(); int f2(); int f3();
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(f1() + f2() + f3() + ZH_BASE); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "zh_pch_op", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_zh_pch_op() { return PyModule_Create(&mod); }
"""

_CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from torch.utils import cpp_extension
    from zerohooks import nativecache
    from zerohooks.jit import extension_build_dir
    load = nativecache.caching_load(cpp_extension.load)  # as DeepSpeed's builder calls it
    before = os.environ.get("CXX")
    m = load(name="zh_pch_op", sources=sys.argv[2:], extra_include_paths=[sys.argv[1]],
             extra_cflags=["-DZH_BASE=30"], extra_cuda_cflags=[], extra_ldflags=[], with_cuda=None,
             verbose=False)
    folder = extension_build_dir("zh_pch_op")
    deps = subprocess.run(["ninja", "-C", str(folder), "-t", "deps"], capture_output=True, text=True).stdout
    cxx = next(ln for ln in (folder / "build.ninja").read_text().splitlines() if ln.startswith("cxx ="))
    print("CHILD " + json.dumps({"answer": m.answer(), "deps": deps, "cxx": cxx,
                                 "restored": os.environ.get("CXX") == before}))
    """
)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_deepspeed_style_build_goes_through_the_precompiled_header(tmp_path: Path, switch: str) -> None:
    """A DeepSpeed-style op of 4 sources loaded through ``nativecache.caching_load`` (as the
    routed ``OpBuilder.jit_load`` does), built by torch's ninja: the module works, and with the
    switch on no object's dependencies list the header (each took it precompiled; with
    ``ZEROHOOKS_NATIVE_PCH=0`` each lists it: the check can fail)."""
    sources = _sources(tmp_path)[1:]
    main = tmp_path / "main.cpp"
    main.write_text(_PYMOD)
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
        nativecache.ENV: str(tmp_path / "shared"),
        _pchcc.HEADER: "zh_pch_demo.h",
        pch.SWITCH: switch,
    }
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "inc"), str(main), *map(str, sources)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("CHILD "))[6:])
    assert found["answer"] == (1 + 1) + (2 + 1) + (3 + 1) + 30
    assert found["restored"]
    blocks = [b for b in found["deps"].split("\n\n") if b.strip()]
    assert len(blocks) == 4, found["deps"]
    parsed = ["zh_pch_demo.h" in b for b in blocks]
    if switch == "1":
        assert "zerohooks-pch-" in found["cxx"] and not any(parsed), found
    else:
        assert "zerohooks-pch-" not in found["cxx"] and all(parsed), found
