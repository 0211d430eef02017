"""Property test of the plugin sections (issue #18).

Every generated DeepSpeed config either trains with exactly the intended plugins on, or fails
before any training step with an error naming a key of the offending section (or the section
itself); no config silently changes which plugins run.

The configs carry 0-3 plugin-ish sections: the real names, the names in another case or spacing,
one or two edits away, nested under ``"plugins"``/``"zerohooks"`` (DeepSpeed ignores unknown
top-level keys) or under ``"zero_optimization"``; ``enabled`` with assorted JSON values;
fields of each plugin's pydantic model (introspected: :func:`test_value_tables_cover_every_field`
fails when a field is added without a row below) with valid, invalid and loosely typed values,
and unknown keys.  The DeepSpeed base varies over ZeRO 0-3 and bf16/fp32.

The oracle (:func:`judge`) is written here from the documented rules, not by calling the code
under test:

* a plugin is intended on when its exact name is a top-level key whose value is ``true`` or an
  object whose ``enabled`` is ``true`` or absent;
* the config must be refused when it has a top-level key that is a plugin's name in another case
  or spacing (``_``, ``-``, whitespace) or one edit (insertion, deletion, substitution,
  transposition) away from one (and not a DeepSpeed key); a plugin's name (in any case or
  spacing) nested one level down, under ``"plugins"`` or ``"zerohooks"`` (which DeepSpeed would
  ignore) or under ``"zero_optimization"`` (which DeepSpeed refuses in its own words, a
  ``pydantic.ValidationError`` naming the key, if zerohooks does not first); an ``enabled`` that
  is not a JSON boolean; a section that is neither an object nor a boolean; an unknown key or an
  invalid value in an enabled section; a rule across keys (autocastzero's loss-scaling keys
  without dtype float16, mixedlayers without any module selected);
* a refusal is required for a value of another JSON type than its field's (``"3"`` or ``3.0``
  for an integer, ``true`` for a number, ``"no"`` or ``0`` for a boolean) and for a value past a
  documented bound (:data:`LAX_CLASSES`);
* a refusal is allowed, not required, for keys two edits from a plugin name (or a misspelt name
  nested under a wrapper), spellings a plugin may normalise (``"FP32"`` for a dtype), the
  contents of a disabled section and, once the engine is built, the
  combinations with DeepSpeed's settings or each other that the plugins document refusing
  (:func:`combinations`: accumdtype's lossy mixes, autocastzero with bf16, mixedlayers with an
  fp32 model, nvmeswap off ZeRO 3...);
* once the model exists a refusal is required for values that only the model or the run can
  judge (a glob or class that matches no module of the model, loco two-level on one rank,
  nvmeswap's native I/O engine where this test disables it).

Any refusal must be a ``zerohooks.ConfigError`` (DeepSpeed's ValidationError only where the oracle
expects DeepSpeed to refuse), raised by ``zerohooks.initialize`` itself (so before any step), and
its message must name one of the culprits the oracle lists; a refusal without any reason the
oracle knows of fails the test too (a valid config must train).

:func:`test_config_step_property` checks what the config step decides (``split_plugin_sections``
and DeepSpeed's own check of its ``zero_optimization`` section) on 600 examples;
:func:`test_engine_property` builds the real engine on one gloo rank and trains one step on 60
examples, half of them shaped to be trainable on CPU.  Both are derandomized: for a given tree
CI sees the same examples every run (hypothesis also draws on constants in the project's source,
so an edit elsewhere may change them).

Excluded from the engine run, because they compile or are slow on CPU: loco's compiled kernels
(``LOCO_KERNELS=reference`` in the rank), nvmeswap's C++ I/O engine and fused Adam
(``NVMESWAP_IO=python``, ``NVMESWAP_ADAM=python``), DeepSpeed's own NVMe swapper (the ``nvme``
offload is only added where nvmeswap is intended on), fp16 models, CPU offload; and, because
TinyNet cannot train with them, mixedlayers' ``cast_inputs`` false and ``output_dtype`` fp32
(:func:`_model_dependent`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import string
from importlib.metadata import entry_points
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from zerohooks.testing import run_distributed

PLUGINS = ("accumdtype", "autocastzero", "mixedlayers", "loco", "nvmeswap")
BULK_EXAMPLES = 600
ENGINE_EXAMPLES = 60
SWAP_DIR = "<swap folder>"
"""A valid nvmeswap folder; the engine run replaces it with a temporary folder."""

_INSTALLED = {ep.name for ep in entry_points(group="zerohooks.plugins")}
pytestmark = pytest.mark.skipif(
    not set(PLUGINS) <= _INSTALLED,
    reason=f"needs every plugin installed (missing: {sorted(set(PLUGINS) - _INSTALLED)})",
)

# -- the oracle's value tables ------------------------------------------------------------------
# Per field of each plugin's section: values that must be accepted (V), must be refused (X), may
# go either way (L: spellings a plugin may normalise, such as "FP32" for a dtype), and values the
# config layer accepts but the run must refuse once the model and the ranks exist (R: TinyNet, one
# rank).  Values of another JSON type (strings "yes"/"no"/"3", booleans as numbers, 4.0 for an
# integer) and values past a bound (buffer counts, threads, block sizes) are X: plugin values are
# strict JSON (zerohooks.strict), see LAX_CLASSES.
V, X, L, R = "valid", "invalid", "lax", "runtime"
NAN, INF = math.nan, math.inf

BOOL: dict[str, list[Any]] = {
    V: [True, False],
    X: [None, "maybe", 2, [], 0.5, 0, 1, "yes", "no", "true", "false", "True", "off"],
}

TABLES: dict[str, dict[str, dict[str, list[Any]]]] = {
    "accumdtype": {
        "dtype": {
            V: ["fp32", "bf16", "fp16", "float32", "bfloat16", "float16"],
            L: ["FP32", "half", "float", "torch.float32", "Bf16"],
            X: ["fp8", "auto", "int8", 32, None, True, ["fp32"], NAN],
        },
        "reduce_dtype": {
            V: ["inherit", "fp32", "bf16", "fp16", "auto", "float32", "bfloat16"],
            L: ["FP16", "Inherit"],
            X: ["fp64", "int4", 16, None, False],
        },
        "allow_lossy": BOOL,
    },
    "autocastzero": {
        "dtype": {
            V: ["bfloat16", "float16", "bf16", "fp16"],
            L: ["BF16", "half", "torch.bfloat16", "FP16"],
            X: ["fp32", "float32", "int8", 16, None, True],
        },
        "lower_precision_safe_modules": {
            V: [[], ["torch.nn.Linear"], ["torch.nn.Linear", "torch.nn.Embedding"]],
            L: ["torch.nn.Linear"],
            X: [["no.such.Module"], ["Linear"], ["torch.nn.functional.gelu"], 3, [3], None],
        },
        "lower_precision_safe_names": {
            V: [[], ["fc1"], ["fc*"]],
            R: [["zz"], ["blocks.*"]],
            L: ["fc1"],
            X: [3, [3], None],
        },
        "fp32_names": {V: [[], ["fc2"], ["norm"]], R: [["zz"]], L: ["fc2"], X: [5, [None], None]},
        "low_precision_reduce": BOOL,
        "low_precision_gather": BOOL,
        # scales that cannot train are refused (2**-24 to 2**32, or 0 for dynamic scaling)
        "loss_scale": {
            V: [0, 0.0, 128.0, 1024],
            X: [-1, -0.5, NAN, "big", None, -INF, INF, 1e300, 2.0**40, "128", True, False],
        },
        "initial_scale_power": {
            V: [0, 8, 16],
            X: [-1, 64, 65, 1.5, NAN, INF, "x", None, 16.0, "16", True, 10**9, 2**64],
        },
        "loss_scale_window": {
            V: [1, 2, 1000, 2**31 - 1],
            X: [0, -5, 2.5, NAN, None, "w", "10", 10.0, True, 2**31, 10**30],
        },
        "hysteresis": {V: [1, 2, 2**31 - 1], X: [0, -1, 1.5, None, "2", True, 2.0, 2**31]},
        "min_loss_scale": {
            V: [1.0, 0.5, 1, 2**-10],
            X: [0, 0.0, -1.0, NAN, -INF, INF, None, "min", "1", True],
        },
    },
    "mixedlayers": {
        "fp32_modules": {
            V: [["fc2"], ["fc*"], ["norm"], "fc1", ["emb", "fc2"], []],
            R: [["zz"], ["blocks.*.norm"]],
            X: [[1], 5, None, [None], {"fc2": 1}],
        },
        "fp32_module_types": {
            V: [["torch.nn.LayerNorm"], "LayerNorm", ["Linear"], ["torch.nn.Embedding"], []],
            R: [["torch.nn.Conv2d"], ["NoSuchNorm"], ["no.such.Module"]],
            X: [3, [3], None],
        },
        "cast_inputs": BOOL,
        "output_dtype": {V: ["input", "train", "fp32"], X: ["bf16", "float32", "Input", None, 1]},
        "keep_buffers": BOOL,
    },
    "loco": {
        "bits": {V: [4, 8], X: [2, 16, "4", True, None, 4.5, NAN, 4.0, 8.0]},
        "err_beta": {
            V: [0, 0.0, 0.5, 0.8, 1, 1.0],
            X: [-0.1, 1.5, NAN, INF, -INF, "high", None, "0.5", True, False],
        },
        "reset_T": {
            V: [0, 1, 1024, 2**31 - 1],
            X: [-1, 1.5, NAN, INF, "x", None, "3", 1.0, True, 2**31, 10**30],
        },
        "group_size": {V: [64, 128, 256, 512, 1024], X: [32, 100, 2048, "128", None, True, 128.0, 2**64]},
        "error_dtype": {V: ["int8", "bf16", "fp32"], X: ["int4", "fp16", "INT8", 8, None]},
        "exact_below": {V: [None, 0, 4096, 2**48], X: [-1, 1.5, "x", NAN, INF, "10", 10.0, False, 2**48 + 1]},
        "error_feedback": BOOL,
        "hierarchy": {V: ["detect", "flat", "auto"], R: ["two_level"], X: ["Flat", "tree", 2, None]},
        "parameter_gather": {V: ["two_level", "deepspeed"], X: ["Two_Level", "ring", "auto", 2, None]},
        "gloo_exchange": {V: ["point_to_point", "collective"], X: ["p2p", "Collective", "auto", 1, None]},
        "node_size": {V: [None, 1, 2, 8, 2**16], X: [0, -1, 1.5, "x", "2", 2.0, True, 2**16 + 1]},
        "on_skip": {V: ["restore", "reset"], X: ["skip", None, 1, "Restore"]},
        "kernels": {V: ["compiled", "reference", "auto"], X: ["cuda", "Reference", None, 1]},
    },
    "nvmeswap": {
        "keep_master_in_ram": BOOL,
        "step_in_backward": BOOL,
        "folder": {V: [None, SWAP_DIR], X: [3, [], True, ["a"], ""]},
        "buffer_count": {
            V: [2, 3, 5, 16],
            X: [1, 17, 65, 0, -1, 2.5, "x", None, 1e300, "3", 3.0, True, 10**9],
        },
        "io_threads": {V: [1, 2, 3, 32], X: [0, 33, 65, 1.5, None, "2", True, 10**6]},
        "block_size": {
            V: [4096, 8192, 1 << 20, 1 << 28],
            X: [4095, 5000, 0, -4096, NAN, INF, "x", None, 4096.0, "4096", True, 2**40, (1 << 28) + 4096],
        },
        "min_swap_numel": {V: [0, 100, 10**9, 2**48], X: [-1, 0.5, None, "0", False, 0.0, 2**48 + 1]},
        "prefetch_bytes": {
            V: [0, 1 << 30, 2**48],
            R: [1, 4095],
            X: [-1, 0.5, None, "0", False, 0.0, 2**48 + 1],
        },
        "io_engine": {V: ["detect", "python", "auto"], R: ["native"], X: ["libaio", "Python", None, 1]},
        "fused_adam": {
            V: [True, False, "when_supported", "auto"],
            X: ["true", 1, 0, None, "yes", "When_supported"],
        },
    },
}

AUTOCAST_DTYPE = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}
"""What the valid autocastzero dtypes mean (its loss-scaling keys need float16)."""
SCALING_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
SELECTION_KEYS = ("fp32_modules", "fp32_module_types")
WRAPPERS = ("plugins", "zerohooks")
"""Top-level keys that are not DeepSpeed's, under which a user might nest the plugin sections."""


