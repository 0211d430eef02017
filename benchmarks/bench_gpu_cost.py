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
- at most 1.15x the equivalent's ops, loco excepted: its budget is what its kernels need (see
  :data:`LOCO_OPS_PER_BUCKET`), stated in benchmarks/RESULTS.md.
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


def rank_main(stage: int, names: list[str] | None = None) -> dict[str, Any]:
    """On each rank: every run's cost of one optimizer step (after one warm-up step)."""
    import torch

    import zerohooks
    from zerohooks.testing.cost import step_cost

    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1)
    for name, cfg in configs(stage).items():
        if names is not None and name not in names:
            continue
        engine, _, _, _ = zerohooks.initialize(model=_model(), model_parameters=None, config=cfg)
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


def measure(stage: int, names: list[str] | None = None, world_size: int = 2) -> dict[str, Any]:
    """Rank 0's counts of every run on ``world_size`` gloo ranks."""
    from zerohooks.testing import run_distributed

    return dict(run_distributed(rank_main, world_size, args=(stage, names), timeout=900)[0])


def check_budgets(counts: dict[str, Any], loco_ops_budget: float | None = None) -> list[str]:
    """Every budget a plugin breaks, in words (empty: all kept).  ``loco_ops_budget``: loco's
    ops ratio allowed instead of :data:`OPS_BUDGET`."""
    broken = []
    for plugin, equivalent in PAIRS.items():
        if plugin not in counts or equivalent not in counts:
            continue
        p, e = counts[plugin], counts[equivalent]
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
        budget = loco_ops_budget if plugin == "loco" and loco_ops_budget else OPS_BUDGET
        po, eo = total(p, "ops"), total(e, "ops")
        if po > budget * eo:
            broken.append(
                f"{plugin}: {po} ops per step, {equivalent} {eo} ({po / eo:.3f}x, budget {budget}x)"
            )
    return broken


def total(run: dict[str, Any], key: str) -> int:
    return int(run["fwd_bwd"][key] + run["step"][key])


def table(results: dict[int, dict[str, Any]]) -> str:
    lines = [
        "| ZeRO | plugin | equivalent | ops fwd+bwd | ops step | ops/step vs equivalent "
        "| syncs fwd+bwd | syncs step | equivalent's syncs (fwd+bwd, step) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for stage, counts in results.items():
        for plugin, eq in PAIRS.items():
            p, e = counts[plugin], counts[eq]
            lines.append(
                f"| {stage} | {plugin} | {eq} | {p['fwd_bwd']['ops']} ({e['fwd_bwd']['ops']}) "
                f"| {p['step']['ops']} ({e['step']['ops']}) | {total(p, 'ops') / total(e, 'ops'):.3f}x "
                f"| {p['fwd_bwd']['syncs']} | {p['step']['syncs']} | {e['fwd_bwd']['syncs']}, {e['step']['syncs']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="2,3")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "out" / "gpu_cost.json"))
    args = p.parse_args(argv)
    results = {int(s): measure(int(s)) for s in args.stages.split(",")}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    for stage, counts in results.items():
        for b in check_budgets(counts):
            print(f"ZeRO {stage}: budget broken: {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
