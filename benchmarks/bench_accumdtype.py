"""accumdtype: step time against DeepSpeed's built-in fp32 accumulation, accumulation-buffer
memory per parameter, and gradient fidelity against a float64 oracle; 2 gloo ranks, bf16 model.

    python benchmarks/bench_accumdtype.py [--steps 2] [--rounds 5] [--stages 0 1 2 3] [--quick] [--no-fidelity]

* Step time: DeepSpeed with ``data_types.grad_accum_dtype: fp32`` and
  ``communication_data_type: fp32`` (its accurate configuration), a second identical DeepSpeed
  engine (A/A: the noise floor), and accumdtype ``{"dtype": "fp32"}``, side by side in one
  process and timed in interleaved rounds (the order rotates), ZeRO 0-3 and CPU offload.  ZeRO 0
  has no built-in fp32 accumulation (DeepSpeed raises NotImplementedError): its baseline is
  DeepSpeed's default (bf16 accumulation and reduction), so that ratio is the cost of fp32.
* Memory: bytes per model parameter, per rank, of the tensors that hold the accumulated
  gradient, read mid-window (accumdtype: ``accumdtype.accumulation_bytes``; DeepSpeed: its own
  buffers: BF16_Optimizer's fp32 gradients, ZeRO 2's fp32 partition, ZeRO 3's partitions).
* Fidelity: relative L2 error of the gradient the optimizer receives after 16 and 64
  micro-steps against float64 sums of the same bf16 micro-step gradients (the oracle of
  packages/accumdtype/tests/_accum_common.py, imported from there).

Writes benchmarks/out/accumdtype.json and prints markdown tables.
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

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "out"
sys.path.insert(0, str(ROOT / "packages" / "accumdtype" / "tests"))  # the fidelity oracle

TIMING_CASES = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
VARIANTS = ("deepspeed", "deepspeed (A/A)", "accumdtype")
FIDELITY = {
    "accumdtype fp32": {"accum": {"dtype": "fp32"}},
    "DeepSpeed default (bf16 accumulation)": {},
    "DeepSpeed grad_accum_dtype=fp32": {"data_types": {"grad_accum_dtype": "fp32"}},
    "DeepSpeed grad_accum_dtype=fp32 + communication_data_type=fp32": {
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
    },
}


def _config(stage: int, offload: bool, gas: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def _builtin_config(stage: int, offload: bool, gas: int) -> dict[str, Any]:
    cfg = _config(stage, offload, gas)
    if stage > 0:
        cfg.update(data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32")
    return cfg


def _builtin_accum_bytes(engine: Any, stage: int) -> int:
    """Bytes of DeepSpeed's own accumulation tensors on this rank (its fp32 configuration)."""
    opt = engine.optimizer
    if stage == 0:  # DeepSpeed's default: param.grad in the model dtype
        return sum(
            p.grad.numel() * p.grad.element_size() for p in engine.module.parameters() if p.grad is not None
        )
    if type(opt).__name__ == "BF16_Optimizer":
        return sum(t.numel() * t.element_size() for t in opt.fp32_groups_gradients_flat)
    if stage == 3:
        buf = opt.grad_partitions_flat_buffer
        return int(buf.numel() * buf.element_size())
    total = 0
    if stage == 1:  # ZeRO 1 with offload: DeepSpeed's per-parameter fp32 grad_accum
        total += sum(
            p.grad_accum.numel() * p.grad_accum.element_size()
            for p in engine.module.parameters()
            if getattr(p, "grad_accum", None) is not None
        )
    for group in opt.averaged_gradients.values():  # ZeRO 2: the fp32 partition
        flat = getattr(group, "flat_partition", None)
        if flat is not None:
            total += flat.numel() * flat.element_size()
    return total


def _timing(
    cases: list[tuple[int, bool]], steps: int, rounds: int, d: int, layers: int, gas: int
) -> dict[str, Any]:
    import deepspeed

    import accumdtype
    import zerohooks

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    for stage, offload in cases:
        engines = {}
        for variant in VARIANTS:
            model = make_model(d, layers)
            kw = {"model": model, "model_parameters": model.parameters()}
            if variant.startswith("deepspeed"):
                engines[variant] = deepspeed.initialize(**kw, config=_builtin_config(stage, offload, gas))[0]
            else:
                cfg = _config(stage, offload, gas) | {"accumdtype": {"dtype": "fp32"}}
                engines[variant] = zerohooks.initialize(**kw, config=cfg)[0]
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(8, 16, d, generator=gen).to(torch.bfloat16)
        numel = sum(
            p.ds_numel if stage == 3 else p.numel() for p in engines["accumdtype"].module.parameters()
        )
        memory: dict[str, float] = {}
        times: dict[str, list[float]] = {v: [] for v in engines}
        order = list(engines)
        for r in range(rounds + 1):  # round 0 warms up (and measures memory mid-window)
            for v in order[r % len(order) :] + order[: r % len(order)]:
                eng = engines[v]
                torch.distributed.barrier()
                t0 = time.perf_counter()
                for i in range(steps * gas):
                    loss = eng(x).float().pow(2).mean()
                    eng.backward(loss)
                    eng.step()
                    if r == 0 and i == gas - 2 and v != "deepspeed (A/A)":
                        nbytes = (
                            accumdtype.accumulation_bytes(eng)
                            if v == "accumdtype"
                            else _builtin_accum_bytes(eng, stage)
                        )
                        memory[v] = nbytes / numel
                torch.distributed.barrier()
                if r:
                    times[v].append((time.perf_counter() - t0) / steps)
        out[f"{stage}-{offload}"] = {
            "stage": stage,
            "offload": offload,
            "step_s": {v: statistics.median(t) for v, t in times.items()},
            "bytes_per_param": memory,
            "deepspeed_optimizer": type(engines["deepspeed"].optimizer).__name__,
            "accumdtype_optimizer": type(engines["accumdtype"].optimizer).__name__,
        }
    return out


