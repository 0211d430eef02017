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


@dataclass(frozen=True)
class Run:
    name: str
    edit: ConfigEdit
    plugins: tuple[str, ...] = ()  # zerohooks plugin sections this run turns on
    requires: tuple[str, ...] = ()  # other modules it needs
    help: str = ""
    needs: tuple[Need, ...] = ()  # checks of the setting: each says why the run cannot run there, or None

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
) -> Run:
    """Register a run; ``edit`` is a config-editing function or a dict of plugin sections;
    ``needs``: checks of the setting (``Where``), each returning why the run cannot run there."""
    if "+" in name or "," in name or not name:
        raise ValueError(f"invalid run name {name!r}: no '+' or ',' allowed")
    if isinstance(edit, Mapping):
        sections = copy.deepcopy(dict(edit))
        help = help or "plugin sections " + ", ".join(f"{k}={v}" for k, v in sections.items())

        def edit_fn(cfg: dict[str, Any]) -> None:
            merge(cfg, sections)

        run = Run(name, edit_fn, tuple(sections), tuple(requires or ()), help, tuple(needs))
    else:
        run = Run(name, edit, tuple(plugins), tuple(requires or ()), help, tuple(needs))
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
add_run("baseline", lambda cfg: None, help="the command-line configuration, no plugin")
for _s in range(4):
    add_run(f"zero{_s}", _stage(_s), help=f"ZeRO stage {_s} (overrides --stage)")

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
)
add_run(
    "loco-noef", {"loco": {"error_feedback": False}}, help="4-bit gradients without error feedback (ablation)"
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
    help="ZeRO 3, optimizer state on disk through nvmeswap (12 B/param/step, no gradient I/O, no libaio)",
)
add_run(
    "nvmeswap-ram",
    _nvme("nvmeswap-ram", True, keep_master_in_ram=True),
    plugins=("nvmeswap",),
    help="nvmeswap keeping fp32 masters in RAM: only the Adam moments on disk (8 B/param/step)",
)
add_run(
    "ds-nvme",
    _nvme("ds-nvme", False),
    help="DeepSpeed's own NVMe optimizer offload (libaio; 16 B/param/step), nvmeswap's baseline",
    needs=(_needs_libaio,),
)
add_run(
    "loco-2level",
    {"loco": {"hierarchy": "two_level", "node_size": 2}},
    help="LoCo two-level, 2-rank nodes (--nodes 2, or --nproc 4)",
    needs=(_two_nodes(2),),
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
)
add_run(
    "autocastzero-fp16",
    _autocast({"dtype": "float16", "initial_scale_power": 12}),
    plugins=("autocastzero",),
    help="fp32 parameters, fp16 autocast forward with dynamic loss scaling (ZeRO 0-3)",
)
add_run(
    "ds-autocast",
    _autocast(None, deepspeed_own=True),
    help="DeepSpeed's own torch_autocast (bf16; ZeRO 1-3), autocastzero's baseline",
    needs=(_not_zero0("DeepSpeed's torch_autocast"),),
)


DEFAULT_RUNS = ("baseline", "loco", "accumdtype", "mixedlayers", "autocastzero", "nvmeswap")
"""``--runs`` left out: the baseline and one run per plugin, each showing what its plugin changes
(bytes on the wire, accumulation dtype, parameters kept in fp32, optimizer state on disk); runs
whose plugin is not installed are left out of the default (``--runs all`` reports them as skipped)."""


def default_runs() -> list[str]:
    """:data:`DEFAULT_RUNS` that can run here (installed), the baseline always."""
    return [n for n in DEFAULT_RUNS if n == "baseline" or RUNS[n].skip_reason() is None]
