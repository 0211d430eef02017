"""The model the step-time benchmarks share: a stack of pre-norm MLP blocks.

Every parameter kind the plugins treat differently is there (Linear weights and biases,
LayerNorms, a head), with enough parameters that a step is dominated by real work rather than
Python overhead.  Benchmarks run as ``python benchmarks/<name>.py``, so this module is imported
by name from the script's folder (also in the ranks they spawn).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))), hidden width 4d."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def make_model(d: int, layers: int, out: int = 16, seed: int = 0) -> nn.Module:
    """``layers`` blocks of width ``d``, a final LayerNorm and a Linear head to ``out`` features."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d) for _ in range(layers)], nn.LayerNorm(d), nn.Linear(d, out))


def demo_ds_config(stage: int, micro_batch: int) -> dict[str, Any]:
    """The demo's (examples/train_gpt.py) DeepSpeed settings: AdamW (torch's) with its betas and
    weight decay, clipping at 1.0, one micro-step per step, ZeRO ``stage``; fp32 unless a caller
    adds a precision section."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 2e-3,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "torch_adam": True,
            },
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
