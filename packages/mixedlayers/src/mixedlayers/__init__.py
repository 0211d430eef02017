"""mixedlayers: chosen modules of a bf16/fp16 model kept in fp32, on every DeepSpeed ZeRO stage.

A zerohooks plugin, enabled by a ``"mixedlayers"`` section in the DeepSpeed config::

    {"bf16": {"enabled": true}, "zero_optimization": {"stage": 2},
     "mixedlayers": {"fp32_modules": ["head"], "fp32_module_types": ["torch.nn.LayerNorm"]}}

The kept modules' parameters (and buffers) stay fp32 through DeepSpeed's init, training and
checkpoints; their floating inputs are cast to fp32 on entry and their outputs back on exit.
"""

from __future__ import annotations

from mixedlayers.__about__ import __version__
from mixedlayers.casting import cast_floats
from mixedlayers.config import MixedLayersConfig, select_modules
from mixedlayers.plugin import MixedLayersPlugin, mixed_state
from mixedlayers.state import MixedState, split_param_groups

__all__ = [
    "MixedLayersConfig",
    "MixedLayersPlugin",
    "MixedState",
    "__version__",
    "cast_floats",
    "mixed_state",
    "select_modules",
    "split_param_groups",
]
