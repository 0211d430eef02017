"""GPU cost counted on any device: aten ops dispatched and host synchronisations per step.

On a GPU nearly every aten op is a kernel launch, and a few ops make the host wait for the device
(a synchronisation): reading a tensor's value into Python (``aten._local_scalar_dense``: ``item()``,
``bool(t)``, ``float(t)``) and the ops whose output size depends on the data (``nonzero``,
``masked_select``, ``unique``; ``equal`` returns a Python bool).  A :class:`CostCounter` (a
``TorchDispatchMode``) counts both wherever it runs, a CPU included, so the GPU cost of a plugin
can be compared with DeepSpeed's own on a machine without one.

Not counted as syncs: the reads of a torch optimizer's step counter (``torch.optim``'s
``_get_value``), which lives on the CPU whatever the device of the parameters (unless the
optimizer is ``capturable``) and makes no device wait.  Not seen at all: copies to the CPU
(``.cpu()`` is an ordinary op here, a sync on a GPU) and work outside aten (C++ collectives).

    counter = CostCounter()
    with counter.phase("fwd_bwd"):
        engine.backward(engine(x))
    with counter.phase("step"):
        engine.step()
    counter.counts  # {"fwd_bwd": PhaseCost(ops=..., syncs=..., sync_ops={...}), "step": ...}

:func:`step_cost` does this for one optimizer step of an engine (all its micro-steps).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NO_LAUNCH", "SYNC_OPS", "CostCounter", "PhaseCost", "step_cost"]

_aten = torch.ops.aten
SYNC_OPS: frozenset[Any] = frozenset(
    op
    for op in (
        _aten._local_scalar_dense.default,
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten.equal.default,
        getattr(_aten, "_unique2", None) and _aten._unique2.default,
        getattr(_aten, "unique_dim", None) and _aten.unique_dim.default,
        getattr(_aten, "unique_consecutive", None) and _aten.unique_consecutive.default,
    )
    if op is not None
)
"""The aten ops that make the host wait for the device."""

NO_LAUNCH: frozenset[str] = frozenset(
    {
        "empty",
        "empty_strided",
        "_unsafe_view",
        "lift_fresh",
        "_record_function_enter",
        "_record_function_enter_new",
        "_record_function_exit",
        "set_",
        "resize_",
    }
)
"""Ops (by name) that launch no kernel on a GPU besides the views (``OpOverload.is_view``):
allocations from the caching allocator, metadata changes, profiler records."""

_OPTIM_DIR = os.path.join("torch", "optim") + os.sep


@dataclass
class PhaseCost:
    """What one phase dispatched."""

    ops: int = 0
    """aten ops dispatched (about one kernel launch each on a GPU)."""
    launches: int = 0
    """the ops among them that launch a kernel on a GPU: not views (``view``, ``transpose``,
    ``slice``, ``detach`` ...) and not :data:`NO_LAUNCH` (``empty`` ...)."""
    syncs: int = 0
    """host synchronisations among them (:data:`SYNC_OPS`, optimizer step counters left out)."""
    sync_ops: collections.Counter[str] = field(default_factory=collections.Counter)
    """the syncs by op name and the function that asked (``op <- file:function``)."""
    by_op: collections.Counter[str] = field(default_factory=collections.Counter)
    """every op by name (to see where a difference comes from)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "ops": self.ops,
            "launches": self.launches,
            "syncs": self.syncs,
            "sync_ops": dict(self.sync_ops),
        }


def _optimizer_counter_read() -> tuple[bool, str]:
    """(whether the op was asked for by torch.optim, the nearest caller outside torch)."""
    frame = sys._getframe(2)
    caller = ""
    while frame is not None:
        name = frame.f_code.co_filename
        if _OPTIM_DIR in name:
            return True, name
        if not caller and f"{os.sep}torch{os.sep}" not in name:
            caller = f"{os.path.basename(name)}:{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return False, caller


class CostCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts aten ops and host syncs per named phase (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: dict[str, PhaseCost] = collections.defaultdict(PhaseCost)
        self._phase: str | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseCost]:
        """Count what runs inside the block into ``counts[name]`` (added to earlier blocks)."""
        previous, self._phase = self._phase, name
        try:
            with self:
                yield self.counts[name]
        finally:
            self._phase = previous

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self._phase is not None:
            cost = self.counts[self._phase]
            name = str(func.overloadpacket.__name__)
            cost.ops += 1
            cost.by_op[name] += 1
            if not func.is_view and name not in NO_LAUNCH:
                cost.launches += 1
            if func in SYNC_OPS:
                optimizer, caller = _optimizer_counter_read()
                if not optimizer:
                    cost.syncs += 1
                    cost.sync_ops[f"{name} <- {caller}"] += 1
        return func(*args, **(kwargs or {}))


def step_cost(
    engine: Any,
    micro_batches: list[tuple[Any, ...]],
    loss_fn: Callable[..., torch.Tensor],
) -> dict[str, PhaseCost]:
    """Count one optimizer step of ``engine``: every micro-batch's forward and backward in
    ``"fwd_bwd"``, every ``engine.step()`` (the boundary one does the optimizer step) in
    ``"step"``.  ``loss_fn(engine, *batch)`` returns the loss."""
    counter = CostCounter()
    for batch in micro_batches:
        with counter.phase("fwd_bwd"):
            loss = loss_fn(engine, *batch)
            engine.backward(loss)
        with counter.phase("step"):
            engine.step()
    return dict(counter.counts)
