"""The DeepSpeed surface zerohooks touches: declared seam by seam, checked when an engine is built.

Each seam of the adapter (:data:`SEAMS`: the step and backward bookkeeping, checkpoints, the
gradient collective, the parameter all-gather, loss scaling, the gradient-partition view, the
ZeRO-3 partition retype, ...) declares every DeepSpeed attribute or method it touches as an
:class:`Internal`, with the ZeRO stages and how (``read``, ``write`` or ``replace``);
:data:`SURFACE` is their union.  A plugin names the seams it uses (``deepspeed_seams``), so this
list names no plugin; a plugin that touches DeepSpeed itself declares its own seam
(:func:`declare_seam`).  :func:`check` runs when the adapter attaches to an engine: every name
of the core seams and of the enabled plugins' seams must exist on the engine, its ZeRO optimizer
or the DeepSpeed module, or :class:`~zerohooks.errors.DeepSpeedInternalMissing` names all the
missing ones before anything is changed.  ``tests/test_surface.py`` checks that every declared
name exists in the installed DeepSpeed, ``tests/test_seam_scan.py`` that the adapter uses no
DeepSpeed name a seam does not declare, and the ``deepspeed_range`` nox session runs the
bit-identity and plugin smoke tests on the oldest and newest DeepSpeed releases supported.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Iterable
from typing import Any

__all__ = [
    "BACKEND",
    "CORE_SEAMS",
    "ENGINE",
    "PARAM",
    "SEAMS",
    "SURFACE",
    "ZERO3",
    "ZERO3_PRIVATE",
    "ZERO12",
    "Internal",
    "check",
    "check_object",
    "declare_seam",
    "entries",
    "make_entries",
    "needed",
    "seams",
    "seams_of",
    "surface",
]

ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
ZERO3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
ZERO3_PRIVATE = "_DeepSpeedZeroOptimizer_Stage3__"
"""The name-mangling prefix of ZeRO 3's private attributes (written once, here)."""
_Z3_PRIVATE = ZERO3_PRIVATE


@dataclasses.dataclass(frozen=True)
class Internal:
    """One DeepSpeed name we rely on, as one seam uses it."""

    owner: str
    """The class (its instances: the engine or its ZeRO optimizer) or module holding it."""
    name: str
    """The attribute (name-mangled for private ones)."""
    stages: frozenset[int]
    """The ZeRO stages it is used on."""
    user: str
    """The seam that uses it (a key of :data:`SEAMS`, or a seam a plugin declared with
    :func:`declare_seam`)."""
    how: str
    """``"read"`` (read or called), ``"write"`` (an attribute set on the instance, DeepSpeed's
    value replaced) or ``"replace"`` (a method wrapped or replaced on the instance)."""
    optional: bool = False
    """The seam works without it (another code path): not required when an engine is built,
    but still checked against the installed DeepSpeed by the tests."""

    @property
    def patched(self) -> bool:
        """Changed on the instance (written or replaced), not only read."""
        return self.how != "read"

    @property
    def qualname(self) -> str:
        return f"{self.owner.rpartition('.')[2]}.{self.name}"


HOWS = ("read", "write", "replace")
"""How a seam may touch a DeepSpeed name."""


def _entries(
    seam: str,
    owner: str,
    stages: Iterable[int],
    patch: str = "",
    read: str = "",
    optional: str = "",
    optional_patch: str = "",
    write: str = "",
) -> list[Internal]:
    """Entries from space-separated names; a leading ``__`` stands for ZeRO 3's name mangling.
    ``patch``: methods replaced; ``write``: attributes set; ``read``: read or called."""
    st = frozenset(stages)

    def make(names: str, how: str, spare: bool) -> list[Internal]:
        out = []
        for n in names.split():
            name = _Z3_PRIVATE + n[2:] if n.startswith("__") else n
            out.append(Internal(owner, name, st, seam, how, optional=spare))
        return out

    return (
        make(patch, "replace", False)
        + make(write, "write", False)
        + make(read, "read", False)
        + make(optional_patch, "replace", True)
        + make(optional, "read", True)
    )


make_entries = _entries
"""Build a seam's :class:`Internal` entries (for :func:`declare_seam`)."""

OPTIMIZER_CHECK_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
"""The module DeepSpeed's ZeRO optimizer check (``is_zero_supported_optimizer``, run by every ZeRO
engine) imports; it calls ``torch.compile`` at import, which imports torch._inductor.  Not a seam:
the multi-rank test harness imports it once in its fork server (:mod:`zerohooks.testing`)."""