def _value_key(value: Any) -> tuple[str, str]:
    """A lookup key telling 1, 1.0 and True apart (they are equal in Python, not in JSON)."""
    return type(value).__name__, repr(value)


_CLASS_OF: dict[tuple[str, str, tuple[str, str]], str] = {
    (plugin, field, _value_key(v)): cls
    for plugin, fields in TABLES.items()
    for field, classes in fields.items()
    for cls, values in classes.items()
    for v in values
}


def _deepspeed_keys() -> set[str]:
    """DeepSpeed's own config key names, read from its constants modules (a generated near-miss
    of a plugin name that happens to be one of them is no near-miss: it is DeepSpeed's)."""
    import importlib

    keys: set[str] = set()
    for name in ("deepspeed.runtime.constants", "deepspeed.runtime.config", "deepspeed.runtime.zero.config"):
        module = importlib.import_module(name)
        keys |= {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}
    return keys


_DS_KEYS = _deepspeed_keys()

# -- the oracle ---------------------------------------------------------------------------------


def _normalised(key: str) -> str:
    """A name in lower case without whitespace, ``_`` or ``-`` (the documented "case or spacing")."""
    return "".join(c for c in key.lower() if not (c.isspace() or c in "_-"))


def _edits(a: str, b: str) -> int:
    """Edit distance with adjacent transpositions (optimal string alignment)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def _closeness(key: str) -> int:
    """0: a plugin's exact name; 1: its name in another case/spacing or one edit away; 2: two
    edits away; 3: farther from every plugin name."""
    if key in PLUGINS:
        return 0
    norm = _normalised(key)
    if norm in PLUGINS:
        return 1
    return min(3, max(1, min(_edits(norm, p) for p in PLUGINS)))


@dataclasses.dataclass
class Verdict:
    """What the oracle expects of one config."""

    intended: set[str] = dataclasses.field(default_factory=set)
    """Plugins that must run if the config is accepted."""
    must: list[str] = dataclasses.field(default_factory=list)
    """Reasons the config step must refuse the config."""
    deepspeed: list[str] = dataclasses.field(default_factory=list)
    """Reasons DeepSpeed's own config check must refuse it (a ValidationError)."""
    runtime: list[str] = dataclasses.field(default_factory=list)
    """Reasons the run must refuse it once the model and the ranks exist."""
    may: list[str] = dataclasses.field(default_factory=list)
    """Reasons a refusal is allowed (not required)."""
    culprits: set[str] = dataclasses.field(default_factory=set)
    """Keys (or section names) one of which a refusal's message must name."""

    def reason(self, where: list[str], text: str, *culprits: str) -> None:
        where.append(text)
        self.culprits.update(culprits)


