"""ZeRO 3: turning the kept parameters' partitions back into fp32 after DeepSpeed built them.

``DeepSpeedZeroOptimizer_Stage3`` builds every parameter partition in the training dtype.
Because mixedlayers splits the param groups by dtype, every ZeRO-3 sub-group is either all
16-bit or all kept; once the optimizer exists, :func:`restore_zero3` asks the adapter's
partition retype (:func:`zerohooks.adapter.retype.retype_partitions`) to hold the kept
parameters in fp32, filled from the exact fp32 values remembered before DeepSpeed's cast
(undone at detach).
"""

from __future__ import annotations

from typing import Any

import torch

from mixedlayers.state import MixedState
from zerohooks.adapter.retype import retype_partitions

__all__ = ["restore_zero3"]


def restore_zero3(att: Any, state: MixedState) -> int:
    """Make the kept parameters' ZeRO-3 partitions and masters fp32; returns sub-groups changed."""
    saved = {id(t): data for t, data in state.saved}
    changed = retype_partitions(att, list(state.params), lambda p: saved[id(p)], "mixedlayers", torch.float32)
    kept = {id(p) for p in state.params}
    state.saved = [(t, d) for t, d in state.saved if id(t) not in kept]
    return changed
