"""loco: LoCo gradient communication for DeepSpeed ZeRO, as a zerohooks plugin.

Enable it with a ``"loco"`` section in the DeepSpeed config given to ``zerohooks.initialize``::

    {"zero_optimization": {"stage": 3}, "bf16": {"enabled": true},
     "loco": {"bits": 4, "err_beta": 0.8, "reset_T": 1024}}

Gradients travel as 4-bit (or 8-bit) codes with one fp32 scale per group, compensated by error
feedback (LoCo, arXiv 2407.04480): ``x = g + e``; ``Q(x)`` is sent;
``e <- err_beta * e + (1 - err_beta) * (x - deQ(Q(x)))``.
"""

from __future__ import annotations

from loco.__about__ import __version__
from loco.config import LocoConfig
from loco.plugin import LocoPlugin, LocoReducer
from loco.state import CommStats, LocoState

__all__ = ["CommStats", "LocoConfig", "LocoPlugin", "LocoReducer", "LocoState", "__version__"]
