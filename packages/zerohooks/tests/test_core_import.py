"""The core imports without DeepSpeed and changes nothing on import; DeepSpeed's op builds are
routed through zerohooks only while ``zerohooks.initialize`` (or ``enable``) holds the routing.

The import checks run in fresh interpreters (``sys.modules`` of this one already holds
everything).  The routing check builds two tiny DeepSpeed-style ops for real in a rank: one
inside ``zerohooks.initialize`` (it must land in the shared ``ZEROHOOKS_NATIVE_CACHE``) and one
after it returned (it must not: DeepSpeed's own ``jit_load`` is back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from zerohooks import PluginConfig, ZeroPlugin, nativecache
from zerohooks.hookspec import SetupContext
from zerohooks.registry import HookRegistry
from zerohooks.testing import run_distributed

CORE = (
    "zerohooks.hookspec",
    "zerohooks.registry",
    "zerohooks.plugin",
    "zerohooks.config",
    "zerohooks.errors",
)

_BLOCKED = textwrap.dedent(
    """
    import importlib, json, sys

    class NoDeepSpeed:  # what an environment without DeepSpeed gives
        def find_spec(self, name, path=None, target=None):
            if name == "deepspeed" or name.startswith("deepspeed."):
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoDeepSpeed())
    for name in sys.argv[1:]:
        importlib.import_module(name)
    import zerohooks
    core = [n for n in zerohooks.__all__ if n in vars(zerohooks)]
    try:
        zerohooks.initialize
        needs = "imported"
    except ImportError as e:
        needs = str(e)
    print("CHILD " + json.dumps({
        "deepspeed": sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed"),
        "core": core, "initialize": needs, "plugin": zerohooks.ZeroPlugin.__module__,
    }))
    """
)


def _child(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("CHILD "))
    return json.loads(line.removeprefix("CHILD "))  # type: ignore[no-any-return]


def test_the_core_imports_without_deepspeed() -> None:
    got = _child(_BLOCKED, *CORE)
    assert got["deepspeed"] == []
    assert got["plugin"] == "zerohooks.plugin"
    # the core's public names are there without DeepSpeed; what needs it says so when used
    assert {"ZeroPlugin", "HookRegistry", "ConfigError", "SetupContext", "KNOWN_PLUGINS"} <= set(got["core"])
    assert "zerohooks.initialize needs DeepSpeed" in got["initialize"], got["initialize"]


_SNAPSHOT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys, types

    def watched():
        return {n: m for n, m in list(sys.modules.items())
                if m is not None and (n.split(".")[0] == "deepspeed" or n in ("torch.utils.cpp_extension",
                                      "torch.distributed", "torch.nn.modules.module", "torch.optim.optimizer"))}

    def snapshot():
        out = {}
        for name, mod in watched().items():
            for attr, value in list(vars(mod).items()):
                out[f"{name}.{attr}"] = id(value)
                if isinstance(value, type) and value.__module__ == name:
                    for k, v in list(vars(value).items()):
                        out[f"{name}.{attr}.{k}"] = id(v)
        return out

    mode, names = sys.argv[1], sys.argv[2:]
    import torch, deepspeed  # noqa
    from deepspeed.ops.op_builder.builder import OpBuilder
    if mode == "list":  # which DeepSpeed modules zerohooks' modules import
        import zerohooks
        mods = [m.name for m in pkgutil.walk_packages(zerohooks.__path__, "zerohooks.")]
        for m in mods:
            importlib.import_module(m)
        print("CHILD " + json.dumps({"zerohooks": mods, "deepspeed": sorted(watched())}))
        sys.exit(0)
    for name in names:
        importlib.import_module(name)
    jit_load, ds_init = OpBuilder.jit_load, deepspeed.initialize
    before = snapshot()
    import zerohooks
    for n in zerohooks.__all__:
        getattr(zerohooks, n)  # every public name, the lazy ones included
    for m in json.loads(mode):
        importlib.import_module(m)
    after = snapshot()
    changed = sorted(k for k, v in before.items() if k in after and after[k] != v)
    removed = sorted(k for k in before if k not in after)
    print("CHILD " + json.dumps({
        "changed": changed, "removed": removed,
        "jit_load": OpBuilder.jit_load is jit_load, "initialize": deepspeed.initialize is ds_init,
    }))
    """
)


def test_importing_zerohooks_changes_nothing_in_deepspeed() -> None:
    listed = _child(_SNAPSHOT, "list")
    assert (
        "zerohooks.adapter.initialize" in listed["zerohooks"]
        and "zerohooks.adapter.gather" in listed["zerohooks"]
    )
    # the DeepSpeed modules zerohooks imports are imported (and snapshot) first, then every
    # zerohooks module and public name: not one attribute of DeepSpeed (its modules and the
    # classes they define) nor of torch's build/distributed/module/optimizer modules differs
    got = _child(_SNAPSHOT, json.dumps(listed["zerohooks"]), *listed["deepspeed"])
    assert got["jit_load"] and got["initialize"]
    assert got["changed"] == [] and got["removed"] == [], got


