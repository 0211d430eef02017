"""mixedlayers benchmark: an fp16 model that overflows and the fix; step-time overhead.

    python benchmarks/bench_mixedlayers.py                       # both parts, CPU, 2 gloo ranks
    python benchmarks/bench_mixedlayers.py --only overflow --steps 80
    python benchmarks/bench_mixedlayers.py --only overhead --device cuda --ranks 1   # on a GPU

1. **overflow**: a sequence classifier fed raw sensor readings (values in the hundreds, as
   logged in physical units): an input projection, a running sum over the sequence (a
   state-space-style scan) and a LayerNorm, then an fp16 MLP and head.  The running sum reaches
   ~1e5, past fp16's largest value (65504), so the uniform fp16 model computes inf, the
   LayerNorm turns it into NaN, and DeepSpeed's dynamic loss scaling skips every step.  With
   mixedlayers keeping that encoder block in fp32 (``"fp32_modules": ["encoder"]``) the
   LayerNorm's output, O(1), goes back to fp16 and training follows the all-fp32 run.  Three
   runs, same data and seed, 2 ranks, ZeRO 2 (``--stage``): fp32, fp16, fp16 + mixedlayers.
   Loss curves in the JSON and a PNG.
2. **overhead**: the demo GPT (examples/gpt.py), uniform 16-bit against mixedlayers with every
   LayerNorm and the (tied) head in fp32, two engines side by side in one process, interleaved
   rounds, median step time; an A/A control (a second uniform engine) shows the noise.  On this
   CPU bf16 matrix products are emulated (fp32 ones are native), so the CPU ratio says little;
   ``--device cuda`` measures it on a GPU (bf16, NCCL).

Results: benchmarks/out/bench_mixedlayers.json, bench_mixedlayers_overflow.png, and a markdown
summary printed and written to benchmarks/out/bench_mixedlayers.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
sys.path.insert(0, str(ROOT / "examples"))  # gpt.py (imported, not edited)


# ------------------------------------------------------------------------------- overflow model
def _overflow_model(seed: int) -> Any:
    import torch
    from torch import nn

    class Encoder(nn.Module):
        """Input projection, running sum over time, LayerNorm (the block kept in fp32)."""

        def __init__(self, d_in: int, width: int) -> None:
            super().__init__()
            self.proj = nn.Linear(d_in, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(torch.cumsum(self.proj(x), dim=1))

    class Classifier(nn.Module):
        def __init__(self, d_in: int = 8, width: int = 64, classes: int = 8) -> None:
            super().__init__()
            self.encoder = Encoder(d_in, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            self.head = nn.Linear(width, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.encoder(x)
            h = h + self.mlp(h)
            return self.head(h.mean(dim=1))

    torch.manual_seed(seed)
    return Classifier()


def _overflow_batch(step: int, rank: int, n: int = 8, t: int = 512, d_in: int = 8) -> Any:
    """Readings around 300 units; one channel drifts up to 900 over the sequence; the label is
    that channel."""
    import torch

    g = torch.Generator().manual_seed(10_000 * step + rank)
    label = torch.randint(0, d_in, (n,), generator=g)
    base = 300.0 + 30.0 * torch.randn(n, 1, d_in, generator=g)
    noise = 20.0 * torch.randn(n, t, d_in, generator=g)
    drift = torch.zeros(n, t, d_in)
    drift[torch.arange(n), :, label] = torch.linspace(0.0, 600.0, t)
    return base + noise + drift, label


def _overflow_run(variant: str, stage: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import zerohooks
    from zerohooks.testing.toy import ds_config

    rank = dist.get_rank()
    model = _overflow_model(0)
    cfg = ds_config(stage, gas=1, lr=3e-3, train_micro_batch_size_per_gpu=8)
    if variant != "fp32":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 100}
    if variant == "fp16+mixedlayers":
        cfg["mixedlayers"] = {"fp32_modules": ["encoder"]}
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dtype = torch.float16 if variant != "fp32" else torch.float32
    losses: list[float] = []
    scales: list[float] = []
    error = None
    for step in range(steps):
        x, y = _overflow_batch(step, rank)
        try:
            loss = torch.nn.functional.cross_entropy(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
        except Exception as e:  # DeepSpeed gives up once the loss scale cannot go lower
            error = f"step {step}: {type(e).__name__}: {e}"
            break
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
        scales.append(
            float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer, "loss_scale", 1.0)))
        )
    return {
        "variant": variant,
        "losses": losses,
        "loss_scale": scales,
        "skipped_steps": int(engine.skipped_steps),
        "steps_run": len(losses),
        "error": error,
    }


def _overflow_all(stage: int, steps: int) -> list[dict[str, Any]]:
    return [_overflow_run(v, stage, steps) for v in ("fp32", "fp16", "fp16+mixedlayers")]


# ------------------------------------------------------------------------------- overhead
def _overhead(steps: int, rounds: int, dtype_name: str, micro_batch: int, size: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from gpt import GPT, GPTConfig

    import zerohooks
    from zerohooks.testing.toy import ds_config

    cuda = torch.cuda.is_available() and os.environ.get("BENCH_DEVICE") == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    gcfg = (
        GPTConfig()
        if size == "demo"
        else GPTConfig(vocab_size=32000, seq_len=1024, n_layer=12, n_head=12, d_model=768)
    )
    section = {"fp32_modules": ["head"], "fp32_module_types": ["torch.nn.LayerNorm"]}
    names = ("uniform", "uniform (A/A)", "mixedlayers")
    engines = {}
    for name in names:
        torch.manual_seed(1234)
        model = GPT(gcfg)
        cfg = ds_config(
            2, gas=1, lr=1e-4, train_micro_batch_size_per_gpu=micro_batch, **{dtype_name: {"enabled": True}}
        )
        if name == "mixedlayers":
            cfg["mixedlayers"] = section
        engines[name], *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, gcfg.vocab_size, (micro_batch, gcfg.seq_len), generator=g).to(device)
    times: dict[str, list[float]] = {n: [] for n in names}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for r in range(rounds + 1):
        order = names[r % 3 :] + names[: r % 3]
        for name in order:
            engine = engines[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = engine(x, x)
                engine.backward(loss)
                engine.step()
            sync()
            if r > 0:  # round 0 warms up
                times[name].append((time.perf_counter() - t0) / steps)
    params = sum(p.numel() for p in engines["uniform"].module.parameters())
    kept = sum(p.numel() for p in engines["mixedlayers"].module.parameters() if p.dtype == torch.float32)
    return {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "dtype": dtype_name,
        "model": size,
        "params": params,
        "kept_fp32_params": kept,
        "micro_batch": micro_batch,
        "seq_len": gcfg.seq_len,
        "median_step_s": {n: statistics.median(v) for n, v in times.items()},
        "all_step_s": times,
    }


# ------------------------------------------------------------------------------- driver
def _ranks(fn: Any, world: int, args: tuple[Any, ...], cuda: bool) -> list[Any]:
    """``fn(*args)`` on ``world`` gloo ranks (CPU), or in this process on one GPU (NCCL)."""
    if not cuda:
        from zerohooks.testing import run_distributed

        return run_distributed(fn, world, args=args, timeout=3000, fp16_on_cpu=True)
    if world != 1:
        raise SystemExit(
            "--device cuda runs one rank in this process: use --ranks 1 (or the deepspeed launcher)"
        )
    os.environ.update(BENCH_DEVICE="cuda", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    return [fn(*args)]


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ax.plot(
            range(len(run["losses"])),
            run["losses"],
            label=f"{run['variant']} (skipped {run['skipped_steps']})",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (mean over ranks)")
    ax.set_title("fp16 overflow through a running sum + LayerNorm")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="overflow,overhead")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps of the overflow runs")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="overhead part only")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="overhead part")
    ap.add_argument("--size", choices=("demo", "gpt2"), default="demo", help="overhead model")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-steps", type=int, default=3)
    ap.add_argument("--tag", default="", help="suffix of the output files")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    result: dict[str, Any] = {"command": " ".join(sys.argv), "host": platform.node()}
    md: list[str] = []
    if "overflow" in only:
        runs = _ranks(_overflow_all, args.ranks, (args.stage, args.steps), False)[0]
        result["overflow"] = {"stage": args.stage, "runs": runs}
        png = OUT / f"bench_mixedlayers_overflow{args.tag}.png"
        _plot(runs, png)
        md += [
            f"Overflow case, ZeRO {args.stage}, {args.ranks} ranks, {args.steps} steps (plot: {png.name})",
            "",
            "| run | steps run | skipped steps | first loss | final loss (mean of last 10) | stopped by |",
            "|---|---|---|---|---|---|",
        ]
        for r in runs:
            last = r["losses"][-10:]
            final = sum(last) / len(last) if last else float("nan")
            first = r["losses"][0] if r["losses"] else float("nan")
            md.append(
                f"| {r['variant']} | {r['steps_run']} | {r['skipped_steps']} | {first:.4f} | {final:.4f} | "
                f"{r['error'] or '-'} |"
            )
    if "overhead" in only:
        cuda = args.device == "cuda"
        ov = _ranks(
            _overhead,
            args.ranks,
            (args.round_steps, args.rounds, args.dtype, args.micro_batch, args.size),
            cuda,
        )[0]
        result["overhead"] = ov
        base = ov["median_step_s"]["uniform"]
        md += [
            "",
            f"Step time, ZeRO 2, {args.ranks} rank(s), {ov['device']}, {ov['dtype']}, model {ov['model']} "
            f"({ov['params'] / 1e6:.2f} M params, {ov['kept_fp32_params'] / 1e6:.3f} M kept fp32), "
            f"micro-batch {ov['micro_batch']} x {ov['seq_len']} tokens, median of {args.rounds} rounds",
            "",
            "| engine | step (ms) | ratio to uniform |",
            "|---|---|---|",
        ]
        for name, t in ov["median_step_s"].items():
            md.append(f"| {name} | {t * 1e3:.1f} | {t / base:.3f}x |")
    from _report import write_report  # this folder (run as a script)

    write_report(OUT, f"bench_mixedlayers{args.tag}", result, "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
