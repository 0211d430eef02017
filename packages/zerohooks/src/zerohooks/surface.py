"""The DeepSpeed surface zerohooks and its plugins touch: one list, checked when an engine is built.

Every DeepSpeed attribute or method that zerohooks' adapter or a plugin reads or patches is an
:class:`Internal` of :data:`SURFACE`, with the ZeRO stages it is used on and who uses it.
:func:`check` runs when the adapter attaches to an engine: every name the stage and the enabled
plugins need must exist on the engine, its ZeRO optimizer or the DeepSpeed module, or
:class:`~zerohooks.errors.DeepSpeedInternalMissing` names all the missing ones before anything
is changed.  ``tests/test_surface.py`` checks that every name exists in the installed DeepSpeed,
and the ``deepspeed_range`` nox session runs the bit-identity and plugin smoke tests on the oldest
and newest DeepSpeed releases supported.  A DeepSpeed rename changes this list and the one call site.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Iterable
from typing import Any

__all__ = ["ENGINE", "SURFACE", "ZERO3", "ZERO12", "Internal", "check", "check_object", "needed"]

ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
ZERO3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
ZERO3_PRIVATE = "_DeepSpeedZeroOptimizer_Stage3__"
"""The name-mangling prefix of ZeRO 3's private attributes (written once, here)."""
_Z3_PRIVATE = ZERO3_PRIVATE


@dataclasses.dataclass(frozen=True)
class Internal:
    """One DeepSpeed name we rely on."""

    owner: str
    """The class (its instances: the engine or its ZeRO optimizer) or module holding it."""
    name: str
    """The attribute (name-mangled for private ones)."""
    stages: frozenset[int]
    """The ZeRO stages it is used on."""
    user: str
    """``"zerohooks"`` (the adapter) or the plugin that uses it."""
    patched: bool
    """True when it is wrapped or replaced (per instance), False when only read or called."""
    optional: bool = False
    """The user works without it (another code path): not required when an engine is built,
    but still checked against the installed DeepSpeed by the tests."""

    @property
    def qualname(self) -> str:
        return f"{self.owner.rpartition('.')[2]}.{self.name}"


def _entries(
    user: str,
    owner: str,
    stages: Iterable[int],
    patch: str = "",
    read: str = "",
    optional: str = "",
    optional_patch: str = "",
) -> list[Internal]:
    """Entries from space-separated names; a leading ``__`` stands for ZeRO 3's name mangling."""
    st = frozenset(stages)

    def make(names: str, patched: bool, spare: bool) -> list[Internal]:
        out = []
        for n in names.split():
            name = _Z3_PRIVATE + n[2:] if n.startswith("__") else n
            out.append(Internal(owner, name, st, user, patched, optional=spare))
        return out

    return (
        make(patch, True, False)
        + make(read, False, False)
        + make(optional_patch, True, True)
        + make(optional, False, True)
    )


