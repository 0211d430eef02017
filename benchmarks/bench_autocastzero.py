"""autocastzero benchmark: step time vs DeepSpeed ``torch_autocast``, memory vs DeepSpeed bf16 mode.

    python benchmarks/bench_autocastzero.py                 # CPU: 2 gloo ranks (about 10 min on 2 cores)
    python benchmarks/bench_autocastzero.py --steps 30 --repeats 3
    python benchmarks/bench_autocastzero.py --device cuda   # 1 rank per GPU (nccl)

The demo GPT (examples/gpt.py; its loss is computed inside the forward, so under autocast) on the
standard-library corpus, the demo's AdamW, ZeRO 1/2/3, bf16 autocast. Cases, each in a fresh
launch (DeepSpeed's ``torch_autocast`` keeps process-wide state), interleaved and repeated:

* ``ds_autocast``: DeepSpeed's own ``torch_autocast`` (bf16), through ``deepspeed.initialize``;
* ``autocastzero``: this plugin, bf16, with ``lower_precision_safe_names: ["tok_emb"]`` so that
  the tied embedding/head weight is reduced in bf16 as DeepSpeed does (the plugin's default keeps
  a weight shared with an Embedding in fp32);
* ``ds_bf16``: DeepSpeed's bf16 mode (bf16 parameters, fp32 master copy), the memory baseline.

Step time: median over the steps after ``--warmup``, best of ``--repeats`` launches; the ratio
of the two ``ds_autocast`` launches is the A/A control (noise of this machine). Memory: on CUDA
the peak allocated bytes (engine build and training); on CPU the bytes of every live tensor
after training (parameters, gradients, optimizer state, DeepSpeed's flat buffers) and the peak
RSS. Losses per step go to a PNG plot.

JSON in benchmarks/out/bench_autocastzero.json, markdown in benchmarks/out/bench_autocastzero.md,
plot in benchmarks/out/bench_autocastzero.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _models import demo_ds_config

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
sys.path.insert(0, str(ROOT / "examples"))  # gpt.py, data.py (imported, not edited)

CASES = ("ds_autocast", "autocastzero", "ds_bf16")


def _config(case: str, stage: int, micro_batch: int) -> dict[str, Any]:
    cfg = demo_ds_config(stage, micro_batch)
    if case == "ds_autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif case == "autocastzero":
        cfg["autocastzero"] = {"dtype": "bfloat16", "lower_precision_safe_names": ["tok_emb"]}
    else:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _live_tensor_bytes() -> int:
    import gc

    import torch

    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        try:
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu":
                continue
            st = obj.untyped_storage()
        except Exception:
            continue
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _timed_step(engine: Any, x: Any, y: Any, cuda: bool, barrier: bool = False) -> tuple[Any, float]:
    """One optimizer step of ``engine`` on the batch ``(x, y)`` and its wall time in seconds (the
    GPU synchronised before and after; ``barrier``: the ranks start it together)."""
    import torch
    import torch.distributed as dist

    x, y = x.to(engine.device), y.to(engine.device)
    if cuda:
        torch.cuda.synchronize()
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    if cuda:
        torch.cuda.synchronize()
    return loss, time.perf_counter() - t0


def _run_case(
    case: str, stage: int, steps: int, warmup: int, micro_batch: int, model_kw: dict[str, int]
) -> Any:
    """Runs on every rank of one launch."""
    import resource

    import deepspeed
    import torch
    import torch.distributed as dist
    from data import BatchSampler, ByteCorpus
    from gpt import GPT, GPTConfig

    import zerohooks

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(1234)
    model = GPT(GPTConfig(**model_kw))
    init = zerohooks.initialize if case == "autocastzero" else deepspeed.initialize
    engine, *_ = init(
        model=model, model_parameters=model.parameters(), config=_config(case, stage, micro_batch)
    )
    corpus = ByteCorpus.load(train_bytes=2 << 20, val_bytes=1 << 16)
    sampler = BatchSampler(corpus.train, model_kw.get("seq_len", 128), micro_batch, 1234, rank)
    losses, times = [], []
    for _ in range(steps):
        x, y = sampler.next()
        loss, seconds = _timed_step(engine, x, y, cuda)
        times.append(seconds)
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    timed = sorted(times[warmup:])
    att = zerohooks.attachment(engine)
    return {
        "case": case,
        "stage": stage,
        "world": world,
        "losses": losses,
        "step_s": timed[len(timed) // 2],
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "live_tensor_bytes": None if cuda else _live_tensor_bytes(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "bytes": att.counters.last_step() if att is not None else None,
        "n_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
        "params_dtype": str(next(model.parameters()).dtype),
    }


INTERLEAVED = ("autocastzero", "ds_bf16", "ds_autocast", "ds_autocast_2")
"""Build order of the interleaved timing: DeepSpeed's torch_autocast engines last (it sets
process-wide flags when built; engines built before it behave the same afterwards)."""


def _run_interleaved(stage: int, steps: int, warmup: int, micro_batch: int, model_kw: dict[str, int]) -> Any:
    """One launch, four engines, one training step of each in turn: paired step times that see
    the same machine load.  ``ds_autocast_2`` is a second DeepSpeed engine, the A/A control."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from data import BatchSampler, ByteCorpus
    from gpt import GPT, GPTConfig

    import zerohooks

    rank = dist.get_rank()
    cuda = torch.cuda.is_available()
    engines = {}
    for case in INTERLEAVED:
        torch.manual_seed(1234)
        model = GPT(GPTConfig(**model_kw))
        init = zerohooks.initialize if case == "autocastzero" else deepspeed.initialize
        cfg = _config(case.removesuffix("_2"), stage, micro_batch)
        engines[case], *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    corpus = ByteCorpus.load(train_bytes=2 << 20, val_bytes=1 << 16)
    sampler = BatchSampler(corpus.train, model_kw.get("seq_len", 128), micro_batch, 1234, rank)
    times: dict[str, list[float]] = {c: [] for c in INTERLEAVED}
    for i in range(steps):
        x, y = sampler.next()
        order = INTERLEAVED if i % 2 == 0 else tuple(reversed(INTERLEAVED))
        for case in order:
            times[case].append(_timed_step(engines[case], x, y, cuda, barrier=True)[1])
    return {"stage": stage, "times": {c: t[warmup:] for c, t in times.items()}}


