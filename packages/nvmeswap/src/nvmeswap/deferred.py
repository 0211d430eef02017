"""While DeepSpeed builds the engine: no fp32 master, no fp32 gradient buffer for a swapped sub-group.

nvmeswap runs DeepSpeed as CPU offload (``config.rewrite_offload``), whose ZeRO-3 optimizer makes,
when it is built, an fp32 master copy of every sub-group (4 bytes a parameter) and a zeroed fp32
gradient buffer for each (4 more).  For a model whose optimizer state is the reason to swap (2 B
parameters: 16 GB of them, next to 8 GB of 16-bit weights and gradients) the engine would run out
of memory before nvmeswap could write a single byte out.  Inside :func:`deferred_masters` (entered
by the plugin's ``building()`` around ``deepspeed.initialize``):

* each sub-group to be swapped keeps its fp32 master tensor (its identity: the optimizer's param
  groups and state are keyed by it) with no storage, right after DeepSpeed made it; the master is
  the 16-bit partition converted to fp32, so :func:`materialise` makes it again, bit for bit,
  when the swapper writes it out (one sub-group at a time);
* such a sub-group gets no fp32 gradient buffer (nvmeswap builds the gradient itself, or the fused
  step reads the 16-bit partition); the sub-groups kept in RAM get theirs as DeepSpeed gives them.

The two methods are replaced on DeepSpeed's ZeRO-3 class only for the duration of the context
and only act for calls from the thread that entered it; everything else sees DeepSpeed's own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["DEFERRED", "NO_GRADIENT", "deferred_masters", "materialise"]

DEFERRED = "_nvmeswap_deferred"
"""Attribute of the ZeRO-3 optimizer: the sub-groups whose fp32 master was not kept."""
NO_GRADIENT = "_nvmeswap_no_gradient"
"""Attribute of the ZeRO-3 optimizer: the sub-groups given no fp32 gradient buffer."""

_lock = threading.Lock()


@contextlib.contextmanager
def deferred_masters(min_numel: int, keep_master: bool) -> Iterator[None]:
    """Build the ZeRO-3 optimizer without fp32 gradient buffers, and without fp32 masters unless
    ``keep_master`` (``keep_master_in_ram``), for the sub-groups of at least ``min_numel``
    elements (those nvmeswap swaps)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as cls

    # Why a patch of DeepSpeed's class, not a seam: it acts while DeepSpeed builds the optimizer,
    # before any engine (or attachment) exists; listed as optional in zerohooks.surface.SURFACE.
    names = ("_create_momentum_buffer", "initialize_optimizer_states")
    if not all(callable(cls.__dict__.get(n)) for n in names):
        yield  # another DeepSpeed: the engine is built as before (the masters exist at first)
        return
    thread = threading.get_ident()
    made_momentum = cls.__dict__["_create_momentum_buffer"]
    init_states = cls.__dict__["initialize_optimizer_states"]

    def mine(opt: Any) -> bool:
        return threading.get_ident() == thread and bool(getattr(opt, "offload_optimizer", False))

    def create_momentum_buffer(self: Any, num_elements: Any, i: int, ds_id: Any) -> Any:
        out = made_momentum(self, num_elements, i, ds_id)
        if mine(self) and int(num_elements) >= max(min_numel, 1) and not getattr(self, "use_muon", False):
            self.__dict__.setdefault(NO_GRADIENT, set()).add(i)
            if not keep_master:
                master = self.fp32_partitioned_groups_flat[i]
                master.data = torch.empty(0, dtype=master.dtype, device=master.device)
                self.__dict__.setdefault(DEFERRED, set()).add(i)
        return out

    def initialize_optimizer_states(self: Any) -> Any:
        deferred = self.__dict__.get(NO_GRADIENT)
        if not deferred or not mine(self) or isinstance(self.optimizer, torch.optim.Adagrad):
            return init_states(self)
        # what DeepSpeed's CPU-offload path gives each sub-group (a zeroed fp32 gradient buffer,
        # pinned when asked) for those kept in RAM; none for the swapped ones
        for i, master in enumerate(self.fp32_partitioned_groups_flat):
            if i in deferred:
                master.grad = None
                continue
            buf = torch.zeros(int(self.fp16_partitioned_groups_flat_numel[i]), dtype=master.dtype)
            if getattr(self, "offload_optimizer_pin_memory", False):
                from deepspeed.accelerator import get_accelerator

                buf = get_accelerator().pin_memory(buf)
            master.grad = buf.to(self.subgroup_to_device[i])
        return None

    with _lock:
        cls._create_momentum_buffer = create_momentum_buffer
        cls.initialize_optimizer_states = initialize_optimizer_states
        try:
            yield
        finally:
            cls._create_momentum_buffer = made_momentum
            cls.initialize_optimizer_states = init_states


def materialise(opt: Any, index: int) -> torch.Tensor | None:
    """Sub-group ``index``'s fp32 master as DeepSpeed made it (the 16-bit partition in fp32), or
    None when it was not deferred."""
    deferred = opt.__dict__.get(DEFERRED, set())
    if index not in deferred:
        return None
    deferred.discard(index)
    return opt.fp16_partitioned_groups_flat[index].to(
        "cpu", dtype=opt.fp32_partitioned_groups_flat[index].dtype
    )
