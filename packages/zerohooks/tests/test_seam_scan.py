"""The seam is the only door into DeepSpeed, read from the code (ast), not from a list kept by hand.

* The adapter (``zerohooks/adapter``) uses no DeepSpeed attribute that no seam declares
  (:data:`zerohooks.adapter.surface.SEAMS`): every attribute access or assignment, every name given to
  ``getattr``/``setattr``/``hasattr``/``require_attr``/``patch`` and every name-mangled name is
  checked against the names DeepSpeed's engine, ZeRO optimizers, communication backend,
  checkpoint engine and parameters define (read from DeepSpeed's own classes and source).
* The plugins (accumdtype, autocastzero, mixedlayers, loco, nvmeswap) import no ``deepspeed``
  (the accelerator API aside), call no ``patch``, assign to no attribute of an engine, an
  optimizer or a DeepSpeed parameter, and name no ZeRO internal.
"""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import re
from collections.abc import Callable

import pytest
import torch

from zerohooks.adapter import surface

_PACKAGES = pathlib.Path(__file__).resolve().parents[2]
_ADAPTER = _PACKAGES / "zerohooks" / "src" / "zerohooks" / "adapter"
_PLUGINS = ("accumdtype", "autocastzero", "mixedlayers", "loco", "nvmeswap")

_NOT_DEEPSPEEDS = {
    # names DeepSpeed's classes also define, used in the adapter on torch's or our own objects
    "dtype": "torch.Tensor.dtype / torch.dtype",
    "device": "torch.Tensor.device",
    "name": "our hooks' and plugins' names",
    "state": "our plugins' and scalers' state objects",
    "scale": "the plugin's Zero0Scaling.scale (adapter/lossscale.py)",
    "get_world_size": "torch.distributed.get_world_size",
    "get_rank": "torch.distributed.get_rank",
    "is_initialized": "torch.distributed.is_initialized",
    "barrier": "zerohooks.watchdog.barrier",
    "reduce": "our GradientReducer.reduce",
    "all_reduce": "torch.distributed.all_reduce",
    "all_gather": "our ParameterGatherer.all_gather",
    "commit": "our checkpoint save job's commit (adapter/checkpoint.py)",
    "load_state_dict": "our StateProvider.load_state_dict",
    "state_dict": "our StateProvider.state_dict",
    "makedirs": "os.makedirs",
    "compile": "re.compile",
    "partition": "str.partition",
    "param_groups": "torch.optim.Optimizer.param_groups (the ZeRO optimizer's inner optimizer, adapter/statestore.py)",
}
"""The curated exceptions: each is a name DeepSpeed defines that the adapter uses on something
else (the reason says on what).  A DeepSpeed name the adapter starts to use must be declared by
a seam, not added here."""


@functools.cache
def _deepspeed_names() -> frozenset[str]:
    """Attribute names DeepSpeed's engine, ZeRO optimizers, backend and checkpoint engine define
    (class attributes and ``self.x = ...`` in their source) and those it sets on parameters."""
    import deepspeed
    from deepspeed.comm.torch import TorchBackend
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    names: set[str] = set()
    classes = (
        DeepSpeedEngine,
        DeepSpeedZeroOptimizer,
        DeepSpeedZeroOptimizer_Stage3,
        TorchBackend,
        TorchCheckpointEngine,
    )
    for cls in classes:
        for base in cls.__mro__:
            if base.__module__.split(".")[0] != "deepspeed":
                continue
            names |= {n for n in vars(base) if not (n.startswith("__") and n.endswith("__"))}
            names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(base)))
    zero = pathlib.Path(deepspeed.__file__).parent / "runtime" / "zero"
    tensor = set(dir(torch.Tensor))  # param.data, param.grad: torch's own
    for f in zero.glob("*.py"):
        names |= set(re.findall(r"\bparam\.(\w+)\s*=(?!=)", f.read_text())) - tensor
    names |= {"comm_dtype", "partition_numel"}  # torch_autocast's attribute; a method set on parameters
    return frozenset(names)


def _declared() -> set[str]:
    out = set()
    for i in surface.surface():
        out.add(i.name)
        if i.name.startswith(surface.ZERO3_PRIVATE):
            out.add("__" + i.name[len(surface.ZERO3_PRIVATE) :])
    return out


_NAMED_BY_STRING = ("getattr", "setattr", "hasattr", "delattr", "require_attr", "patch")