_PYMOD = """
#include <Python.h>
#define ZH_STR2(x) #x
#define ZH_STR(x) ZH_STR2(x)
#define ZH_CAT2(a, b) a##b
#define ZH_CAT(a, b) ZH_CAT2(a, b)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ZH_ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, ZH_STR(NAME), nullptr, -1, methods};
PyMODINIT_FUNC ZH_CAT(PyInit_, NAME)() { return PyModule_Create(&mod); }
"""


def _tiny_op(name: str, src: str) -> Any:
    """A DeepSpeed op builder (DeepSpeed's own ``OpBuilder.jit_load``) for a one-function module."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    class Tiny(OpBuilder):  # type: ignore[misc]
        def absolute_name(self) -> str:
            return name

        def sources(self) -> list[str]:
            return [src]

        def cxx_args(self) -> list[str]:
            return ["-O0", "-DZH_ANSWER=42", f"-DNAME={name}"]

        def nvcc_args(self) -> list[str]:
            return []

    return Tiny(name)


class _BuildsInAttach(ZeroPlugin):
    """Builds a tiny op while ``zerohooks.initialize`` runs (in ``attach``), on rank 0."""

    name = "zh_build_probe"

    def __init__(self, src: str) -> None:
        super().__init__(PluginConfig())
        self.src = src
        self.during: Any = None

    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        import torch.distributed as dist
        from deepspeed.ops.op_builder.builder import OpBuilder

        self.during = OpBuilder.jit_load
        if dist.get_rank() == 0:
            assert _tiny_op("zh_probe_during", self.src).jit_load(verbose=False).answer() == 42


def _routing_in_a_rank(src: str) -> dict[str, Any]:
    import torch.distributed as dist
    from deepspeed.ops.op_builder.builder import OpBuilder

    import zerohooks
    from zerohooks import testing
    from zerohooks.adapter import compat as _compat
    from zerohooks.testing.toy import ds_config, make_model

    testing.rank_op_builds.remove()  # the harness's own routing: this test judges initialize's
    ds_jit_load = OpBuilder.jit_load
    plugin = _BuildsInAttach(src)
    model = make_model()
    zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(2), plugins=[plugin]
    )
    after = OpBuilder.jit_load
    if dist.get_rank() == 0:
        assert _tiny_op("zh_probe_after", src).jit_load(verbose=False).answer() == 42
    return {
        "untouched_before": not getattr(ds_jit_load, "__zerohooks_routed__", False),
        "routed_during": getattr(plugin.during, "__zerohooks_routed__", False)
        and plugin.during.__wrapped__ is ds_jit_load,
        "put_back_after": after is ds_jit_load and not _compat.op_builds_routed(),
    }


@pytest.mark.multirank
@pytest.mark.skipif(
    not any(os.access(os.path.join(d, "c++"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)),
    reason="no C++ compiler",
)
def test_initialize_routes_deepspeed_op_builds_only_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "op" / "zh_probe.cpp"
    src.parent.mkdir()
    src.write_text(_PYMOD)
    cache, builds = tmp_path / "shared", tmp_path / "ext"
    monkeypatch.setenv(nativecache.ENV, str(cache))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(builds))
    results = run_distributed(_routing_in_a_rank, 2, args=(str(src),), timeout=600)
    for r in results:
        assert r == {"untouched_before": True, "routed_during": True, "put_back_after": True}, r
    stored = sorted(p.name for p in cache.rglob("*") if p.is_file())
    # the op built inside initialize went through zerohooks.nativecache; the one after did not
    assert any("zh_probe_during" in n for n in stored), stored
    assert not any("zh_probe_after" in n for n in stored), stored
    assert (builds / "zh_probe_after").is_dir() and (builds / "zh_probe_during").is_dir()


def test_enable_routes_op_builds_until_its_last_handle_is_removed() -> None:
    import deepspeed
    from deepspeed.ops.op_builder.builder import OpBuilder

    import zerohooks

    ds_jit_load, ds_initialize = OpBuilder.jit_load, deepspeed.initialize
    first = zerohooks.enable()
    second = zerohooks.enable()
    routed = OpBuilder.jit_load
    assert routed is not ds_jit_load and routed.__wrapped__ is ds_jit_load  # type: ignore[attr-defined]
    first.remove()
    assert OpBuilder.jit_load is routed and zerohooks.enabled()  # one handle still held
    second.remove()
    assert OpBuilder.jit_load is ds_jit_load and deepspeed.initialize is ds_initialize
    with zerohooks.route_deepspeed_op_builds() as handle:
        assert handle.active and OpBuilder.jit_load is not ds_jit_load
    assert OpBuilder.jit_load is ds_jit_load