PARAM = "torch.nn.Parameter (DeepSpeed's attributes)"
"""The owner of the attributes DeepSpeed sets on parameters (``ds_*`` of ZeRO 3, ``comm_dtype``)."""
BACKEND = "deepspeed.comm.torch.TorchBackend"
"""DeepSpeed's communication backend (``deepspeed.comm.comm.cdb``)."""
_ALL = (0, 1, 2, 3)

CORE_SEAMS = ("engine", "checkpoint", "reduction", "parameter_gather", "loss_scale_query")
"""The seams the adapter itself uses on every engine it attaches to."""

SEAMS: dict[str, tuple[Internal, ...]] = {
    # -- the adapter, every stage: step, backward, engine facts ----------------------------------
    "engine": (
        *_entries(
            "engine",
            ENGINE,
            _ALL,
            patch="_take_model_step forward backward _backward_prologue _backward_epilogue step",
            read="skipped_steps global_steps micro_steps is_gradient_accumulation_boundary module optimizer zero_optimization_partition_weights zero_optimization_stage global_rank gradient_accumulation_steps",
        ),
        *_entries("engine", ENGINE, _ALL, optional_patch="destroy"),
        # an optimizer DeepSpeed's ZeRO would refuse once the model is built is refused before
        # (adapter.dsrules.check_zero_optimizer), by DeepSpeed's own lists
        *_entries("engine", "deepspeed.runtime.config", (1, 2, 3), read="DEEPSPEED_OPTIMIZERS"),
        *_entries("engine", "deepspeed.runtime.zero.utils", (1, 2, 3), read="ZERO_SUPPORTED_OPTIMIZERS"),
        # native MoE on ZeRO 3, which DeepSpeed refuses once building, is refused before
        # (dsrules.check_moe_stage)
        *_entries("engine", "deepspeed.moe.layer", (3,), read="MoE"),
        *_entries("engine", "deepspeed.pipe", (2, 3), read="PipelineModule"),
        *_entries("engine", "deepspeed.runtime.zero.config", _ALL, optional="ZeroStageEnum"),
    ),
    # -- checkpoints: saved and loaded through the adapter (adapter/checkpoint.py, dsfiles, ckptwrite)
    "checkpoint": (
        *_entries("checkpoint", ENGINE, _ALL, patch="save_checkpoint load_checkpoint"),
        # universal checkpoints' own tag file
        *_entries("checkpoint", ENGINE, _ALL, optional="load_universal_checkpoint"),
        # loads read DeepSpeed's files with weights_only=True (adapter/dsfiles.py): the engine's
        # checkpoint engine and the DeepSpeed classes its files may hold; without them the load
        # falls back to torch's own weights-only reader, so none is required
        *_entries("checkpoint", ENGINE, _ALL, optional="checkpoint_engine"),
        # ... and only the files DeepSpeed will read for this rank (dsfiles._files reproduces its
        # names); without them every name pattern DeepSpeed may read is assumed
        *_entries(
            "checkpoint",
            ENGINE,
            _ALL,
            optional="bfloat16_enabled zero_optimization zero_elastic_checkpoint checkpoint_mp_rank has_moe_layers",
        ),
        # saves create every file without following a link (adapter/ckptwrite.py)
        *_entries(
            "checkpoint",
            "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine",
            _ALL,
            optional_patch="load save",
            optional="zipfile_serialization is_decoupled",
        ),
        *_entries("checkpoint", ENGINE, _ALL, optional_patch="_copy_recovery_script"),
        *_entries(
            "checkpoint", "deepspeed.runtime.fp16.loss_scaler", _ALL, optional="DynamicLossScaler LossScaler"
        ),
        *_entries("checkpoint", "deepspeed.utils.tensor_fragment", _ALL, optional="fragment_address"),
        # ZeRO 3's universal load shares one step tensor between sub-groups (universal.py mends it)
        *_entries("checkpoint", ZERO3, (3,), optional="fp32_partitioned_groups_flat optimizer"),
    ),
    # -- the gradient collective of every stage, its dtype, its owner (adapter/zero0, zero12, zero3)
    "reduction": (
        *_entries(
            "reduction",
            ENGINE,
            (0,),
            patch="allreduce_bucket allreduce_and_copy",
            read="gradient_predivide_factor communication_data_type gradient_average flatten unflatten",
        ),
        *_entries(
            "reduction",
            ZERO12,
            (1, 2),
            patch="process_gradients get_param_comm_dtype get_gradient_for_reduction allreduce_and_copy_with_multiple_ranks allreduce_bucket gradient_reduction_w_predivide",
            read="gradient_predivide_factor dp_process_group flatten gradient_average ipg_buckets communication_data_type bit16_groups sequence_parallel_size real_dp_process_group",
            # the IPG buffers sized to their buckets once reduce_dtype hooks split the gradients
            # (adapter/zero12._fit_bucket_buffers); without these DeepSpeed's own sizes stay
            optional_patch="setup_buckets",
            optional="ready_for_gradients contiguous_gradients overlap_comm reduce_bucket_size _gradient_reduction_buffer_dtype",
        ),
        *_entries(
            "reduction",
            ZERO3,
            (3,),
            patch="reduce_ready_partitions_and_remove_grads get_param_comm_dtype __avg_scatter_grads __avg_scatter_contiguous_grads",
            read="ipg_buckets communication_data_type contiguous_gradients fp16_groups reduce_bucket_size reduce_scatter gradient_predivide_factor dp_process_group _get_param_partition_group _gradient_averaging_world_size gradient_accumulation_dtype sequence_parallel_size",
        ),
        *_entries(
            "reduction", "deepspeed.runtime.comm.coalesced_collectives", (3,), read="reduce_scatter_coalesced"
        ),
        # ZeRO 3's parameters: the reduce-scatter reads where each one lies
        *_entries("reduction", PARAM, (3,), read="ds_id ds_numel ds_tensor ds_process_group partition_numel"),
    ),
    # -- the parameter all-gather (adapter/gather.py, zero3.py): its dtype and its route ----------
    "parameter_gather": (
        *_entries(
            "parameter_gather",
            "deepspeed.runtime.zero.partition_parameters",
            (3,),
            read="get_allgather_dtype",
        ),
        *_entries("parameter_gather", BACKEND, (1, 2, 3), patch="all_gather_into_tensor"),
        # the all-gather dtype DeepSpeed reads from each parameter (torch_autocast's attribute)
        *_entries(
            "parameter_gather",
            PARAM,
            (3,),
            write="comm_dtype",
            read="ds_shape ds_status ds_tensor ds_process_group",
        ),
    ),
    # whether a loss scaler can skip steps (adapter.seams.steps_may_be_skipped)
    "loss_scale_query": (
        *_entries("loss_scale_query", ENGINE, (0,), optional="torch_autocast_z0_gradscaler"),
        *_entries("loss_scale_query", ZERO12, (1, 2), optional="dynamic_loss_scale"),
        *_entries("loss_scale_query", ZERO3, (3,), optional="dynamic_loss_scale"),
    ),
    # -- the seams plugins declare (``deepspeed_seams``) ----------------------------------------------
    # seams.accumulate_separately: DeepSpeed's own separate fp32 accumulation, per instance
    "separate_accumulation": tuple(
        _entries(
            "separate_accumulation",
            ZERO12,
            (1, 2),
            write="gradient_accumulation_dtype use_separate_grad_accum use_grad_accum_attribute",
        )
    ),
    # seams.widen_reduction_buffer
    "widen_reduction_buffer": tuple(
        _entries("widen_reduction_buffer", ZERO12, (1, 2), patch="_gradient_reduction_buffer_dtype")
    ),
    # seams.stage_buckets_in_own_dtype
    "stage_buckets": tuple(
        _entries(
            "stage_buckets",
            ZERO12,
            (1, 2),
            patch="setup_buckets",
            read="contiguous_gradients bit16_groups reduce_bucket_size ipg_buckets get_param_comm_dtype",
        )
    ),
    # seams.gradient_groups: the groups a gradient collective's owner reduces over (read only)
    "gradient_groups": tuple(
        _entries(
            "gradient_groups",
            ENGINE,
            _ALL,
            read="data_parallel_group expert_data_parallel_group has_moe_layers",
        )
    ),
    # seams.check_before_save
    "check_before_save": tuple(_entries("check_before_save", ENGINE, _ALL, patch="save_checkpoint")),
    # seams.forward_under_autocast
    "forward": tuple(_entries("forward", ENGINE, _ALL, patch="torch_autocast_enabled torch_autocast_dtype")),
    # seams.own_loss_scaling (adapter/lossscale.py)
    "loss_scaling": (
        *_entries("loss_scaling", ENGINE, (0,), write="torch_autocast_z0_gradscaler"),
        *_entries(
            "loss_scaling",
            ZERO12,
            (1, 2),
            write="loss_scaler dynamic_loss_scale",
            patch="check_grad_overflow",
            read="overflow",
        ),
        *_entries(
            "loss_scaling",
            ZERO3,
            (3,),
            write="loss_scaler dynamic_loss_scale overflow",
            patch="_overflow_check_and_loss_scale_update",
            read="check_overflow _loss_scale_update_and_overflow_cleanup",
        ),
    ),
    # adapter/gradview.py: the read-only gradient-partition view (and the micro-step counter)
    "gradient_partitions": (
        *_entries(
            "gradient_partitions",
            ZERO12,
            (1, 2),
            read="_get_param_group_idx _use_compact_grad_partition_buffer averaged_gradients grad_start_offset grad_partition_insertion_offset partition_size real_dp_process_group _get_compact_grad_partition_slice get_param_id contiguous_gradients reduce_bucket_size",
        ),
        *_entries(
            "gradient_partitions", ZERO3, (3,), read="__param_id_to_grad_partition _get_param_partition_rank"
        ),
        *_entries("gradient_partitions", ENGINE, _ALL, write="micro_steps"),
        *_entries("gradient_partitions", PARAM, (1,), read="grad_accum"),
        *_entries("gradient_partitions", PARAM, (3,), read="ds_id ds_numel partition_numel"),
    ),
    # adapter/stagenorm.py: ZeRO 1/2's gradient norm reduced over a pipeline's stages once a step
    "stage_norm": (
        *_entries("stage_norm", ZERO12, (1, 2), patch="scaled_global_norm", write="model_parallel_group"),
    ),
    # adapter/retype.py: ZeRO 3's partitions held in another dtype
    "partition_retype": (
        *_entries(
            "partition_retype",
            ZERO3,
            (3,),
            write="fp16_partitioned_groups fp16_partitioned_groups_flat",
            read="fp16_groups fp32_partitioned_groups_flat",
        ),
        *_entries(
            "partition_retype",
            PARAM,
            (3,),
            write="ds_tensor",
            read="ds_process_group ds_shape partition_numel",
        ),
    ),
    # adapter/statestore.py: ZeRO 3's fp32 optimizer state held elsewhere by a plugin (nvmeswap
    # replaces DeepSpeed's NVMe path: sub-group prepare/release, the boundary hand-off, the fp32
    # state accessors, the step, checkpoints, the masters while the optimizer is built)
    "optimizer_state_store": (
        *_entries(
            "optimizer_state_store",
            ZERO3,
            (3,),
            patch="_offload_grad_partition_at_boundary _prepare_sub_group _release_sub_group unscale_and_clip_grads _optimizer_step _get_fp32_grad_state_partition _get_fp32_opt_state_partition set_full_hp_param set_local_hp_param _restore_from_bit16_weights _rigid_load_state_dict _reassign_or_swap_out_partitioned_parameters",
            write="norm_for_param_grads",
            read="fp32_partitioned_groups_flat fp16_partitioned_groups_flat_numel grad_position __param_id_to_grad_partition _constant_buffered_norm2 sub_group_to_group_id get_param_id optimizer _unflatten_partitioned_parameters _global_grad_norm loss_scale",
        ),
        *_entries("optimizer_state_store", ENGINE, (3,), patch="_save_zero_checkpoint _load_zero_checkpoint"),
        # adapter/unistate.py: a universal load, one sub-group at a time
        *_entries(
            "optimizer_state_store",
            ZERO3,
            (3,),
            patch="load_hp_checkpoint_state_from_checkpoint_dir_stage3",
            read="param_names _load_global_state_stage3 _get_param_partition_group fp16_groups",
        ),
        *_entries("optimizer_state_store", ENGINE, (3,), read="checkpoint_engine"),
        # while DeepSpeed builds the optimizer (skipped on a DeepSpeed without them)
        *_entries(
            "optimizer_state_store",
            ZERO3,
            (3,),
            optional_patch="_create_momentum_buffer initialize_optimizer_states",
            optional="fp16_partitioned_groups_flat subgroup_to_device offload_optimizer offload_optimizer_pin_memory use_muon",
        ),
        *_entries("optimizer_state_store", PARAM, (3,), read="ds_id"),
    ),
}
"""Every seam the adapter offers, with the DeepSpeed names it touches and how."""

