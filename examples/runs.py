"""The registry of configurations the demo can compare (``--runs``, ``--plugins``).

A run is a name and a function that edits the DeepSpeed config dict in place. The base config
(ZeRO stage, dtype, optimizer, batch sizes: see ``train_gpt.ds_config``) is built from the
command-line options; each run then edits its own copy. A plugin package joins the comparison
with one line here::

    add_run("myplugin", {"myplugin": {"level": 2}}, help="what the run shows")

A dict is merged into the config (nested dicts merged key by key); each of its top-level keys
is a zerohooks plugin section, and the run is reported as skipped, with the reason, when
zerohooks or that plugin (its ``zerohooks.plugins`` entry point) is not installed. For anything
else, pass a function, and name the plugins and other modules it needs::

    add_run("loco-ef", lambda cfg: cfg.update(loco={"err_beta": 0.9}), plugins=("loco",))

``--runs a+b`` combines registered runs (edits applied left to right); ``--plugins p,q``
applies the edits of runs ``p`` and ``q`` on top of every selected run. A zerohooks plugin with
no registered run can still be named: it runs with an empty section (the plugin's defaults).
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ConfigEdit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Where:
    """Where the runs of one launch train, as far as a run's needs go (known to the launcher
    before any rank starts)."""

    world_size: int
    """Ranks of the launch."""
    nodes: int
    """Emulated nodes (``--nodes``; 1 on one machine)."""
    stage: int
    """ZeRO stage of the command line (``--stage``); a run may set its own."""
    cuda: bool
    """Whether the ranks run on GPUs."""


Need = Callable[[Where], "str | None"]
Against = Callable[[str, int], "tuple[str, ...]"]
"""A run's like-for-like baselines for the model dtype ('bf16', 'fp16' or 'fp32') and the
command line's ZeRO stage: registered runs that differ from it only by what it changes."""


def _against(*names: str) -> Against:
    return lambda dtype, stage: names


def _vs_baseline(dtype: str, stage: int) -> tuple[str, ...]:
    """The command-line configuration without the run's plugin."""
    return ("baseline",)


@dataclass(frozen=True)
class Run:
    """One configuration of the comparison."""

    name: str
    """As given to --runs (``a+b`` for a combination)."""
    edit: ConfigEdit
    """Edits the DeepSpeed config dict in place."""
    plugins: tuple[str, ...] = ()
    """zerohooks plugin sections this run turns on."""
    requires: tuple[str, ...] = ()
    """Other modules it needs."""
    help: str = ""
    """What the run shows, in words."""
    needs: tuple[Need, ...] = ()
    """Checks of the setting: each says why the run cannot run there, or None."""
    against: Against = _vs_baseline
    """Its like-for-like baselines (:data:`Against`); none for a baseline itself."""

    def baselines(self, dtype: str, stage: int) -> tuple[str, ...]:
        """The registered runs this one is compared with, for the model dtype and ``--stage``:
        the same stage, dtype and offload, differing only by the plugin (or DeepSpeed feature)."""
        return tuple(self.against(dtype, stage))

    def skip_reason(self, where: Where | None = None) -> str | None:
        """Why this run cannot run here (a plugin or module not installed; with ``where``, a
        setting it cannot run in, e.g. one node for a two-level reduction), else None."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if self.plugins:
            missing += _missing_plugins(self.plugins)
        if missing:
            return f"not installed: {', '.join(dict.fromkeys(missing))}"
        if where is not None:
            for need in self.needs:
                reason = need(where)
                if reason:
                    return reason
        return None

    def config(self, base: Mapping[str, Any]) -> dict[str, Any]:
        cfg = copy.deepcopy(dict(base))
        self.edit(cfg)
        return cfg


def _installed_plugins() -> set[str] | None:
    """Names of the installed zerohooks plugins (entry points, not loaded); None without zerohooks."""
    try:
        import zerohooks
    except ImportError:
        return None
    group = getattr(zerohooks, "ENTRY_POINT_GROUP", "zerohooks.plugins")
    return {ep.name for ep in importlib.metadata.entry_points(group=group)}


def _known_plugins() -> dict[str, str]:
    """The project's own plugins: section name -> distribution name (empty without zerohooks)."""
    try:
        import zerohooks
    except ImportError:
        return {}
    return dict(getattr(zerohooks, "KNOWN_PLUGINS", {}))


