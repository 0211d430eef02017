"""Registry overhead: step time of raw DeepSpeed vs zerohooks without plugins vs zerohooks with a
plugin registered on every transform hook (no owner: DeepSpeed's collectives run), on 2 gloo
ranks, ZeRO 0-3, bf16.  The three engines live side by side and are timed in interleaved rounds,
so machine noise hits them alike.

    python benchmarks/bench_overhead.py [--steps 8] [--rounds 5] [--stages 0 1 2 3]

Writes benchmarks/out/overhead.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _models import make_model

OUT = Path(__file__).resolve().parent / "out"
# "deepspeed (A/A)" is a second, identical raw DeepSpeed engine: its ratio to the first is the noise
# floor of the measurement (engines created later in the same process, cache effects).
VARIANTS = ("deepspeed", "deepspeed (A/A)", "zerohooks", "zerohooks+all-hooks")


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }


def _all_hooks_plugin() -> Any:
    from zerohooks import ZeroPlugin

    class AllHooks(ZeroPlugin):
        """Registers a pass-through callback on every transform hook."""

        name = "allhooks"

        calls = 0

        def attach(self, registry: Any, ctx: Any) -> None:
            def count(ret: Any) -> Any:
                AllHooks.calls += 1
                return ret

            registry.register_micro_step_grad(lambda p, c: count(None), name=self.name)
            registry.register_reduce_dtype(lambda p, d: count(d), name=self.name)
            registry.register_reduce_tensor(lambda p, t: count(t), name=self.name)
            registry.register_before_step(lambda c: count(None), name=self.name)
            registry.register_after_step(lambda c, s: count(None), name=self.name)

    return AllHooks(AllHooks.Config())


def _per_call_cost(engine: Any) -> float:
    """Seconds one adapter dispatch costs: firing the registered micro-step hooks for a parameter."""
    import timeit

    import zerohooks

    att = zerohooks.attachment(engine)
    p = next(engine.module.parameters())
    n = 20000
    return min(timeit.repeat(lambda: att.fire_micro_step_grad(p), number=n, repeat=5)) / n


def _rank_main(stages: list[int], steps: int, rounds: int, d: int, layers: int) -> dict[str, Any]:
    import deepspeed

    import zerohooks

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for stage in stages:
        engines = {}
        for variant in VARIANTS:
            model = make_model(d, layers)
            kw = {"model": model, "model_parameters": model.parameters(), "config": _config(stage)}
            if variant.startswith("deepspeed"):
                engines[variant] = deepspeed.initialize(**kw)[0]
            elif variant == "zerohooks":
                engines[variant] = zerohooks.initialize(**kw)[0]
            else:
                engines[variant] = zerohooks.initialize(**kw, plugins=[_all_hooks_plugin()])[0]
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(8, 16, d, generator=gen).to(torch.bfloat16)
        times: dict[str, list[float]] = {v: [] for v in engines}
        order = list(engines)
        for r in range(rounds + 1):  # round 0 warms up; the order rotates so no variant always goes first
            for v in order[r % len(order) :] + order[: r % len(order)]:
                eng = engines[v]
                torch.distributed.barrier()
                t0 = time.perf_counter()
                for _ in range(steps * 2):  # 2 micro-steps per optimizer step
                    loss = eng(x).float().pow(2).mean()
                    eng.backward(loss)
                    eng.step()
                torch.distributed.barrier()
                if r:
                    times[v].append((time.perf_counter() - t0) / steps)
        results[str(stage)] = {v: statistics.median(t) for v, t in times.items()}
        hooked = engines["zerohooks+all-hooks"]
        plugin_cls = type(zerohooks.attachment(hooked).plugins[0])
        before = plugin_cls.calls
        for _ in range(2):
            loss = hooked(x).float().pow(2).mean()
            hooked.backward(loss)
            hooked.step()
        results[str(stage)]["hook_calls_per_step"] = plugin_cls.calls - before
        results[str(stage)]["per_call_s"] = _per_call_cost(hooked)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    from zerohooks.testing import run_distributed

    n_params = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
    print(f"model: {n_params / 1e6:.2f} M params; 2 gloo ranks; bf16; GAS 2", flush=True)
    res = run_distributed(
        _rank_main, 2, args=(args.stages, args.steps, args.rounds, args.width, args.layers), timeout=3600
    )[0]
    OUT.mkdir(exist_ok=True)
    payload = {"params": n_params, "args": vars(args), "step_time_s": res, "machine": os.uname().nodename}
    (OUT / "overhead.json").write_text(json.dumps(payload, indent=2))
    print(
        "\n| ZeRO stage | DeepSpeed step (ms) | A/A control | zerohooks, no plugin | zerohooks + every hook "
        "| hook calls/step | cost/call (us) | dispatch share of step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for stage, t in res.items():
        base = t["deepspeed"]
        cells = " | ".join(f"{t[v] * 1e3:.1f} ms ({t[v] / base:.3f}x)" for v in VARIANTS[1:])
        share = t["hook_calls_per_step"] * t["per_call_s"] / base
        print(
            f"| {stage} | {base * 1e3:.1f} | {cells} | {t['hook_calls_per_step']} "
            f"| {t['per_call_s'] * 1e6:.2f} | {share:.4%} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