def _names_used(tree: ast.AST) -> dict[str, int]:
    """Attribute names a module uses, with a line: ``x.name``, ``getattr(x, "name")`` and the
    like, ``_MANGLE + "name"`` (reported as ``__name``) and mangled string constants."""
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.setdefault(node.attr, node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(surface.ZERO3_PRIVATE) and node.value.isidentifier():
                out.setdefault(node.value, node.lineno)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if called not in _NAMED_BY_STRING:
                continue
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.setdefault(arg.value, node.lineno)
            elif isinstance(arg, ast.BinOp) and isinstance(arg.right, ast.Constant):
                out.setdefault("__" + str(arg.right.value), node.lineno)  # a mangling prefix + name
    return out


def _undeclared(path: pathlib.Path) -> list[str]:
    ds = _deepspeed_names()
    declared = _declared()
    used = _names_used(ast.parse(path.read_text(), str(path)))
    return [
        f"{path.name}:{line}: {name}"
        for name, line in sorted(used.items(), key=lambda kv: kv[1])
        if (name in ds or name.startswith("ds_") or name.startswith(("__", surface.ZERO3_PRIVATE)))
        and not (name.startswith("__") and name.endswith("__"))
        and name not in declared
        and name not in _NOT_DEEPSPEEDS
        and name != surface.ZERO3_PRIVATE  # the mangling prefix itself (surface.py)
    ]


@pytest.mark.parametrize("path", sorted(_ADAPTER.glob("*.py")), ids=lambda p: p.name)
def test_the_adapter_uses_only_declared_deepspeed_names(path: pathlib.Path) -> None:
    assert _undeclared(path) == [], (
        "declare these DeepSpeed names in a seam of zerohooks.adapter.surface.SEAMS"
    )


def test_the_scan_finds_an_undeclared_name(tmp_path: pathlib.Path) -> None:
    """The scan is not vacuous: DeepSpeed names no seam declares are found in each form."""
    f = tmp_path / "probe.py"
    f.write_text(
        "def f(opt, att, p):\n"
        "    opt.round_robin_gradients\n"  # attribute
        "    getattr(opt, 'partition_count')\n"  # by string
        "    att.patch(opt, _MANGLE + 'reduce_independent_p_g_buckets_and_remove_grads', make)\n"
        "    p.ds_persist = True\n"  # a parameter attribute DeepSpeed sets
        "    opt.dtype, opt.get_param_comm_dtype\n"  # an exception and a declared name
    )
    found = [entry.split(": ", 1)[1] for entry in _undeclared(f)]
    assert found == [
        "round_robin_gradients",
        "partition_count",
        "__reduce_independent_p_g_buckets_and_remove_grads",
        "ds_persist",
    ]
    assert not set(_NOT_DEEPSPEEDS) & _declared(), "an exception is also declared: remove it from the list"


# -- the plugins ---------------------------------------------------------------------------------
_HOLDERS = frozenset({"engine", "opt", "optimizer", "zero_optimizer"})
"""Names (variables or attributes) that hold a DeepSpeed engine or optimizer in plugin code."""
_PARAM_PARTS = frozenset({"ds_tensor", "master"})
"""Attributes that hold DeepSpeed's parameter partitions or fp32 masters."""
_PUBLIC = frozenset(
    {
        "optimizer",
        "communication_data_type",
        "gradient_predivide_factor",
        "reduce_scatter",
        "offload_optimizer",
        "loss_scale",
    }
)
"""ZeRO optimizer names that are also public API of the engine (``engine.optimizer``, the
optimizers' ``loss_scale`` property), fields of zerohooks' own config views
(``ctx.offload_optimizer``: DeepSpeed's config section; loco's state keeps its own
``loss_scale``), or torch.distributed functions."""


def _chain(node: ast.AST) -> list[str]:
    """``a.b.c`` -> ["a", "b", "c"] (subscripts and calls skipped through)."""
    out: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            out.append(node.attr)
            node = node.value
        elif isinstance(node, (ast.Subscript, ast.Call)):
            node = node.value if isinstance(node, ast.Subscript) else node.func
        elif isinstance(node, ast.Name):
            out.append(node.id)
            break
        else:
            break
    return out[::-1]


def _writes_deepspeed(target: ast.AST) -> bool:
    """An assignment target on an engine, optimizer or DeepSpeed parameter: ``engine.x = ``,
    ``opt.x[i] = ``, ``p.ds_x = ``, ``p.ds_tensor.data = ``, ``g.master.data = ``."""
    if isinstance(target, ast.Subscript):
        target = target.value
    if not isinstance(target, ast.Attribute):
        return False
    owner = _chain(target.value)
    return bool(
        target.attr.startswith("ds_") or (owner and owner[-1] in _HOLDERS) or _PARAM_PARTS & set(owner)
    )


def _internals() -> frozenset[str]:
    out = {
        i.name
        for i in surface.surface()
        if i.owner in (surface.ZERO12, surface.ZERO3)
        or (i.owner == surface.ENGINE and i.name.startswith("_"))
    }
    return frozenset(out - _PUBLIC)


def _deepspeed_imports(node: ast.AST) -> list[tuple[str, str | None]]:
    """(module, name) of each DeepSpeed import in ``node`` (name None for ``import m``)."""
    if isinstance(node, ast.Import):
        found: list[tuple[str, str | None]] = [(a.name, None) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        found = [(node.module or "", a.name) for a in node.names]
    else:
        return []
    return [(m, n) for m, n in found if m.split(".")[0] == "deepspeed"]


def _plugin_problems(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    internals = _internals()
    out: list[str] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        out += [
            f"{line}: imports {m}"
            for m in sorted({m for m, _ in _deepspeed_imports(node)})
            if m != "deepspeed.accelerator"
        ]
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr == "patch":
                out.append(f"{line}: calls patch")
            if (
                isinstance(fn, ast.Name)
                and fn.id == "setattr"
                and node.args
                and _writes_deepspeed(ast.Attribute(value=node.args[0], attr="?"))
            ):
                out.append(f"{line}: setattr on {'.'.join(_chain(node.args[0]))}")
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, (ast.Attribute, ast.Subscript)) and _writes_deepspeed(leaf):
                    out.append(f"{line}: assigns {'.'.join(_chain(leaf))}")
                    break
        if isinstance(node, ast.Attribute) and node.attr in internals:
            out.append(f"{line}: names {node.attr}")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "_DeepSpeedZeroOptimizer" in node.value
        ):
            out.append(f"{line}: names {node.value}")
    return out


def _plugin_files() -> list[pathlib.Path]:
    return sorted(f for pkg in _PLUGINS for f in (_PACKAGES / pkg / "src").rglob("*.py"))


def _offenders(files: list[pathlib.Path], scan: Callable[[pathlib.Path], list[str]]) -> dict[str, list[str]]:
    """``{"<folder>/<file>": problems}`` for each file ``scan`` finds problems in."""
    found = {}
    for f in files:
        problems = scan(f)
        if problems:
            found[f"{f.parent.name}/{f.name}"] = problems
    return found


def _probe(tmp_path: pathlib.Path, code: str, scan: Callable[[pathlib.Path], list[str]]) -> list[str]:
    """What ``scan`` finds in a probe file holding ``code`` (the kinds, without line numbers), sorted."""
    f = tmp_path / "probe.py"
    f.write_text(code)
    return sorted(entry.split(": ", 1)[1] for entry in scan(f))


def test_plugins_touch_deepspeed_only_through_the_seams() -> None:
    """No plugin file is exempt: nvmeswap's optimizer-state store is the adapter's
    (``zerohooks.adapter.statestore``, issue #36) like every other seam."""
    found = _offenders(_plugin_files(), _plugin_problems)
    assert found == {}, "plugins must go through zerohooks' seams (zerohooks.adapter), not DeepSpeed itself"


def test_the_plugin_scan_finds_each_kind(tmp_path: pathlib.Path) -> None:
    kinds = _probe(
        tmp_path,
        "import deepspeed.runtime.zero.stage3\n"
        "from deepspeed.accelerator import get_accelerator\n"  # allowed
        "def f(att, engine, opt, p, g, state):\n"
        "    att.patch(opt, 'step', make)\n"
        "    engine.micro_steps = 3\n"
        "    opt.fp16_partitioned_groups_flat[0] = None\n"
        "    p.ds_tensor.data = None\n"
        "    state.engine = engine\n"  # allowed: our own state object
        "    setattr(state.optimizer, 'overflow', True)\n"
        "    return opt.fp32_partitioned_groups_flat, '_DeepSpeedZeroOptimizer_Stage3__x'\n",
        _plugin_problems,
    )
    assert kinds == sorted(
        [
            "imports deepspeed.runtime.zero.stage3",
            "calls patch",
            "assigns engine.micro_steps",
            "assigns opt.fp16_partitioned_groups_flat",
            "names fp16_partitioned_groups_flat",
            "assigns p.ds_tensor.data",
            "setattr on state.optimizer",
            "names fp32_partitioned_groups_flat",
            "names _DeepSpeedZeroOptimizer_Stage3__x",
        ]
    )


# -- the core (zerohooks outside the adapter) -------------------------------------------------------
_CORE = _ADAPTER.parent
_DS_PUBLIC = frozenset({"initialize", "init_distributed", "zero", "__version__", "accelerator"})
"""DeepSpeed's public API the core may use as ``deepspeed.<name>`` (the test harness's process
groups and toy model: ``init_distributed``, ``zero.GatheredParameters``, the accelerator)."""
_DS_PUBLIC_FROM = {
    "deepspeed.accelerator": None,  # any name: the accelerator API
    "deepspeed.accelerator.cpu_accelerator": None,
    "deepspeed.utils": frozenset({"safe_get_full_fp32_param", "safe_get_full_grad"}),
    # the MoE API DeepSpeed's MoE tutorial has users write (the toy MoE model of the tests)
    "deepspeed.moe.layer": frozenset({"MoE"}),
    "deepspeed.moe.utils": frozenset({"split_params_into_different_moe_groups_for_optimizer"}),
}
"""Modules of DeepSpeed's public API the core may import from (None: any name)."""


_DS_MODULE_PATH = r"\bdeepspeed[./](runtime|ops|comm|module_inject)\b"
"""A DeepSpeed module path in a string (``"deepspeed.runtime.config"``, ``"/deepspeed/comm/"``)."""


def _core_problems(path: pathlib.Path) -> list[str]:
    """Where a core file names a DeepSpeed internal: imports a DeepSpeed module (or name) that is
    not public API, uses ``deepspeed.<x>`` beyond it, names a ZeRO or private engine attribute a
    seam declares, or holds a DeepSpeed module path or a name-mangled ZeRO name in a string."""
    tree = ast.parse(path.read_text(), str(path))
    internals, out = _internals(), []
    for node in ast.walk(tree):
        for module, name in _deepspeed_imports(node):
            allowed = _DS_PUBLIC_FROM.get(module, frozenset())
            if name is None and module != "deepspeed" and module not in _DS_PUBLIC_FROM:
                out.append(f"{node.lineno}: imports {module}")  # type: ignore[attr-defined]
            elif name is not None and allowed is not None and name not in allowed:
                out.append(f"{node.lineno}: imports {module}.{name}")  # type: ignore[attr-defined]
        if isinstance(node, ast.Attribute):
            if (
                isinstance(node.value, ast.Name)
                and node.value.id == "deepspeed"
                and node.attr not in _DS_PUBLIC
            ):
                out.append(f"{node.lineno}: uses deepspeed.{node.attr}")
            elif node.attr in internals:
                out.append(f"{node.lineno}: names {node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            internal = "_DeepSpeedZeroOptimizer" in node.value or re.search(_DS_MODULE_PATH, node.value)
            if internal and not _is_docstring(tree, node):
                out.append(f"{node.lineno}: names {node.value[:60]!r}")
    return out


def _is_docstring(tree: ast.AST, const: ast.Constant) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and body[0].value is const:
                return True
        if isinstance(node, ast.Expr) and node.value is const:  # an attribute's docstring
            return True
    return False


def _core_files() -> list[pathlib.Path]:
    return sorted(f for f in _CORE.rglob("*.py") if _ADAPTER not in f.parents)


def test_the_core_names_no_deepspeed_internal() -> None:
    """Outside ``zerohooks/adapter`` zerohooks uses DeepSpeed's public API at most (issue #36:
    a DeepSpeed upgrade touches the adapter folder only)."""
    assert _offenders(_core_files(), _core_problems) == {}, (
        "move what names DeepSpeed's internals into zerohooks.adapter"
    )


def test_the_core_scan_finds_each_kind(tmp_path: pathlib.Path) -> None:
    kinds = _probe(
        tmp_path,
        '"""Docs may say deepspeed.runtime.zero."""\n'
        "import deepspeed\n"  # allowed: its public functions
        "import deepspeed.ops\n"
        "from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys\n"
        "from deepspeed.accelerator import get_accelerator\n"  # allowed
        "from deepspeed.utils import safe_get_full_grad, logger\n"
        "def f(opt):\n"
        "    deepspeed.init_distributed('gloo')\n"  # allowed
        "    deepspeed.ops.__compatible_ops__\n"
        "    opt.fp32_partitioned_groups_flat\n"
        "    return ('deepspeed.runtime.constants', '/deepspeed/comm/', '_DeepSpeedZeroOptimizer_Stage3__x')\n",
        _core_problems,
    )
    assert kinds == sorted(
        [
            "imports deepspeed.ops",
            "imports deepspeed.runtime.config_utils.dict_raise_error_on_duplicate_keys",
            "imports deepspeed.utils.logger",
            "uses deepspeed.ops",
            "names fp32_partitioned_groups_flat",
            "names 'deepspeed.runtime.constants'",
            "names '/deepspeed/comm/'",
            "names '_DeepSpeedZeroOptimizer_Stage3__x'",
        ]
    )
