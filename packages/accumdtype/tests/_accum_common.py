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

from zerohooks import PluginConfig, StepContext, ZeroPlugin
from zerohooks.registry import HookRegistry
from zerohooks.testing import toy
from zerohooks.testing.toy import DTYPES, full_params, loss_fn, make_model
from zerohooks.testing.toy import full_grads as full_grads_now

__all__ = [
    "DTYPES",
    "FP16_SCALE",
    "Probe",
    "all_two_rank_scenarios",
    "batch",
    "ds_config",
    "full_grads_now",
    "full_params",
    "grad_scale",
    "loss_fn",
    "make_model",
    "micro_step",
    "reference_grads",
    "rel_error",
    "train",
]

FP16_SCALE = 128.0
"""Static loss scale of the fp16 configs (gradients at the boundary are scaled by it)."""


def ds_config(
    stage: int,
    dtype: str = "bf16",
    offload: bool = False,
    gas: int = 2,
    accum: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """zerohooks.testing.toy's config, bf16 by default, fp16 with the static scale
    :data:`FP16_SCALE`; ``accum`` is the accumdtype section (None: no section)."""
    sections = None if accum is None else {"accumdtype": accum}
    return toy.ds_config(
        stage, dtype, offload, gas, fp16={"loss_scale": FP16_SCALE}, sections=sections, **extra
    )


def batch(step: int, micro: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return toy.batch(step, micro, rank, n, stride=100_000)


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
