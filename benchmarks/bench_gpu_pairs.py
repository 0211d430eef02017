"""Each plugin against its DeepSpeed equivalent, every run in its own process (true peak memory).

    python benchmarks/bench_gpu_pairs.py                              # GPU: 152 M-param GPT, ZeRO 2, 3, 1
    python benchmarks/bench_gpu_pairs.py --stages 3 --rounds 5 --deadline-s 1200
    python benchmarks/bench_gpu_pairs.py --nvme                       # nvmeswap vs DeepSpeed NVMe offload
    python benchmarks/bench_gpu_pairs.py --tiny --stages 2 --rounds 1 # CPU smoke: tiny model, few steps

The pairs (runs from examples/runs.py, the demo's definitions, on a bf16 model unless said):

=============  ===================  ==========================================================
plugin run     its equivalent       what is compared
=============  ===================  ==========================================================
accumdtype     ds-accum-fp32        fp32 accumulation + reduction: DeepSpeed ``grad_accum_dtype``
autocastzero   ds-autocast          fp32 parameters, bf16 autocast: DeepSpeed ``torch_autocast``
mixedlayers    bf16                 LayerNorms + head in fp32 vs the whole model in bf16
loco           bf16                 4-bit gradients with error feedback vs bf16 reduction
nvmeswap       ds-nvme              (``--nvme``, ZeRO 3) optimizer state on disk; DeepSpeed's
                                    needs libaio: where it is missing that is said and
                                    nvmeswap is measured alone
=============  ===================  ==========================================================

One process per run (world size 1, NCCL on a GPU, gloo on CPU): DeepSpeed engines are not freed
by ``del`` (see issue 25), so runs sharing a process share memory.  Runs are interleaved over
rounds (the order rotates each round); a run's figure is the median step time of its timed steps
(after warm-up), a pair's the median over rounds; the peak memory is the process's
``torch.cuda.max_memory_allocated`` (peak RSS on CPU) over the whole run, engine build included.
A deadline (``--deadline-s`` or ``--deadline-at``) stops starting runs so the JSON and markdown
(``--out``) are always written; they are rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import run_group

ROOT = Path(__file__).resolve().parents[1]
PAIRS: tuple[tuple[str, str], ...] = (
    ("accumdtype", "ds-accum-fp32"),
    ("autocastzero", "ds-autocast"),
    ("mixedlayers", "bf16"),
    ("loco", "bf16"),
)
NVME_PAIR = ("nvmeswap", "ds-nvme")
GPU_MODEL = {"layers": 12, "d_model": 1024, "heads": 16, "seq_len": 512, "micro_batch": 8}
NVME_MODEL = {"layers": 6, "d_model": 768, "heads": 12, "seq_len": 256, "micro_batch": 4}
"""The nvme section's model (about 43 M parameters): both runs finish in the suite's budget."""
TINY_MODEL = {"layers": 2, "d_model": 64, "heads": 2, "seq_len": 32, "micro_batch": 2}
WORLD_SIZE_1 = {
    "loco": "world size 1: loco has nothing to send and takes its exact path (no quantization), so the "
    "pair shows nothing; its kernels are checked and timed in the gpu-tests and loco-kernels sections"
}
"""Pairs given no run slot by default, with the reason (these runs are one process each)."""
RESULT_TAG = "BENCH_GPU_PAIRS_RESULT "
DONE_TAG = "BENCH_GPU_PAIRS_DONE"


# ------------------------------------------------------------------------------------ one run
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Train one run in this process; the result dict (printed on one tagged line)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    cuda = torch.cuda.is_available() and not args.tiny_cpu
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed
    import runs as registry
    from gpt import GPT, GPTConfig

    import zerohooks

    zerohooks.skip_deepspeed_compiles()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    m = json.loads(args.model)
    base: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": m["micro_batch"],
        "gradient_accumulation_steps": 1,
        "train_batch_size": m["micro_batch"],
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    run = registry.resolve(args.child)
    config = run.config(base)
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=m["seq_len"], n_layer=m["layers"], n_head=m["heads"], d_model=m["d_model"]))
    n_params = model.num_parameters()
    t0 = time.perf_counter()
    engine, _, _, _ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=config)
    build_s = time.perf_counter() - t0
    device = engine.device
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (m["micro_batch"], m["seq_len"] + 1), generator=gen)
        x = x.to(device)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float().item()))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    timed = times[args.warmup :]
    profile = _profile_step(engine, m, gen, cuda) if args.profile else None
    if cuda:
        peak, kind = int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"
    return {
        "run": args.child,
        "stage": args.stage,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "n_params": n_params,
        "engine_build_s": round(build_s, 3),
        "step_ms": 1e3 * statistics.median(timed),
        "step_ms_all": [round(1e3 * t, 3) for t in times],
        "final_loss": losses[-1],
        "peak_memory_bytes": peak,
        "memory_kind": kind,
        **({"profile": profile} if profile is not None else {}),
    }


def _profile_step(engine: Any, m: dict[str, Any], gen: Any, cuda: bool) -> dict[str, Any]:
    """One more step (after the timed ones, so they are untouched) under torch.profiler: the ops
    taking the most self time on the device (CPU time where there is no GPU), for the pair's
    where-the-time-differs table."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    x = torch.randint(0, 256, (m["micro_batch"], m["seq_len"] + 1), generator=gen).to(engine.device)
    with profile(activities=acts) as prof:
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()

    def self_us(e: Any) -> float:
        if cuda:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))
        return float(e.self_cpu_time_total)

    events = [e for e in prof.key_averages() if self_us(e) > 0]
    events.sort(key=self_us, reverse=True)
    return {
        "clock": "device" if cuda else "cpu",
        "total_ms": round(sum(self_us(e) for e in events) / 1e3, 3),
        "top": [
            {"op": e.key[:90], "self_ms": round(self_us(e) / 1e3, 3), "calls": int(e.count)}
            for e in events[:25]
        ],
    }