def _missing_plugins(names: tuple[str, ...]) -> list[str]:
    installed = _installed_plugins()
    if installed is None:
        return ["zerohooks"]
    known = _known_plugins()
    return [
        f"{n} plugin (pip install {known[n]})" if n in known else f"{n} plugin"
        for n in names
        if n not in installed
    ]


RUNS: dict[str, Run] = {}


def merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    """Merge ``src`` into ``dst``: nested dicts key by key, anything else replaced."""
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            merge(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


def add_run(
    name: str,
    edit: ConfigEdit | Mapping[str, Any],
    *,
    plugins: tuple[str, ...] = (),
    requires: tuple[str, ...] = (),
    help: str = "",
    needs: tuple[Need, ...] = (),
    against: Against | tuple[str, ...] = ("baseline",),
) -> Run:
    """Register a run; ``edit`` is a config-editing function or a dict of plugin sections;
    ``needs``: checks of the setting (``Where``), each returning why the run cannot run there."""
    if "+" in name or "," in name or not name:
        raise ValueError(f"invalid run name {name!r}: no '+' or ',' allowed")
    vs = _against(*against) if isinstance(against, tuple) else against
    if isinstance(edit, Mapping):
        sections = copy.deepcopy(dict(edit))
        help = help or "plugin sections " + ", ".join(f"{k}={v}" for k, v in sections.items())

        def edit_fn(cfg: dict[str, Any]) -> None:
            merge(cfg, sections)

        run = Run(name, edit_fn, tuple(sections), tuple(requires or ()), help, tuple(needs), vs)
    else:
        run = Run(name, edit, tuple(plugins), tuple(requires or ()), help, tuple(needs), vs)
    RUNS[name] = run
    return run


def plugin_names() -> set[str]:
    """zerohooks plugins known here (installed or the project's own), empty without zerohooks."""
    return (_installed_plugins() or set()) | set(_known_plugins())


def plugin_default_run(name: str) -> Run:
    """A run for a plugin with no registered run: its section with the plugin's defaults."""
    return Run(name, lambda cfg: merge(cfg, {name: {}}), (name,), (), f"{name} plugin, default settings")


def resolve(spec: str, plugins: tuple[str, ...] = ()) -> Run:
    """A run from ``name`` or ``a+b+...``, with the ``plugins`` runs' edits applied on top."""
    parts = [p for p in spec.split("+") if p]
    parts += [p for p in plugins if p not in parts]
    known = [*RUNS, *sorted(plugin_names() - set(RUNS))]
    unknown = [p for p in parts if p not in known]
    if not parts or unknown:
        raise KeyError(unknown_message(unknown or [spec], known))
    runs = [
        RUNS[p] if p in RUNS else plugin_default_run(p)
        for p in parts
        if not (p == "baseline" and len(parts) > 1)
    ]

    def edit(cfg: dict[str, Any]) -> None:
        for r in runs:
            r.edit(cfg)

    return Run(
        "+".join(parts),
        edit,
        tuple(dict.fromkeys(p for r in runs for p in r.plugins)),
        tuple(dict.fromkeys(m for r in runs for m in r.requires)),
        "; ".join(r.help for r in runs if r.help),
        tuple(dict.fromkeys(n for r in runs for n in r.needs)),
        runs[-1].against if len(runs) == 1 else _vs_baseline,
    )


def unknown_message(names: list[str], known: list[str]) -> str:
    """``unknown run 'lcoo' (did you mean 'loco'?)``, as zerohooks says of a misspelt plugin
    section, then every name that is accepted."""
    said = []
    for name in names:
        close = difflib.get_close_matches(name.strip().lower(), known, n=1, cutoff=0.6)
        said.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plugins = sorted(plugin_names())
    return (
        f"unknown run {', '.join(said)}; registered runs: {', '.join(RUNS)}"
        + (f"; zerohooks plugins: {', '.join(plugins)}" if plugins else "")
        + "; 'all' for every registered run"
    )


def _not_zero0(what: str) -> Need:
    def need(where: Where) -> str | None:
        return (
            f"{what} needs ZeRO stage 1, 2 or 3 (DeepSpeed raises on ZeRO 0); --stage is 0"
            if where.stage == 0
            else None
        )

    return need


def _two_nodes(node_size: int) -> Need:
    def need(where: Where) -> str | None:
        if where.world_size >= 2 * node_size and where.world_size % node_size == 0:
            return None
        return (
            f"needs at least two nodes of {node_size} ranks (it reduces within each node, then between "
            f"nodes); this launch has {where.world_size} rank(s): use --nodes 2 (or --nproc {2 * node_size})"
        )

    return need


@functools.cache
def _libaio() -> str | None:
    """Why DeepSpeed's async_io op (its NVMe offload) cannot be built here, else None."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if AsyncIOBuilder().is_compatible(verbose=False):
            return None
    except Exception as e:  # an op builder that cannot even be asked
        return f"DeepSpeed's NVMe offload (async_io op) is unavailable here: {type(e).__name__}: {e}"
    return (
        "DeepSpeed's NVMe offload needs libaio (its async_io op): not found here (Debian/Ubuntu: "
        "apt-get install libaio-dev; nvmeswap does not need it)"
    )


def _needs_libaio(where: Where) -> str | None:
    return _libaio()


def _stage(stage: int) -> ConfigEdit:
    def edit(cfg: dict[str, Any]) -> None:
        zero = cfg.setdefault("zero_optimization", {})
        zero["stage"] = stage
        if stage == 0:
            zero.pop("offload_optimizer", None)

    return edit


# --- built-in runs -------------------------------------------------------------------------
add_run("baseline", lambda cfg: None, help="the command-line configuration, no plugin", against=())
for _s in range(4):
    add_run(f"zero{_s}", _stage(_s), help=f"ZeRO stage {_s} (overrides --stage)", against=())


def _fp32(cfg: dict[str, Any]) -> None:
    """The whole model in fp32: DeepSpeed's 16-bit modes off (autocastzero's baseline)."""
    for key in ("bf16", "fp16"):
        if isinstance(cfg.get(key), dict):
            cfg[key]["enabled"] = False


add_run("fp32", _fp32, help="the whole model in fp32, no autocast: autocastzero's baseline", against=())


def _sixteen(dtype: str) -> bool:
    return dtype in ("bf16", "fp16")


def _vs_bf16_reduction(dtype: str, stage: int) -> tuple[str, ...]:
    """loco against DeepSpeed's bf16 reduction: the baseline in a bf16 model, else bf16comm."""
    return ("baseline",) if dtype == "bf16" else ("bf16comm",)


