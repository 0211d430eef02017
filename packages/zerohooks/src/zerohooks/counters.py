"""Per-step byte counters of the gradient collectives, kept by the adapter."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CommCounters", "dtype_name"]

StepBytes = dict[str, dict[str, int]]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class CommCounters:
    """Bytes handed to each collective, by dtype, for each optimizer step on this rank.

    ``add`` is called by the adapter for every collective call; the adapter closes a step after
    the optimizer step.  ``history`` keeps the last ``maxlen`` closed steps.
    """

    __slots__ = ("_current", "history")

    def __init__(self, maxlen: int = 100_000) -> None:
        self._current: StepBytes = {}
        self.history: collections.deque[StepBytes] = collections.deque(maxlen=maxlen)

    def add(self, collective: str, dtype: torch.dtype, nbytes: int) -> None:
        """Count ``nbytes`` handed to ``collective`` in ``dtype``."""
        per_dtype = self._current.setdefault(collective, {})
        name = dtype_name(dtype)
        per_dtype[name] = per_dtype.get(name, 0) + int(nbytes)

    def end_step(self) -> None:
        """Close the current step (called by the adapter after each optimizer step)."""
        self.history.append(self._current)
        self._current = {}

    def current(self) -> StepBytes:
        """Bytes counted since the last optimizer step."""
        return {k: dict(v) for k, v in self._current.items()}

    def last_step(self) -> StepBytes:
        """Bytes of the last closed step (empty before the first step)."""
        return {k: dict(v) for k, v in self.history[-1].items()} if self.history else {}

    def total(self) -> StepBytes:
        """Bytes summed over the kept history."""
        out: StepBytes = {}
        for step in self.history:
            for coll, per in step.items():
                dst = out.setdefault(coll, {})
                for dt, n in per.items():
                    dst[dt] = dst.get(dt, 0) + n
        return out

    @staticmethod
    def step_total(step: StepBytes) -> int:
        """All bytes of one step, every collective and dtype."""
        return sum(sum(per.values()) for per in step.values())