def profile_diff(plugin: dict[str, Any], equivalent: dict[str, Any], n: int = 6) -> list[dict[str, Any]]:
    """The ops whose self time differs most between two profiled steps (plugin minus equivalent);
    an op in only one side's top list counts as 0 on the other."""
    a = {x["op"]: x for x in plugin["top"]}
    b = {x["op"]: x for x in equivalent["top"]}
    rows = []
    for op in set(a) | set(b):
        pa, pb = a.get(op, {}), b.get(op, {})
        rows.append(
            {
                "op": op,
                "plugin_ms": pa.get("self_ms", 0.0),
                "equivalent_ms": pb.get("self_ms", 0.0),
                "plugin_calls": pa.get("calls", 0),
                "equivalent_calls": pb.get("calls", 0),
            }
        )
    rows.sort(key=lambda r: abs(r["plugin_ms"] - r["equivalent_ms"]), reverse=True)
    return rows[:n]


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


# ------------------------------------------------------------------------------ the schedule
AIO_PROBE = r"""
import json, os
r = {"ok": False}
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import distutils.ccompiler  # noqa: F401  (DeepSpeed's has_function compiles its test with it)
    except Exception as e:
        r["reason"] = (f"import distutils failed ({type(e).__name__}: {e}; Python 3.12 has no distutils: "
                       "install setuptools)")
        raise
    import ctypes.util
    from deepspeed.ops.op_builder import AsyncIOBuilder
    ok = AsyncIOBuilder().is_compatible(verbose=False)
    if ok:
        r["ok"] = True
    elif ctypes.util.find_library("aio") is None:
        r["reason"] = "libaio missing (no libaio.so: apt install libaio-dev)"
    else:
        r["reason"] = ("DeepSpeed's compile-and-link test of io_submit failed though libaio.so is there "
                       "(libaio.h missing? apt install libaio-dev; or set CFLAGS/LDFLAGS)")
except Exception as e:
    r["reason"] = r.get("reason") or f"{type(e).__name__}: {e}"[:300]
print("SUITE_AIO_PROBE " + json.dumps(r), flush=True)
"""
"""Whether DeepSpeed's async_io op (its NVMe offload) can be built here and, when not, the real
reason: distutils missing, libaio missing, the compile test failing, or DeepSpeed's error."""


