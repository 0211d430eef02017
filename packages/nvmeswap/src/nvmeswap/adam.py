"""The fused Adam/AdamW step reading 16-bit gradients (``csrc/nvmeswap_adam.cpp``).

:func:`adam_step_` updates an fp32 parameter slice and its two moments in place from a gradient
slice in bf16, fp16 or fp32 (or none: a zero gradient), bitwise as ``torch.optim.Adam``/``AdamW``
(single-tensor CPU step) would on ``grad.float() * grad_scale``.  The operator is
``torch.ops.nvmeswap.adam_step_`` (schema in C++, a fake kernel here).  When it loads it is
checked against torch's own Adam and AdamW, once with torch's fused multiply-adds (its AVX2 and
AVX-512 kernels) and once without (its portable kernels), and used in the rounding that agrees.
When the build fails, or neither agrees, a warning is issued once and
:func:`reference_adam_step_`, the same arithmetic in torch operations, is used instead (it
materialises the fp32 gradient of the slice it is given).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["AdamHyper", "adam_step_", "build_error", "load", "reference_adam_step_", "supported", "uses_fma"]

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


_state: dict[str, Any] = {"tried": False, "ok": False, "error": None, "fma": True}


def _simd_flags() -> tuple[str, list[str]]:
    """Build name and flags: AVX2/FMA/F16C code where torch itself dispatches to AVX2 or AVX-512
    kernels on this machine, portable code otherwise.  The name carries the choice, so a build
    cache shared between different machines never hands one machine's instructions to another."""
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "DEFAULT"
    if cap.upper().startswith("AVX"):
        return "nvmeswap_adam_avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "nvmeswap_adam_portable", []


def _build() -> None:
    from torch.utils.cpp_extension import load as jit_load

    from zerohooks.jit import announce_build, extension_cached

    name, simd = _simd_flags()
    with announce_build(
        f"nvmeswap's fused Adam kernel ({name})",
        why="the optimizer step on swapped-in state; NVMESWAP_ADAM=python skips it (torch operations)",
        eta="about 30 s on 2 CPU cores",
        hint="python -m zerohooks.build nvmeswap",
        cached=extension_cached(name),
    ):
        jit_load(
            name=name,
            sources=[str(CSRC / "nvmeswap_adam.cpp")],
            # -ffp-contract=off: every multiply and add rounded as torch's kernels round them
            extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", *simd],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=os.environ.get("NVMESWAP_VERBOSE_BUILD", "") not in ("", "0"),
        )


def _agrees_with_torch(fma: bool) -> bool:
    """The kernel against torch's own Adam and AdamW on one odd-length slice (a block and a
    tail), every gradient dtype, both lerp branches, both kinds of weight decay, a grad scale."""
    n = 4097
    gen = torch.Generator().manual_seed(0)
    for gdt in (torch.bfloat16, torch.float16, torch.float32, None):
        for cls, beta1 in ((torch.optim.AdamW, 0.9), (torch.optim.Adam, 0.3)):
            p0 = torch.randn(n, generator=gen)
            grads = [None if gdt is None else (torch.randn(n, generator=gen) * 3).to(gdt) for _ in range(2)]
            q = torch.nn.Parameter(p0.clone())
            opt = cls([q], lr=1e-2, betas=(beta1, 0.999), eps=1e-8, weight_decay=0.05)
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            for k, g in enumerate(grads):
                q.grad = torch.zeros(n) if g is None else g.to(torch.float32, copy=True)
                q.grad.mul_(0.37)
                opt.step()
                h = AdamHyper(1e-2, beta1, 0.999, 1e-8, 0.05, cls is torch.optim.AdamW, float(k + 1))
                torch.ops.nvmeswap.adam_step_(p, m, v, g, 0.37, *h.args(), fma)
            st = opt.state[q]
            if not (
                torch.equal(p, q.data) and torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"])
            ):
                return False
    return True


def _fail(reason: str, warn: bool = True) -> None:
    _state["ok"], _state["error"] = False, reason
    if warn:
        warnings.warn(
            f"nvmeswap: the fused Adam kernel is not used ({reason.splitlines()[0][:300]}); the same "
            "step runs as torch operations (bitwise the same, one fp32 gradient per parameter slice)",
            RuntimeWarning,
            stacklevel=3,
        )


def load(build: bool = True) -> bool:
    """Build and register the operator (once per process) and check it against torch's own
    optimizer; False (with a warning) if it cannot be built or does not agree.  ``build=False``
    gives up without trying (another rank of this machine tried and failed)."""
    with _lock:
        if _state["tried"]:
            return bool(_state["ok"])
        _state["tried"] = True
        if os.environ.get("NVMESWAP_ADAM", "") == "python":
            _fail("disabled by NVMESWAP_ADAM=python", warn=False)
            return False
        if not build:
            _fail("its build failed on local rank 0 of this machine")
            return False
        try:
            _build()
        except Exception as e:  # no compiler, build or load error: fall back to torch operations
            _fail(f"build failed: {type(e).__name__}: {e}")
            return False
        # torch's AVX2/AVX-512 kernels fuse some multiply-adds, its portable ones do not: use the
        # rounding this torch uses, or none if neither agrees bit for bit
        for fma in (True, False):
            if _agrees_with_torch(fma):
                _state["ok"], _state["fma"] = True, fma
                return True
        _fail(
            "it does not reproduce this torch's Adam/AdamW bit for bit (CPU capability "
            f"{_simd_flags()[0]}, torch {torch.__version__})"
        )
        return False


def uses_fma() -> bool:
    """Whether the loaded kernel rounds as torch's AVX2/AVX-512 kernels (fused multiply-adds)
    rather than as its portable ones (meaningful once :func:`load` returned True)."""
    return bool(_state["fma"])


def build_error() -> str | None:
    """Why the C++ kernel is not in use (None when it is, or was not tried yet)."""
    return _state["error"]


def load_distributed() -> bool:
    """:func:`load`, built by local rank 0 while the other ranks of its machine wait (and give up
    without building when it failed)."""
    from zerohooks.jit import local_rank0_first

    return bool(local_rank0_first(load))


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
        torch.ops.nvmeswap.adam_step_(
            param, exp_avg, exp_avg_sq, grad, float(grad_scale), *h.args(), _state["fma"]
        )
    else:
        reference_adam_step_(param, exp_avg, exp_avg_sq, grad, grad_scale, h)