def _fidelity(micro_steps: list[int]) -> dict[str, Any]:
    import deepspeed
    from _accum_common import (
        Probe,
        ds_config,
        full_grads_now,
        make_model,
        micro_step,
        reference_grads,
        rel_error,
    )

    import zerohooks

    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {}
    for stage in range(4):
        for gas in micro_steps:
            ref = reference_grads("bf16", gas, world)
            for label, spec in FIDELITY.items():
                key = f"{label}|{stage}|{gas}"
                model = make_model()
                extra = {k: v for k, v in spec.items() if k != "accum"}
                cfg = ds_config(stage, "bf16", False, gas, accum=spec.get("accum"), **extra)
                if "accum" in spec:
                    probe = Probe()
                    engine = zerohooks.initialize(
                        model=model, model_parameters=model.parameters(), config=cfg, plugins=[probe]
                    )[0]
                    for m in range(gas):
                        micro_step(engine, 0, m)
                    out[key] = rel_error(probe.grads[0], ref)
                    continue
                try:
                    engine = deepspeed.initialize(
                        model=model, model_parameters=model.parameters(), config=cfg
                    )[0]
                except NotImplementedError:
                    out[key] = None  # ZeRO 0: "unsupported mix"
                    continue
                seen: dict[str, Any] = {}
                take = engine._take_model_step

                def read_then_step(
                    *a: Any, _e: Any = engine, _t: Any = take, _s: Any = seen, **k: Any
                ) -> Any:
                    _s.update(full_grads_now(_e))
                    return _t(*a, **k)

                engine._take_model_step = read_then_step
                for m in range(gas):
                    micro_step(engine, 0, m)
                out[key] = rel_error(seen, ref)
    return out


def _rank_main(args: dict[str, Any]) -> dict[str, Any]:
    cases = [c for c in TIMING_CASES if c[0] in args["stages"] and not (args["quick"] and c[1])]
    return {
        "timing": _timing(cases, args["steps"], args["rounds"], args["width"], args["layers"], args["gas"]),
        "fidelity": {} if args["no_fidelity"] else _fidelity([16, 64]),
    }


def _fmt(x: float | None) -> str:
    return "raises" if x is None else f"{x:.2g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--gas", type=int, default=4, help="micro-steps per optimizer step in the timing")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], help="ZeRO stages to time")
    ap.add_argument("--quick", action="store_true", help="time without CPU offload only")
    ap.add_argument("--no-fidelity", action="store_true", help="skip the fidelity table")
    args = ap.parse_args()
    from zerohooks.testing import run_distributed

    n_params = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
    print(f"timing model: {n_params / 1e6:.2f} M params, bf16, 2 gloo ranks, GAS {args.gas}", flush=True)
    t0 = time.time()
    res = run_distributed(_rank_main, 2, args=(vars(args),), timeout=3600)[0]
    OUT.mkdir(exist_ok=True)
    payload = {
        "command": "python benchmarks/bench_accumdtype.py " + " ".join(sys.argv[1:]),
        "params": n_params,
        "args": vars(args),
        "torch": torch.__version__,
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "wall_s": round(time.time() - t0, 1),
        **res,
    }
    (OUT / "accumdtype.json").write_text(json.dumps(payload, indent=2))

    print("\n### Step time and accumulation memory (bf16 model, fp32 accumulation and reduction)\n")
    print(
        "| ZeRO | offload | DeepSpeed step (ms) | A/A ratio | accumdtype step (ms) | ratio | "
        "accum. bytes/param/rank: DeepSpeed | accumdtype |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in res["timing"].values():
        t, m = r["step_s"], r["bytes_per_param"]
        base = t["deepspeed"]
        note = " (DeepSpeed default: bf16)" if r["stage"] == 0 else ""
        print(
            f"| {r['stage']}{note} | {'cpu' if r['offload'] else '-'} | {base * 1e3:.1f} | "
            f"{t['deepspeed (A/A)'] / base:.3f} | {t['accumdtype'] * 1e3:.1f} | {t['accumdtype'] / base:.3f} | "
            f"{m.get('deepspeed', float('nan')):.2f} | {m.get('accumdtype', float('nan')):.2f} |"
        )
    if not res["fidelity"]:
        return
    print("\n### Relative error of the reduced gradient vs float64 (TinyNet, bf16, 2 ranks)\n")
    print("| configuration | micro-steps | ZeRO 0 | ZeRO 1 | ZeRO 2 | ZeRO 3 |")
    print("|---|---|---|---|---|---|")
    for label in FIDELITY:
        for gas in (16, 64):
            row = [_fmt(res["fidelity"][f"{label}|{s}|{gas}"]) for s in range(4)]
            print(f"| {label} | {gas} | " + " | ".join(row) + " |")
    print(f"\n(wall time {payload['wall_s']} s; JSON in {OUT / 'accumdtype.json'})")


if __name__ == "__main__":
    main()
