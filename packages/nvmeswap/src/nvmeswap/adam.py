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
from pathlib import Path
from typing import Any

import torch

from zerohooks.native import NativeExtension

__all__ = [
    "EXTENSION",
    "AdamHyper",
    "adam_step_",
    "build_error",
    "load",
    "reference_adam_step_",
    "supported",
    "uses_fma",
]

CSRC = Path(__file__).resolve().parent / "csrc"


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


_fma = [True]  # whether the loaded kernel rounds with fused multiply-adds (set by _verify)


def _simd_flags() -> tuple[str, list[str]]:
    """Build name and flags: AVX2/FMA/F16C code where torch itself dispatches to AVX2 or AVX-512
    kernels on this machine, portable code otherwise.  The name carries the choice, so a build
    cache shared between different machines never hands one machine's instructions to another."""
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "DEFAULT"
    if cap.upper().startswith("AVX"):
        return "nvmeswap_adam_avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "nvmeswap_adam_portable", []


def _disagreement(fma: bool) -> str | None:
    """The kernel against torch's own Adam and AdamW on one odd-length slice (a block and a
    tail), every gradient dtype, both lerp branches, both kinds of weight decay, a grad scale:
    None when every result is bitwise torch's, else where the first one differs."""
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
            for what, ours, theirs in (
                ("param", p, q.data),
                ("exp_avg", m, st["exp_avg"]),
                ("exp_avg_sq", v, st["exp_avg_sq"]),
            ):
                if not torch.equal(ours, theirs):
                    bad = (ours != theirs).nonzero()[:, 0]
                    i = int(bad[0])
                    return (
                        f"{cls.__name__}, {gdt} gradients: {what} differs in {bad.numel()} of {n} elements, "
                        f"first at {i} ({float(ours[i])!r} vs torch's {float(theirs[i])!r})"
                    )
    return None


def _serial_disagreement(fma: bool) -> str | None:
    """:func:`_disagreement` with torch on one thread: the check is of the rounding, not of the
    threads (their independence is the tests' ``test_threads_do_not_change_the_result``).  Two
    clean CI runs saw torch's step of the 4097-element slice split over 2 threads at 2049 with
    most of the second half off by a few ulps, and neither rounding then agreed; not reproduced
    in a fresh process (cause not yet found)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _disagreement(fma)
    finally:
        torch.set_num_threads(before)


def _verify(module: Any) -> str | None:
    """Torch's AVX2/AVX-512 kernels fuse some multiply-adds, its portable ones do not: use the
    rounding this torch uses, or none if neither agrees bit for bit (the message says where each
    differed first, and torch's CPU capability at that moment)."""
    found = []
    for fma in (True, False):
        why = _serial_disagreement(fma)
        if why is None:
            _fma[0] = fma
            return None
        found.append(f"{'with' if fma else 'without'} fused multiply-adds: {why}")
    return (
        "it does not reproduce this torch's Adam/AdamW bit for bit (CPU capability "
        f"{_simd_flags()[0]}, torch {torch.__version__} dispatching to "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
        + "; ".join(found)
        + ")"
    )


EXTENSION = NativeExtension(
    owner="nvmeswap",
    name=_simd_flags()[0],
    what="the fused Adam kernel",
    sources=(CSRC / "nvmeswap_adam.cpp",),
    why="the optimizer step on swapped-in state; NVMESWAP_ADAM=python skips it (torch operations)",
    eta="about 30 s on 2 CPU cores",
    fallback="the same step as torch operations (bitwise the same, one fp32 gradient per parameter slice)",
    # -ffp-contract=off: every multiply and add rounded as torch's kernels round them
    cflags=("-O3", "-ffp-contract=off", "-fopenmp", *_simd_flags()[1]),
    ldflags=("-fopenmp",),
    disable_env=("NVMESWAP_ADAM", "python"),
    verbose_env="NVMESWAP_VERBOSE_BUILD",
    verify=_verify,
)
"""The fused Adam kernel (one of ``NvmeSwapPlugin.native``)."""


def load(build: bool = True) -> bool:
    """Build and register the operator (once per process) and check it against torch's own
    optimizer; False (with a warning) if it cannot be built or does not agree.  ``build=False``
    gives up without trying (another rank of this machine tried and failed)."""
    return EXTENSION.load(build)


def uses_fma() -> bool:
    """Whether the loaded kernel rounds as torch's AVX2/AVX-512 kernels (fused multiply-adds)
    rather than as its portable ones (meaningful once :func:`load` returned True)."""
    return _fma[0]


def build_error() -> str | None:
    """Why the C++ kernel is not in use (None when it is, or was not tried yet)."""
    return EXTENSION.error


def load_distributed() -> bool:
    """:func:`load`, built by local rank 0 while the other ranks of its machine wait (and give up
    without building when it failed)."""
    return EXTENSION.load_distributed()


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
        torch.ops.nvmeswap.adam_step_(param, exp_avg, exp_avg_sq, grad, float(grad_scale), *h.args(), _fma[0])
    else:
        reference_adam_step_(param, exp_avg, exp_avg_sq, grad, grad_scale, h)
