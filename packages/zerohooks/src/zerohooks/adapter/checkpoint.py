"""Plugin state in DeepSpeed checkpoints: one file per rank beside DeepSpeed's own files."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zerohooks.adapter.base import Attachment

__all__ = ["install_checkpoint_patches", "state_file"]

FORMAT = 1


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def state_file(ckpt_dir: str, tag: str, rank: int) -> str:
    """Where rank ``rank`` keeps its plugin state for checkpoint ``tag``."""
    return os.path.join(ckpt_dir, str(tag), f"zerohooks_state_rank{rank:05d}.pt")


def _save(att: Attachment, save_dir: str, tag: str) -> None:
    rank, world = _rank_world()
    path = state_file(save_dir, tag, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    payload = {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "states": {name: p.state_dict() for name, p in att.registry.states.items()},
    }
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-save never leaves a half-written state file


def _load(att: Attachment, load_dir: str, tag: str | None) -> None:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    rank, world = _rank_world()
    path = state_file(load_dir, tag, rank)
    names = sorted(att.registry.states)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"checkpoint {os.path.join(load_dir, tag)!r} has no zerohooks plugin state for rank {rank} ({path!r}); "
            f"the plugins {names} need it. Was it saved without these plugins?"
        )
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a zerohooks plugin-state file (format {FORMAT})")
    if payload["world_size"] != world:
        raise ValueError(
            f"{path!r} was saved with {payload['world_size']} ranks but this run has {world}; "
            "plugin state is rank-local and cannot be resharded"
        )
    missing = [n for n in names if n not in payload["states"]]
    if missing:
        raise KeyError(f"{path!r} has no state for plugins {missing}; it holds {sorted(payload['states'])}")
    for name in names:
        att.registry.states[name].load_state_dict(payload["states"][name])


def install_checkpoint_patches(att: Attachment) -> None:
    engine = att.engine

    def make_save(original: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            if tag is None:
                tag = f"global_step{engine.global_steps}"  # DeepSpeed's own default tag
            out = original(save_dir, tag, *args, **kwargs)
            if att.registry.states:
                _save(att, save_dir, str(tag))
                if dist.is_available() and dist.is_initialized():
                    dist.barrier()
            return out

        return save_checkpoint

    def make_load(original: Callable[..., Any]) -> Callable[..., Any]:
        def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            out = original(load_dir, tag, *args, **kwargs)
            load_path = out[0] if isinstance(out, tuple) else out
            if load_path is not None and att.registry.states:
                _load(att, load_dir, None if tag is None else str(tag))
            return out

        return load_checkpoint

    att.patch(engine, "save_checkpoint", make_save, "DeepSpeedEngine")
    att.patch(engine, "load_checkpoint", make_load, "DeepSpeedEngine")
