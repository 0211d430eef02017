"""LoCo benchmark: gradient bytes per step, kernel throughput, convergence on the demo LM.

    python benchmarks/bench_loco.py                     # everything (about 20 min on 2 CPU cores)
    python benchmarks/bench_loco.py --only bytes,kernels
    python benchmarks/bench_loco.py --steps 300         # longer convergence runs
    python benchmarks/bench_loco.py --only kernels --keep  # re-measure one section, keep the others

1. **bytes**: the demo GPT (examples/gpt.py, default size) on 2 gloo ranks, ZeRO 1/2/3, fp32
   compute with bf16 gradient communication. For LoCo, the bytes each rank sends to other ranks
   per optimizer step, counted by the plugin (``plugin.stats``); for the baseline, DeepSpeed's own
   bf16 collectives as counted by zerohooks (bytes handed to each collective) turned into bytes
   sent by a ring (all-reduce ``2(W-1)/W``, reduce-scatter ``(W-1)/W`` of the bytes handed).
   Also 4 ranks flat and two-level (2 nodes x 2) on ZeRO 3.
2. **kernels**: the CPU kernels on 16M elements, bytes read and written per second, against
   STREAM's Copy kernel (benchmarks/stream_copy.c, built with gcc here: ``c[j] = a[j]`` over two
   128 MiB double arrays, 16 bytes counted per element) and, as a second bar, torch's
   ``copy_`` of a 128 MiB fp32 buffer, all measured in the same run, interleaved, best of N,
   1 thread and all threads.
3. **feedback**: what error feedback does, on a synthetic gradient stream whose small persistent
   component 4-bit rounding sends as zero: the drift of the sum of what was sent from the sum of
   the true gradients, without feedback, with LoCo's default and with beta 0.
4. **convergence**: the demo GPT on the standard-library corpus (examples/data.py), 2 ranks,
   ZeRO 2, the demo's optimizer and schedule: bf16 all-reduce (DeepSpeed), LoCo 4-bit, and 4-bit
   without error feedback; final train loss (mean of the last 10 steps) and validation loss,
   on ``--seeds`` seeds (default 3: model init and data order), each compared with the bf16 run
   of its own seed.

Results: JSON in benchmarks/out/bench_loco.json, markdown printed and in benchmarks/out/bench_loco.md,
plot (bytes, kernel fractions, feedback drift, loss curves) in benchmarks/out/bench_loco.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _models import demo_ds_config

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
sys.path.insert(0, str(ROOT / "examples"))  # gpt.py, data.py (imported, not edited)
os.environ.setdefault("DS_ACCELERATOR", "cpu")


# --------------------------------------------------------------------------------------- ranks


def _skip_shm() -> None:
    import zerohooks  # skip DeepSpeed's inference-only shm comm op build (as the demo does)

    zerohooks.skip_deepspeed_compiles()


def _ds_config(stage: int, steps: int, micro_batch: int, loco: dict[str, Any] | None) -> dict[str, Any]:
    """examples/train_gpt.py's defaults, fp32 compute, bf16 gradient communication."""
    cfg = demo_ds_config(stage, micro_batch)
    cfg["scheduler"] = {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": steps,
            "warmup_num_steps": max(1, steps // 10),
            "warmup_type": "linear",
            "cos_min_ratio": 0.1,
        },
    }
    cfg["communication_data_type"] = "bf16"
    if loco is not None:
        cfg["loco"] = loco
    return cfg


