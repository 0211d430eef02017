"""GPU cost on CPU: aten ops (about one kernel launch each) and host syncs per optimizer step,
each plugin against its DeepSpeed equivalent in the same run.

    python benchmarks/bench_gpu_cost.py                 # ZeRO 2 and 3, 2 gloo ranks
    python benchmarks/bench_gpu_cost.py --stages 3 --json out.json

The model: 6 x (Linear(256, 256), LayerNorm(256)), micro-batch 4, 2 micro-steps per optimizer
step, AdamW (torch's), gradient clipping at 1.0, bf16 unless the pair says otherwise.  One
optimizer step is run first (lazy set-up), the next is counted with
:class:`zerohooks.testing.cost.CostCounter`: ``fwd_bwd`` = both micro-steps' forward and
backward (ZeRO 2/3 reduce gradients from backward hooks), ``step`` = both ``engine.step()`` calls.
Counts are rank 0's.  The budgets (:func:`check_budgets`, also tests/integration/test_gpu_cost.py):

- no host sync in forward/backward (where the equivalent has none);
- at most one sync per optimizer step more than the equivalent;
- at most 1.15x the equivalent's ops, loco excepted: loco calls its own kernels (``quantize_ef``,
  ``dequant_reduce``, ``dequant_reduce_requant``: one launch each) once per bucket on ZeRO 1/2
  and once per parameter on ZeRO 3 (each parameter has its own error-feedback buffer), and
  each call needs a few views of the send/receive rows (no kernel).  Its budget: its kernel
  launches (``launches``: ops that launch a GPU kernel, views and allocations left out) less
  its own kernel calls within 1.15x of the equivalent's launches, i.e. nothing besides the
  kernels themselves.
- mixedlayers, besides the ops budget: its kernel launches less the casts at the boundaries of
  its fp32 modules (``_to_copy`` beyond the equivalent's) within 1.15x of the equivalent's
  launches (the casts are the feature; the whole-bf16 model is no functional equivalent).

A self-check (``wasteful``: a plugin syncing in backward and twice before the step) must break
the budgets, so they are known to be able to fail.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SYNC_BUDGET = 1
OPS_BUDGET = 1.15
PAIRS: dict[str, str] = {
    "accumdtype": "ds-accum-fp32",
    "autocastzero": "ds-autocast",
    "mixedlayers": "ds-bf16",
    "loco": "ds-bf16",
}
"""plugin run -> its DeepSpeed equivalent."""
LOCO_KERNELS = ("quantize_ef", "dequant_reduce", "dequant_reduce_requant")
"""loco's own ops: one kernel launch per call."""


def _wasteful_plugin() -> Any:
    """A plugin that makes the host wait: once per micro-step in backward, twice before the step."""
    import torch

    from zerohooks import HookRegistry, SetupContext, StepContext, ZeroPlugin

    class Wasteful(ZeroPlugin):
        name = "wasteful"
        distribution = "benchmarks"

        def __init__(self) -> None:
            super().__init__(self.Config())
            self.seen: set[int] = set()

        def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
            registry.register_micro_step_grad(self._micro, name=self.name)
            registry.register_before_step(self._before, name=self.name)

        def _micro(self, param: torch.nn.Parameter, ctx: StepContext) -> None:
            if ctx.micro_step not in self.seen:  # once per micro-step
                self.seen.add(ctx.micro_step)
                torch.ones(()).item()

        def _before(self, ctx: StepContext) -> None:
            torch.ones(()).item()
            torch.ones(()).item()

    return Wasteful()


def configs(stage: int) -> dict[str, dict[str, Any]]:
    """Every run's DeepSpeed config (plugin sections included)."""
    base: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    no16 = {**base, "bf16": {"enabled": False}}
    return {
        "ds-bf16": base,
        "ds-accum-fp32": {
            **base,
            "data_types": {"grad_accum_dtype": "fp32"},
            "communication_data_type": "fp32",
        },
        "accumdtype": {**base, "accumdtype": {"dtype": "fp32"}},
        "ds-autocast": {**no16, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
        "autocastzero": {**no16, "autocastzero": {"dtype": "bfloat16"}},
        "mixedlayers": {**base, "mixedlayers": {"fp32_module_types": ["torch.nn.LayerNorm"]}},
        "loco": {**base, "loco": {}},
    }


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.LayerNorm(256))])


def _loss(engine: Any, x: Any) -> Any:
    return engine(x).float().pow(2).mean()


def rank_main(stages: list[int], names: list[str] | None = None) -> dict[int, dict[str, Any]]:
    """On each rank: every run's cost of one optimizer step (after one warm-up step), per stage."""
    return {stage: _rank_stage(stage, names) for stage in stages}


def _rank_stage(stage: int, names: list[str] | None) -> dict[str, Any]:
    import torch

    import zerohooks
    from zerohooks.testing.cost import step_cost

    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1)
    runs = {**configs(stage), "wasteful": configs(stage)["ds-bf16"]}
    for name, cfg in runs.items():
        if names is not None and name not in names:
            continue
        plugins = [_wasteful_plugin()] if name == "wasteful" else []
        engine, _, _, _ = zerohooks.initialize(
            model=_model(), model_parameters=None, config=cfg, plugins=plugins
        )
        gas = cfg["gradient_accumulation_steps"]
        dtype = torch.bfloat16 if cfg["bf16"]["enabled"] else torch.float32

        batches = [[(torch.randn(4, 256, generator=gen).to(dtype),) for _ in range(gas)] for _ in range(2)]
        step_cost(engine, batches[0], _loss)  # warm-up: lazy buffers, first-step paths
        cost = step_cost(engine, batches[1], _loss)
        out[name] = {phase: c.as_dict() for phase, c in cost.items()}
        out[name]["by_op"] = {phase: dict(c.by_op) for phase, c in cost.items()}
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):
            destroy()
        del engine
    return out


