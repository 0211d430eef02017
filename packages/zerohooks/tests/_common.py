"""Helpers shared by the zerohooks tests (imported by the spawned ranks too)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TinyNet(nn.Module):
    """Embedding, Linear, LayerNorm, GELU, Linear: the parameter kinds the plugins care about."""

    def __init__(self, vocab: int = 32, width: int = 24, out: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.fc2 = nn.Linear(2 * width, out)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(dim=1)
        return self.fc2(nn.functional.gelu(self.norm(self.fc1(h))))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyNet()


def ds_config(
    stage: int, dtype: str = "fp32", offload: bool = False, gas: int = 2, **extra: Any
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    cfg.update(extra)
    return cfg


def batch(step: int, micro: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 32, (n, 6), generator=g), torch.randint(0, 8, (n,), generator=g)


def loss_fn(model: Any, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).float(), target)


def train(engine: Any, steps: int, gas: int) -> list[float]:
    rank = int(os.environ.get("RANK", "0"))
    losses = []
    for s in range(steps):
        for m in range(gas):
            tokens, target = batch(s, m, rank)
            loss = loss_fn(engine, tokens, target)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def full_params(engine: Any, stage: int) -> list[torch.Tensor]:
    """Every parameter, gathered on ZeRO 3, plus the fp32 masters where DeepSpeed keeps them."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            out = [p.detach().clone() for p in params]
    else:
        out = [p.detach().clone() for p in params]
    if stage > 0:
        out += [safe_get_full_fp32_param(p).detach().clone() for p in params]
    return out
