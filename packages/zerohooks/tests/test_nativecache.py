"""zerohooks.nativecache: one real build shared by environments (processes with their own
TORCH_EXTENSIONS_DIR), never a stale one.

A tiny C++ library (no torch headers, so it compiles in about a second) is built for real by
``NativeExtension.load`` in one process; a second process with an empty build folder of its own
loads the stored library without building; a changed header beside the source, or changed
flags, give another key and a real build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zerohooks import nativecache

_CHILD = textwrap.dedent(
    """
    import ctypes, json, sys, warnings
    from pathlib import Path
    from zerohooks.native import NativeExtension
    src, flag = Path(sys.argv[1]), sys.argv[2]
    ext = NativeExtension(owner="demo", name="zh_cache_demo", what="the demo library", sources=(src,),
                          why="a test", eta="1 s", fallback="nothing", cflags=("-O1", flag))
    warnings.simplefilter("error")
    assert ext.load(), ext.error
    from zerohooks.jit import extension_build_dir
    built = sorted(p.name for p in extension_build_dir("zh_cache_demo").glob("*.so"))
    import torch
    libs = [p for p in torch.ops.loaded_libraries if "zh_cache_demo" in p]
    answer = ctypes.CDLL(libs[0]).zh_answer()
    print("CHILD " + json.dumps({"built": built, "libs": libs, "answer": answer}))
    """
)


def _child(src: Path, ext_dir: Path, cache: Path, flag: str = "-DZH=1") -> dict[str, object]:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), nativecache.ENV: str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), flag], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("CHILD "))
    return json.loads(line.removeprefix("CHILD "))  # type: ignore[no-any-return]


@pytest.mark.skipif(
    not any(os.access(os.path.join(d, "c++"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)),
    reason="no C++ compiler",
)
def test_a_build_is_shared_and_never_stale(tmp_path: Path) -> None:
    src_dir = tmp_path / "csrc"
    src_dir.mkdir()
    header = src_dir / "answer.h"
    header.write_text("#define ZH_ANSWER 41\n")
    src = src_dir / "demo.cpp"
    src.write_text('#include "answer.h"\nextern "C" int zh_answer() { return ZH_ANSWER + 1; }\n')
    cache = tmp_path / "shared"

    first = _child(src, tmp_path / "ext-a", cache)
    assert first["built"] == ["zh_cache_demo.so"] and first["answer"] == 42
    stored = sorted(cache.glob("zh_cache_demo-*/zh_cache_demo*"))
    assert len(stored) == 1

    second = _child(
        src, tmp_path / "ext-b", cache
    )  # another "venv": nothing built, the stored library loaded
    assert second["built"] == [] and second["answer"] == 42
    assert second["libs"] == [str(stored[0])]

    header.write_text("#define ZH_ANSWER 99\n")  # a header beside the source changed: a new key, a build
    third = _child(src, tmp_path / "ext-c", cache)
    assert third["built"] == ["zh_cache_demo.so"] and third["answer"] == 100
    assert len(list(cache.glob("zh_cache_demo-*"))) == 2

    fourth = _child(src, tmp_path / "ext-d", cache, flag="-DZH=2")  # other flags: another key
    assert fourth["built"] == ["zh_cache_demo.so"] and fourth["answer"] == 100


def test_off_without_the_variable_and_keys_cover_the_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(nativecache.ENV, raising=False)
    assert nativecache.cache_dir() is None and nativecache.lookup("x", "0") is None
    assert nativecache.store("x", "0", Path(__file__)) is None
    src = tmp_path / "a.cpp"
    src.write_text("int a;\n")
    base = dict(flags=(("-O3",),), python_module=False)
    k = nativecache.key("x", [src], **base)  # type: ignore[arg-type]
    assert k == nativecache.key("x", [src], **base)  # type: ignore[arg-type]
    assert k != nativecache.key("y", [src], **base)  # type: ignore[arg-type]
    assert k != nativecache.key("x", [src], flags=(("-O2",),), python_module=False)
    assert k != nativecache.key("x", [src], flags=(("-O3",),), python_module=True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert k != nativecache.key("x", [src], **base)  # type: ignore[arg-type]


_PYMOD = """
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ZH_ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "zh_ds_demo", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_zh_ds_demo() { return PyModule_Create(&mod); }
"""

_DS_CHILD = textwrap.dedent(
    """
    import json, sys
    from torch.utils import cpp_extension
    from zerohooks import nativecache
    from zerohooks.jit import extension_build_dir
    load = nativecache.caching_load(cpp_extension.load)  # as DeepSpeed's builder calls it
    m = load(name="zh_ds_demo", sources=[sys.argv[1]], extra_include_paths=[], extra_cflags=["-DZH_ANSWER=42"],
             extra_cuda_cflags=[], extra_ldflags=[], with_cuda=None, verbose=False)
    built = sorted(p.name for p in extension_build_dir("zh_ds_demo").glob("*.so"))
    print("CHILD " + json.dumps({"answer": m.answer(), "file": m.__file__, "built": built}))
    """
)


def test_deepspeed_style_loads_share_their_build(tmp_path: Path) -> None:
    src = tmp_path / "op" / "zh_ds_demo.cpp"
    src.parent.mkdir()
    src.write_text(_PYMOD)
    cache = tmp_path / "shared"
    seen = []
    for ext in ("a", "b"):
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / ext), nativecache.ENV: str(cache)}
        out = subprocess.run(
            [sys.executable, "-c", _DS_CHILD, str(src)], capture_output=True, text=True, env=env, timeout=600
        )
        assert out.returncode == 0, out.stdout + out.stderr
        seen.append(json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("CHILD "))[6:]))
    assert seen[0]["answer"] == seen[1]["answer"] == 42
    assert seen[0]["built"] == ["zh_ds_demo.so"] and seen[1]["built"] == []  # the second built nothing
    assert seen[1]["file"].startswith(str(cache))


@pytest.mark.skipif(
    not any(os.access(os.path.join(d, "c++"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)),
    reason="no C++ compiler",
)
def test_two_environments_wanting_one_build_at_once_build_it_once(tmp_path: Path) -> None:
    """Two processes with their own build folders ask for the same library at the same time (two
    test sessions side by side): the second waits for the first's build and loads it. The
    compiler is made slow (a wrapper that sleeps 4 s before compiling), so without the lock the
    second would be compiling too."""
    src = tmp_path / "csrc" / "demo.cpp"
    src.parent.mkdir()
    src.write_text('extern "C" int zh_answer() { return 42; }\n')
    slow = tmp_path / "slow-c++"
    slow.write_text('#!/bin/sh\ncase "$*" in *--version*) ;; *) sleep 4 ;; esac\nexec c++ "$@"\n')
    slow.chmod(0o755)
    cache = tmp_path / "shared"
    env = {**os.environ, nativecache.ENV: str(cache), "CXX": str(slow)}
    procs = []
    for name in ("a", "b"):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(src), "-DZH=1"],
                env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path / f"ext-{name}")},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        time.sleep(1.5)  # a is compiling (in its sleep) when b asks
    found = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out + err
        line = next(ln for ln in out.splitlines() if ln.startswith("CHILD "))
        found.append((json.loads(line.removeprefix("CHILD ")), err))
    (a, _), (b, b_err) = found
    assert a["built"] == ["zh_cache_demo.so"] and a["answer"] == 42
    assert b["built"] == [] and b["answer"] == 42, b  # waited, then loaded a's build
    assert "another process is building zh_cache_demo" in b_err
    assert len(list(cache.glob("zh_cache_demo-*/zh_cache_demo*"))) == 1
