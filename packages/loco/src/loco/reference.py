"""Pure-torch reference of the LoCo kernels: the definition the C++ and CUDA kernels reproduce.

Quantization (``bits`` 4 or 8, ``qmax`` 7 or 127), per group of ``G`` float32 values ``x``:

* ``amax = max |x|``;  a group holding inf or NaN gets ``scale = +inf`` and all codes 0, so that
  its dequantized values are non-finite and an fp16 overflow still reaches DeepSpeed;
  a group with ``amax < 2**-100`` gets ``scale = 0`` and codes 0 (its value stays in the error);
* otherwise ``scale = amax / qmax`` and ``code = clamp(round_half_even(x * (qmax / amax)))``,
  both divisions IEEE float32 (never reciprocal-then-multiply);
* ``deQ(code) = code * scale``.

4-bit codes are stored two per byte, ``(c[2i] + 8) | (c[2i+1] + 8) << 4``; 8-bit codes as the
bytes of int8 values.  Every arithmetic step is one float32 operation in a fixed order (no fused
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
    c = codes.reshape(-1).to(torch.int32)
    if bits == 8:
        return c.to(torch.int8).view(torch.uint8)
    lo = (c[0::2] + 8).to(torch.uint8)
    hi = (c[1::2] + 8).to(torch.uint8)
    return lo | (hi << 4)


def _unpack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Float codes of packed rows ``q`` [S, bytes] -> [S, elements]."""
    if bits == 8:
        return q.contiguous().view(torch.int8).to(torch.float32)
    lo = (q & 15).to(torch.int32) - 8
    hi = (q >> 4).to(torch.int32) - 8
    return torch.stack([lo, hi], dim=-1).reshape(q.shape[0], -1).to(torch.float32)


def encode(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 ``x`` (numel a multiple of ``group_size``): packed codes, fp32 scales."""
    codes, scale = _codes_and_scale(x.reshape(-1, group_size), QMAX[bits])
    return _pack(codes, bits), scale


def decode(q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Float32 values of packed codes ``q`` [S, bytes] with scales [S, groups] -> [S, elements]."""
    codes = _unpack(q, bits)
    s = codes.shape[0]
    return (codes.view(s, -1, group_size) * scale.reshape(s, -1, 1)).reshape(s, -1)


def _load_error(e: torch.Tensor, e_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    if e.dtype == torch.int8:
        return (e.to(torch.float32).view(-1, group_size) * e_scale.view(-1, 1)).reshape(-1)
    return e.reshape(-1).to(torch.float32)


def _store_error(
    e_new: torch.Tensor, like: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if like.dtype == torch.int8:
        codes, scale = _codes_and_scale(e_new.view(-1, group_size), QMAX[8])
        return codes.reshape(-1).to(torch.int8), scale
    return e_new.to(like.dtype), torch.empty(0, dtype=torch.float32, device=e_new.device)


def _encode_ef(
    x: torch.Tensor,
    e: torch.Tensor,
    e_scale: torch.Tensor,
    e_prev: torch.Tensor | None,
    beta: float,
    bits: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scale = _codes_and_scale(x.view(-1, group_size), QMAX[bits])
    q = _pack(codes, bits)
    if e_prev is None:
        empty = torch.empty(0, dtype=torch.float32, device=x.device)
        return q, scale, e.new_empty(0), empty
    residual = x.view(-1, group_size) - codes * scale[:, None]
    e_new = (float(beta) * e_prev.view(-1, group_size) + float(1.0 - beta) * residual).reshape(-1)
    e_out, e_scale_out = _store_error(e_new, e, group_size)
    return q, scale, e_out, e_scale_out


def quantize_ef(
    g: torch.Tensor,
    e: torch.Tensor,
    e_scale: torch.Tensor,
    beta: float,
    bits: int,
    group_size: int,
    row_len: int,
    nrows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused error feedback + quantization of ``g`` in the padded row layout.

    ``x = pad(g) + deQ(e)``; returns ``(q, scale, e_new, e_new_scale)`` with
    ``e_new = beta * e + (1 - beta) * (x - deQ(q))`` stored like ``e``.  ``e`` empty: no error
    feedback (``x = pad(g)``), and the returned error tensors are empty.
    """
    cpad = padded_row_len(row_len, group_size)
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
    return _encode_ef(x, e, e_scale, e_prev, beta, bits, group_size)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum ``S`` quantized rows (``q`` [S, bytes], ``scale`` [S, groups]), add the error, requantize.

    ``x = sum_s deQ(q[s]) + deQ(e)``; returns ``(q2, scale2, e_new, e_new_scale)`` as
    :func:`quantize_ef` does.
    """
    x = _reduce(q, scale, bits, group_size)
    e_prev = None
    if e.numel():
        e_prev = _load_error(e, e_scale, group_size)
        x = x + e_prev
    return _encode_ef(x, e, e_scale, e_prev, beta, bits, group_size)


def dequant_reduce(
    q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, divisor: float, out: torch.Tensor
) -> None:
    """``out[:] = (sum_s deQ(q[s]))[: out.numel()] / divisor``, cast to ``out.dtype`` (in place)."""
    acc = _reduce(q, scale, bits, group_size)[: out.numel()]
    if divisor != 1.0:
        acc = acc / torch.full_like(acc, float(divisor))
    out.view(-1).copy_(acc)
