"""The fused Adam/AdamW step reading 16-bit gradients (``csrc/nvmeswap_adam.cpp``).

:func:`adam_step_` updates an fp32 parameter slice and its two moments in place from a gradient
slice in bf16, fp16 or fp32 (or none: a zero gradient), bitwise as ``torch.optim.Adam``/``AdamW``
(single-tensor CPU step) would on ``grad.float() * grad_scale``.  The operator is
``torch.ops.nvmeswap.adam_step_`` (schema in C++, a fake kernel here); when the C++ build fails a
warning is issued once and :func:`reference_adam_step_`, the same arithmetic in torch operations,
is used instead (it materialises the fp32 gradient of the slice it is given).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["AdamHyper", "adam_step_", "build_error", "load", "reference_adam_step_", "supported"]

CSRC = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class AdamHyper:
    """The hyper-parameters of one Adam/AdamW step, as torch's param group holds them."""

    lr: float
    """Learning rate."""
    beta1: float
    """First-moment decay (the lerp weight is ``1 - beta1``)."""
    beta2: float
    """Second-moment decay."""
    eps: float
    """Added to the bias-corrected square root of the second moment."""
    weight_decay: float
    """AdamW: the parameter is multiplied by ``1 - lr * weight_decay``; Adam: added to the gradient."""
    decoupled: bool
    """True for AdamW (decoupled weight decay), False for Adam (L2)."""
    step: float
    """The step count after this step (torch's ``state["step"]``), for the bias corrections."""

    def args(self) -> tuple[float, float, float, float, float, bool, float]:
        """The operator's trailing arguments."""
        return (self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.decoupled, self.step)


_state: dict[str, Any] = {"tried": False, "ok": False, "error": None}


def load() -> bool:
    """Build and register the operator (once per process); False (with a warning) if it cannot."""
    with _lock:
        if _state["tried"]:
            return bool(_state["ok"])
        _state["tried"] = True
        if os.environ.get("NVMESWAP_ADAM", "") == "python":
            _state["error"] = "disabled by NVMESWAP_ADAM=python"
            return False
        try:
            from torch.utils.cpp_extension import load as jit_load

            jit_load(
                name="nvmeswap_adam",
                sources=[str(CSRC / "nvmeswap_adam.cpp")],
                # -march=native: the build is per machine (JIT); -ffp-contract=off keeps every
                # multiply and add rounded as torch's kernels round them (see the C++ header)
                extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=os.environ.get("NVMESWAP_VERBOSE_BUILD", "") not in ("", "0"),
            )
            _state["ok"] = True
        except Exception as e:  # no compiler, build or load error: fall back to torch operations
            _state["error"] = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"nvmeswap: could not build the fused Adam kernel ({str(_state['error']).splitlines()[0][:300]}); "
                "using torch operations instead (same results, one fp32 gradient per parameter slice)",
                RuntimeWarning,
                stacklevel=2,
            )
        return bool(_state["ok"])


def build_error() -> str | None:
    """Why the C++ kernel is not in use (None when it is, or was not tried yet)."""
    return _state["error"]


def load_distributed() -> bool:
    """:func:`load`, built by local rank 0 while the other ranks wait."""
    from nvmeswap.io import rank0_first

    return bool(rank0_first(load))


def _fake(*args: Any) -> None:
    return None


_registered_fake = False


def _register_fake() -> None:
    global _registered_fake
    if not _registered_fake:
        torch.library.register_fake("nvmeswap::adam_step_")(_fake)
        _registered_fake = True


def reference_adam_step_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor | None,
    grad_scale: float,
    h: AdamHyper,
) -> None:
    """The operator's arithmetic in torch operations: DeepSpeed's unscale, then torch's
    single-tensor Adam/AdamW step (the same calls, so the same roundings)."""
    g = torch.zeros_like(param) if grad is None else grad.to(torch.float32, copy=True)
    g.mul_(grad_scale)
    if h.weight_decay != 0:
        if h.decoupled:
            param.mul_(1 - h.lr * h.weight_decay)
        else:
            g = g.add(param, alpha=h.weight_decay)
    exp_avg.lerp_(g, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    bias_correction1 = 1 - h.beta1**h.step
    bias_correction2 = 1 - h.beta2**h.step
    step_size = h.lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def supported() -> bool:
    """Whether the C++ operator is loaded (builds it on first call)."""
    ok = load()
    if ok:
        _register_fake()
    return ok


def adam_step_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor | None,
    grad_scale: float,
    h: AdamHyper,
) -> None:
    """One Adam or AdamW step of a slice, in place, with the gradient ``grad * grad_scale`` (None:
    zero): the C++ operator, or the torch fallback."""
    if supported():
        torch.ops.nvmeswap.adam_step_(param, exp_avg, exp_avg_sq, grad, float(grad_scale), *h.args())
    else:
        reference_adam_step_(param, exp_avg, exp_avg_sq, grad, grad_scale, h)
