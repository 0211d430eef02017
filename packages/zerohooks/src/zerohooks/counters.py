"""Per-step byte counters of the gradient collectives, kept by the adapter."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CommCounters", "dtype_name", "ring_wire_bytes"]

StepBytes = dict[str, dict[str, int]]


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; a string (a wire format such as ``"int4 codes"``) is kept."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def ring_wire_bytes(collective: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends to the others when ``nbytes`` are handed to ``collective`` over
    ``world`` ranks, with the bandwidth-optimal (ring) algorithm: ``2 (W-1)/W`` of the input for
    ``all_reduce``, ``(W-1)/W`` for ``reduce_scatter`` and ``reduce``, ``W-1`` times the input for
    ``all_gather``, ``(W-1)/W`` for ``all_to_all``.  Zero on one rank."""
    if world <= 1:
        return 0
    factor = {
        "all_reduce": 2 * (world - 1) / world,
        "reduce_scatter": (world - 1) / world,
        "reduce": (world - 1) / world,
        "all_to_all": (world - 1) / world,
        "all_gather": float(world - 1),
    }.get(collective)
    if factor is None:
        raise ValueError(f"no wire model for collective {collective!r}")
    return round(factor * nbytes)


def _copy(step: StepBytes) -> StepBytes:
    return {k: dict(v) for k, v in step.items()}


def _sum(steps: collections.deque[StepBytes]) -> StepBytes:
    out: StepBytes = {}
    for step in steps:
        for coll, per in step.items():
            dst = out.setdefault(coll, {})
            for dt, n in per.items():
                dst[dt] = dst.get(dt, 0) + n
    return out


class CommCounters:
    """Bytes of the gradient collectives on this rank, by collective and dtype, per optimizer step.

    Two records, each ``{collective: {dtype or format: bytes}}`` per step:

    * *handed* (``add``, ``history``, ``last_step()``, ``total()``): the bytes DeepSpeed hands to
      its gradient collective (``all_reduce``, ``reduce``, ``reduce_scatter``) in the
      communication dtype, before any owner of the collective transforms them.  Counted by the
      adapter for every call.
    * *wire* (``add_wire``, ``wire_history``, ``last_step(wire=True)``, ``total(wire=True)``): the
      bytes this rank sends to other ranks, by the collective that really runs and the format that
      really travels.  Without an owner of the collective (:class:`~zerohooks.GradientReducer`)
      the adapter counts DeepSpeed's collective with the ring model of :func:`ring_wire_bytes`.
      An owner reports what it sends itself, during its ``reduce`` call, with ``add_wire`` (loco:
      ``all_to_all``/``all_gather`` of ``"int4 codes"`` and ``"float32 scales"``, and its exact
      small-tensor path in the gradient dtype); an owner that reports nothing for a call is
      counted as DeepSpeed's collective would be.

    The adapter closes a step after the optimizer step; the histories keep the last ``maxlen``
    closed steps.
    """

    __slots__ = ("_current", "_current_wire", "history", "wire_history", "wire_reports")

    def __init__(self, maxlen: int = 100_000) -> None:
        self._current: StepBytes = {}
        self._current_wire: StepBytes = {}
        self.history: collections.deque[StepBytes] = collections.deque(maxlen=maxlen)
        self.wire_history: collections.deque[StepBytes] = collections.deque(maxlen=maxlen)
        self.wire_reports = 0
        """How many times ``add_wire`` was called (the adapter uses it to see whether an owner
        reported its bytes)."""

    @staticmethod
    def _add(record: StepBytes, collective: str, dtype: torch.dtype | str, nbytes: int) -> None:
        per_dtype = record.setdefault(collective, {})
        name = dtype_name(dtype)
        per_dtype[name] = per_dtype.get(name, 0) + int(nbytes)

    def add(self, collective: str, dtype: torch.dtype, nbytes: int) -> None:
        """Count ``nbytes`` handed to ``collective`` in ``dtype`` (before any owner)."""
        self._add(self._current, collective, dtype, nbytes)

    def add_wire(self, collective: str, fmt: torch.dtype | str, nbytes: int) -> None:
        """Count ``nbytes`` this rank sends to other ranks through ``collective`` in ``fmt`` (a
        dtype, or a format name such as ``"int4 codes"``).  For owners of the collective."""
        self.wire_reports += 1
        self._add(self._current_wire, collective, fmt, nbytes)

    def add_default_wire(self, collective: str, dtype: torch.dtype, nbytes: int, world: int) -> None:
        """Count DeepSpeed's own ``collective`` of ``nbytes`` over ``world`` ranks on the wire
        (:func:`ring_wire_bytes`).  Called by the adapter when no owner reported the call."""
        self.add_wire(collective, dtype, ring_wire_bytes(collective, nbytes, world))

    def end_step(self) -> None:
        """Close the current step (called by the adapter after each optimizer step)."""
        self.history.append(self._current)
        self.wire_history.append(self._current_wire)
        self._current = {}
        self._current_wire = {}

    def current(self, wire: bool = False) -> StepBytes:
        """Bytes counted since the last optimizer step (handed over, or on the wire)."""
        return _copy(self._current_wire if wire else self._current)

    def last_step(self, wire: bool = False) -> StepBytes:
        """Bytes of the last closed step (empty before the first step)."""
        hist = self.wire_history if wire else self.history
        return _copy(hist[-1]) if hist else {}

    def total(self, wire: bool = False) -> StepBytes:
        """Bytes summed over the kept history."""
        return _sum(self.wire_history if wire else self.history)

    @staticmethod
    def step_total(step: StepBytes) -> int:
        """All bytes of one step, every collective and dtype."""
        return sum(sum(per.values()) for per in step.values())