_ALL = (0, 1, 2, 3)
SURFACE: tuple[Internal, ...] = (
    # -- the adapter, every stage: step, backward and checkpoint bookkeeping ---------------------
    *_entries(
        "zerohooks",
        ENGINE,
        _ALL,
        patch="_take_model_step forward backward _backward_prologue _backward_epilogue step save_checkpoint load_checkpoint",
        read="skipped_steps global_steps micro_steps is_gradient_accumulation_boundary module optimizer zero_optimization_partition_weights",
    ),
    # engine.destroy releases zerohooks first where it exists; universal checkpoints' own tag file
    *_entries("zerohooks", ENGINE, _ALL, optional="destroy load_universal_checkpoint"),
    # checkpoint loads read DeepSpeed's files with weights_only=True (adapter/dsfiles.py): the
    # engine's checkpoint engine and the DeepSpeed classes its files may hold; without them the
    # load falls back to torch's own weights-only reader, so none is required when an engine is built
    *_entries("zerohooks", ENGINE, _ALL, optional="checkpoint_engine"),
    # ... and only the files DeepSpeed will read for this rank (dsfiles._files reproduces its
    # names: bf16_ prefix, ZeRO optimizer, elastic checkpoints, model-parallel rank, MoE files);
    # without them every name pattern DeepSpeed may read is assumed
    *_entries(
        "zerohooks",
        ENGINE,
        _ALL,
        optional="bfloat16_enabled zero_optimization zero_elastic_checkpoint checkpoint_mp_rank has_moe_layers",
    ),
    # checkpoint saves create every file without following a link (adapter/ckptwrite.py): the
    # checkpoint engine's save (its zipfile_serialization read) and the recovery-script copy
    *_entries(
        "zerohooks",
        "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine",
        _ALL,
        optional_patch="load save",
        optional="zipfile_serialization",
    ),
    *_entries("zerohooks", ENGINE, _ALL, optional_patch="_copy_recovery_script"),
    # an optimizer DeepSpeed's ZeRO would refuse once the model is built is refused before
    # (dsconfig.check_zero_optimizer), by DeepSpeed's own lists
    *_entries("zerohooks", "deepspeed.runtime.config", (1, 2, 3), read="DEEPSPEED_OPTIMIZERS"),
    *_entries("zerohooks", "deepspeed.runtime.zero.utils", (1, 2, 3), read="ZERO_SUPPORTED_OPTIMIZERS"),
    *_entries(
        "zerohooks", "deepspeed.runtime.fp16.loss_scaler", _ALL, optional="DynamicLossScaler LossScaler"
    ),
    *_entries("zerohooks", "deepspeed.runtime.zero.config", _ALL, optional="ZeroStageEnum"),
    *_entries("zerohooks", "deepspeed.utils.tensor_fragment", _ALL, optional="fragment_address"),
    # ZeRO 0: the engine all-reduces gradients itself
    *_entries(
        "zerohooks",
        ENGINE,
        (0,),
        patch="allreduce_bucket allreduce_and_copy",
        read="gradient_predivide_factor communication_data_type gradient_average flatten unflatten",
    ),
    # ZeRO 1/2: gradient hand-off, communication dtype, the collective
    *_entries(
        "zerohooks",
        ZERO12,
        (1, 2),
        patch="process_gradients get_param_comm_dtype get_gradient_for_reduction allreduce_and_copy_with_multiple_ranks allreduce_bucket gradient_reduction_w_predivide",
        read="gradient_predivide_factor dp_process_group flatten gradient_average ipg_buckets communication_data_type bit16_groups sequence_parallel_size real_dp_process_group",
    ),
    # ZeRO 3: gradient hand-off, communication dtype, reduce-scatter, all-gather dtype
    *_entries(
        "zerohooks",
        ZERO3,
        (3,),
        patch="reduce_ready_partitions_and_remove_grads get_param_comm_dtype __avg_scatter_grads __avg_scatter_contiguous_grads",
        read="ipg_buckets communication_data_type contiguous_gradients fp16_groups reduce_bucket_size reduce_scatter gradient_predivide_factor dp_process_group _get_param_partition_group _gradient_averaging_world_size gradient_accumulation_dtype",
    ),
    *_entries(
        "zerohooks", "deepspeed.runtime.comm.coalesced_collectives", (3,), read="reduce_scatter_coalesced"
    ),
    *_entries("zerohooks", "deepspeed.runtime.zero.partition_parameters", (3,), read="get_allgather_dtype"),
    # -- accumdtype: DeepSpeed's own fp32 accumulation switched on per instance; the partitions ----
    *_entries(
        "accumdtype",
        ZERO12,
        (1, 2),
        patch="gradient_accumulation_dtype use_separate_grad_accum use_grad_accum_attribute _gradient_reduction_buffer_dtype",
        read="_get_param_group_idx _use_compact_grad_partition_buffer averaged_gradients grad_start_offset grad_partition_insertion_offset partition_size real_dp_process_group _get_compact_grad_partition_slice get_param_id contiguous_gradients reduce_bucket_size",
    ),
    *_entries(
        "accumdtype",
        ENGINE,
        _ALL,
        patch="save_checkpoint micro_steps",
        read="global_rank gradient_accumulation_steps",
    ),
    *_entries(
        "accumdtype",
        ZERO3,
        (3,),
        read="__param_id_to_grad_partition _get_param_partition_rank",
    ),
    # whether a loss scaler can skip steps (adapter.seams.steps_may_be_skipped, asked by loco)
    *_entries("zerohooks", ENGINE, (0,), optional="torch_autocast_z0_gradscaler"),
    *_entries("zerohooks", ZERO12, (1, 2), optional="dynamic_loss_scale"),
    *_entries("zerohooks", ZERO3, (3,), optional="dynamic_loss_scale"),
    # -- autocastzero: loss scaling and the forward under autocast ----------------------------------
    *_entries("autocastzero", ENGINE, _ALL, patch="forward", optional="global_rank"),
    *_entries("autocastzero", ENGINE, (0,), patch="torch_autocast_z0_gradscaler"),
    *_entries(
        "autocastzero",
        ZERO12,
        (1, 2),
        patch="loss_scaler dynamic_loss_scale check_grad_overflow",
        read="overflow",
    ),
    *_entries(
        "autocastzero",
        ZERO3,
        (3,),
        patch="loss_scaler dynamic_loss_scale _overflow_check_and_loss_scale_update",
        read="overflow check_overflow _loss_scale_update_and_overflow_cleanup",
    ),
    # -- mixedlayers: fp32 accumulation and staging (ZeRO 1/2), the flat partitions (ZeRO 3) --------
    *_entries("mixedlayers", ENGINE, _ALL, read="zero_optimization_stage"),
    *_entries(
        "mixedlayers",
        ZERO12,
        (1, 2),
        patch="gradient_accumulation_dtype use_separate_grad_accum use_grad_accum_attribute setup_buckets",
        read="contiguous_gradients bit16_groups reduce_bucket_size ipg_buckets get_param_comm_dtype",
    ),
    *_entries(
        "mixedlayers",
        ZERO3,
        (3,),
        patch="fp16_partitioned_groups fp16_partitioned_groups_flat",
        read="fp16_groups fp32_partitioned_groups_flat",
    ),
    # -- nvmeswap: the NVMe optimizer-state path of ZeRO 3 -------------------------------------------
    *_entries(
        "nvmeswap",
        ZERO3,
        (3,),
        patch="_offload_grad_partition_at_boundary _prepare_sub_group _release_sub_group unscale_and_clip_grads _optimizer_step _get_fp32_grad_state_partition _get_fp32_opt_state_partition set_full_hp_param set_local_hp_param _restore_from_bit16_weights",
        read="fp32_partitioned_groups_flat fp16_partitioned_groups_flat_numel grad_position norm_for_param_grads __param_id_to_grad_partition _constant_buffered_norm2 sub_group_to_group_id get_param_id optimizer",
    ),
    *_entries("nvmeswap", ENGINE, (3,), patch="_save_zero_checkpoint _load_zero_checkpoint"),
    # while DeepSpeed builds the optimizer (nvmeswap.deferred: skipped on a DeepSpeed without them);
    # set per instance while a checkpoint loads (nvmeswap.checkpoint)
    *_entries(
        "nvmeswap",
        ZERO3,
        (3,),
        patch="_rigid_load_state_dict",
        optional_patch="_create_momentum_buffer initialize_optimizer_states",
        optional="fp16_partitioned_groups_flat subgroup_to_device offload_optimizer_pin_memory use_muon",
    ),
)
"""Every DeepSpeed name zerohooks and its plugins read or patch (see :class:`Internal`)."""