_DECLARED: dict[str, tuple[Internal, ...]] = {}


def declare_seam(name: str, entries: Iterable[Internal]) -> None:
    """Declare a seam a plugin (our own or a third party's) implements itself: the DeepSpeed names
    it touches, checked on every engine the plugin is enabled on and by the surface tests.  The
    same declaration twice is accepted (a module imported again); a different one, or one of the
    adapter's own names, is refused."""
    items = tuple(entries)
    if name in SEAMS:
        raise ValueError(f"seam {name!r} is the adapter's own; declare a seam under another name")
    bad = [i for i in items if i.user != name or i.how not in HOWS]
    if bad:
        raise ValueError(f"seam {name!r}: entries must name it as their user and a how of {HOWS}: {bad[:3]}")
    if _DECLARED.get(name, items) != items:
        raise ValueError(f"seam {name!r} is already declared with other names")
    _DECLARED[name] = items


def seams() -> dict[str, tuple[Internal, ...]]:
    """The adapter's :data:`SEAMS` and the seams plugins declared."""
    return {**SEAMS, **_DECLARED}


def entries(seam: str, owner: str | None = None) -> list[Internal]:
    """The entries of ``seam`` (on ``owner`` only, when given)."""
    return [i for i in seams()[seam] if owner is None or i.owner == owner]


