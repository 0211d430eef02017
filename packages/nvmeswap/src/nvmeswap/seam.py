"""The DeepSpeed names nvmeswap touches itself, declared as its own seam ``nvmeswap.swap``.

nvmeswap replaces DeepSpeed's ZeRO-3 NVMe path (sub-group prepare/release, the boundary
hand-off, the fp32 state accessors, the step, checkpoints, the masters while the optimizer is
built) with its own swapper; until the adapter offers that store as an owner interface, the
names are declared here, checked on every engine nvmeswap is enabled on
(:func:`zerohooks.surface.check`) and against the installed DeepSpeed by the surface tests.
"""

from __future__ import annotations

from zerohooks.surface import ENGINE, PARAM, ZERO3, declare_seam, make_entries

__all__ = ["SEAM"]

SEAM = "nvmeswap.swap"
"""The seam's name (``NvmeSwapPlugin.deepspeed_seams``)."""

declare_seam(
    SEAM,
    (
        *make_entries(
            SEAM,
            ZERO3,
            (3,),
            patch="_offload_grad_partition_at_boundary _prepare_sub_group _release_sub_group unscale_and_clip_grads _optimizer_step _get_fp32_grad_state_partition _get_fp32_opt_state_partition set_full_hp_param set_local_hp_param _restore_from_bit16_weights _rigid_load_state_dict",
            write="norm_for_param_grads",
            read="fp32_partitioned_groups_flat fp16_partitioned_groups_flat_numel grad_position __param_id_to_grad_partition _constant_buffered_norm2 sub_group_to_group_id get_param_id optimizer",
        ),
        *make_entries(SEAM, ENGINE, (3,), patch="_save_zero_checkpoint _load_zero_checkpoint"),
        # while DeepSpeed builds the optimizer (nvmeswap.deferred: skipped on a DeepSpeed without them)
        *make_entries(
            SEAM,
            ZERO3,
            (3,),
            optional_patch="_create_momentum_buffer initialize_optimizer_states",
            optional="fp16_partitioned_groups_flat subgroup_to_device offload_optimizer_pin_memory use_muon",
        ),
        *make_entries(SEAM, PARAM, (3,), read="ds_id"),
    ),
)
