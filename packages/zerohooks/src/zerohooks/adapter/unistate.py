"""ZeRO 3's universal-checkpoint load, one sub-group at a time, for a plugin that holds the
optimizer state elsewhere (nvmeswap's swap files).

DeepSpeed's loader (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) fills every
sub-group's fp32 master and Adam moments in RAM from the universal folder (``zero/<parameter>/
{fp32,exp_avg,exp_avg_sq}.pt``, each the whole parameter, cut here into this rank's partition)
and copies each master into its 16-bit partition.  A plugin whose masters and moments live on
disk has no such tensors to fill, and the whole state would not fit in RAM anyway.
:func:`universal_load_replaced` swaps that loader, for the duration of one load, for one that
reads the same files, builds one sub-group's state at a time and hands it to the plugin
(``take``); the sub-groups the plugin does not take are filled where DeepSpeed fills them.  The
global state (loss scaler), the step and the hyper-parameters are restored as DeepSpeed does,
each sub-group with its own step counter (:func:`zerohooks.adapter.universal.separate_step_counters`).

Files are read through the engine's checkpoint engine, which during a zerohooks load is the
weights-only reader of :mod:`zerohooks.adapter.dsfiles` (the folder already scanned).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from zerohooks.adapter import statestore

__all__ = ["KEYS", "Take", "universal_load_replaced"]

KEYS = ("fp32", "exp_avg", "exp_avg_sq")
"""The per-parameter files of a universal checkpoint's ``zero/`` folder a ZeRO-3 load reads."""
_LOADER = "load_hp_checkpoint_state_from_checkpoint_dir_stage3"
_STATE, _GROUPS = "optimizer_state_dict", "param_groups"

Take = Callable[[int, torch.Tensor], bool]
"""``take(sub_group, fp32)``: called with the sub-group's moments and step already in the torch
optimizer's state (DeepSpeed's place for them, keyed by the sub-group's master) and this rank's
fp32 master partition; True when the plugin stored the sub-group itself (master, moments and
16-bit partition), False to leave the master to DeepSpeed's tensor."""


def _partition(read: Callable[..., Any], folder: str, name: str, key: str, group: Any) -> torch.Tensor:
    """This rank's partition of parameter ``name``'s ``key`` (zero-padded to whole partitions, as
    ZeRO 3 partitions a parameter)."""
    loaded = read(os.path.join(folder, name, f"{key}.pt"), map_location="cpu")
    whole = loaded["param"] if isinstance(loaded, dict) else loaded
    if not isinstance(whole, torch.Tensor):
        raise ValueError(f"{os.path.join(folder, name, key)}.pt holds no tensor ({type(whole).__name__})")
    flat = whole.reshape(-1).float()
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    size = math.ceil(flat.numel() / world)
    out = torch.zeros(size, dtype=torch.float32)
    part = flat[rank * size : (rank + 1) * size]
    out[: part.numel()].copy_(part)
    return out


def _sub_group_state(
    opt: Any, read: Callable[..., Any], folder: str, sub_group: int
) -> dict[str, torch.Tensor]:
    numel = statestore.sub_group_numels(opt)[sub_group]
    out = {}
    for key in KEYS:
        parts = [
            _partition(read, folder, opt.param_names[p], key, opt._get_param_partition_group(p))
            for p in opt.fp16_groups[sub_group]
        ]
        flat = torch.cat(parts) if parts else torch.zeros(0)
        if flat.numel() != numel:
            raise ValueError(
                f"universal checkpoint {folder}: sub-group {sub_group} holds {flat.numel()} elements on this "
                f"rank, the engine's partition {numel}"
            )
        out[key] = flat
    return out


def _load(opt: Any, read: Callable[..., Any], checkpoint_dir: str, take: Take) -> None:
    folder = os.path.join(checkpoint_dir, "zero")
    saved = read(os.path.join(folder, "optimizer_state.pt"), map_location="cpu")
    opt._load_global_state_stage3(saved)
    inner = saved[_STATE]
    step = inner["state"][0]["step"]
    for i in range(len(opt.fp16_groups)):
        values = _sub_group_state(opt, read, folder, i)
        master = statestore.master(opt, i)
        opt.optimizer.state[master] = {
            "step": step.clone() if isinstance(step, torch.Tensor) else step,
            "exp_avg": values["exp_avg"],
            "exp_avg_sq": values["exp_avg_sq"],
        }
        if take(i, values["fp32"]):
            continue
        master.data.copy_(values["fp32"])
        statestore.bit16_from_master(opt, i)
    for group in opt.optimizer.param_groups:  # the first group's hyper-parameters, as DeepSpeed
        for key, value in inner[_GROUPS][0].items():
            group[key] = [] if key == "params" else value


@contextlib.contextmanager
def universal_load_replaced(opt: Any, engine: Any, take: Take) -> Iterator[None]:
    """Within the context, a universal load of the ZeRO-3 optimizer ``opt`` (of ``engine``)
    builds each sub-group's state in turn and offers it to ``take``; DeepSpeed's loader again
    afterwards, whatever happened."""
    had = _LOADER in vars(opt)
    previous = vars(opt).get(_LOADER)

    def load(checkpoint_dir: str) -> None:
        _load(opt, engine.checkpoint_engine.load, checkpoint_dir, take)

    setattr(opt, _LOADER, load)
    try:
        yield
    finally:
        if had:
            setattr(opt, _LOADER, previous)
        else:
            delattr(opt, _LOADER)