def aio_probe_reason(text: str) -> str | None:
    """The reason from :data:`AIO_PROBE`'s output, None when the op can be built."""
    line = next((x for x in text.splitlines() if x.startswith("SUITE_AIO_PROBE ")), None)
    if line is None:
        return "the async_io probe printed no result: " + text.strip()[-300:]
    r = json.loads(line[len("SUITE_AIO_PROBE ") :])
    return None if r.get("ok") else str(r.get("reason"))


def _libaio_reason() -> str | None:
    """Why DeepSpeed's NVMe offload cannot run here (its async_io op cannot be built), else None."""
    out = run_group([sys.executable, "-c", AIO_PROBE], 120, tag="SUITE_AIO_PROBE", grace=5)
    if out.cut:
        return "could not check DeepSpeed's async_io op (the check took over 120 s)"
    why = aio_probe_reason(out.text)
    return None if why is None else f"DeepSpeed's NVMe offload cannot run ({why}): nvmeswap is measured alone"


def _pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    names = [x for x in args.pairs.split(",") if x]
    unknown = set(names) - {p for p, _ in PAIRS}
    if unknown:
        raise SystemExit(
            f"bench_gpu_pairs: unknown --pairs {sorted(unknown)}; known: {[p for p, _ in PAIRS]}"
        )
    return [pair for pair in PAIRS if pair[0] in names]


def _jobs(args: argparse.Namespace) -> list[tuple[int, str]]:
    stages = [int(s) for s in args.stages.split(",") if s]
    if args.nvme:
        return [(3, r) for r in NVME_PAIR]
    jobs: list[tuple[int, str]] = []
    for s in stages:
        for pair in _pairs(args):
            jobs += [(s, r) for r in pair if (s, r) not in jobs]
    return jobs


