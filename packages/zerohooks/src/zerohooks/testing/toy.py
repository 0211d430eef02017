"""A tiny model, DeepSpeed configs and a training loop for plugin tests.

Every plugin's tests need the same pieces: a model with the parameter kinds plugins care about
(an embedding, Linear layers, a LayerNorm), a DeepSpeed config for a ZeRO stage and dtype,
deterministic per-rank batches, a micro-step loop and a way to read every parameter back on any
stage.  They live here, installed with zerohooks, so each package's isolated test session (and
the ranks it spawns) can import them.

Example::

    from zerohooks.testing import distributed
    from zerohooks.testing.toy import ds_config, make_model, train

    @distributed(world_size=2)
    def run() -> list[float]:
        import zerohooks
        model = make_model()
        engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(2, "bf16", sections={"myplugin": {}}))
        return train(engine, steps=3, gas=2)
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The short dtype names the test configs use."""

FP16_DYNAMIC: dict[str, Any] = {"initial_scale_power": 8, "loss_scale_window": 2}
"""DeepSpeed fp16 settings of :func:`ds_config` by default: dynamic scaling from 2**8, growing
every 2 good steps (so a short test sees the scale move)."""


class TinyNet(nn.Module):
    """Embedding, Linear, LayerNorm, GELU, Linear: the parameter kinds the plugins care about.

    ``mult`` widens the hidden layer (``mult * width`` features)."""

    def __init__(self, vocab: int = 32, width: int = 24, out: int = 8, mult: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.fc1 = nn.Linear(width, mult * width)
        self.norm = nn.LayerNorm(mult * width)
        self.fc2 = nn.Linear(mult * width, out)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(dim=1)
        logits: torch.Tensor = self.fc2(nn.functional.gelu(self.norm(self.fc1(h))))
        return logits


class _EmbedMean(nn.Module):
    """The embedding averaged over the sequence: :class:`TinyNet`'s first layer on its own."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mean: torch.Tensor = self.emb(tokens).mean(dim=1)
        return mean


def pipeline_layers(net: TinyNet) -> list[nn.Module]:
    """``net``'s forward as a list of layers holding the same weights, for DeepSpeed's
    ``PipelineModule`` (the same function as ``net`` when run in order)."""
    return [_EmbedMean(net.emb), net.fc1, net.norm, nn.GELU(), net.fc2]


class MoENet(TinyNet):
    """:class:`TinyNet` with a 2-expert DeepSpeed MoE layer beside its hidden block (``ep_size``
    2: one expert per rank on 2 ranks, k=1, no token dropped); the router is
    ``moe.deepspeed_moe.gate.wg``."""

    def __init__(self, mult: int = 4) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__(mult=mult)
        width = self.fc2.in_features
        self.moe = MoE(
            width, nn.Linear(width, width), num_experts=2, ep_size=2, k=1, min_capacity=0, drop_tokens=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.norm(self.fc1(self.emb(tokens).mean(dim=1))))
        mixed, _aux, _counts = self.moe(h)
        out: torch.Tensor = self.fc2(h + mixed)
        return out


def moe_parameters(model: nn.Module) -> list[dict[str, Any]]:
    """``model``'s parameters as DeepSpeed's MoE wants them handed to ``initialize``: the expert
    parameters in their own groups."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups: list[dict[str, Any]] = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all"}
    )
    return groups


def make_model(seed: int = 0, **kwargs: Any) -> TinyNet:
    """A :class:`TinyNet` with weights drawn from ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    return TinyNet(**kwargs)


def ds_config(
    stage: int,
    dtype: str = "fp32",
    offload: bool = False,
    gas: int = 2,
    *,
    lr: float = 1e-2,
    fp16: dict[str, Any] | None = None,
    sections: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A DeepSpeed config: AdamW (torch's), micro-batch 4, ``gas`` micro-steps per step.

    ``dtype`` is ``fp32``, ``bf16`` or ``fp16`` (DeepSpeed's own section; ``fp16`` holds its
    settings, :data:`FP16_DYNAMIC` by default); ``offload`` moves the optimizer to the CPU
    (DeepSpeed's offload path, with torch's AdamW rather than the JIT-built cpu_adam);
    ``sections`` are plugin sections added as they are; ``extra`` top-level keys override.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, **(FP16_DYNAMIC if fp16 is None else fp16)}
    cfg.update(sections or {})
    cfg.update(extra)
    return cfg


def batch(
    step: int, micro: int, rank: int, n: int = 4, vocab: int = 32, out: int = 8, stride: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(n, 6)`` and targets ``(n,)``, a function of (step, micro-step, rank) only."""
    g = torch.Generator().manual_seed(stride * step + 10 * micro + rank)
    return torch.randint(0, vocab, (n, 6), generator=g), torch.randint(0, out, (n,), generator=g)


def loss_fn(model: Any, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the model's logits, computed in fp32 whatever the model dtype."""
    return nn.functional.cross_entropy(model(tokens).float(), target)


def train(engine: Any, steps: int, gas: int, first: int = 0, **batch_kwargs: Any) -> list[float]:
    """``steps`` optimizer steps of ``gas`` micro-steps each, from step ``first``; every
    micro-step's loss.  ``batch_kwargs`` go to :func:`batch` (vocab, out, stride)."""
    rank = int(os.environ.get("RANK", "0"))
    losses = []
    for s in range(first, first + steps):
        for m in range(gas):
            tokens, target = batch(s, m, rank, **batch_kwargs)
            loss = loss_fn(engine, tokens, target)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def mean_loss_step(engine: Any, *inputs: Any) -> float:
    """One forward (``engine(*inputs)`` returns the loss), backward and step of ``engine``; the
    loss averaged over the ranks of the default group."""
    import torch.distributed as dist

    loss = engine(*inputs)
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def train_like_accelerate(
    engine: Any, steps: int, gas: int, first: int = 0, **batch_kwargs: Any
) -> list[float]:
    """:func:`train` driven as accelerate (hence Hugging Face Trainer) drives the engine: the
    boundary set explicitly before every backward, ``engine.step()`` only at the boundary."""
    rank = int(os.environ.get("RANK", "0"))
    losses = []
    for s in range(first, first + steps):
        for m in range(gas):
            tokens, target = batch(s, m, rank, **batch_kwargs)
            engine.set_gradient_accumulation_boundary(m == gas - 1)
            loss = loss_fn(engine, tokens, target)
            engine.backward(loss)
            if m == gas - 1:
                engine.step()
            losses.append(float(loss.detach()))
    return losses


def full_params(engine: Any, stage: int) -> list[torch.Tensor]:
    """Every parameter (gathered on ZeRO 3), then the fp32 masters where DeepSpeed keeps them."""
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


def full_grads(engine: Any) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``safe_get_full_grad`` of every parameter, float64 (call before the step)."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().double().clone() for n, p in engine.module.named_parameters()}