def needed(stage: int, users: Iterable[str]) -> list[Internal]:
    """The entries a ``stage`` engine with the adapter and ``users`` (plugin names) relies on."""
    who = {"zerohooks", *users}
    return [i for i in SURFACE if stage in i.stages and i.user in who and not i.optional]


def _missing(obj: Any, entries: Iterable[Internal]) -> list[tuple[str, str]]:
    """``(Owner.name, user)`` of each entry ``obj`` lacks, the owner named as ``obj``'s class."""
    owner = getattr(obj, "__name__", None) if inspect.ismodule(obj) else type(obj).__name__
    return [(f"{owner or i.owner}.{i.name}", i.user) for i in entries if not hasattr(obj, i.name)]


def _raise(missing: list[tuple[str, str]]) -> None:
    if not missing:
        return
    import deepspeed

    from zerohooks._compat import SUPPORTED_DEEPSPEED
    from zerohooks.errors import DeepSpeedInternalMissing

    names = list(dict.fromkeys(n for n, _ in missing))
    users = ", ".join(dict.fromkeys(u for _, u in missing))
    raise DeepSpeedInternalMissing(
        f"zerohooks needs {', '.join(names)}, which DeepSpeed {deepspeed.__version__} does not have "
        f"(used by {users}; zerohooks supports DeepSpeed {SUPPORTED_DEEPSPEED})."
    )


def check_object(obj: Any, owner: str, stage: int, user: str) -> None:
    """Raise :class:`DeepSpeedInternalMissing` naming every entry of ``user`` on ``owner`` (for
    ``stage``) that ``obj`` (an instance of ``owner``) lacks."""
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
