"""DeepSpeed's universal-checkpoint converter (``ds_to_universal``) run in the calling process
(the tests' way; from a shell: ``python -m deepspeed.checkpoint.ds_to_universal --input_folder
... --output_folder ... --inject_missing_state``): one worker (no process pool), the missing
``universal_checkpoint_info`` injected (the converter wants it in the client state, as Megatron
writes it).  It converts DeepSpeed's files only: zerohooks' plugin-state files are not copied,
and each plugin keeping state says what it does on a universal load (``load_universal``).

:func:`separate_step_counters` mends what DeepSpeed's own ZeRO-3 universal load leaves shared
(called by the checkpoint patch after every universal load of an engine zerohooks built)."""

from __future__ import annotations

import os
from argparse import Namespace
from typing import Any

import torch

__all__ = ["separate_step_counters", "to_universal"]


def to_universal(save_dir: str, tag: str) -> str:
    """Convert checkpoint ``tag`` of ``save_dir`` into ``save_dir/universal/<tag>`` (which also
    gets ``latest_universal``, so ``load_checkpoint(save_dir + "/universal")`` finds it); returns
    the converted folder."""
    from deepspeed.checkpoint import ds_to_universal

    out = os.path.join(save_dir, "universal", tag)
    args = Namespace(
        input_folder=os.path.join(save_dir, tag),
        output_folder=out,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds_to_universal.main(args)
    return out


def separate_step_counters(optimizer: Any) -> int:
    """Give the optimizer state of every sub-group of ``optimizer`` (DeepSpeed's ZeRO-3
    optimizer) its own ``step`` tensor; returns how many were copied.

    DeepSpeed 0.19.8's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)
    stores the one ``step`` it read from the checkpoint into the state of every sub-group.  A torch
    optimizer keeps ``step`` as a tensor and increments it in place, once per sub-group and step, so
    with more than one sub-group (several param groups, or a model larger than ``sub_group_size``)
    the second sub-group of the first resumed step sees step n + 2, the third n + 3, and Adam's bias
    correction leaves the uninterrupted run (measured: the losses of the second resumed step differ
    by 0.03 on the toy model with two sub-groups, plain DeepSpeed as much as with a plugin).  An
    integer ``step`` (DeepSpeed's own CPU Adam) is not shared and is left alone, as is any other
    optimizer."""
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    inner = getattr(optimizer, "optimizer", None)
    state = getattr(inner, "state", None)
    if masters is None or state is None:
        return 0
    seen: set[int] = set()
    copied = 0
    for master in masters:
        entry = state.get(master) if master is not None else None
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), torch.Tensor):
            continue
        if id(entry["step"]) in seen:
            entry["step"] = entry["step"].clone()
            copied += 1
        seen.add(id(entry["step"]))
    return copied
