"""Two nodes on one machine: step time and bytes on the inter-node link, DeepSpeed vs LoCo.

    python benchmarks/bench_two_nodes.py                                  # ZeRO 0; 100mbit, 1gbit, unshaped
    python benchmarks/bench_two_nodes.py --rates 100mbit,none --steps 6   # a shorter run

Two emulated nodes (network namespaces joined by a veth pair, ``zerohooks.testing.nodes``) of two
gloo ranks each, started by torchrun in each namespace; the link between them shaped with tc's
token bucket at each ``--rates`` entry (``none``: unshaped).  Ranks of one node talk over
loopback, unshaped, as on a real machine.  The demo GPT (examples/gpt.py; d_model 512, 2 layers,
8 heads: 6.4 M parameters) trains on the standard-library corpus (examples/data.py), micro-batch
4 x 32 tokens, fp32 compute (``--model-dtype bf16``: a bf16 model), ZeRO ``--stage``, three ways in the same launch:

* ``deepspeed-bf16``: DeepSpeed alone, gradients all-reduced in bf16 (``communication_data_type``);
* ``loco-flat``: LoCo 4-bit, one all-to-all over the 4 ranks;
* ``loco-two-level``: LoCo 4-bit, ``hierarchy: detect`` (two-level: the node layout comes from
  torchrun's LOCAL_WORLD_SIZE); on ZeRO 1-3 loco also all-gathers the parameters, two-level
  (``parameter_gather``, the default);
* ``loco-two-level-dsgather`` (when ``--runs`` names it): the same with ``parameter_gather:
  deepspeed``, DeepSpeed's ring all-gather of the parameters;
* ``loco-two-level-collective`` (when ``--runs`` names it): the same with ``gloo_exchange:
  collective``, gloo's all-to-all and all-gather collectives instead of loco's point-to-point
  exchanges.

DeepSpeed's own 4-bit gradients (ZeRO++ ``zero_quantized_gradients``, ZeRO 3 only) are tried
once before anything starts: on CPU DeepSpeed has no quantizer op, so it is reported as not
runnable, with DeepSpeed's error.

Per run: median step time (forward, backward, optimizer step; the slowest rank of each step),
the loss of the last step (mean over ranks), the bytes that crossed the link per step (median;
counters of node 0's link interface read between barriers around each step) and what the
counters say should cross (zerohooks' wire record for DeepSpeed's ring all-reduce, ``plugin.stats``
for LoCo: its inter-node all-to-all and all-gather, 2/3 of a flat all-to-all, half of a ring
all-gather; gradients only: DeepSpeed's parameter all-gathers are not counted).  With an unshaped
rate in the same launch, each shaped run is also compared with its floor (the run's unshaped step
time plus the busier direction's bytes over the link rate), and every run's time to a target loss
(DeepSpeed's final loss + 1 %) is reported.

Results: JSON in benchmarks/out/bench_two_nodes.json, markdown printed and in
benchmarks/out/bench_two_nodes.md, step time against link rate in benchmarks/out/bench_two_nodes.png.
Needs root and iproute2 (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
sys.path.insert(0, str(ROOT / "examples"))  # gpt.py, data.py (imported, not edited)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

FORMAT = 2
RUNS = (
    "deepspeed-bf16",
    "loco-flat",
    "loco-two-level",
    "loco-two-level-dsgather",
    "loco-two-level-collective",
    "deepspeed-bf16-hpz",
    "loco-two-level-hpz",
)
"""Every run; the ``-hpz`` ones (ZeRO 3 only: ZeRO++ hierarchical partitioning, a secondary copy
of the parameters per node, so forward and backward all-gathers stay inside the node) run when
``--runs`` names them."""
DEFAULT_RUNS = RUNS[:3]
NODES, LOCAL = 2, 2


# --------------------------------------------------------------------------------------- ranks


def _link() -> tuple[int, int]:
    """Bytes sent and received through this node's link interface so far."""
    base = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def _run_config(name: str, stage: int, model_dtype: str = "fp32") -> dict[str, Any]:
    from _models import demo_ds_config

    cfg = demo_ds_config(stage, micro_batch=4)
    cfg["communication_data_type"] = "bf16"
    if model_dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if name == "loco-flat":
        cfg["loco"] = {"hierarchy": "flat"}
    elif name.startswith("loco-two-level"):
        cfg["loco"] = {"hierarchy": "detect"}
        if name.endswith("-dsgather"):
            cfg["loco"]["parameter_gather"] = "deepspeed"
        if name.endswith("-collective"):
            cfg["loco"]["gloo_exchange"] = "collective"
    if name.endswith("-hpz"):
        cfg["zero_optimization"]["zero_hpz_partition_size"] = LOCAL
    return cfg