def summarize(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per stage and pair: median step time of each side over rounds, the ratio, peak memory."""
    by: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in results:
        if r.get("status") == "ok":
            by.setdefault((r["stage"], r["run"]), []).append(r)
    rows = []
    pairs = [NVME_PAIR] if args.nvme else _pairs(args)
    for s in sorted({st for st, _ in _jobs(args)}):
        for plugin, base in pairs:
            p, b = by.get((s, plugin), []), by.get((s, base), [])
            row: dict[str, Any] = {
                "stage": s,
                "plugin": plugin,
                "equivalent": base,
                "rounds": [len(p), len(b)],
            }
            for key, side in (("plugin", p), ("equivalent", b)):
                if side:
                    row[f"{key}_step_ms"] = statistics.median(x["step_ms"] for x in side)
                    row[f"{key}_peak_bytes"] = max(x["peak_memory_bytes"] for x in side)
                    steps = [t for x in side for t in x["step_ms_all"][args.warmup :]]
                    row[f"{key}_step_quartiles_ms"] = _quartiles(steps)
            if p and b:
                row["step_ratio"] = row["plugin_step_ms"] / row["equivalent_step_ms"]
                row["peak_ratio"] = row["plugin_peak_bytes"] / row["equivalent_peak_bytes"]
                if "profile" in p[0] and "profile" in b[0]:
                    row["profile_diff"] = profile_diff(p[0]["profile"], b[0]["profile"])
                    row["profile_total_ms"] = [p[0]["profile"]["total_ms"], b[0]["profile"]["total_ms"]]
                    if b[0]["profile"]["total_ms"] > 0:
                        row["profile_ratio"] = p[0]["profile"]["total_ms"] / b[0]["profile"]["total_ms"]
            rows.append(row)
    return {"pairs": rows}


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"Model: {data.get('n_params', '?')} parameters, {data['model']}; device {data.get('device', '?')}; "
        f"rounds completed {data['rounds_done']} of {data['rounds']}; {data['steps']} timed steps after "
        f"{data['warmup']} warm-up per run; each run in its own process.",
        "",
        "Step times: the median of a run's timed steps (median over rounds), quartiles of every timed step "
        "in brackets: the spread within a run. Profiled ratio: the self time of every op in the one "
        "profiled step, summed, plugin over equivalent (device time on a GPU, CPU time without one); "
        "a kernel counts under its op and as itself, so compare the two sides, not the absolute sums. "
        "It does not move with the host's launch noise that spreads the step times.",
        "",
        "| ZeRO | plugin | equivalent | plugin step (ms) | equivalent step (ms) | step ratio "
        "| profiled ratio | plugin peak (GiB) | equivalent peak (GiB) | rounds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(row: dict[str, Any], key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
        if key not in row:
            return "-"
        text = fmt.format(row[key] / scale)
        q = row.get(key.replace("_step_ms", "_step_quartiles_ms")) if key.endswith("_step_ms") else None
        return f"{text} ({q[0]:.1f}-{q[1]:.1f})" if q else text

    for row in data["summary"]["pairs"]:
        lines.append(
            f"| {row['stage']} | {row['plugin']} | {row['equivalent']} | {f(row, 'plugin_step_ms')} "
            f"| {f(row, 'equivalent_step_ms')} | {f(row, 'step_ratio', fmt='{:.3f}x')} "
            f"| {f(row, 'profile_ratio', fmt='{:.3f}x')} "
            f"| {f(row, 'plugin_peak_bytes', 2**30, '{:.2f}')} | {f(row, 'equivalent_peak_bytes', 2**30, '{:.2f}')} "
            f"| {row['rounds'][0]}/{row['rounds'][1]} |"
        )
    for plugin, why in data.get("skipped_pairs", {}).items():
        lines.append(f"| all | {plugin} | - | skipped: {why} | | | | | | |")
    if any(r["plugin"] == "loco" for r in data["summary"]["pairs"]):
        data.setdefault("notes", [])
        if WORLD_SIZE_1["loco"] not in data["notes"]:
            data["notes"].append(WORLD_SIZE_1["loco"])
    diffs = [r for r in data["summary"]["pairs"] if r.get("profile_diff")]
    if diffs:
        lines += [
            "",
            "Where the step time differs: one profiled step of each side (after the timed ones), "
            "self time per op, the ops differing most (plugin minus equivalent):",
            "",
        ]
        lines += [
            "| ZeRO | plugin | op | plugin ms (calls) | equivalent ms (calls) |",
            "|---|---|---|---|---|",
        ]
        for r in diffs:
            for d in r["profile_diff"]:
                lines.append(
                    f"| {r['stage']} | {r['plugin']} | `{d['op']}` | {d['plugin_ms']:.2f} ({d['plugin_calls']}) "
                    f"| {d['equivalent_ms']:.2f} ({d['equivalent_calls']}) |"
                )
    for note in data.get("notes", []):
        lines += ["", f"- {note}"]
    failed = [r for r in data["results"] if r.get("status") != "ok"]
    for r in failed:
        lines.append(f"- ZeRO {r['stage']} {r['run']}: {r['status']}: {r.get('error', '')[-300:]}")
    return "\n".join(lines) + "\n"


def parent(args: argparse.Namespace) -> dict[str, Any]:
    deadline = args.deadline_at or (time.time() + args.deadline_s)
    model = TINY_MODEL if args.tiny else NVME_MODEL if args.nvme else GPU_MODEL
    data: dict[str, Any] = {
        "model": model,
        "rounds": args.rounds,
        "rounds_done": 0,
        "steps": args.steps,
        "warmup": args.warmup,
        "results": [],
        "notes": [],
        "summary": {"pairs": []},
    }
    if not args.nvme:
        chosen = {p for p, _ in _pairs(args)}
        data["skipped_pairs"] = {p: why for p, why in WORLD_SIZE_1.items() if p not in chosen}
    jobs = _jobs(args)
    skip: dict[str, str] = {}
    if args.nvme:
        reason = args.skip_ds_nvme or _libaio_reason()
        if reason:
            skip["ds-nvme"] = reason
            data["notes"].append(reason)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the runs' temporary folder: the NVMe runs' swap files (O_DIRECT: not on a tmpfs)
    scratch = Path(tempfile.mkdtemp(prefix="bench_gpu_pairs-", dir=args.scratch))

    def save() -> None:
        data["summary"] = summarize(data["results"], args)
        out.write_text(json.dumps(data, indent=1))
        out.with_suffix(".md").write_text(markdown(data))

    save()
    longest = 0.0
    for rnd in range(args.rounds):
        order = jobs[rnd % len(jobs) :] + jobs[: rnd % len(jobs)]
        for stage, name in order:
            if name in skip:
                if rnd == 0:
                    data["results"].append(
                        {"stage": stage, "run": name, "status": "skipped", "error": skip[name]}
                    )
                continue
            left = deadline - time.time()
            if left < max(longest, 5.0):
                data["notes"].append(
                    f"deadline: stopped in round {rnd + 1} with {left:.0f} s left (a run took up to {longest:.0f} s)"
                )
                save()
                return data
            cmd = (
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    name,
                    "--stage",
                    str(stage),
                    "--model",
                    json.dumps(model),
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                ]
                + (["--tiny-cpu"] if args.tiny and args.cpu else [])
                + (["--profile"] if args.profile else [])
            )
            env = dict(os.environ, TMPDIR=str(scratch), MASTER_PORT=str(_free_port()))
            t0 = time.time()
            rec: dict[str, Any] = {"stage": stage, "run": name, "round": rnd}
            by_deadline = left < args.run_timeout
            got = run_group(
                cmd, min(args.run_timeout, left), env, tag=RESULT_TAG.strip(), grace=args.exit_grace
            )
            line = next((x for x in got.text.splitlines() if x.startswith(RESULT_TAG)), None)
            if got.ok and line:
                rec.update(json.loads(line[len(RESULT_TAG) :]), status="ok")
                if got.hung_after_result is not None:
                    rec["note"] = f"hung at exit after its result: killed after {got.hung_after_result} s"
                data.setdefault("n_params", rec["n_params"])
                data.setdefault("device", rec["device"])
            elif got.cut and by_deadline:
                rec.update(status=f"cut by the deadline after {got.seconds:.0f} s", error=got.text[-2000:])
            elif got.cut:
                rec.update(
                    status=f"timed out after {got.seconds:.0f} s (--run-timeout)", error=got.text[-2000:]
                )
            else:
                rec.update(status=f"failed (exit {got.rc})", error=got.text[-2000:])
            rec["wall_s"] = round(time.time() - t0, 1)
            longest = max(longest, rec["wall_s"])
            data["results"].append(rec)
            save()
            print(
                f"[round {rnd + 1}] ZeRO {stage} {name}: {rec['status']} {rec.get('step_ms', 0):.1f} ms",
                flush=True,
            )
        data["rounds_done"] = rnd + 1
        save()
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="2,3,1", help="ZeRO stages, in the order measured")
    p.add_argument(
        "--pairs",
        default=",".join(p for p, _ in PAIRS if p not in WORLD_SIZE_1),
        help="plugins to compare, comma-separated (default: all but loco, which shows nothing at world size 1)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step per run (torch.profiler) and report the ops whose time differs most",
    )
    p.add_argument("--nvme", action="store_true", help="nvmeswap vs DeepSpeed's NVMe offload (ZeRO 3)")
    p.add_argument(
        "--scratch", default=None, help="folder for the runs' files, swap files included (default: TMPDIR)"
    )
    p.add_argument("--skip-ds-nvme", default=None, help="with --nvme: skip DeepSpeed's run, for this reason")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke check)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU is visible")
    p.add_argument("--deadline-s", type=float, default=600.0, help="stop starting runs after this")
    p.add_argument("--deadline-at", type=float, default=None, help="the same as a Unix time")
    p.add_argument("--run-timeout", type=float, default=240.0, help="longest one run may take")
    p.add_argument(
        "--exit-grace",
        type=float,
        default=10.0,
        help="seconds a run may take to exit after printing its result",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu_pairs.json"))
    p.add_argument("--child", default=None, help="internal: run this one run in this process")
    p.add_argument("--stage", type=int, default=2, help="internal (--child)")
    p.add_argument("--model", default=json.dumps(GPU_MODEL), help="internal (--child)")
    p.add_argument("--tiny-cpu", action="store_true", help="internal (--child)")
    args = p.parse_args(argv)
    if args.child:
        print(RESULT_TAG + json.dumps(child(args)), flush=True)
        return 0
    data = parent(args)
    print(markdown(data))
    print(DONE_TAG, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