def _vs_uniform16(dtype: str, stage: int) -> tuple[str, ...]:
    """mixedlayers against the same 16-bit model without it."""
    return ("baseline",) if _sixteen(dtype) else ("bf16",)


def _vs_fp32(dtype: str, stage: int) -> tuple[str, ...]:
    """autocast runs against fp32 parameters without autocast."""
    return ("baseline",) if dtype == "fp32" else ("fp32",)


def _vs_zero3(dtype: str, stage: int) -> tuple[str, ...]:
    """Optimizer state on disk against ZeRO 3 with it in RAM, then DeepSpeed's NVMe offload."""
    return ("baseline" if stage == 3 else "zero3", "ds-nvme")


# --- plugin runs: one line per package -----------------------------------------------------
add_run(
    "accumdtype",
    {"accumdtype": {"dtype": "fp32"}},
    help="fp32 gradient accumulation and reduction (changes nothing for an fp32 model)",
)
add_run(
    "ds-accum-fp32",
    lambda cfg: cfg.update(data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32"),
    help="DeepSpeed's built-in fp32 accumulation and reduction (ZeRO 1-3; DeepSpeed raises on ZeRO 0)",
    needs=(_not_zero0("DeepSpeed's grad_accum_dtype"),),
)
add_run(
    "loco",
    {"loco": {"bits": 4, "err_beta": 0.8, "reset_T": 1024}},
    help="LoCo: 4-bit gradients with error feedback",
    against=_vs_bf16_reduction,
)
add_run(
    "loco-noef",
    {"loco": {"error_feedback": False}},
    help="4-bit gradients without error feedback (ablation)",
    against=_vs_bf16_reduction,
)
add_run(
    "bf16comm",
    lambda cfg: cfg.update(communication_data_type="bf16"),
    help="DeepSpeed's reduction in bf16 (LoCo's baseline on fp32 CPUs)",
)


def _mixedlayers(cfg: dict[str, Any]) -> None:
    """LayerNorms and the (tied) head in fp32 inside a 16-bit model: bf16 when --dtype is fp32."""
    if not any(isinstance(cfg.get(k), dict) and cfg[k].get("enabled") for k in ("bf16", "fp16")):
        cfg["bf16"] = {"enabled": True}
    cfg["mixedlayers"] = {"fp32_modules": ["head"], "fp32_module_types": ["torch.nn.LayerNorm"]}


def _uniform16(cfg: dict[str, Any]) -> None:
    """The same 16-bit model without mixedlayers (mixedlayers' baseline)."""
    if not any(isinstance(cfg.get(k), dict) and cfg[k].get("enabled") for k in ("bf16", "fp16")):
        cfg["bf16"] = {"enabled": True}


add_run(
    "mixedlayers",
    _mixedlayers,
    plugins=("mixedlayers",),
    help="LayerNorms and the head in fp32 inside the bf16 (or --dtype fp16) model",
    against=_vs_uniform16,
)
add_run("bf16", _uniform16, help="the whole model in bf16 (or --dtype fp16): mixedlayers' baseline")


def swap_folder(tag: str) -> str:
    """The swap folder of one run of one launch (under the system temp dir): runs never share
    one, so no run finds another's files or lock.  ``TRAIN_GPT_LAUNCH`` names the launch."""
    import os
    import tempfile

    launch = os.environ.get("TRAIN_GPT_LAUNCH") or str(os.getpid())
    return os.path.join(tempfile.gettempdir(), f"zerohooks-demo-nvme-{os.getuid()}", f"{launch}-{tag}")


def _nvme(tag: str, plugin: bool, **section: Any) -> ConfigEdit:
    """ZeRO 3 with the optimizer state on disk (``swap_folder(tag)``)."""

    def edit(cfg: dict[str, Any]) -> None:
        zero = cfg.setdefault("zero_optimization", {})
        zero["stage"] = 3
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_folder(tag), "pin_memory": False}
        cfg["zero_force_ds_cpu_optimizer"] = False  # keep torch AdamW
        if plugin:
            cfg["nvmeswap"] = dict(section)

    return edit


