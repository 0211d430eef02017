"""Plugin state in DeepSpeed checkpoints: one file per rank beside DeepSpeed's own files.

A checkpoint and the engine loading it must agree on which plugins keep state: state saved by a
plugin that is not enabled now, or a plugin enabled now whose state is not in the checkpoint, is
a :class:`~zerohooks.errors.CheckpointStateError` naming both sides and the fix, never a silent
change of the run.  ``load_module_only=True`` loads weights only, as DeepSpeed does: plugin
state is neither read nor required.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zerohooks.errors import CheckpointStateError

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
    ctx = att.step_ctx
    payload = {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "states": {name: p.state_dict() for name, p in att.registry.states.items()},
        # where the run is in its accumulation window (not saved by DeepSpeed)
        "position": {"micro_step": ctx.micro_step, "window_micro_step": ctx.window_micro_step},
    }
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-save never leaves a half-written state file


def _resolve_tag(load_dir: str, tag: str | None) -> str:
    if tag is not None:
        return tag
    with open(os.path.join(load_dir, "latest"), encoding="utf-8") as f:
        return f.read().strip()


def _read(path: str) -> dict[str, Any]:
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a zerohooks plugin-state file (format {FORMAT})")
    return payload


def _load(att: Attachment, load_dir: str, tag: str | None) -> None:
    tag = _resolve_tag(load_dir, tag)
    rank, world = _rank_world()
    path = state_file(load_dir, tag, rank)
    names = sorted(att.registry.states)
    where = os.path.join(load_dir, tag)
    if not os.path.exists(path):
        if not names:
            return  # neither side has plugin state
        raise CheckpointStateError(
            f"checkpoint {where!r} has no zerohooks plugin state for rank {rank} ({path!r}), but the plugins "
            f"{names} of this run keep state. It was saved without them (or without zerohooks routing "
            "deepspeed.initialize: call zerohooks.enable() before the framework builds the engine). "
            "Resume with the same plugin sections it was saved with, or load weights only with "
            "load_checkpoint(..., load_module_only=True)"
        )
    payload = _read(path)
    saved = sorted(payload["states"])
    extra = [n for n in saved if n not in names]
    if extra:
        raise CheckpointStateError(
            f"checkpoint {where!r} holds state of the plugins {extra}, which this run does not enable "
            f"(enabled with state: {names or 'none'}); resuming would silently drop it. Enable them again "
            "(their config sections, with zerohooks.enable() when a framework builds the engine), or load "
            "weights only with load_checkpoint(..., load_module_only=True)"
        )
    missing = [n for n in names if n not in saved]
    if missing:
        raise CheckpointStateError(
            f"checkpoint {where!r} has no state for the plugins {missing} of this run (it holds {saved}); "
            "resume with the plugin sections it was saved with, or load weights only with "
            "load_checkpoint(..., load_module_only=True)"
        )
    if payload["world_size"] != world:
        raise ValueError(
            f"{path!r} was saved with {payload['world_size']} ranks but this run has {world}; "
            "plugin state is rank-local and cannot be resharded"
        )
    position = payload.get("position")
    if isinstance(position, dict):
        att.step_ctx.restore(position["micro_step"], position["window_micro_step"])
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
        signature = inspect.signature(original)

        def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            try:
                module_only = bool(
                    signature.bind(load_dir, tag, *args, **kwargs).arguments.get("load_module_only")
                )
            except TypeError:
                module_only = False  # DeepSpeed reports the bad call itself
            out = original(load_dir, tag, *args, **kwargs)
            load_path = out[0] if isinstance(out, tuple) else out
            if load_path is None:
                return out
            if module_only:
                if att.registry.states and engine.global_rank == 0:
                    warnings.warn(
                        f"load_checkpoint(load_module_only=True): weights only; the plugins "
                        f"{sorted(att.registry.states)} start with fresh state",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                return out
            _load(att, load_dir, None if tag is None else str(tag))
            return out

        return load_checkpoint

    att.patch(engine, "save_checkpoint", make_save, "DeepSpeedEngine")
    att.patch(engine, "load_checkpoint", make_load, "DeepSpeedEngine")