def measure(
    stages: list[int], names: list[str] | None = None, world_size: int = 2
) -> dict[int, dict[str, Any]]:
    """Rank 0's counts of every run, per ZeRO stage, on ``world_size`` gloo ranks (one launch)."""
    from zerohooks.testing import run_distributed

    return dict(run_distributed(rank_main, world_size, args=(stages, names), timeout=1200)[0])


def own_kernel_calls(run: dict[str, Any]) -> int:
    """loco's kernel calls in a run (every phase)."""
    return sum(run["by_op"][phase].get(k, 0) for phase in ("fwd_bwd", "step") for k in LOCO_KERNELS)


def check_pair(plugin: str, p: dict[str, Any], equivalent: str, e: dict[str, Any]) -> list[str]:
    """Every budget ``plugin`` (counts ``p``) breaks against ``equivalent`` (``e``), in words."""
    broken = []
    if p["fwd_bwd"]["syncs"] > e["fwd_bwd"]["syncs"]:
        broken.append(
            f"{plugin}: {p['fwd_bwd']['syncs']} host syncs in forward/backward "
            f"({equivalent}: {e['fwd_bwd']['syncs']}): {p['fwd_bwd']['sync_ops']}"
        )
    ps, es = total(p, "syncs"), total(e, "syncs")
    if ps > es + SYNC_BUDGET:
        broken.append(
            f"{plugin}: {ps} host syncs per step, {equivalent} {es} (budget +{SYNC_BUDGET}): "
            f"{p['step']['sync_ops']} vs {e['step']['sync_ops']}"
        )
    if plugin == "loco":
        pl, el, own = total(p, "launches"), total(e, "launches"), own_kernel_calls(p)
        if pl - own > OPS_BUDGET * el:
            broken.append(
                f"{plugin}: {pl} kernel launches per step of which {own} its own kernels, {equivalent} "
                f"{el} ({(pl - own) / el:.3f}x besides its kernels, budget {OPS_BUDGET}x)"
            )
    else:
        po, eo = total(p, "ops"), total(e, "ops")
        if po > OPS_BUDGET * eo:
            broken.append(
                f"{plugin}: {po} ops per step, {equivalent} {eo} ({po / eo:.3f}x, budget {OPS_BUDGET}x)"
            )
    if plugin == "mixedlayers":
        pl, el, casts = total(p, "launches"), total(e, "launches"), extra_casts(p, e)
        if pl - casts > OPS_BUDGET * el:
            broken.append(
                f"{plugin}: {pl} kernel launches per step of which {casts} boundary casts, {equivalent} "
                f"{el} ({(pl - casts) / el:.3f}x besides the casts, budget {OPS_BUDGET}x)"
            )
    return broken


def extra_casts(p: dict[str, Any], e: dict[str, Any]) -> int:
    """The dtype casts (``_to_copy``) a run makes beyond its equivalent's (mixedlayers' boundaries)."""
    n = sum(
        p["by_op"][ph].get("_to_copy", 0) - e["by_op"][ph].get("_to_copy", 0) for ph in ("fwd_bwd", "step")
    )
    return max(0, n)


def check_budgets(counts: dict[str, Any]) -> list[str]:
    """Every budget a plugin breaks, in words (empty: all kept)."""
    return [
        b
        for plugin, eq in PAIRS.items()
        if plugin in counts and eq in counts
        for b in check_pair(plugin, counts[plugin], eq, counts[eq])
    ]


def total(run: dict[str, Any], key: str) -> int:
    return int(run["fwd_bwd"][key] + run["step"][key])


def table(results: dict[int, dict[str, Any]]) -> str:
    lines = [
        "| ZeRO | plugin (equivalent) | ops fwd+bwd | ops step | ops vs equivalent | kernel launches "
        "| launches vs equivalent | syncs fwd+bwd | syncs step | budgets |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stage, counts in results.items():
        for plugin, eq in [*PAIRS.items(), ("wasteful", "ds-bf16")]:
            if plugin not in counts or eq not in counts:
                continue
            p, e = counts[plugin], counts[eq]
            own = f", {own_kernel_calls(p)} its own kernels" if plugin == "loco" else ""
            own = f", {extra_casts(p, e)} boundary casts" if plugin == "mixedlayers" else own
            broken = check_pair(plugin, p, eq, e)
            lines.append(
                f"| {stage} | {plugin} ({eq}) | {p['fwd_bwd']['ops']} ({e['fwd_bwd']['ops']}) "
                f"| {p['step']['ops']} ({e['step']['ops']}) | {total(p, 'ops') / total(e, 'ops'):.3f}x "
                f"| {total(p, 'launches')} ({total(e, 'launches')}){own} "
                f"| {total(p, 'launches') / total(e, 'launches'):.3f}x "
                f"| {p['fwd_bwd']['syncs']} ({e['fwd_bwd']['syncs']}) | {p['step']['syncs']} ({e['step']['syncs']}) "
                f"| {'kept' if not broken else 'BROKEN: ' + '; '.join(b.split(': ', 1)[1].split(' (')[0] for b in broken)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="2,3")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "out" / "gpu_cost.json"))
    args = p.parse_args(argv)
    results = measure([int(s) for s in args.stages.split(",")])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    for stage, counts in results.items():
        for b in check_budgets(counts):
            print(f"ZeRO {stage}: budget broken: {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