def _judge_section(name: str, value: Any, verdict: Verdict) -> None:
    """Judge the section at the top-level key ``name`` (a real plugin name)."""
    if value is True:
        fields: dict[str, Any] = {}
    elif value is False:
        return
    elif not isinstance(value, dict):
        verdict.reason(verdict.must, f"{name}: {value!r} is neither an object nor a boolean", name)
        return
    else:
        enabled = value.get("enabled", True)
        if type(enabled) is not bool:
            verdict.reason(verdict.must, f"{name}.enabled = {enabled!r}", f"{name}.enabled")
            return
        if enabled is False:
            verdict.reason(verdict.may, f"{name}: contents of a disabled section", name)
            return
        fields = {k: v for k, v in value.items() if k != "enabled"}
    verdict.intended.add(name)
    lax: set[str] = set()
    for key, v in fields.items():
        cls = _CLASS_OF.get((name, key, _value_key(v))) if key in TABLES[name] else None
        if key not in TABLES[name]:
            verdict.reason(verdict.must, f"{name}.{key}: unknown key", f"{name}.{key}")
        elif cls is None:
            raise AssertionError(f"the generator made {name}.{key} = {v!r}, which no table lists")
        elif cls == X:
            verdict.reason(verdict.must, f"{name}.{key} = {v!r} is invalid", f"{name}.{key}")
        elif cls == L:
            lax.add(key)
            verdict.reason(verdict.may, f"{name}.{key} = {v!r} may be coerced", f"{name}.{key}")
        elif cls == R:
            verdict.reason(
                verdict.runtime, f"{name}.{key} = {v!r} cannot hold for the model/run", f"{name}.{key}"
            )
    if name == "autocastzero":
        scaling = [k for k in SCALING_KEYS if k in fields]
        dtype = fields.get("dtype", "bfloat16")
        meaning = AUTOCAST_DTYPE.get(dtype) if isinstance(dtype, str) else None
        if scaling and meaning == "bf16" and "dtype" not in lax:
            verdict.reason(verdict.must, f"autocastzero: {scaling} without dtype float16", name, *scaling)
        elif scaling and "dtype" in lax:
            verdict.reason(verdict.may, f"autocastzero: {scaling} with dtype {dtype!r}", name, *scaling)
        dynamic = [k for k in SCALING_KEYS[1:] if k in fields]
        if dynamic and fields.get("loss_scale", 0) not in (0, 0.0):
            # a static scale makes the dynamic-scaling keys moot: refused by the checks being added
            verdict.reason(verdict.may, f"autocastzero: {dynamic} with a static loss_scale", name, *dynamic)
    if name == "nvmeswap" and fields.get("step_in_backward") is True:
        prefetch = fields.get("prefetch_bytes", 0)
        if fields.get("keep_master_in_ram") is True:
            verdict.reason(
                verdict.must, "nvmeswap: step_in_backward with keep_master_in_ram", "step_in_backward"
            )
        if type(prefetch) is int and prefetch != 0:
            verdict.reason(verdict.must, "nvmeswap: step_in_backward with prefetch_bytes", "step_in_backward")
    if name == "mixedlayers":
        chosen = [k for k in SELECTION_KEYS if k in fields and fields[k] not in ([], None)]
        if not chosen:
            verdict.reason(verdict.must, "mixedlayers selects no module", name, *SELECTION_KEYS)