def _rank_entry(*args: Any) -> Any:
    return _run_interleaved(*args[1:]) if args[0] == "interleaved" else _run_case(*args)


def launch(world: int, backend: str, *args: Any) -> dict[str, Any]:
    """Rank 0's result of one case on ``world`` ranks (gloo: the cores shared among the ranks)."""
    from zerohooks.testing import run_distributed

    threads = max(1, (os.cpu_count() or 2) // world) if backend == "gloo" else 1
    return run_distributed(_rank_entry, world, args=args, timeout=1800, backend=backend, threads=threads)[0]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    world = 1 if cuda else args.world
    backend = "nccl" if cuda else "gloo"
    model_kw = {
        "n_layer": args.layers,
        "d_model": args.d_model,
        "n_head": args.heads,
        "seq_len": args.seq_len,
    }
    runs: list[dict[str, Any]] = []
    for stage in [] if args.no_separate else args.stages:
        for rep in range(args.repeats):
            order = CASES if rep % 2 == 0 else tuple(reversed(CASES))
            for case in order:
                r = launch(world, backend, case, stage, args.steps, args.warmup, args.micro_batch, model_kw)
                r["repeat"] = rep
                runs.append(r)
                print(f"ZeRO {stage} {case:13s} rep {rep}: {r['step_s'] * 1e3:8.1f} ms/step", flush=True)
    interleaved = []
    if args.interleaved:
        for stage in args.stages:
            r = launch(
                world, backend, "interleaved", stage, args.steps, args.warmup, args.micro_batch, model_kw
            )
            interleaved.append(r)
            med = {c: statistics.median(t) for c, t in r["times"].items()}
            print(f"ZeRO {stage} interleaved: " + ", ".join(f"{c} {v * 1e3:.1f} ms" for c, v in med.items()))
    return {
        "interleaved": interleaved,
        "runs": runs,
        "model": model_kw,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "world": world,
        "device": args.device,
        "machine": _machine(cuda),
    }


def _machine(cuda: bool) -> str:
    if cuda:
        import torch

        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"


def summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    stages = sorted({r["stage"] for r in res["runs"]})
    for stage in stages:
        by = {c: [r for r in res["runs"] if r["stage"] == stage and r["case"] == c] for c in CASES}
        best = {c: min(r["step_s"] for r in v) for c, v in by.items()}
        ds_times = sorted(r["step_s"] for r in by["ds_autocast"])
        mem_key = "peak_cuda_bytes" if res["device"] == "cuda" else "live_tensor_bytes"
        mem = {c: by[c][0][mem_key] for c in CASES}
        rows.append(
            {
                "stage": stage,
                "ds_autocast_ms": best["ds_autocast"] * 1e3,
                "autocastzero_ms": best["autocastzero"] * 1e3,
                "ds_bf16_ms": best["ds_bf16"] * 1e3,
                "time_ratio": best["autocastzero"] / best["ds_autocast"],
                "aa_ratio": ds_times[-1] / ds_times[0] if len(ds_times) > 1 else None,
                "mem_metric": mem_key,
                "mem_autocastzero": mem["autocastzero"],
                "mem_ds_bf16": mem["ds_bf16"],
                "mem_ds_autocast": mem["ds_autocast"],
                "mem_ratio_vs_bf16": mem["autocastzero"] / mem["ds_bf16"],
                "rss_autocastzero": by["autocastzero"][0]["peak_rss_bytes"],
                "rss_ds_bf16": by["ds_bf16"][0]["peak_rss_bytes"],
                "final_loss": {c: sum(by[c][0]["losses"][-5:]) / 5 for c in CASES},
                "bytes_autocastzero": by["autocastzero"][0]["bytes"],
            }
        )
    return rows


def interleaved_summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in res["interleaved"]:
        t = r["times"]
        med = {c: statistics.median(v) for c, v in t.items()}
        paired = [a / b for a, b in zip(t["autocastzero"], t["ds_autocast"], strict=True)]
        paired_aa = [a / b for a, b in zip(t["ds_autocast_2"], t["ds_autocast"], strict=True)]
        rows.append(
            {
                "stage": r["stage"],
                "median_ms": {c: v * 1e3 for c, v in med.items()},
                "ratio": med["autocastzero"] / med["ds_autocast"],
                "aa_ratio": med["ds_autocast_2"] / med["ds_autocast"],
                "paired_ratio": statistics.median(paired),
                "paired_aa_ratio": statistics.median(paired_aa),
                "bf16_mode_ratio": med["ds_bf16"] / med["ds_autocast"],
                "steps": len(paired),
            }
        )
    return rows


def markdown_interleaved(res: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "Interleaved: the four engines in one launch, one step of each in turn (order reversed every "
        "step), medians over the timed steps; 'paired' is the median of the per-step ratios.",
        "",
        "| ZeRO | DS torch_autocast (ms) | DS torch_autocast #2 (A/A) | autocastzero (ms) | ratio | paired ratio "
        "(goal <= 1.05) | paired A/A | DS bf16 mode (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["median_ms"]
        lines.append(
            f"| {r['stage']} | {m['ds_autocast']:.1f} | {m['ds_autocast_2']:.1f} ({r['aa_ratio']:.3f}) "
            f"| {m['autocastzero']:.1f} | {r['ratio']:.3f} | {r['paired_ratio']:.3f} | {r['paired_aa_ratio']:.3f} "
            f"| {m['ds_bf16']:.1f} |"
        )
    return "\n".join(lines)


def markdown(res: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    mib = 1 << 20
    mem_name = "peak CUDA allocated" if res["device"] == "cuda" else "live tensor bytes after training"
    lines = [
        f"Machine: {res['machine']}; {res['world']} rank(s); GPT {res['model']}, micro-batch "
        f"{res['micro_batch']}, {res['steps']} steps ({res['warmup']} warm-up), best of the launches.",
        "",
        f"| ZeRO | DS torch_autocast (ms) | A/A | autocastzero (ms) | ratio (goal <= 1.05) | DS bf16 mode (ms) "
        f"| {mem_name}: autocastzero | DS bf16 mode | ratio | DS torch_autocast | final loss: autocastzero / DS autocast / DS bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        aa = f"{r['aa_ratio']:.3f}" if r["aa_ratio"] is not None else "-"
        fl = r["final_loss"]
        lines.append(
            f"| {r['stage']} | {r['ds_autocast_ms']:.1f} | {aa} | {r['autocastzero_ms']:.1f} | {r['time_ratio']:.3f} "
            f"| {r['ds_bf16_ms']:.1f} | {r['mem_autocastzero'] / mib:.1f} MiB | {r['mem_ds_bf16'] / mib:.1f} MiB "
            f"| {r['mem_ratio_vs_bf16']:.2f} | {r['mem_ds_autocast'] / mib:.1f} MiB "
            f"| {fl['autocastzero']:.4f} / {fl['ds_autocast']:.4f} / {fl['ds_bf16']:.4f} |"
        )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["stage"] for r in res["runs"]})
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 4), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        for case in CASES:
            r = next(r for r in res["runs"] if r["stage"] == stage and r["case"] == case)
            ax.plot(r["losses"], label=case, linestyle="--" if case == "ds_autocast" else "-")
        ax.set_title(f"ZeRO {stage}")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.legend()
    fig.suptitle(f"autocastzero vs DeepSpeed, {res['device']}, {res['world']} rank(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world", type=int, default=2, help="ranks on CPU (CUDA: 1)")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument(
        "--interleaved", action="store_true", help="also time the engines side by side in one launch"
    )
    p.add_argument("--no-separate", action="store_true", help="skip the separate launches (memory, losses)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.monotonic()
    res = bench(args)
    rows = summary(res) if res["runs"] else []
    res["summary"] = rows
    irows = interleaved_summary(res)
    res["interleaved_summary"] = irows
    res["wall_s"] = time.monotonic() - t0
    res["command"] = "python benchmarks/bench_autocastzero.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    OUT.mkdir(parents=True, exist_ok=True)
    name = "bench_autocastzero" + (f"_{args.tag}" if args.tag else "")
    (OUT / f"{name}.json").write_text(json.dumps(res, indent=1))
    md = "\n\n".join(
        ([markdown(res, rows)] if rows else []) + ([markdown_interleaved(res, irows)] if irows else [])
    )
    (OUT / f"{name}.md").write_text(md + "\n")
    if res["runs"]:
        plot(res, OUT / f"{name}.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