add_run(
    "nvmeswap",
    _nvme("nvmeswap", True),
    plugins=("nvmeswap",),
    help="ZeRO 3, optimizer state on disk through nvmeswap (12 B/param/step each way, no gradient I/O, "
    "no libaio)",
    against=_vs_zero3,
)
add_run(
    "nvmeswap-ram",
    _nvme("nvmeswap-ram", True, keep_master_in_ram=True),
    plugins=("nvmeswap",),
    help="nvmeswap keeping fp32 masters in RAM: only the Adam moments on disk (8 B/param/step each way)",
    against=_vs_zero3,
)
add_run(
    "ds-nvme",
    _nvme("ds-nvme", False),
    help="DeepSpeed's own NVMe optimizer offload (libaio; 16 B/param/step each way), nvmeswap's baseline",
    needs=(_needs_libaio,),
    against=lambda dtype, stage: ("baseline" if stage == 3 else "zero3",),
)
add_run(
    "loco-2level",
    {"loco": {"hierarchy": "two_level", "node_size": 2}},
    help="LoCo two-level, 2-rank nodes (--nodes 2, or --nproc 4)",
    needs=(_two_nodes(2),),
    against=_vs_bf16_reduction,
)


def _autocast(section: dict[str, Any] | None, deepspeed_own: bool = False) -> ConfigEdit:
    """fp32 parameters with the forward under torch.autocast: DeepSpeed's 16-bit modes off."""

    def edit(cfg: dict[str, Any]) -> None:
        for key in ("bf16", "fp16"):
            if isinstance(cfg.get(key), dict):
                cfg[key]["enabled"] = False
        if deepspeed_own:
            cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        else:
            cfg["autocastzero"] = dict(section or {})

    return edit