def judge(config: dict[str, Any], base_keys: set[str]) -> Verdict:
    """The oracle: what ``config`` must do, from the documented rules only."""
    verdict = Verdict()
    for key, value in config.items():
        if key in PLUGINS:
            _judge_section(key, value, verdict)
        elif key == "zero_optimization":
            for inner in value if isinstance(value, dict) else ():
                if isinstance(inner, str) and _closeness(inner) <= 2:
                    verdict.reason(verdict.deepspeed, f"zero_optimization.{inner}: not a ZeRO key", inner)
        elif key in base_keys or key in _DS_KEYS:
            continue
        elif _closeness(key) == 1:
            verdict.reason(verdict.must, f'"{key}" is a near-miss of a plugin name', key)
        elif _closeness(key) == 2:
            verdict.reason(verdict.may, f'"{key}" is two edits from a plugin name', key)
        elif isinstance(value, dict):
            nested = [k for k in value if isinstance(k, str) and _closeness(k) <= 2]
            if any(_normalised(k) in PLUGINS for k in nested):
                verdict.reason(verdict.must, f'"{key}" holds plugin sections {nested}', key, *nested)
            elif nested:
                verdict.reason(verdict.may, f'"{key}" holds {nested}, misspelt plugin names', key, *nested)
    return verdict


# -- the generator ------------------------------------------------------------------------------
LETTERS = string.ascii_lowercase + string.digits


@st.composite
def _one_edit(draw: st.DrawFn, name: str) -> str:
    op = draw(st.sampled_from(["delete", "insert", "substitute", "transpose"]))
    i = draw(st.integers(0, len(name) - 1))
    c = draw(st.sampled_from(LETTERS))
    if op == "delete":
        return name[:i] + name[i + 1 :]
    if op == "insert":
        return name[:i] + c + name[i:]
    if op == "substitute":
        return name[:i] + c + name[i + 1 :]
    i = min(i, len(name) - 2)
    return name[:i] + name[i + 1] + name[i] + name[i + 2 :]


