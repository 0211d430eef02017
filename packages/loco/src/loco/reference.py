"""Pure-torch reference of the LoCo kernels: the definition the C++ and CUDA kernels reproduce.

Quantization (``bits`` 4 or 8, ``qmax`` 7 or 127), per group of ``G`` float32 values ``x``:

* ``amax = max |x|``;  a group holding inf or NaN gets ``scale = +inf`` and all codes 0, so that
  its dequantized values are non-finite and an fp16 overflow still reaches DeepSpeed;
  a group with ``amax < 2**-100`` gets ``scale = 0`` and codes 0 (its value stays in the error);
* otherwise ``scale = amax / qmax`` and ``code = clamp(round_half_even(x * (qmax / amax)))``,
  both divisions IEEE float32 (never reciprocal-then-multiply);
* ``deQ(code) = code * scale``.

4-bit codes are stored two per byte: in each group, byte ``j < G/2`` holds
``(c[j] + 8) | (c[j + G/2] + 8) << 4`` (the two halves of the group side by side, which SIMD
lanes and CUDA threads pack without shuffles); 8-bit codes are the bytes of int8 values.  Every arithmetic step is one float32 operation in a fixed order (no fused
multiply-add), so the compiled kernels can be, and on CPU are, bitwise equal to this file.

Error buffers ``e`` (same padded layout as the codes) are int8 codes with one fp32 scale per
group (the 8-bit quantizer above), or dense bf16 / fp32 tensors.

Padded row layout (:func:`quantize_ef`): a flat tensor of ``n`` elements is cut into ``nrows``
rows of ``row_len`` elements (the last rows short or empty), each row padded with zeros to
``cpad = ceil(row_len / G) * G``; row ``r`` is what rank ``r`` receives.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "QMAX",
    "TINY",
    "decode",
    "dequant_reduce",
    "dequant_reduce_requant",
    "encode",
    "padded_row_len",
    "quantize_ef",
]

QMAX = {4: 7, 8: 127}
TINY = 2.0**-100
"""Groups whose largest magnitude is below this are sent as zeros (their value stays in e)."""


def padded_row_len(row_len: int, group_size: int) -> int:
    """``row_len`` rounded up to a whole number of groups."""
    return math.ceil(row_len / group_size) * group_size if row_len > 0 else 0


def _codes_and_scale(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float codes (integral values) and scales of ``x`` viewed as [groups, G], float32."""
    amax = x.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    usable = finite & (amax >= TINY)
    q = torch.full_like(amax, float(qmax))
    safe = torch.where(usable, amax, torch.ones_like(amax))
    scale = torch.where(usable, safe / q, torch.zeros_like(amax))
    scale = torch.where(finite, scale, torch.full_like(amax, math.inf))
    inv = torch.where(usable, q / safe, torch.zeros_like(amax))
    codes = torch.round(x * inv[:, None]).clamp(-qmax, qmax)
    codes = torch.where(finite[:, None], codes, torch.zeros_like(codes))
    return codes, scale


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes of float codes [groups, G]."""
    c = codes.to(torch.int32)
    if bits == 8:
        return c.reshape(-1).to(torch.int8).view(torch.uint8)
    half = c.shape[1] // 2
    return ((c[:, :half] + 8) | ((c[:, half:] + 8) << 4)).to(torch.uint8).reshape(-1)


def _unpack(q: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Float codes of packed rows ``q`` [S, bytes] -> [S, elements]."""
    if bits == 8:
        return q.contiguous().view(torch.int8).to(torch.float32)
    b = q.reshape(q.shape[0], -1, group_size // 2).to(torch.int32)
    codes = torch.cat([(b & 15) - 8, (b >> 4) - 8], dim=-1)
    return codes.reshape(q.shape[0], -1).to(torch.float32)


def encode(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 ``x`` (numel a multiple of ``group_size``): packed codes, fp32 scales."""
    codes, scale = _codes_and_scale(x.reshape(-1, group_size), QMAX[bits])
    return _pack(codes, bits), scale


def decode(q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Float32 values of packed codes ``q`` [S, bytes] with scales [S, groups] -> [S, elements]."""
    codes = _unpack(q, bits, group_size)
    s = codes.shape[0]
    return (codes.view(s, -1, group_size) * scale.reshape(s, -1, 1)).reshape(s, -1)


def _load_error(e: torch.Tensor, e_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    if e.dtype == torch.int8:
        return (e.to(torch.float32).view(-1, group_size) * e_scale.view(-1, 1)).reshape(-1)
    return e.reshape(-1).to(torch.float32)


def _encode_ef(
    x: torch.Tensor,
    e: torch.Tensor,
    e_scale: torch.Tensor,
    e_prev: torch.Tensor | None,
    beta: float,
    bits: int,
    group_size: int,
    q: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    codes, s = _codes_and_scale(x.view(-1, group_size), QMAX[bits])
    q.copy_(_pack(codes, bits).view(q.shape))
    scale.copy_(s.view(scale.shape))
    if e_prev is None:
        return
    residual = x.view(-1, group_size) - codes * s[:, None]
    e_new = (float(beta) * e_prev.view(-1, group_size) + float(1.0 - beta) * residual).reshape(-1)
    if e.dtype == torch.int8:
        e_codes, e_s = _codes_and_scale(e_new.view(-1, group_size), QMAX[8])
        e.copy_(e_codes.reshape(-1).to(torch.int8))
        e_scale.copy_(e_s)
    else:
        e.copy_(e_new)


def _rows(t: torch.Tensor) -> int:
    return t.shape[0] * t.shape[1] if t.dim() == 3 else t.shape[0]


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
) -> None:
    """Error feedback + quantization of ``g`` in the padded row layout, written into ``q``/``scale``.

    ``q`` ([rows, bytes] or [A, B, bytes], row ``r = a * B + b``) and ``scale`` (same shape with
    ``cpad / G`` scales per row) receive the codes of ``x = pad(g) + deQ(e)``; ``e`` (and
    ``e_scale`` for int8) is overwritten with ``beta * e + (1 - beta) * (x - deQ(q))``.  An
    empty ``e`` means no error feedback (``x = pad(g)``).
    """
    cpad = padded_row_len(row_len, group_size)
    nrows = _rows(q)
    flat = g.reshape(-1).to(torch.float32)
    n = flat.numel()
    if n > nrows * row_len:
        raise ValueError(f"{n} elements do not fit {nrows} rows of {row_len}")
    x = torch.nn.functional.pad(flat, (0, nrows * row_len - n)).view(nrows, row_len)
    x = torch.nn.functional.pad(x, (0, cpad - row_len)).reshape(-1)
    e_prev = None
    if e.numel():
        e_prev = _load_error(e, e_scale, group_size)
        x = x + e_prev
    _encode_ef(x, e, e_scale, e_prev, beta, bits, group_size, q, scale)


def _reduce(q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    values = decode(q, scale, bits, group_size)
    acc = torch.zeros(values.shape[1], dtype=torch.float32, device=values.device)
    for s in range(values.shape[0]):  # sources in order: the kernels add in the same order
        acc = acc + values[s]
    return acc


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
) -> None:
    """Sum ``S`` quantized rows (``q`` [S, bytes], ``scale`` [S, groups]), add the error, requantize.

    ``x = sum_s deQ(q[s]) + deQ(e)`` is quantized into ``q_out`` [R, bytes] / ``scale_out``
    [R, groups] (R rows of whole groups); ``e`` is updated in place as in :func:`quantize_ef`.
    """
    x = _reduce(q, scale, bits, group_size)
    e_prev = None
    if e.numel():
        e_prev = _load_error(e, e_scale, group_size)
        x = x + e_prev
    _encode_ef(x, e, e_scale, e_prev, beta, bits, group_size, q_out, scale_out)


def dequant_reduce(
    q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, divisor: float, out: torch.Tensor
) -> None:
    """``out[:] = (sum_s deQ(q[s]))[: out.numel()] / divisor``, cast to ``out.dtype`` (in place)."""
    acc = _reduce(q, scale, bits, group_size)[: out.numel()]
    if divisor != 1.0:
        acc = acc / torch.full_like(acc, float(divisor))
    out.view(-1).copy_(acc)