def _train(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs on every rank: warm-up steps, then measured steps, each between barriers."""
    import torch
    import torch.distributed as dist
    from data import BatchSampler, ByteCorpus
    from gpt import GPT, GPTConfig

    import zerohooks

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=8, d_model=args.d_model))
    engine, *_ = zerohooks.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_run_config(name, args.stage, args.model_dtype),
    )
    att = zerohooks.attachment(engine)
    plugin = next((p for p in att.plugins if p.name == "loco"), None) if att is not None else None
    sampler = BatchSampler(ByteCorpus.load(train_bytes=1 << 20).train, args.seq_len, 4, args.seed, rank)
    losses, times, link, busiest = [], [], [], []
    phases: list[tuple[float, float, float]] = []  # forward, backward, optimizer step
    for step in range(args.warmup + args.steps):
        x, y = sampler.next()
        dist.barrier()
        before = _link()
        dist.barrier()  # nobody starts before rank 0 has read
        t0 = time.perf_counter()
        loss = engine(x, y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        dist.barrier()
        after = _link()
        dist.barrier()  # nobody goes on before rank 0 has read
        losses.append(float(loss.detach()))
        if step >= args.warmup:
            times.append(elapsed)
            phases.append((t1 - t0, t2 - t1, t0 + elapsed - t2))
            tx, rx = after[0] - before[0], after[1] - before[1]
            link.append(tx + rx)
            busiest.append(max(tx, rx))  # each direction has its own token bucket
    topo = getattr(plugin, "_two_level", None) if plugin is not None else None
    mine = {
        "losses": losses,
        "times": times,
        "link": link,
        "busiest": busiest,
        "phases": phases,
        "stats": list(plugin.stats.history)[args.warmup :] if plugin is not None else None,
        "wire": list(att.counters.wire_history)[args.warmup :] if att is not None else None,
        "two_level": None if topo is None else [topo.nodes, topo.node_size],
        "kernels": bool(plugin.kernels) if plugin is not None else None,
        "params": model.num_parameters(),
    }
    zerohooks.detach(engine)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return _summary(every, args)


def _crossing(every: list[dict[str, Any]], step: int) -> float:
    """Bytes the counters say crossed between the 2 nodes at ``step`` (see the module docstring)."""
    from loco.state import crossing_bytes

    ring = NODES / len(every)  # of a ring over ranks 0..W-1, N of the W edges join two nodes
    total = 0.0
    for r in every:
        if r["stats"] is None:
            total += ring * sum(n for coll in r["wire"][step].values() for n in coll.values())
        else:
            total += crossing_bytes(r["stats"][step], NODES, LOCAL)
    return total


def _summary(every: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    steps = range(args.steps)
    slowest = [max(r["times"][i] for r in every) for i in steps]
    return {
        "params": every[0]["params"],
        "kernels": every[0]["kernels"],
        "two_level": every[0]["two_level"],
        "step_s": slowest,
        "median_step_s": statistics.median(slowest),
        "final_loss": sum(r["losses"][-1] for r in every) / len(every),
        "losses": [sum(r["losses"][i] for r in every) / len(every) for i in range(len(every[0]["losses"]))],
        "link_bytes": every[0]["link"],
        "median_link_bytes": statistics.median(every[0]["link"]),
        "median_busiest_direction_bytes": statistics.median(every[0]["busiest"]),
        # rank 0's forward, backward and optimizer step, each the median over the measured steps
        "median_phases_s": [statistics.median(p[k] for p in every[0]["phases"]) for k in range(3)],
        "counted_crossing_bytes": statistics.median(_crossing(every, i) for i in steps),
    }


def worker(args: argparse.Namespace) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    import zerohooks

    torch.set_num_threads(1)
    zerohooks.skip_deepspeed_compiles()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    out = {name: _train(name, args) for name in args.runs.split(",")}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -------------------------------------------------------------------------------------- driver


def probe_qgz() -> str | None:
    """None when DeepSpeed's quantized gradients (ZeRO++ qgZ) can run here, else why not: the
    op its ``all_to_all_quant_reduce`` loads first, as it loads it."""
    try:
        from deepspeed.ops import op_builder

        op_builder.QuantizerBuilder().load()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_rate(rate: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from zerohooks.testing.nodes import EmulatedNodes

    with (
        tempfile.TemporaryDirectory() as tmp,
        EmulatedNodes(NODES, None if rate == "none" else rate) as nodes,
    ):
        out = Path(tmp) / "out.json"
        worker_argv = [str(Path(__file__).resolve()), "--worker", "--out", str(out), *argv]
        job = nodes.launch(worker_argv, LOCAL, env={"PYTHONUNBUFFERED": "1"})
        codes = job.wait(timeout=args.timeout)
        if any(codes) or not out.exists():
            raise RuntimeError(f"rate {rate}: exit codes {codes}\n{job.output(0)[-6000:]}")
        return dict(json.loads(out.read_text()))


_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bytes_per_s(rate: str) -> float | None:
    """A tc rate (``100mbit``, ``1gbit``; tc's decimal units) in bytes per second; None for
    ``none`` (unshaped)."""
    for unit, factor in _UNITS.items():
        if rate.endswith(unit) and rate[: -len(unit)].replace(".", "", 1).isdigit():
            return float(rate[: -len(unit)]) * factor / 8
    return None


def _smoothed(losses: list[float], i: int) -> float:
    """Mean of the loss at step i and the two before it (the demo's loss is noisy step to step)."""
    window = losses[max(0, i - 2) : i + 1]
    return sum(window) / len(window)


def derive(res: dict[str, Any], slack: float = 0.01) -> None:
    """Per run: the floor (the same run's unshaped step time plus the busier direction's bytes
    over the link rate, both from this launch), the ratio to it, the final loss (last three
    steps) against DeepSpeed's, and the time to the target loss: DeepSpeed's final loss plus
    ``slack``, reached when the last three steps' mean falls to it (measured steps only)."""
    unshaped = res["rates"].get("none", {})
    warmup = res["meta"]["warmup"]
    for rate, runs in res["rates"].items():
        base = runs.get("deepspeed-bf16")
        bps = rate_bytes_per_s(rate)
        target = None if base is None else (1 + slack) * _smoothed(base["losses"], len(base["losses"]) - 1)
        for name, r in runs.items():
            r["final_loss_smoothed"] = _smoothed(r["losses"], len(r["losses"]) - 1)
            if base is not None:
                r["final_loss_vs_deepspeed"] = r["final_loss_smoothed"] / base["final_loss_smoothed"] - 1
            if bps is not None and name in unshaped:
                floor = unshaped[name]["median_step_s"] + r["median_busiest_direction_bytes"] / bps
                r["floor_s"], r["vs_floor"] = floor, r["median_step_s"] / floor
            if target is not None:
                r["target_loss"] = target
                r["time_to_target_s"] = None
                elapsed = 0.0
                for i, t in enumerate(r["step_s"]):
                    elapsed += t
                    if _smoothed(r["losses"], warmup + i) <= target:
                        r["time_to_target_s"] = elapsed
                        break


def markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [
        f"Two emulated nodes x 2 ranks, ZeRO {meta['stage']}, demo GPT {meta['params'] / 1e6:.1f} M "
        f"parameters (d_model {meta['d_model']}, {meta['layers']} layers), micro-batch 4 x {meta['seq_len']} "
        f"tokens, {'a bf16 model' if meta.get('model_dtype') == 'bf16' else 'fp32 compute'}; {meta['steps']} "
        f"measured steps after {meta['warmup']} warm-up.",
        "",
        "| link | run | median step (s) | vs DeepSpeed | vs floor | time to target (s) | final loss (vs DS) "
        "| bytes on the link / step | counted to cross (gradients) | vs DeepSpeed bytes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, runs in res["rates"].items():
        base = runs.get("deepspeed-bf16")
        for name, r in runs.items():
            rel_t = f"{r['median_step_s'] / base['median_step_s']:.2f}x" if base else "-"
            rel_b = f"{r['median_link_bytes'] / base['median_link_bytes']:.3f}x" if base else "-"
            floor = f"{r['vs_floor']:.2f}x" if "vs_floor" in r else "-"
            ttt = r.get("time_to_target_s", "-")
            ttt = "not reached" if ttt is None else ttt if isinstance(ttt, str) else f"{ttt:.1f}"
            vs = f" ({100 * r['final_loss_vs_deepspeed']:+.2f} %)" if "final_loss_vs_deepspeed" in r else ""
            lines.append(
                f"| {rate} | {name} | {r['median_step_s']:.3f} | {rel_t} | {floor} | {ttt} | "
                f"{r['final_loss_smoothed']:.4f}{vs} | {r['median_link_bytes'] / 1e6:.3f} MB | "
                f"{r['counted_crossing_bytes'] / 1e6:.3f} MB | {rel_b} |"
            )
    lines += [
        "",
        "Floor: the run's unshaped median step plus the busier direction's bytes per step over the link "
        "rate. Target loss: DeepSpeed's final loss (mean of the last 3 steps) + 1 %.",
        f"DeepSpeed zero_quantized_gradients (qgZ): {res['qgz']}",
    ]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(res["rates"])
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name in RUNS:
        ys = [res["rates"][r][name]["median_step_s"] for r in rates if name in res["rates"][r]]
        if ys:
            ax.plot(rates[: len(ys)], ys, marker="o", label=name)
    ax.set_xlabel("inter-node link rate (tc tbf; none = unshaped veth)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(
        f"2 nodes x 2 ranks, ZeRO {res['meta']['stage']}, {res['meta']['params'] / 1e6:.1f} M params"
    )
    ax.legend(fontsize=8)
    from _report import save_figure  # this folder (run as a script)

    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="100mbit,1gbit,none", help="comma-separated tc rates; none = unshaped")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    p.add_argument("--steps", type=int, default=8, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured ones")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--model-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32 compute, or a bf16 model (DeepSpeed's bf16 section: weights gathered in bf16 on ZeRO 1-3)",
    )
    p.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help=f"comma-separated subset of {list(RUNS)} (the -hpz ones need --stage 3)",
    )
    p.add_argument("--timeout", type=float, default=1200, help="seconds per link rate")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if set(args.runs.split(",")) - set(RUNS):
        p.error(f"--runs takes a comma-separated subset of {list(RUNS)}")
    if args.stage != 3 and "-hpz" in args.runs:
        p.error("the -hpz runs need --stage 3 (hpZ partitions ZeRO 3 parameters)")
    from zerohooks.testing.nodes import available

    reason = available(rate=True)
    if reason is not None:
        print(f"bench_two_nodes: {reason}", file=sys.stderr)
        return 2
    from zerohooks.build import build

    build(["loco"])  # once, here: the ranks load the cached kernels
    import torch

    argv = sys.argv[1:] if argv is None else argv
    passed = ["--stage", str(args.stage), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    passed += ["--d-model", str(args.d_model), "--layers", str(args.layers), "--seq-len", str(args.seq_len)]
    passed += ["--seed", str(args.seed), "--runs", args.runs, "--model-dtype", args.model_dtype]
    qgz = probe_qgz()
    t0, load = time.time(), os.getloadavg()[0]
    res: dict[str, Any] = {
        "meta": {
            "format": FORMAT,
            "command": " ".join(["python benchmarks/bench_two_nodes.py", *argv]),
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            **{
                k: getattr(args, k)
                for k in ("stage", "steps", "warmup", "d_model", "layers", "seq_len", "model_dtype")
            },
        },
        "qgz": "runs here (not measured by this script yet)"
        if qgz is None
        else f"cannot run on this machine (ZeRO 3 only; DeepSpeed's quantizer op: {qgz})",
        "rates": {},
    }
    for rate in args.rates.split(","):
        t = time.time()
        res["rates"][rate] = run_rate(rate, args, passed)
        print(f"{rate} done ({time.time() - t:.0f} s)", flush=True)
    first = next(iter(next(iter(res["rates"].values())).values()))
    res["meta"]["params"] = first["params"]
    res["meta"]["loco_kernels"] = (
        "compiled"
        if any(r.get("kernels") for runs in res["rates"].values() for r in runs.values())
        else "reference"
    )
    derive(res)
    res["meta"]["seconds"] = round(time.time() - t0)
    res["meta"]["load"] = f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    from _report import write_report  # this folder (run as a script)

    write_report(OUT, "bench_two_nodes", res, markdown(res), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