@st.composite
def _spelling(draw: st.DrawFn, name: str) -> str:
    """``name`` or a variant of it: case, spacing, ``_``/``-``, one or two edits."""
    kind = draw(st.sampled_from(["exact"] * 8 + ["case", "space", "separator", "edit", "edit2", "mixed"]))
    if kind == "exact":
        return name
    if kind in ("edit", "edit2", "mixed"):
        name = draw(_one_edit(name))
    if kind == "edit2":
        name = draw(_one_edit(name))
    if kind in ("case", "mixed"):
        flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
        name = "".join(c.upper() if f else c for c, f in zip(name, flips, strict=True))
        if name.islower():
            name = name.capitalize() if name[:1].isalpha() else name.upper()
    if kind == "space":
        name = draw(st.sampled_from([f" {name}", f"{name} ", f"{name}\t", f"\n{name}"]))
    if kind == "separator":
        i = draw(st.integers(1, len(name) - 1))
        name = name[:i] + draw(st.sampled_from(["_", "-", " "])) + name[i:]
    return name


@st.composite
def _value(draw: st.DrawFn, plugin: str, field: str, classes: tuple[str, ...] = (V,) * 6 + (X, L, R)) -> Any:
    table = TABLES[plugin][field]
    cls = draw(st.sampled_from([c for c in classes if table.get(c)]))
    return copy.deepcopy(draw(st.sampled_from(table[cls])))


@st.composite
def _section(draw: st.DrawFn, plugin: str) -> Any:
    """A plugin section: an object (usually) or another JSON value."""
    form = draw(st.sampled_from(["object"] * 8 + ["true", "false", "other"]))
    if form == "true":
        return True
    if form == "false":
        return False
    if form == "other":
        return draw(st.sampled_from([None, "false", "true", 0, 1, "no", [], "loco"]))
    fields = list(TABLES[plugin])
    chosen = draw(st.lists(st.sampled_from(fields), unique=True, max_size=4))
    section: dict[str, Any] = {}
    enabled = draw(
        st.sampled_from(["absent"] * 16 + [True] * 3 + [False] * 2 + ["false", 0, 1, None, "no", "true"])
    )
    if enabled != "absent":
        section["enabled"] = enabled
    if plugin == "mixedlayers" and not any(k in chosen for k in SELECTION_KEYS) and draw(st.booleans()):
        chosen.append(draw(st.sampled_from(SELECTION_KEYS)))
    for field in chosen:
        section[field] = draw(_value(plugin, field))
    if draw(st.integers(0, 14)) == 0:
        field = draw(st.sampled_from(fields))
        unknown = draw(
            st.sampled_from(
                [field + "s", field.upper(), field.replace("_", "-"), f"{field}_x", "foo", "Enabled"]
            )
        )
        assume(unknown not in fields and unknown != "enabled")
        section[unknown] = draw(_value(plugin, field))
    return section


@st.composite
def _clean_section(draw: st.DrawFn, plugin: str) -> Any:
    """A section the oracle calls valid (values of class V only)."""
    if plugin != "mixedlayers" and draw(st.integers(0, 4)) == 0:
        return True
    fields = [f for f in TABLES[plugin] if not (plugin == "autocastzero" and f in SCALING_KEYS)]
    section: dict[str, Any] = {}
    for field in draw(st.lists(st.sampled_from(fields), unique=True, max_size=3)):
        section[field] = draw(_value(plugin, field, (V,)))
    if plugin == "mixedlayers" and not any(section.get(k) for k in SELECTION_KEYS):
        section["fp32_modules"] = draw(_value(plugin, "fp32_modules", (V,)).filter(bool))
    if plugin == "autocastzero" and AUTOCAST_DTYPE.get(section.get("dtype", "")) == "fp16":
        for field in draw(st.lists(st.sampled_from(SCALING_KEYS), unique=True, max_size=2)):
            section[field] = draw(_value(plugin, field, (V,)))
    if draw(st.integers(0, 5)) == 0:
        section["enabled"] = draw(st.booleans())
    return section


@st.composite
def _base(draw: st.DrawFn) -> dict[str, Any]:
    from zerohooks.testing.toy import ds_config

    return ds_config(draw(st.integers(0, 3)), draw(st.sampled_from(["fp32", "bf16"])), gas=1)


FAR_KEYS = ("notes", "experiment", "my_settings")
"""Unrelated top-level keys (DeepSpeed ignores them; nothing about plugins)."""


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """A DeepSpeed config with 0-3 plugin-ish sections (and sometimes an unrelated key): in 4
    configs of 10 exact names and valid sections, in the others anything :func:`_spelling` and
    :func:`_section` make."""
    cfg = draw(_base())
    base = set(cfg)
    noisy = draw(st.integers(0, 9)) < 6
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2, 3]))):
        plugin = draw(st.sampled_from(PLUGINS))
        if not noisy:
            cfg[plugin] = draw(_clean_section(plugin))
            continue
        where = draw(st.sampled_from(["top"] * 14 + ["wrapper", "zero"]))
        key = draw(_spelling(plugin))
        assume(key not in _DS_KEYS and key not in base and key.strip() != "")
        section = draw(_section(plugin))
        if where == "top":
            cfg[key] = section
        elif where == "wrapper":
            cfg.setdefault(draw(st.sampled_from(WRAPPERS)), {})[key] = section
        else:
            assume(key not in cfg["zero_optimization"])
            cfg["zero_optimization"][key] = section
    if draw(st.integers(0, 9)) == 0:
        cfg[draw(st.sampled_from(FAR_KEYS))] = {"anything": 1}
    return cfg


