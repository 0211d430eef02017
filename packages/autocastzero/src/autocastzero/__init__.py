"""autocastzero: torch.autocast compute with fp32 parameters under every DeepSpeed ZeRO stage.

A zerohooks plugin, enabled by an ``"autocastzero"`` section in the DeepSpeed config::

    {"zero_optimization": {"stage": 3}, "autocastzero": {"dtype": "bfloat16"}}

The engine's forward runs under ``torch.autocast``; parameters stay fp32; gradients of
lower-precision-safe modules (Linear, Conv and Hugging Face's Conv1D by default) are reduced in the autocast dtype and, on
ZeRO 3, those parameters are all-gathered in it; float16 gets dynamic loss scaling on ZeRO 0-3.
"""

from __future__ import annotations

from autocastzero.__about__ import __version__
from autocastzero.config import DEFAULT_SAFE_MODULES, AutocastZeroConfig, check_deepspeed_config
from autocastzero.plugin import AutocastState, AutocastZeroPlugin, autocast_state
from autocastzero.scaling import ScaleState
from autocastzero.select import safe_parameters

__all__ = [
    "DEFAULT_SAFE_MODULES",
    "AutocastState",
    "AutocastZeroConfig",
    "AutocastZeroPlugin",
    "ScaleState",
    "__version__",
    "autocast_state",
    "check_deepspeed_config",
    "safe_parameters",
]