def seams_of(plugins: Iterable[Any]) -> list[str]:
    """The seams ``plugins`` declare (their ``deepspeed_seams``), each a known seam or a
    ValueError naming the known ones."""
    known = seams()
    out: list[str] = []
    for p in plugins:
        for name in getattr(p, "deepspeed_seams", ()):
            if name not in known:
                raise ValueError(
                    f"plugin {getattr(p, 'name', p)!r} declares the unknown seam {name!r}; known: {sorted(known)}"
                )
            if name not in out:
                out.append(name)
    return out


SURFACE: tuple[Internal, ...] = tuple(i for seam in SEAMS.values() for i in seam)
"""Every DeepSpeed name the adapter's seams touch: the union of :data:`SEAMS` (plugins' own
seams: :func:`surface`)."""


def surface() -> tuple[Internal, ...]:
    """:data:`SURFACE` and the entries of every declared seam."""
    return tuple(i for seam in seams().values() for i in seam)


def needed(stage: int, users: Iterable[str]) -> list[Internal]:
    """The entries a ``stage`` engine relies on: the core seams and ``users`` (seam names)."""
    who = {*CORE_SEAMS, *users}
    return [i for i in surface() if stage in i.stages and i.user in who and not i.optional]


def _missing(obj: Any, entries: Iterable[Internal]) -> list[tuple[str, str]]:
    """``(Owner.name, user)`` of each entry ``obj`` lacks, the owner named as ``obj``'s class."""
    owner = getattr(obj, "__name__", None) if inspect.ismodule(obj) else type(obj).__name__
    return [(f"{owner or i.owner}.{i.name}", i.user) for i in entries if not hasattr(obj, i.name)]


