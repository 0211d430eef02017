"""accumdtype: gradient accumulation and reduction dtypes independent of the model dtype.

A zerohooks plugin, enabled by an ``"accumdtype"`` section in the DeepSpeed config::

    {"bf16": {"enabled": true}, "zero_optimization": {"stage": 2},
     "accumdtype": {"dtype": "fp32"}}

``grad_accum(engine, param)`` and ``grad_reduc(engine, param)`` return DeepSpeed PR #2847's two
tensors (the one that accumulates, the one that is reduced) on every ZeRO stage.
"""

from __future__ import annotations

from accumdtype.__about__ import __version__
from accumdtype.access import accum_state, accumulation_bytes, grad_accum, grad_accum_range, grad_reduc
from accumdtype.checkpoint import MidWindowCheckpointError
from accumdtype.config import AccumDtypeConfig, Plan, make_plan
from accumdtype.plugin import AccumDtypePlugin
from accumdtype.state import AccumState

__all__ = [
    "AccumDtypeConfig",
    "AccumDtypePlugin",
    "AccumState",
    "MidWindowCheckpointError",
    "Plan",
    "__version__",
    "accum_state",
    "accumulation_bytes",
    "grad_accum",
    "grad_accum_range",
    "grad_reduc",
    "make_plan",
]
