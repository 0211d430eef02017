"""Helpers shared by the accumdtype tests and benchmark (imported by the spawned ranks too).

The oracle for every fidelity check is independent of DeepSpeed and of accumdtype: an unwrapped
copy of the model, in the model dtype, computes each rank's micro-step gradients one by one
(``zero_grad`` between them), and they are summed in float64 and averaged over the ranks.  The
gradients DeepSpeed computes in its backward are bit-for-bit these (same weights, same
single-threaded CPU kernels), so the reference is exact and any difference is accumulation or
reduction error.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from zerohooks import PluginConfig, StepContext, ZeroPlugin
from zerohooks.registry import HookRegistry

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 128.0
"""Static loss scale of the fp16 configs (gradients at the boundary are scaled by it)."""


class TinyNet(nn.Module):
    """Embedding, Linear, LayerNorm, GELU, Linear (about 2.5k parameters)."""

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
    stage: int,
    dtype: str = "bf16",
    offload: bool = False,
    gas: int = 2,
    accum: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A DeepSpeed config; ``accum`` is the accumdtype section (None: no section)."""
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
        cfg["fp16"] = {"enabled": True, "loss_scale": FP16_SCALE}
    if accum is not None:
        cfg["accumdtype"] = accum
    cfg.update(extra)
    return cfg


def batch(step: int, micro: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + 10 * micro + rank)
    return torch.randint(0, 32, (n, 6), generator=g), torch.randint(0, 8, (n,), generator=g)


def loss_fn(model: Any, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).float(), target)


def micro_step(engine: Any, step: int, micro: int) -> float:
    tokens, target = batch(step, micro, int(os.environ.get("RANK", "0")))
    loss = loss_fn(engine, tokens, target)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def train(engine: Any, steps: int, gas: int, first: int = 0) -> list[float]:
    return [micro_step(engine, s, m) for s in range(first, first + steps) for m in range(gas)]


def grad_scale(dtype: str, stage: int) -> float:
    """The loss scale in the gradients DeepSpeed reduces.

    DeepSpeed 0.19.8 scales the loss only for ZeRO optimizers: at ZeRO 0 its fp16 wrappers are
    not ZeROOptimizers, so ``engine.backward`` leaves the loss unscaled, and their step still
    divides by the loss scale (measured: the SGD update is 1/128 of the gradient)."""
    return FP16_SCALE if dtype == "fp16" and stage > 0 else 1.0


def reference_grads(
    dtype: str,
    gas: int,
    world: int,
    micros: int | None = None,
    ranks: list[int] | None = None,
    scale: float = 1.0,
) -> dict[str, torch.Tensor]:
    """float64 mean over ``ranks`` (default all) of the sum of the first ``micros`` micro-step
    gradients of step 0, each of ``loss / gas * scale``, computed in ``dtype``."""
    model = make_model().to(DTYPES[dtype])
    acc = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    ranks = list(range(world)) if ranks is None else ranks
    for r in ranks:
        for m in range(gas if micros is None else micros):
            model.zero_grad()
            tokens, target = batch(0, m, r)
            ((loss_fn(model, tokens, target) / gas) * scale).backward()
            for n, p in model.named_parameters():
                acc[n] += p.grad.double()
    return {n: a / len(ranks) for n, a in acc.items()}


def rel_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """||got - ref|| / ||ref|| over all parameters together (float64)."""
    num = sum(float((got[n].double().reshape(r.shape) - r).norm() ** 2) for n, r in ref.items())
    den = sum(float(r.norm() ** 2) for r in ref.values())
    return (num / den) ** 0.5


class Probe(ZeroPlugin):
    """Records, at each optimizer step, the full gradient DeepSpeed's optimizer is about to use.

    Its ``before_step`` runs after accumdtype's (order 0 > accumdtype.plugin.FIRST) and reads the
    gradients through DeepSpeed's ``safe_get_full_grad`` (gathering partitions on ZeRO 2/3).
    """

    name = "probe"
    distribution = "tests"

    def __init__(self) -> None:
        super().__init__(PluginConfig())
        self.engine: Any = None
        self.grads: list[dict[str, torch.Tensor]] = []
        self.dtypes: set[torch.dtype] = set()

    def attach(self, registry: HookRegistry, ctx: Any) -> None:
        registry.register_before_step(self._before, name=self.name)

    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        self.engine = engine

    def _before(self, ctx: StepContext) -> None:
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for n, p in self.engine.module.named_parameters():
            g = safe_get_full_grad(p)
            self.dtypes.add(g.dtype)
            out[n] = g.detach().double().clone()
        self.grads.append(out)


def full_grads_now(engine: Any) -> dict[str, torch.Tensor]:
    """``safe_get_full_grad`` of every parameter (for engines built without zerohooks)."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().double().clone() for n, p in engine.module.named_parameters()}


def full_params(engine: Any, stage: int) -> list[torch.Tensor]:
    """Every parameter (gathered on ZeRO 3), plus the fp32 masters where DeepSpeed keeps them."""
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


def all_two_rank_scenarios(tmp: str) -> dict[str, Any]:
    """Every 2-rank scenario of the test modules, on one rank (see conftest.two_ranks).

    Lives here, in a uniquely named module, because the spawned ranks import it by name.
    """
    import test_accumdtype_fidelity
    import test_accumdtype_fp16_lossy
    import test_accumdtype_training

    return {
        "fidelity": test_accumdtype_fidelity.measure(),
        "fp16_lossy": test_accumdtype_fp16_lossy.measure(),
        "training": test_accumdtype_training.scenarios(tmp),
    }