def _raise(missing: list[tuple[str, str]]) -> None:
    if not missing:
        return
    import deepspeed

    from zerohooks.adapter.compat import SUPPORTED_DEEPSPEED
    from zerohooks.errors import DeepSpeedInternalMissing

    names = list(dict.fromkeys(n for n, _ in missing))
    users = ", ".join(dict.fromkeys(u for _, u in missing))
    raise DeepSpeedInternalMissing(
        f"zerohooks needs {', '.join(names)}, which DeepSpeed {deepspeed.__version__} does not have "
        f"(used by {users}; zerohooks supports DeepSpeed {SUPPORTED_DEEPSPEED})."
    )


def check_object(obj: Any, owner: str, stage: int, user: str) -> None:
    """Raise :class:`DeepSpeedInternalMissing` naming every entry of the seam ``user`` on
    ``owner`` (for ``stage``) that ``obj`` (an instance of ``owner``) lacks."""
    _raise(_missing(obj, [i for i in needed(stage, [user]) if i.owner == owner and i.user == user]))


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def check(engine: Any, stage: int, users: Iterable[str]) -> None:
    """Raise :class:`DeepSpeedInternalMissing` naming every name of :func:`needed` that ``engine``,
    its ZeRO optimizer or the DeepSpeed modules lack (the optimizer's only when it is the stage's
    ZeRO optimizer: the adapter refuses the others itself)."""
    missing: list[tuple[str, str]] = []
    entries = needed(stage, users)
    optimizer = {1: ZERO12, 2: ZERO12, 3: ZERO3}.get(stage)
    for owner in sorted({i.owner for i in entries}):
        mine = [i for i in entries if i.owner == owner]
        if owner in (PARAM, BACKEND):
            continue  # on each parameter / the process's backend: checked where they are used
        if owner == ENGINE:
            missing += _missing(engine, mine)
        elif owner in (ZERO12, ZERO3):
            if owner == optimizer and isinstance(engine.optimizer, _class(owner)):
                missing += _missing(engine.optimizer, mine)
        else:
            try:
                module = importlib.import_module(owner)
            except ImportError:
                module = None
            if module is None:
                missing += [(f"{i.owner}.{i.name}", i.user) for i in mine]
            else:
                missing += _missing(module, mine)
    _raise(missing)
