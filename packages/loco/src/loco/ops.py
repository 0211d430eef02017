"""The ``loco::`` operators: just-in-time build, Python wrappers, fake (meta) implementations.

The schemas live in C++ (``csrc/loco_ops.cpp``, ``TORCH_LIBRARY(loco, m)``), with the CPU
implementation (``TORCH_LIBRARY_IMPL(loco, CPU, m)``); ``csrc/loco_cuda.cpp`` and
``csrc/loco_kernels.cu`` add the CUDA one.  :func:`load` builds them with
``torch.utils.cpp_extension.load`` (ninja) into ``TORCH_EXTENSIONS_DIR`` (torch's default when
unset), once per process; a failed build is a warning and the pure-torch reference
(:mod:`loco.reference`) is used instead, never a crash.  ``LOCO_KERNELS=reference`` in the
environment skips the build.

The wrappers (:func:`quantize_ef`, :func:`dequant_reduce_requant`, :func:`dequant_reduce`) call
the compiled operator when it exists for the tensor's device, the reference otherwise; both give
the same bits on CPU.  Every operator writes into tensors the caller provides and updates the
error buffer in place (schema ``Tensor(a!)``), so the collective can quantize straight into its
send buffer and nothing is allocated per call.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from loco import reference

__all__ = [
    "CSRC",
    "available",
    "build_error",
    "build_name",
    "cpu_build_flags",
    "dequant_reduce",
    "dequant_reduce_requant",
    "load",
    "load_distributed",
    "quantize_ef",
]

CSRC = Path(__file__).resolve().parent / "csrc"
_lock = threading.RLock()
_state: dict[str, bool] = {}  # device type -> compiled operators usable
_errors: dict[str, str] = {}
_fakes_registered = False


def _cpu_tag() -> str:
    return str(torch.backends.cpu.get_cpu_capability()).lower().replace(" ", "_")


def cpu_build_flags() -> list[str]:
    """Compiler flags of the CPU kernels: vector ISA of this CPU, OpenMP, no FMA contraction."""
    isa = {
        "avx2": ["-mavx2", "-mfma", "-mf16c"],
        "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c"],
    }.get(_cpu_tag(), [])
    # -ffp-contract=off: no fused multiply-add, so the kernels are bitwise equal to the reference
    return ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", *isa]


def build_name(device_type: str = "cpu") -> str:
    """The extension name (folder under ``TORCH_EXTENSIONS_DIR``) of the ``device_type`` kernels."""
    return f"loco_cpu_{_cpu_tag()}" if device_type == "cpu" else f"loco_{device_type}"


# nvcc flags of the CUDA kernels: no multiply-add contraction (every product rounded on its own,
# as in the reference); tests compile the sources with the same flags
CUDA_CFLAGS = ["-O3", "--fmad=false"]


def _build(name: str, sources: list[Path], cuda: bool = False) -> None:
    from torch.utils.cpp_extension import load as cpp_load

    from zerohooks.jit import announce_build, extension_cached

    kwargs: dict[str, Any] = {}
    if cuda:
        kwargs["extra_cuda_cflags"] = list(CUDA_CFLAGS)
    with announce_build(
        f"loco's {'CUDA' if cuda else 'CPU'} kernels ({name})",
        why="loco's 4-bit quantize/reduce operators; LOCO_KERNELS=reference skips them (slower, same results)",
        eta="a few minutes" if cuda else "about 1 min on 2 CPU cores",
        hint="python -m zerohooks.build loco",
        cached=extension_cached(name),
    ):
        cpp_load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=cpu_build_flags(),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            is_python_module=False,
            verbose=os.environ.get("LOCO_VERBOSE_BUILD", "") not in ("", "0"),
            **kwargs,
        )


def _try(device: str, name: str, sources: list[Path], cuda: bool = False) -> bool:
    try:
        _build(name, sources, cuda)
    except Exception as e:  # compiler missing, build error, load error: fall back
        _errors[device] = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"loco: could not build the {device.upper()} kernels ({_errors[device].splitlines()[0][:300]}); "
            "using the pure-torch reference implementation instead (slower, same results)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def load(device_type: str = "cpu") -> bool:
    """Build (first call) and load the compiled operators for ``device_type``; True if usable."""
    with _lock:
        if device_type in _state:
            return _state[device_type]
        ok = False
        if os.environ.get("LOCO_KERNELS", "") == "reference":
            _errors[device_type] = "disabled by LOCO_KERNELS=reference"
        elif device_type == "cpu":
            ok = _try("cpu", build_name("cpu"), [CSRC / "loco_ops.cpp"])
        elif device_type == "cuda":
            if not load("cpu"):  # the schemas live in the CPU library
                _errors["cuda"] = "the CPU library (operator schemas) is not available"
            elif not torch.cuda.is_available():
                _errors["cuda"] = "no CUDA device"
            else:
                ok = _try(
                    "cuda", build_name("cuda"), [CSRC / "loco_cuda.cpp", CSRC / "loco_kernels.cu"], cuda=True
                )
        else:
            _errors[device_type] = f"no kernels for device type {device_type!r}"
        if ok:
            _register_fakes()
        _state[device_type] = ok
        return ok


def load_distributed(device_type: str = "cpu") -> bool:
    """:func:`load` with local rank 0 of each machine building while the other ranks wait; they
    then load its cached build (or try again themselves where it failed)."""
    from zerohooks.jit import local_rank0_first

    return bool(local_rank0_first(lambda build=True: load(device_type)))


def available(device_type: str) -> bool:
    """True when the compiled operators were loaded for ``device_type`` (no build attempted)."""
    return _state.get(device_type, False)


def build_error(device_type: str) -> str | None:
    """Why the compiled operators are not available for ``device_type`` (None if they are)."""
    return _errors.get(device_type)


# ---- fake implementations (shapes only) for torch.compile / FakeTensor ---------------------------


def _register_fakes() -> None:
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True

    # Every operator writes into tensors it is given (declared mutable in the schema) and returns
    # nothing, so the fake implementations have nothing to compute.
    @torch.library.register_fake("loco::quantize_ef")
    def _quantize_ef_fake(
        g: torch.Tensor,
        e: torch.Tensor,
        e_scale: torch.Tensor,
        beta: float,
        bits: int,
        group_size: int,
        row_len: int,
        q: torch.Tensor,
        scale: torch.Tensor,
    ) -> None:
        return None

    @torch.library.register_fake("loco::dequant_reduce_requant")
    def _drr_fake(
        q: torch.Tensor,
        scale: torch.Tensor,
        e: torch.Tensor,
        e_scale: torch.Tensor,
        beta: float,
        bits: int,
        group_size: int,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
    ) -> None:
        return None

    @torch.library.register_fake("loco::dequant_reduce")
    def _dr_fake(
        q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, divisor: float, out: torch.Tensor
    ) -> None:
        return None


# ---- wrappers ------------------------------------------------------------------------------------


def _native(t: torch.Tensor, use_kernels: bool) -> bool:
    return use_kernels and _state.get(t.device.type, False)


def quantize_ef(
    g: torch.Tensor,
    e: torch.Tensor,
    e_scale: torch.Tensor,
    beta: float,
    bits: int,
    group_size: int,
    row_len: int,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    use_kernels: bool = True,
) -> None:
    """See :func:`loco.reference.quantize_ef` (writes ``q``, ``scale``; updates ``e`` in place)."""
    if _native(g, use_kernels):
        torch.ops.loco.quantize_ef(g, e, e_scale, float(beta), bits, group_size, row_len, q, scale)
    else:
        reference.quantize_ef(g, e, e_scale, beta, bits, group_size, row_len, q, scale)


def dequant_reduce_requant(
    q: torch.Tensor,
    scale: torch.Tensor,
    e: torch.Tensor,
    e_scale: torch.Tensor,
    beta: float,
    bits: int,
    group_size: int,
    q_out: torch.Tensor,
    scale_out: torch.Tensor,
    *,
    use_kernels: bool = True,
) -> None:
    """See :func:`loco.reference.dequant_reduce_requant`."""
    if _native(q, use_kernels):
        torch.ops.loco.dequant_reduce_requant(
            q, scale, e, e_scale, float(beta), bits, group_size, q_out, scale_out
        )
    else:
        reference.dequant_reduce_requant(q, scale, e, e_scale, beta, bits, group_size, q_out, scale_out)


def dequant_reduce(
    q: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    group_size: int,
    divisor: float,
    out: torch.Tensor,
    *,
    use_kernels: bool = True,
) -> None:
    """See :func:`loco.reference.dequant_reduce` (writes ``out`` in place)."""
    if _native(q, use_kernels):
        torch.ops.loco.dequant_reduce(q, scale, bits, group_size, float(divisor), out)
    else:
        reference.dequant_reduce(q, scale, bits, group_size, divisor, out)
