"""The fused optimizer step of a swapped sub-group: Adam/AdamW straight from the 16-bit gradient
partitions recorded at the accumulation boundary (:mod:`nvmeswap.adam`), instead of DeepSpeed's
unscale of an fp32 gradient buffer followed by ``optimizer.step()``.

Only ``torch.optim.Adam`` and ``torch.optim.AdamW`` (DeepSpeed's ``"torch_adam": true``, or a
client optimizer of either class) in their default single-tensor CPU form are fused: the kernel
repeats their arithmetic bitwise.  DeepSpeed's own ``DeepSpeedCPUAdam`` keeps its bias-correction
powers inside its C++ object, updated incrementally from call to call, so no outside kernel can
follow it bit for bit; with it (or any other optimizer) the sub-group is stepped unfused.
"""

from __future__ import annotations

from typing import Any

import torch

from nvmeswap import adam
from nvmeswap.swapper import SwapState
from zerohooks.adapter import seams

__all__ = ["refusal", "step", "usable"]

_FLAGS_OFF = ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")


def usable(fuse: bool, zero: Any) -> bool:
    """Whether this step of DeepSpeed's ZeRO-3 optimizer ``zero`` takes the fused path: chosen at
    attach (``fuse``) and still possible now (a step hook registered since refuses it)."""
    return fuse and refusal(zero.optimizer, zero) is None


def refusal(optimizer: Any, zero: Any = None) -> str | None:
    """Why ``optimizer`` (the torch optimizer inside DeepSpeed's ZeRO-3 optimizer ``zero``) cannot
    be fused, or None when it can."""
    for attr, what in (
        ("torch_autocast_gradscaler", "DeepSpeed's torch_autocast GradScaler steps the optimizer"),
        ("zenflow", "DeepSpeed's ZenFlow steps the optimizer"),
        ("use_muon", "DeepSpeed's Muon changes the gradients before the step"),
    ):
        if zero is not None and getattr(zero, attr, None):
            return what
    import torch.optim.optimizer as base

    hooks = [
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
        getattr(base, "_global_optimizer_pre_hooks", None),
        getattr(base, "_global_optimizer_post_hooks", None),
    ]
    if any(hooks):
        return "step hooks are registered on the optimizer (the fused step does not call optimizer.step())"
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return (
            f"the optimizer is {type(optimizer).__module__}.{type(optimizer).__qualname__}; the fused step "
            'supports torch.optim.Adam and torch.optim.AdamW (DeepSpeed: "optimizer": {"type": "AdamW", '
            '"params": {"torch_adam": true, ...}})'
        )
    for k, group in enumerate(optimizer.param_groups):
        on = [f for f in _FLAGS_OFF if group.get(f)]
        if on:
            return f"param group {k} sets {on}; the fused step supports none of {list(_FLAGS_OFF)}"
        tensors = [f for f in ("lr", "eps", "weight_decay") if isinstance(group.get(f), torch.Tensor)]
        tensors += ["betas"] * any(isinstance(b, torch.Tensor) for b in group.get("betas", ()))
        if tensors:
            return f"param group {k} holds {tensors} as tensors; the fused step takes plain numbers"
    return None


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _segments(state: SwapState, index: int) -> list[tuple[int, int, torch.Tensor | None]]:
    """(offset, numel, gradient or None for zero) covering sub-group ``index`` in order."""
    numel = state.groups[index].numel
    override = state.overrides.get(index)
    if override is not None:
        return [(0, numel, override)]
    parts = sorted(state.pending_grads.get(index, {}).items())
    out: list[tuple[int, int, torch.Tensor | None]] = []
    pos = 0
    for off, t in parts:
        if off > pos:
            out.append((pos, off - pos, None))
        g = t.reshape(-1)
        if g.device.type != "cpu":
            g = g.to("cpu")
        out.append((off, g.numel(), g.contiguous()))
        pos = off + g.numel()
    if pos < numel:
        out.append((pos, numel - pos, None))
    return out


def step(state: SwapState, index: int, optimizer: Any, group: dict[str, Any], grad_scale: float) -> None:
    """Adam/AdamW on sub-group ``index`` (resident), gradient from the recorded 16-bit partitions
    times ``grad_scale`` (DeepSpeed's unscale-and-clip factor), the optimizer's state updated as
    torch's own step would update it."""
    segments = _segments(state, index)
    for _, _, g in segments:  # checked before anything changes: a refused slice changes nothing
        if g is not None and g.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(
                f"nvmeswap: a gradient partition of sub-group {index} is {g.dtype}; the fused "
                "Adam step reads bfloat16, float16 or float32"
            )
    master = state.groups[index].master
    st = optimizer.state[master]
    if len(st) == 0:  # torch's lazy state initialisation
        st["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        st["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    st["step"] += 1
    state.fused_steps += 1
    count = float(st["step"].item())
    beta1, beta2 = group["betas"]
    decoupled = bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))
    h = adam.AdamHyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], decoupled, count)
    p, m, v = master.data, st["exp_avg"].data, st["exp_avg_sq"].data
    # torch's LR schedulers check that optimizer.step() ran before them (they wrap it): it did,
    # in effect, for this sub-group
    seams.note_optimizer_stepped(optimizer)
    for off, n, g in segments:
        adam.adam_step_(p.narrow(0, off, n), m.narrow(0, off, n), v.narrow(0, off, n), g, grad_scale, h)
