"""Accumulation state in DeepSpeed checkpoints.

A checkpoint may be saved between two micro-steps of an accumulation window.  DeepSpeed 0.19.8
saves neither its micro-step counter nor any gradient, so a plain DeepSpeed run resumed from such
a checkpoint silently restarts the window with the gradients of the first micro-steps lost.

* ZeRO 0 and 1 accumulate whole, rank-local tensors until the boundary (accumdtype's buffers on
  ZeRO 0; DeepSpeed's ``param.grad_accum``, or ``param.grad`` for the model dtype, on ZeRO 1).
  They are saved with the window position (``engine.micro_steps``) and restored on load: the
  resumed run continues the window bit for bit.
* ZeRO 2 and 3 accumulate in DeepSpeed's reduced gradient partitions, whose bookkeeping
  (micro-step ids deciding copy or add, lazily built buffers, offload copies) DeepSpeed neither
  saves nor exposes.  A save inside a window is refused with an error before anything is
  written; at a boundary there is nothing to save but the position.
"""

from __future__ import annotations

from typing import Any

import torch

import zerohooks
from accumdtype.access import grad_accum
from accumdtype.config import dtype_name
from accumdtype.state import AccumState
from zerohooks.adapter import gradview

__all__ = ["AccumCheckpoint", "MidWindowCheckpointError", "in_window"]

FORMAT = 1


class MidWindowCheckpointError(RuntimeError):
    """``save_checkpoint`` inside an accumulation window on ZeRO 2/3, which cannot be resumed."""


def in_window(engine: Any) -> bool:
    """True between the micro-steps of one accumulation window (not at a boundary).

    Read from zerohooks' own count of backward passes since the last optimizer step, not from
    ``engine.micro_steps``: accelerate (hence Hugging Face Trainer) calls ``engine.step()`` only
    at boundaries, so DeepSpeed's counter then counts optimizer steps."""
    return zerohooks.step_context(engine).in_window


def check_save(state: AccumState) -> None:
    """Raise :class:`MidWindowCheckpointError` for a save that could not be resumed exactly."""
    engine = state.engine
    if state.plan.stage >= 2 and in_window(engine):
        gas = int(engine.gradient_accumulation_steps())
        done = zerohooks.step_context(engine).window_micro_step
        raise MidWindowCheckpointError(
            f"save_checkpoint was called after micro-step {done} of {gas} of an "
            f"accumulation window. On ZeRO {state.plan.stage} the accumulated gradient lives in DeepSpeed's "
            "reduced partitions, which DeepSpeed does not save, so the run could not resume this window. "
            "Save after the engine.step() that ends the window (engine.is_gradient_accumulation_boundary() "
            "was True)."
        )


def _fingerprint(state: AccumState) -> dict[str, Any]:
    plan = state.plan
    return {
        "stage": plan.stage,
        "model_dtype": dtype_name(plan.model_dtype),
        "accum_dtype": dtype_name(plan.accum_dtype),
        "reduce_dtype": dtype_name(plan.reduce_dtype),
        "numels": [p.numel() for p in state.params],
    }


def _restore(state: AccumState, param: Any, value: torch.Tensor) -> None:
    """Put a saved accumulation tensor back where this stage accumulates."""
    plan = state.plan
    value = value.to(param.device)
    i = state.index[id(param)]
    if state.buffers:
        state.buffers[i].copy_(value.view(state.buffers[i].shape))
    elif plan.stage == 1 and plan.separate:
        param.grad_accum = value.view(param.shape).clone()  # DeepSpeed's own ZeRO-1 slot
    else:
        param.grad = value.view(param.shape).to(param.dtype).clone()


class AccumCheckpoint:
    """The :class:`zerohooks.hookspec.StateProvider` of one engine."""

    __slots__ = ("state",)

    def __init__(self, state: AccumState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        state = self.state
        engine = state.engine
        tensors: list[torch.Tensor | None] = []
        if in_window(engine) and state.plan.stage <= 1:
            for p in state.params:
                t = grad_accum(engine, p)
                tensors.append(None if t is None else t.detach().to("cpu", copy=True))
        return {
            "format": FORMAT,
            "fingerprint": _fingerprint(state),
            "micro_steps": int(engine.micro_steps),
            "accum": tensors,
        }

    def load_universal(self) -> None:
        """After a universal load (``ds_to_universal``, any number of ranks): nothing to carry.
        At a window boundary, where ZeRO 2/3 saves are made, the state is the position only, and
        the resumed run starts a window as plain DeepSpeed does; accumdtype's own buffers (ZeRO 0)
        are cleared.  A ZeRO 0/1 checkpoint saved inside a window restarts it, as plain
        DeepSpeed's (the rank-local partial sums cannot be resharded)."""
        for buf in self.state.buffers:
            buf.zero_()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.state
        if saved.get("format") != FORMAT:
            raise ValueError(f"accumdtype checkpoint state has format {saved.get('format')!r}, not {FORMAT}")
        mine = _fingerprint(state)
        if saved["fingerprint"] != mine:
            diff = {
                k: (saved["fingerprint"].get(k), v)
                for k, v in mine.items()
                if saved["fingerprint"].get(k) != v
            }
            raise ValueError(f"the checkpoint was saved with another accumdtype setup (saved, now): {diff}")
        gradview.restore_micro_steps(state.engine, int(saved["micro_steps"]))
        tensors = saved["accum"]
        if tensors:
            for p, value in zip(state.params, tensors, strict=True):
                if value is not None:
                    _restore(state, p, value)