def _base_keys() -> set[str]:
    from zerohooks.testing.toy import ds_config

    return set(ds_config(0, "bf16", offload=True)) | {"bf16", "fp16"}


# -- checking a refusal -------------------------------------------------------------------------


def _check_refusal(error: BaseException, verdict: Verdict, config: Any) -> None:
    """A ConfigError (DeepSpeed's ValidationError where DeepSpeed must refuse) naming a culprit."""
    from zerohooks import ConfigError

    allowed: tuple[type[BaseException], ...] = (ConfigError,)
    if verdict.deepspeed:
        allowed += (pydantic.ValidationError,)
    assert isinstance(error, allowed), f"refused with {type(error).__name__}: {error}\nconfig: {config!r}"
    message = str(error)
    assert any(c in message for c in verdict.culprits), (
        f"the refusal names none of {sorted(verdict.culprits)}: {message}\nconfig: {config!r}"
    )


# -- the config step, 600 examples --------------------------------------------------------------


def _deepspeed_zero_check(ds_config: dict[str, Any]) -> None:
    """DeepSpeed's own validation of its zero_optimization section (as its config reader does)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = ds_config.get("zero_optimization")
    if isinstance(zero, dict):
        DeepSpeedZeroConfig(**zero)


BASE_KEYS = _base_keys()


@pytest.mark.slow
@settings(
    max_examples=BULK_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(config=configs())
def test_config_step_property(config: dict[str, Any]) -> None:
    from zerohooks import ConfigError
    from zerohooks.config import split_plugin_sections

    verdict = judge(config, BASE_KEYS)
    ds_part = copy.deepcopy(config)
    try:
        built = split_plugin_sections(ds_part)
        _deepspeed_zero_check(ds_part)
    except (ConfigError, pydantic.ValidationError) as e:
        event("refused")
        assert verdict.must or verdict.deepspeed or verdict.may or verdict.runtime, (
            f"a valid config was refused: {e}\nconfig: {config!r}"
        )
        _check_refusal(e, verdict, config)
        return
    event(f"accepted: {'+'.join(sorted(p.name for p in built)) or 'no plugin'}")
    assert not verdict.must, f"accepted although {verdict.must}\nconfig: {config!r}"
    assert not verdict.deepspeed, f"DeepSpeed accepted although {verdict.deepspeed}\nconfig: {config!r}"
    assert sorted(p.name for p in built) == sorted(verdict.intended), config
    # DeepSpeed gets the rest, unchanged: every exact plugin section gone, nothing else touched
    assert ds_part == {k: v for k, v in config.items() if k not in PLUGINS}


# -- combinations the plugins may refuse ---------------------------------------------------------
# What the oracle knows of combinations, from the plugins' READMEs: these may be refused (by the
# plugin named, whose message names it) once the plugins are on; any other refusal of a config
# the oracle calls valid fails the test.

_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
}


def _word(table: dict[str, str], value: Any) -> str | None:
    """``table[value]`` for a string ``value`` it holds, else None (also for lists, numbers...)."""
    return table.get(value) if isinstance(value, str) else None


def combinations(config: dict[str, Any], verdict: Verdict) -> list[tuple[str, str]]:
    """(plugin, why) for each documented combination refusal that may apply to ``config``."""
    on = verdict.intended
    bf16 = isinstance(config.get("bf16"), dict) and config["bf16"].get("enabled") is True
    model = "bf16" if bf16 else "fp32"
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0

    def section(name: str) -> dict[str, Any]:
        value = config.get(name)
        return value if isinstance(value, dict) else {}

    out = []
    if "accumdtype" in on:
        s = section("accumdtype")
        accum = _word(_DTYPE_NAMES, s.get("dtype", "fp32"))
        reduce = s.get("reduce_dtype", "inherit")
        reduce = accum if reduce in ("inherit", "auto") else _word(_DTYPE_NAMES, reduce)
        lossless = (
            accum is not None
            and reduce is not None
            and ((accum == model or accum == "fp32") and (reduce == accum or reduce == "fp32"))
        )
        if not lossless and s.get("allow_lossy") is not True:
            out.append(("accumdtype", "accumdtype: a lossy accumulation/reduction mix without allow_lossy"))
    if "autocastzero" in on:
        if bf16:
            out.append(("autocastzero", "autocastzero: DeepSpeed's bf16 is enabled (fp32 parameters needed)"))
        if "nvmeswap" in on and _word(AUTOCAST_DTYPE, section("autocastzero").get("dtype")) == "fp16":
            out.append(("autocastzero", "autocastzero: float16 loss scaling with an offloaded optimizer"))
    if "mixedlayers" in on:
        if not bf16 and "autocastzero" not in on:
            out.append(("mixedlayers", "mixedlayers: an fp32 model has nothing to keep in fp32"))
        if "nvmeswap" in on:
            out.append(("mixedlayers", "mixedlayers: ZeRO 3 with NVMe optimizer offload"))
    if "nvmeswap" in on and stage != 3:
        out.append(("nvmeswap", "nvmeswap: needs ZeRO 3"))
    return out


# -- the engine, 60 examples on one rank --------------------------------------------------------


@st.composite
def engine_configs(draw: st.DrawFn) -> dict[str, Any]:
    """Half of them configs shaped to train on CPU (exact names, valid values, a base that suits the
    plugins), the rest from :func:`configs`."""
    if draw(st.integers(0, 9)) >= 5:
        return draw(configs())
    plugins = draw(st.lists(st.sampled_from(PLUGINS), unique=True, min_size=1, max_size=3))
    stage = 3 if "nvmeswap" in plugins else draw(st.integers(0, 3))
    if "autocastzero" in plugins:
        dtype = "fp32"
    elif "mixedlayers" in plugins:
        dtype = "bf16"
    else:
        dtype = draw(st.sampled_from(["fp32", "bf16"]))
    from zerohooks.testing.toy import ds_config

    cfg = ds_config(stage, dtype, gas=1)
    for plugin in plugins:
        cfg[plugin] = draw(_clean_section(plugin))
    return cfg


def _model_dependent(config: dict[str, Any], verdict: Verdict) -> bool:
    """mixedlayers settings that only suit some models: ``cast_inputs`` false (a kept module must
    then receive its input in fp32) or ``output_dtype`` fp32 (the next module must take fp32, as a
    loss on an LM head's logits does).  TinyNet's kept modules get 16-bit inputs and feed 16-bit
    modules, so its forward fails in the first step with a dtype mismatch; excluded from the run."""
    section = config.get("mixedlayers")
    if "mixedlayers" not in verdict.intended or not isinstance(section, dict):
        return False
    cast = section.get("cast_inputs", True)
    return (
        cast in (False, "no", "false")
        or (type(cast) is int and cast == 0)
        or section.get("output_dtype") == "fp32"
    )


def _engine_property(examples: int) -> dict[str, int]:
    """Runs on one gloo rank: build the engine for each example and train one step."""
    os.environ["LOCO_KERNELS"] = "reference"
    os.environ["NVMESWAP_IO"] = "python"
    os.environ["NVMESWAP_ADAM"] = "python"
    import shutil
    import tempfile
    import warnings

    import zerohooks
    from zerohooks.testing.toy import make_model, train

    warnings.simplefilter("ignore")
    tally = {"trained": 0, "refused": 0}
    seen: dict[str, int] = {}
    folder = tempfile.mkdtemp(prefix="zerohooks-property-")

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(config=engine_configs())
    def check(config: dict[str, Any]) -> None:
        verdict = judge(config, BASE_KEYS)
        assume(not _model_dependent(config, verdict))
        run = copy.deepcopy(config)
        if isinstance(run.get("nvmeswap"), dict) and run["nvmeswap"].get("folder") == SWAP_DIR:
            run["nvmeswap"]["folder"] = folder
        if "nvmeswap" in verdict.intended:
            # nvmeswap's place; never without it (DeepSpeed's own NVMe swapper builds for minutes)
            run["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": folder}
            run["zero_force_ds_cpu_optimizer"] = False
        model = make_model()
        try:
            engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=run)
        except Exception as e:
            tally["refused"] += 1
            what = f"refused ({type(e).__name__}): {str(e).splitlines()[0][:90]}"
            seen[what] = seen.get(what, 0) + 1
            allowed = verdict.must + verdict.deepspeed + verdict.runtime + verdict.may
            # combinations with DeepSpeed's settings (or each other) a plugin may refuse, naming itself
            combos = combinations(config, verdict)
            verdict.culprits |= {p for p, _ in combos}
            allowed += [why for _, why in combos]
            assert allowed, f"a valid config was refused: {type(e).__name__}: {e}\nconfig: {config!r}"
            _check_refusal(e, verdict, config)
            return
        att = zerohooks.attachment(engine)
        attached = sorted(p.name for p in att.plugins) if att is not None else []
        try:
            assert not (verdict.must or verdict.deepspeed or verdict.runtime), (
                f"built although {verdict.must + verdict.deepspeed + verdict.runtime}\nconfig: {config!r}"
            )
            assert attached == sorted(verdict.intended), f"attached {attached}\nconfig: {config!r}"
            losses = train(engine, steps=1, gas=1)
            assert all(math.isfinite(x) for x in losses), losses
            tally["trained"] += 1
            what = f"trained: {'+'.join(attached) or 'no plugin'}"
            seen[what] = seen.get(what, 0) + 1
        finally:
            zerohooks.detach(engine)

    try:
        check()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {**tally, **seen}


@pytest.mark.slow
@pytest.mark.multirank
def test_engine_property() -> None:
    tally = run_distributed(_engine_property, 1, args=(ENGINE_EXAMPLES,), timeout=300)[0]
    print("engine property:", *(f"{n:4d} {what}" for what, n in sorted(tally.items())), sep="\n")
    # the shaped examples must mostly train: a generator that only made refusals would prove little
    assert tally["trained"] >= ENGINE_EXAMPLES // 3, tally


def test_value_tables_cover_every_field() -> None:
    """The oracle's tables list every field of every plugin's section model (introspected), and
    each table value is judged as the table says by the plugin's own model, one key at a time
    (a disagreement is a table to fix or a validation to fix: this test says which)."""
    from zerohooks.config import available_plugins

    plugins = available_plugins()
    for name in PLUGINS:
        model = plugins[name].Config
        assert set(TABLES[name]) == set(model.model_fields), (name, sorted(model.model_fields))
        wrong = []
        for field, classes in TABLES[name].items():
            for cls in (V, X):
                for value in classes.get(cls, []):
                    section = {field: value}
                    if name == "mixedlayers" and field not in SELECTION_KEYS:
                        section["fp32_modules"] = ["fc2"]
                    if name == "autocastzero" and field in SCALING_KEYS:
                        section["dtype"] = "float16"
                    if name == "mixedlayers" and value == []:
                        continue  # nothing selected: judged with the rule across keys
                    try:
                        model.model_validate(section)
                        ok = True
                    except (pydantic.ValidationError, ValueError):
                        ok = False
                    if ok != (cls == V):
                        wrong.append(f"{name}.{field} = {value!r}: table says {cls}")
        assert not wrong, "\n".join(wrong)


LAX_CLASSES: dict[str, Any] = {
    "string for a boolean": lambda f, t: ["yes", "no", "true", "false"] if t == "boolean" else [],
    "number for a boolean": lambda f, t: [0, 1] if t == "boolean" else [],
    "boolean for a number": lambda f, t: [True, False] if t in ("integer", "number") else [],
    "string for a number": lambda f, t: ["3", "0.5"] if t in ("integer", "number") else [],
    "float for an integer": lambda f, t: (
        [float(v) for v in f.get(V, []) if type(v) is int][:2] if t == "integer" else []
    ),
    "huge value": lambda f, t: [10**30] if t == "integer" and f.get("huge") else [],
}
"""Each class of lax value: field's table, field's JSON type -> values of that class to try."""
BOUNDED = {
    ("nvmeswap", "block_size"),
    ("nvmeswap", "io_threads"),
    ("nvmeswap", "buffer_count"),
    ("nvmeswap", "min_swap_numel"),
    ("nvmeswap", "prefetch_bytes"),
    ("loco", "reset_T"),
    ("loco", "exact_below"),
    ("loco", "node_size"),
    ("autocastzero", "initial_scale_power"),
    ("autocastzero", "loss_scale_window"),
    ("autocastzero", "hysteresis"),
}
"""Fields with an upper bound (every integer field of every plugin: memory, threads or disk for
nvmeswap's, step counts at most 2**31 - 1, element counts at most 2**48, ranks per node at most
2**16, scale powers at most 32); :func:`test_every_integer_field_is_bounded` keeps it whole."""


def test_every_integer_field_is_bounded() -> None:
    """Every integer field of every plugin (introspected) has an upper bound in its JSON schema and
    is in :data:`BOUNDED`, so the huge value of :data:`LAX_CLASSES` is tried on it (issue #33: a
    ``loco.reset_T`` of 10**30 was accepted)."""
    from zerohooks.config import available_plugins

    plugins = available_plugins()
    unbounded, unlisted = [], []
    for name in PLUGINS:
        model = plugins[name].Config
        schema = model.model_json_schema()["properties"]
        for field in model.model_fields:
            if _json_kind(model, field) != "integer":
                continue
            parts = schema[field].get("anyOf", [schema[field]])
            if not any("maximum" in p or "enum" in p or "const" in p for p in parts):
                unbounded.append(f"{name}.{field}")
            if (name, field) not in BOUNDED and not any("enum" in p for p in parts):
                unlisted.append(f"{name}.{field}")
    assert not unbounded, f"integer fields without an upper bound: {unbounded}"
    assert not unlisted, f"bounded integer fields missing from BOUNDED: {unlisted}"


def _json_kind(model: Any, field: str) -> str | None:
    """The field's JSON type (boolean, integer, number), or None for anything else."""
    prop = model.model_json_schema()["properties"][field]
    kinds = {s.get("type") for s in prop.get("anyOf", [prop])} - {"null"}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    return kind if kind in ("boolean", "integer", "number") else None


def test_lax_value_classes_are_refused_naming_key_and_accepted_values() -> None:
    """Every lax class (:data:`LAX_CLASSES`) is refused for every field of its JSON type in every
    plugin (introspected), by ``split_plugin_sections``, with a message naming the key and what
    is accepted; the table's valid values are still accepted (so the refusal is the type's)."""
    from zerohooks import ConfigError
    from zerohooks.config import available_plugins, split_plugin_sections

    plugins = available_plugins()
    tried: dict[str, int] = dict.fromkeys(LAX_CLASSES, 0)
    for name in PLUGINS:
        model = plugins[name].Config
        for field in model.model_fields:
            kind = _json_kind(model, field)
            table = {**TABLES[name][field], "huge": (name, field) in BOUNDED}
            base: dict[str, Any] = {"fp32_modules": ["fc2"]} if name == "mixedlayers" else {}
            if name == "autocastzero" and field in SCALING_KEYS:
                base["dtype"] = "float16"
            for cls, make in LAX_CLASSES.items():
                for value in make(table, kind):
                    tried[cls] += 1
                    with pytest.raises(ConfigError) as info:
                        split_plugin_sections({name: {**base, field: value}}, {name: plugins[name]})
                    message = str(info.value)
                    assert f"{name}.{field}" in message, (cls, value, message)
                    assert "accepted" in message or "must be" in message, (cls, value, message)
            for value in table.get(V, [])[:1]:
                if value != SWAP_DIR:
                    split_plugin_sections({name: {**base, field: value}}, {name: plugins[name]})
    assert all(tried.values()), tried  # every class met at least one field
