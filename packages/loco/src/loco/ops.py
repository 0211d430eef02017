"""The ``loco::`` operators: just-in-time build, Python wrappers, fake (meta) implementations.

The schemas live in C++ (``csrc/loco_ops.cpp``, ``TORCH_LIBRARY(loco, m)``), with the CPU
implementation (``TORCH_LIBRARY_IMPL(loco, CPU, m)``); ``csrc/loco_cuda.cpp`` and
``csrc/loco_kernels.cu`` add the CUDA one.  :data:`EXTENSIONS` describes them
(:class:`zerohooks.native.NativeExtension`: zerohooks builds them with
``torch.utils.cpp_extension.load`` into ``TORCH_EXTENSIONS_DIR`` once per process; a failed
build is a warning and the pure-torch reference (:mod:`loco.reference`) is used instead, never a
crash).  ``LOCO_KERNELS=reference`` in the
environment skips the build.

The wrappers (:func:`quantize_ef`, :func:`dequant_reduce_requant`, :func:`dequant_reduce`) call
the compiled operator when it exists for the tensor's device, the reference otherwise; both give
the same bits on CPU.  Every operator writes into tensors the caller provides and updates the
error buffer in place (schema ``Tensor(a!)``), so the collective can quantize straight into its
send buffer and nothing is allocated per call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loco import reference
from zerohooks.native import NativeExtension

__all__ = [
    "CSRC",
    "EXTENSIONS",
    "available",
    "build_error",
    "build_name",
    "cpu_build_flags",
    "dequant_reduce",
    "dequant_reduce_requant",
    "extension",
    "load",
    "load_distributed",
    "quantize_ef",
]

CSRC = Path(__file__).resolve().parent / "csrc"
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


def _fakes(module: Any) -> None:
    _register_fakes()


def _cuda_device() -> str | None:
    return None if torch.cuda.is_available() else "no CUDA device"


def extension(device_type: str, sources: list[Path] | None = None) -> NativeExtension:
    """The description of the ``device_type`` kernels (``sources`` replaces their sources: tests)."""
    common: dict[str, Any] = dict(
        owner="loco",
        name=build_name(device_type),
        why="loco's 4-bit quantize/reduce operators; LOCO_KERNELS=reference skips them (slower, same results)",
        fallback="the pure-torch reference implementation (slower, same results)",
        cflags=tuple(cpu_build_flags()),
        ldflags=("-fopenmp",),
        include_paths=(CSRC,),
        disable_env=("LOCO_KERNELS", "reference"),
        verbose_env="LOCO_VERBOSE_BUILD",
    )
    if device_type == "cpu":
        return NativeExtension(
            what="the CPU kernels",
            sources=tuple(sources or [CSRC / "loco_ops.cpp"]),
            eta="about 1 min on 2 CPU cores",
            verify=_fakes,
            **common,
        )
    return NativeExtension(
        what="the CUDA kernels",
        sources=tuple(sources or [CSRC / "loco_cuda.cpp", CSRC / "loco_kernels.cu"]),
        eta="a few minutes",
        cuda_cflags=tuple(CUDA_CFLAGS),
        needs=(EXTENSIONS["cpu"],),  # the schemas live in the CPU library
        precondition=_cuda_device,
        **common,
    )


EXTENSIONS: dict[str, NativeExtension] = {}
"""loco's extensions by device type (its ``LocoPlugin.native``)."""
EXTENSIONS["cpu"] = extension("cpu")
EXTENSIONS["cuda"] = extension("cuda")


def load(device_type: str = "cpu") -> bool:
    """Build (first call) and load the compiled operators for ``device_type``; True if usable."""
    ext = EXTENSIONS.get(device_type)
    return ext is not None and ext.load()


def load_distributed(device_type: str = "cpu") -> bool:
    """:func:`load` with local rank 0 of each machine building while the other ranks wait; they
    then load its cached build (or give up where it failed)."""
    ext = EXTENSIONS.get(device_type)
    return ext is not None and ext.load_distributed()


def available(device_type: str) -> bool:
    """True when the compiled operators were loaded for ``device_type`` (no build attempted)."""
    ext = EXTENSIONS.get(device_type)
    return ext is not None and ext.available


def build_error(device_type: str) -> str | None:
    """Why the compiled operators are not available for ``device_type`` (None if they are)."""
    ext = EXTENSIONS.get(device_type)
    return f"no kernels for device type {device_type!r}" if ext is None else ext.error


# ---- fake implementations (shapes only) for torch.compile / FakeTensor ---------------------------


def _register_fakes() -> None:
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True

    # Every operator writes into tensors it is given (declared mutable in the schema) and returns
    # nothing, so the fake implementations have nothing to compute: one function serves the three
    # (the schemas registered with the kernels give the arguments).
    def _writes_only(*args: object) -> None:
        return None

    for op in ("loco::quantize_ef", "loco::dequant_reduce_requant", "loco::dequant_reduce"):
        torch.library.register_fake(op)(_writes_only)


# ---- wrappers ------------------------------------------------------------------------------------


def _native(t: torch.Tensor, use_kernels: bool) -> bool:
    return use_kernels and available(t.device.type)


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