add_run(
    "autocastzero",
    _autocast({"dtype": "bfloat16"}),
    plugins=("autocastzero",),
    help="fp32 parameters, bf16 autocast forward, Linear gradients (and ZeRO-3 gathers) in bf16",
    against=_vs_fp32,
)
add_run(
    "autocastzero-fp16",
    _autocast({"dtype": "float16", "initial_scale_power": 12}),
    plugins=("autocastzero",),
    help="fp32 parameters, fp16 autocast forward with dynamic loss scaling (ZeRO 0-3)",
    against=_vs_fp32,
)
add_run(
    "ds-autocast",
    _autocast(None, deepspeed_own=True),
    help="DeepSpeed's own torch_autocast (bf16; ZeRO 1-3), autocastzero's baseline",
    needs=(_not_zero0("DeepSpeed's torch_autocast"),),
    against=_vs_fp32,
)


DEFAULT_RUNS = ("baseline", "loco", "accumdtype", "mixedlayers", "autocastzero", "nvmeswap")
"""``--runs`` left out: one run per plugin, each showing what its plugin changes (bytes on the
wire, accumulation dtype, parameters kept in fp32, optimizer state on disk), each after its
like-for-like baselines (:meth:`Run.baselines`); runs whose plugin is not installed are left out
of the default (``--runs all`` reports them as skipped)."""


def _async_io_built() -> bool:
    """Whether DeepSpeed's async_io op (ds-nvme's) is already built in this build folder (its
    first build takes minutes on a 2-core machine: too long for the default demo)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return any(Path(_get_build_directory("async_io", False)).glob("async_io*.so"))
    except Exception:
        return False


def left_out_baseline(name: str) -> str | None:
    """Why the default demo leaves out the baseline ``name`` here, else None."""
    reason = RUNS[name].skip_reason()
    if reason is None and name == "ds-nvme" and not _async_io_built():
        reason = (
            "DeepSpeed's async_io op is not built yet (a one-time build of minutes); "
            "--runs zero3,nvmeswap,ds-nvme builds it and compares"
        )
    return reason


def default_runs(dtype: str = "bf16", stage: int = 2) -> list[str]:
    """:data:`DEFAULT_RUNS` that can run here (installed), each after its like-for-like baselines
    for the model ``dtype`` and ``--stage`` (those that can run here, see :func:`left_out_baseline`)."""
    out: list[str] = []
    for name in DEFAULT_RUNS:
        if name != "baseline" and RUNS[name].skip_reason() is not None:
            continue
        for base in RUNS[name].baselines(dtype, stage):
            if base not in out and left_out_baseline(base) is None:
                out.append(base)
        if name not in out:
            out.append(name)
    return out