def _train(
    stage: int,
    steps: int,
    loco: dict[str, Any] | None,
    micro_batch: int = 16,
    evaluate: bool = False,
    seed: int = 1234,
) -> dict[str, Any]:
    """Runs on every rank: train the demo GPT, return losses and byte counts (rank 0's view)."""
    import torch
    import torch.distributed as dist
    from data import BatchSampler, ByteCorpus
    from gpt import GPT, GPTConfig

    import zerohooks
    from zerohooks.testing.toy import mean_loss_step

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "emb" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "emb" not in n)]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=groups, config=_ds_config(stage, steps, micro_batch, loco)
    )
    corpus = ByteCorpus.load(train_bytes=4 << 20, val_bytes=1 << 18)
    sampler = BatchSampler(corpus.train, 128, micro_batch, seed, rank)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(mean_loss_step(engine, *sampler.next()))
        times.append(time.perf_counter() - t0)
    val = None
    if evaluate:
        batches = BatchSampler(corpus.val, 128, micro_batch, 1235, rank).fixed(8)
        engine.eval()
        with torch.no_grad():
            total = torch.zeros((), dtype=torch.float64)
            for x, y in batches:
                total += engine(x, y).double()
        dist.all_reduce(total)
        val = float(total) / (len(batches) * world)
    att = zerohooks.attachment(engine)
    counted = att.counters.last_step() if att is not None else {}
    plugin = next((p for p in att.plugins if p.name == "loco"), None) if att is not None else None
    loco_stats = plugin.stats.last_step() if plugin is not None else None
    # bytes summed over ranks
    mine = {"counted": counted, "loco": loco_stats}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return {
        "losses": losses,
        "val_loss": val,
        "step_time_s": sorted(times[3:])[len(times[3:]) // 2] if len(times) > 3 else None,
        "per_rank": every,
        "n_params": sum(p.numel() for p in model.parameters()),
        "kernels": bool(plugin.kernels) if plugin is not None else None,
    }


def _ring_bytes(counted: dict[str, dict[str, int]], world: int) -> float:
    """Bytes a rank sends for DeepSpeed's collectives, from the bytes handed to them."""
    factor = {
        "all_reduce": 2 * (world - 1) / world,
        "reduce_scatter": (world - 1) / world,
        "reduce": (world - 1) / world,
    }
    return sum(factor.get(coll, 1.0) * n for coll, per in counted.items() for n in per.values())


def _bytes_worker(cases: list[tuple[int, dict[str, Any] | None]], steps: int) -> list[dict[str, Any]]:
    _skip_shm()
    return [_train(stage, steps, loco, micro_batch=4) for stage, loco in cases]


def bench_bytes(
    world: int = 2, stages: tuple[int, ...] = (1, 2, 3), extra: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    from zerohooks.testing import run_distributed

    steps = 3
    loco = {**(extra or {})}
    cases: list[tuple[int, dict[str, Any] | None]] = []
    for stage in stages:
        cases += [(stage, None), (stage, loco)]
    results = run_distributed(_bytes_worker, world, args=(cases, steps), timeout=1800)[0]
    rows = []
    for stage in stages:
        base, ours = results[cases.index((stage, None))], results[cases.index((stage, loco))]
        base_wire = sum(_ring_bytes(r["counted"], world) for r in base["per_rank"])
        base_handed = sum(sum(sum(v.values()) for v in r["counted"].values()) for r in base["per_rank"])
        stats = [r["loco"] for r in ours["per_rank"]]
        wire = sum(s["wire_bytes"] for s in stats)
        rows.append(
            {
                "ranks": world,
                "topology": "2 nodes x 2" if extra and extra.get("hierarchy") == "two_level" else "flat",
                "zero_stage": stage,
                "n_params": ours["n_params"],
                "bf16_wire_bytes_per_step": base_wire,
                "bf16_handed_bytes_per_step": base_handed,
                "loco_wire_bytes_per_step": wire,
                "loco_handed_bytes_per_step": sum(s["handed_bytes"] for s in stats),
                "loco_wire_by_collective": {
                    k: sum(s.get(k, 0) for s in stats)
                    for k in sorted({k for s in stats for k in s if k.startswith("wire:")})
                },
                "loco_bf16_equivalent_wire": sum(s["bf16_wire_bytes"] for s in stats),
                "ratio": wire / base_wire,
                "kernels": ours["kernels"],
            }
        )
    return rows


# ------------------------------------------------------------------------------------- kernels


def bench_kernels(n: int = 1 << 24, repeats: int = 7) -> dict[str, Any]:
    import torch

    from loco import ops

    built = ops.load("cpu")
    G = 128
    kernels = _kernel_cases("cpu", n, G)
    # written, not torch.empty: untouched pages all map the kernel's one zero page, which stays in
    # cache, and a copy that reads them runs ~1.5x faster than one reading memory
    src = torch.ones(1 << 25)  # 128 MiB fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    stream = _stream_copy()
    sa = torch.ones(1 << 24, dtype=torch.float64)  # 128 MiB each
    sc = torch.zeros_like(sa)

    def best(fn: Any, clock: Any = time.perf_counter) -> float:
        fn()
        t0 = clock()
        fn()
        return clock() - t0

    results: dict[str, Any] = {"elements": n, "group_size": G, "compiled": built, "threads": {}}
    results["stream_copy_built"] = stream is not None
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)

        def stream_fn(threads: int = threads) -> None:
            if stream is None or stream(sa.data_ptr(), sc.data_ptr(), sa.numel(), threads) != 0:
                raise RuntimeError("stream_copy failed to start its threads")

        copies = {"stream": stream_fn, "torch": lambda: dst.copy_(src)}
        if stream is None:
            del copies["stream"]
        copy_bytes = {"stream": 2 * sa.numel() * 8, "torch": 2 * src.numel() * 4}
        copy_t: dict[str, list[float]] = {c: [] for c in copies}
        copy_cpu: dict[str, list[float]] = {c: [] for c in copies}
        times: dict[str, list[float]] = {name: [] for name in kernels}
        cpu_times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(repeats):  # interleaved, so all see the same machine load
            for c, fn in copies.items():
                copy_t[c].append(best(fn))
            for name, (fn, _) in kernels.items():
                times[name].append(best(lambda fn=fn: fn(True)))
            if threads == 1:  # CPU time: what other jobs on a shared machine do not inflate
                for c, fn in copies.items():
                    copy_cpu[c].append(best(fn, time.process_time))
                for name, (fn, _) in kernels.items():
                    cpu_times[name].append(best(lambda fn=fn: fn(True), time.process_time))
        bw_of = {c: copy_bytes[c] / min(copy_t[c]) for c in copies}
        # the goal's bar: STREAM's Copy; torch's copy_ where the STREAM kernel could not be built
        bar = bw_of.get("stream", bw_of["torch"])
        row: dict[str, Any] = {
            "stream_copy_GBps": bw_of["stream"] / 1e9 if "stream" in bw_of else None,
            "torch_copy_GBps": bw_of["torch"] / 1e9,
            "kernels": {},
        }
        for name, (fn, moved) in kernels.items():
            bw = moved / min(times[name])
            ref = moved / best(lambda fn=fn: fn(False))
            row["kernels"][name] = {
                "GBps": bw / 1e9,
                "fraction_of_copy": bw / bar,
                "fraction_of_torch_copy": bw / bw_of["torch"],
                "Gelem_per_s": n / min(times[name]) / 1e9,
                "reference_GBps": ref / 1e9,
            }
            if threads == 1:
                cpu_bar = "stream" if "stream" in copies else "torch"
                row["kernels"][name]["fraction_of_copy_cpu_time"] = (moved / min(cpu_times[name])) / (
                    copy_bytes[cpu_bar] / min(copy_cpu[cpu_bar])
                )
        results["threads"][threads] = row
    results["cuda"] = bench_cuda_kernels()
    return results


def _kernel_cases(device: str, n: int, G: int = 128, sources: int = 2) -> dict[str, tuple[Any, float]]:
    """The three kernels on ``n`` elements of ``device``: name -> (``fn(use_kernels)``, bytes one
    call reads and writes)."""
    import torch

    from loco import ops

    g = torch.randn(n).to(device=device, dtype=torch.bfloat16)
    e, es = torch.zeros(n, dtype=torch.int8, device=device), torch.zeros(n // G, device=device)
    q, s = torch.empty(1, n // 2, dtype=torch.uint8, device=device), torch.empty(1, n // G, device=device)
    rq = torch.randint(0, 256, (sources, n // 2), dtype=torch.uint8).to(device)
    rs = torch.rand(sources, n // G).to(device)
    q2, s2 = torch.empty_like(q), torch.empty_like(s)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    sb = 4 * n / G  # bytes of one fp32 scale per group
    return {
        "quantize_ef (bf16 in, int8 error, 4-bit out)": (
            lambda use: ops.quantize_ef(g, e, es, 0.8, 4, G, n, q, s, use_kernels=use),
            n * 2 + (n + sb) * 2 + n / 2 + sb,
        ),
        "dequant_reduce_requant (2 sources, int8 error)": (
            lambda use: ops.dequant_reduce_requant(rq, rs, e, es, 0.8, 4, G, q2, s2, use_kernels=use),
            sources * (n / 2 + sb) + (n + sb) * 2 + n / 2 + sb,
        ),
        "dequant_reduce (2 sources, bf16 out)": (
            lambda use: ops.dequant_reduce(rq, rs, 4, G, 2.0, out, use_kernels=use),
            sources * (n / 2 + sb) + 2 * n,
        ),
    }


def bench_cuda_kernels(n: int = 1 << 26, repeats: int = 20) -> dict[str, Any]:
    """The same three kernels on a CUDA device (64 M elements), bytes per second as a fraction of
    the device's copy of a 256 MiB fp32 buffer, timed with CUDA events (goal >= 0.7), for each
    variant of the kernels: ``warp`` (the default: a warp per group, 1-2 bytes per lane per
    access) and ``vec16`` (``LOCO_CUDA_VARIANT=vec16``: 16 bytes per lane, several groups per
    warp), interleaved.  ``kernels`` holds the default's figures, ``variants`` every variant's.
    A dict with the reason where there is no GPU or the CUDA kernels do not build."""
    import os

    import torch

    from loco import ops

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    if not ops.load("cuda"):
        return {"skipped": f"the CUDA kernels did not build: {ops.build_error('cuda')}"}
    kernels = {
        name: (lambda fn=fn: fn(True), moved) for name, (fn, moved) in _kernel_cases("cuda", n).items()
    }
    variants = ("warp", "vec16")
    src = torch.ones(n, device="cuda")
    dst = torch.empty_like(src)
    before = os.environ.get("LOCO_CUDA_VARIANT")

    def timed(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats / 1e3

    copy_t: list[float] = []
    times: dict[str, dict[str, list[float]]] = {v: {name: [] for name in kernels} for v in variants}
    try:
        for _ in range(5):  # interleaved
            copy_t.append(timed(lambda: dst.copy_(src)))
            for v in variants:
                os.environ["LOCO_CUDA_VARIANT"] = v
                for name, (fn, _) in kernels.items():
                    times[v][name].append(timed(fn))
    finally:
        if before is None:
            os.environ.pop("LOCO_CUDA_VARIANT", None)
        else:
            os.environ["LOCO_CUDA_VARIANT"] = before
    copy_bw = 2 * 4 * n / min(copy_t)
    figures = {
        v: {
            name: {
                "GBps": moved / min(times[v][name]) / 1e9,
                "fraction_of_copy": moved / min(times[v][name]) / copy_bw,
            }
            for name, (_, moved) in kernels.items()
        }
        for v in variants
    }
    return {
        "device": torch.cuda.get_device_name(),
        "elements": n,
        "copy_GBps": copy_bw / 1e9,
        "kernels": figures["warp"],
        "variants": figures,
    }


def _stream_copy() -> Any:
    """benchmarks/stream_copy.c built with gcc for this CPU (-march=native, so rebuilt on every
    run, in a temporary folder), as a ctypes function; None (with a message) where there is no C
    compiler."""
    import ctypes
    import shutil
    import subprocess

    source = ROOT / "benchmarks" / "stream_copy.c"
    lib = Path(tempfile.mkdtemp(prefix="stream_copy_")) / "stream_copy.so"
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        print(f"no C compiler ({cc}): the kernels are compared with torch's copy_ only", file=sys.stderr)
        return None
    flags = ["-O3", "-march=native", "-fno-tree-loop-distribute-patterns", "-fPIC", "-shared", "-pthread"]
    subprocess.run([cc, *flags, str(source), "-o", str(lib)], check=True)
    fn = ctypes.CDLL(str(lib)).stream_copy
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# --------------------------------------------------------------------------------- convergence


def _convergence_worker(
    runs: list[tuple[str, dict[str, Any] | None]], steps: int, seeds: list[int]
) -> list[dict[str, Any]]:
    _skip_shm()
    out = []
    for seed in seeds:
        for name, loco in runs:
            r = _train(2, steps, loco, micro_batch=16, evaluate=True, seed=seed)
            r["name"], r["seed"] = name, seed
            out.append(r)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"  seed {seed}: {name}: final loss {sum(r['losses'][-10:]) / 10:.4f}", flush=True)
    return out


def bench_convergence(
    steps: int, seeds: int = 3, group_size: int = 128, world: int = 2
) -> list[dict[str, Any]]:
    """Each run on ``seeds`` seeds (model init and data order); the figures are means over seeds,
    with each seed's gap to the bf16 run of the same seed."""
    from zerohooks.testing import run_distributed

    runs: list[tuple[str, dict[str, Any] | None]] = [
        ("bf16 all-reduce (DeepSpeed)", None),
        ("LoCo 4-bit", {"group_size": group_size}),
        ("4-bit, no error feedback", {"group_size": group_size, "error_feedback": False}),
    ]
    seed_list = [1234 + 1000 * k for k in range(seeds)]
    results = run_distributed(_convergence_worker, world, args=(runs, steps, seed_list), timeout=7200)[0]

    def final(r: dict[str, Any]) -> float:
        return sum(r["losses"][-10:]) / 10

    base = {r["seed"]: final(r) for r in results if r["name"] == runs[0][0]}
    base_val = {r["seed"]: r["val_loss"] for r in results if r["name"] == runs[0][0]}
    rows = []
    for name, _ in runs:
        mine = [r for r in results if r["name"] == name]
        gaps = [final(r) / base[r["seed"]] - 1 for r in mine]
        val_gaps = [r["val_loss"] / base_val[r["seed"]] - 1 for r in mine]
        rows.append(
            {
                "run": name,
                "group_size": group_size,
                "seeds": [r["seed"] for r in mine],
                "final_train_loss": sum(final(r) for r in mine) / len(mine),
                "final_train_loss_per_seed": [final(r) for r in mine],
                "vs_bf16": sum(gaps) / len(gaps),
                "vs_bf16_per_seed": gaps,
                "val_loss": sum(r["val_loss"] for r in mine) / len(mine),
                "val_vs_bf16": sum(val_gaps) / len(val_gaps),
                "step_time_s": sorted(r["step_time_s"] for r in mine)[len(mine) // 2],
                "losses": [sum(v) / len(mine) for v in zip(*(r["losses"] for r in mine), strict=True)],
                "losses_per_seed": [r["losses"] for r in mine],
            }
        )
    return rows


def bench_feedback(steps: int = 300, n: int = 1 << 20, seed: int = 7) -> dict[str, Any]:
    """What error feedback buys, on a synthetic gradient stream where 4-bit rounding is biased:
    g_t = s + noise_t, with one large value per group (it sets the group's scale) and a small
    persistent component s elsewhere (below half a code step, so rounding sends it as 0).  Per
    step t, the relative error of the sum of what was sent against the sum of the true gradients,
    ||sum(sent) - sum(g)|| / ||sum(g)|| over the small coordinates: the drift a model following
    the sent gradients accumulates.  Without feedback it stays near 1 (the component is never
    sent); with it, it falls as the error buffer carries the rounded-away part into later steps."""
    import torch

    from loco import ops, reference

    G, bits = 128, 4
    ops.load("cpu")  # the compiled kernel where it builds (same results as the reference, faster)
    gen = torch.Generator().manual_seed(seed)
    big = torch.zeros(n)
    big[::G] = 1.0  # scale of every group: 1/7, half a code step 0.071
    small = torch.ones(n, dtype=torch.bool)
    small[::G] = False
    signal = torch.where(small, 0.02 * torch.randn(n, generator=gen).sign(), big)  # +-0.02
    variants = {
        "no error feedback": None,
        "LoCo, err_beta 0.8 (default)": 0.8,
        "error feedback, beta 0": 0.0,
    }
    curves: dict[str, list[float]] = {}
    for name, beta in variants.items():
        noise_gen = torch.Generator().manual_seed(seed + 1)  # the same stream for every variant
        if beta is None:
            e, es = torch.empty(0, dtype=torch.int8), torch.empty(0)
        else:
            e, es = torch.zeros(n, dtype=torch.int8), torch.zeros(n // G)
        q, sc = torch.empty(1, n * bits // 8, dtype=torch.uint8), torch.empty(1, n // G)
        sent_sum, true_sum = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        curve = []
        for _ in range(steps):
            g = signal + 0.01 * torch.randn(n, generator=noise_gen) * small
            ops.quantize_ef(g, e, es, 0.0 if beta is None else beta, bits, G, n, q, sc)
            sent_sum += reference.decode(q, sc, bits, G).view(-1).double()
            true_sum += g.double()
            diff = (sent_sum - true_sum)[small].norm() / true_sum[small].norm()
            curve.append(float(diff))
        curves[name] = curve
    return {
        "steps": steps,
        "elements": n,
        "group_size": G,
        "curves": curves,
        "final": {k: v[-1] for k, v in curves.items()},
    }


# --------------------------------------------------------------------------------------- report


SECTIONS = ("kernels", "bytes", "feedback", "convergence")
FORMAT = 2  # of benchmarks/out/bench_loco.json; --keep drops sections written in another format


def _keep_older(res: dict[str, Any], old: dict[str, Any]) -> None:
    """Copy into ``res`` the sections of ``old`` (an earlier bench_loco.json) that ``res`` lacks,
    with their own dates and commands; sections of another format are dropped, with a message."""
    sections = old.get("meta", {}).get("sections", {})
    if old.get("meta", {}).get("format") != FORMAT:
        if sections or any(k in old for k in SECTIONS):
            print(
                f"--keep: {OUT / 'bench_loco.json'} is in an older format; its sections are dropped",
                file=sys.stderr,
            )
        return
    for key, meta in sections.items():
        if key not in res and key in old:
            res[key] = old[key]
            res["meta"]["sections"][key] = meta


def _bar(kernels: dict[str, Any]) -> str:
    """What the kernels' fractions are of: STREAM's Copy, or torch's copy_ where it was not built."""
    return "STREAM copy" if kernels.get("stream_copy_built", True) else "torch copy_ (STREAM copy not built)"


def _convergence_keys(res: dict[str, Any]) -> list[str]:
    return sorted((k for k in res if k.startswith("convergence")), key=lambda k: (k != "convergence", k))


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# LoCo benchmark ({res['meta']['machine']}, torch {res['meta']['torch']})", ""]
    for name, m in res["meta"]["sections"].items():
        lines.append(f"* {name}: {m.get('date')}, load average {m.get('load')}, `{m.get('command')}`")
    lines.append("")
    if "bytes" in res:
        lines += [
            "## Gradient bytes per optimizer step (sent by all ranks), demo GPT "
            f"({res['bytes'][0]['n_params'] / 1e6:.2f} M params), bf16 communication",
            "",
            "| ranks | topology | ZeRO | bf16 (DeepSpeed) | LoCo 4-bit | ratio (goal <= 0.27) | LoCo per collective |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in res["bytes"]:
            per = ", ".join(f"{k[5:]} {v / 1e6:.2f} MB" for k, v in r["loco_wire_by_collective"].items())
            lines.append(
                f"| {r['ranks']} | {r['topology']} | {r['zero_stage']} | {r['bf16_wire_bytes_per_step'] / 1e6:.2f} MB | "
                f"{r['loco_wire_bytes_per_step'] / 1e6:.2f} MB | **{r['ratio']:.3f}** | {per} |"
            )
        lines.append("")
    if "kernels" in res:
        k = res["kernels"]
        lines += [
            f"## CPU kernels, {k['elements'] / 2**20:.0f} M elements, group {k['group_size']} "
            f"(compiled: {k['compiled']}); bytes read + written per second",
            "",
            f"| threads | kernel | GB/s | G elem/s | STREAM copy GB/s | fraction of {_bar(k)} (goal >= 0.5) "
            "| same, CPU time | torch copy_ GB/s | fraction of torch copy_ | reference GB/s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for threads, row in k["threads"].items():
            stream = row.get("stream_copy_GBps")
            for name, v in row["kernels"].items():
                cpu = v.get("fraction_of_copy_cpu_time")
                lines.append(
                    f"| {threads} | {name} | {v['GBps']:.2f} | {v['Gelem_per_s']:.2f} | "
                    f"{'not built' if stream is None else f'{stream:.2f}'} | **{v['fraction_of_copy']:.2f}** | "
                    f"{'' if cpu is None else f'{cpu:.2f}'} | {row['torch_copy_GBps']:.2f} | "
                    f"{v['fraction_of_torch_copy']:.2f} | {v['reference_GBps']:.2f} |"
                )
        lines.append("")
        cu = k.get("cuda") or {"skipped": "not measured"}
        if "skipped" in cu:
            lines += [f"CUDA kernels: not measured ({cu['skipped']}).", ""]
        else:
            lines += [
                f"## CUDA kernels, {cu['device']}, {cu['elements'] / 2**20:.0f} M elements, group 128",
                "",
                "| kernel | GB/s | device copy GB/s | fraction of copy (goal >= 0.7) |",
                "|---|---|---|---|",
            ]
            for name, v in cu["kernels"].items():
                lines.append(
                    f"| {name} | {v['GBps']:.0f} | {cu['copy_GBps']:.0f} | **{v['fraction_of_copy']:.2f}** |"
                )
            lines.append("")
    if "feedback" in res:
        f = res["feedback"]
        marks = [t for t in (1, 10, 50, 100, 200, 300, 1000) if t <= f["steps"]]
        lines += [
            f"## Error feedback on a biased stream ({f['elements'] / 2**20:.0f} M elements, group {f['group_size']}, "
            "4-bit): ||sum sent - sum true|| / ||sum true|| over the small coordinates",
            "",
            "| variant | " + " | ".join(f"step {t}" for t in marks) + " |",
            "|---|" + "---|" * len(marks),
        ]
        for name, curve in f["curves"].items():
            lines.append(f"| {name} | " + " | ".join(f"{curve[t - 1]:.3f}" for t in marks) + " |")
        lines.append("")
    for key in _convergence_keys(res):
        c = res[key]
        lines += [
            f"## Convergence: demo GPT, 2 ranks, ZeRO 2, {len(c[0]['losses'])} steps, "
            f"{len(c[0]['seeds'])} seeds (means; per seed in brackets), LoCo group size {c[1].get('group_size', 128)}",
            "",
            "| run | final train loss (last 10) | vs bf16, same seed (goal LoCo within 1%) | val loss | val vs bf16 "
            "| step time |",
            "|---|---|---|---|---|---|",
        ]
        for r in c:
            per = ", ".join(f"{100 * g:+.2f}%" for g in r["vs_bf16_per_seed"])
            lines.append(
                f"| {r['run']} | {r['final_train_loss']:.4f} | {100 * r['vs_bf16']:+.2f}% ({per}) | "
                f"{r['val_loss']:.4f} | {100 * r['val_vs_bf16']:+.2f}% | {r['step_time_s']:.3f} s |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    """One panel per section present: bytes per step, kernel fractions of copy, loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conv = _convergence_keys(res)
    panels = [k for k in ("bytes", "kernels", "feedback") if k in res] + conv[:1]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        if key == "bytes":
            rows = res["bytes"]
            labels = [
                f"{r['ranks']}r {'2x2' if r['topology'] != 'flat' else 'flat'} Z{r['zero_stage']}"
                for r in rows
            ]
            xs = range(len(rows))
            ax.bar(
                [x - 0.2 for x in xs], [r["bf16_wire_bytes_per_step"] / 1e6 for r in rows], 0.4, label="bf16"
            )
            ax.bar(
                [x + 0.2 for x in xs],
                [r["loco_wire_bytes_per_step"] / 1e6 for r in rows],
                0.4,
                label="LoCo 4-bit",
            )
            ax.set_xticks(list(xs), labels, rotation=20)
            ax.set_ylabel("MB sent per optimizer step (all ranks)")
            ax.set_title("gradient bytes")
        elif key == "kernels":
            threads = list(res["kernels"]["threads"].items())
            names = list(threads[0][1]["kernels"])
            width = 0.8 / len(threads)
            for t, (n_threads, row) in enumerate(threads):
                xs = [k + (t - (len(threads) - 1) / 2) * width for k in range(len(names))]
                fr = [row["kernels"][name]["fraction_of_copy"] for name in names]
                ax.bar(xs, fr, width, label=f"{n_threads} thread(s)")
            ax.axhline(0.5, color="k", ls="--", lw=1, label="goal")
            ax.set_xticks(range(len(names)), [name.split(" ")[0] for name in names], rotation=15)
            ax.set_ylabel(f"bytes/s as a fraction of {_bar(res['kernels'])}")
            ax.set_title("CPU kernels")
        elif key == "feedback":
            for name, curve in res["feedback"]["curves"].items():
                ax.plot(range(1, len(curve) + 1), curve, label=name)
            ax.set_xlabel("step")
            ax.set_ylabel("||sum sent - sum true|| / ||sum true||")
            ax.set_yscale("log")
            ax.set_title("error feedback, biased 4-bit stream")
        else:
            for r in res[key]:
                ys = r["losses"]
                smooth = [
                    sum(ys[max(0, i - 9) : i + 1]) / len(ys[max(0, i - 9) : i + 1]) for i in range(len(ys))
                ]
                ax.plot(range(1, len(ys) + 1), smooth, label=r["run"])
            ax.set_xlabel("step")
            ax.set_ylabel(f"train loss (10-step mean, mean of {len(res[key][0]['seeds'])} seeds)")
            ax.set_title("convergence, demo GPT, 2 ranks, ZeRO 2")
        ax.legend(fontsize=8)
    from _report import save_figure  # this folder (run as a script)

    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per convergence run")
    p.add_argument("--seeds", type=int, default=3, help="seeds per convergence run")
    p.add_argument("--group-size", type=int, default=128, help="LoCo's group_size in the convergence runs")
    p.add_argument("--no-4-ranks", action="store_true", help="skip the 4-rank byte counts")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the sections of the last benchmarks/out/bench_loco.json that this run does not measure "
        "(each keeps its own date and command)",
    )
    args = p.parse_args(argv)
    from zerohooks.build import build

    build(["loco"])  # once, here, announced: the ranks spawned below load the cached kernels
    only = set(args.only.split(","))
    unknown = only - set(SECTIONS)
    if unknown:
        p.error(
            f"unknown section(s) {sorted(unknown)}; --only takes a comma-separated subset of {list(SECTIONS)}"
        )
    import torch

    command = "python benchmarks/bench_loco.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res: dict[str, Any] = {
        "meta": {
            "format": FORMAT,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            "sections": {},
        }
    }
    for name in SECTIONS:
        if name not in only:
            continue
        t0 = time.time()
        load = os.getloadavg()[0]
        key = name
        if name == "kernels":
            res["kernels"] = bench_kernels()
        elif name == "feedback":
            res["feedback"] = bench_feedback()
        elif name == "bytes":
            res["bytes"] = bench_bytes(2, (1, 2, 3))
            if not args.no_4_ranks:
                res["bytes"] += bench_bytes(4, (3,))
                res["bytes"] += bench_bytes(4, (3,), {"hierarchy": "two_level", "node_size": 2})
        else:  # one key per group size, so --keep holds runs with different group sizes side by side
            key = "convergence" if args.group_size == 128 else f"convergence_g{args.group_size}"
            res[key] = bench_convergence(args.steps, args.seeds, args.group_size)
        res["meta"]["sections"][key] = {
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)),
            "command": command,
            "load": f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
            "seconds": round(time.time() - t0),
        }
        print(f"{key} done ({time.time() - t0:.0f} s)", flush=True)
    path = OUT / "bench_loco.json"
    if args.keep and path.exists():  # read now, not at the start: another --keep run may have written since
        _keep_older(res, json.loads(path.read_text()))
    from _report import write_report  # this folder (run as a script)

    write_report(OUT, "bench_loco", res, markdown(res), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
