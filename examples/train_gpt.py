"""Train a small GPT on the Python standard library's source bytes with DeepSpeed ZeRO.

    python examples/train_gpt.py                      # 2 CPU ranks (gloo), or 1 rank per GPU (NCCL)
    python examples/train_gpt.py --stage 3 --runs baseline,accumdtype
    python examples/train_gpt.py --runs all           # every registered run, or skipped with the reason
    python examples/train_gpt.py --list-runs
    python examples/train_gpt.py --nodes 2 --link-rate 100mbit --stage 0 --runs baseline,loco  # as root

The command launches its own ranks: run outside a distributed launch (no ``RANK`` in the
environment), it starts itself again under ``torch.distributed.run`` with ``--nproc`` ranks,
once per run (each run in its own processes: its own memory, peak memory and swap folder), or
once for all runs with ``--same-process`` (each engine released before the next is built).
The runs (``--runs``, registered in ``runs.py``) are compared in one report folder (``--out``):
loss.png, comm_bytes.png, report.md, results.json. ``--nodes N`` runs the ranks as N emulated
nodes joined by one shaped network link (``nodes.py``; Linux, root) and reports the bytes that
crossed it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure
import nodes as emulated  # sibling modules of this script
import outdir
import runs as run_registry
from launch import command_line, launch, registered_runs, where
from rank_utils import Progress, peak_memory, quiet_deepspeed, release, reset_peak_memory, skip_shm_build

WARMUP_STEPS = 3
T_IMPORT = time.time()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, also for options without help text (which argparse's own
    formatter skips); flags (no value) and options whose help already names the default are left
    as they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default is argparse.SUPPRESS or "(default" in text:
            return text
        default = "none" if action.default in ("", None) else "%(default)s"
        return f"{text} (default: {default})".strip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")
    g.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp32", "fp16"),
        default="auto",
        help="model/training dtype. auto: bf16 on GPUs and on CPUs with native bf16 matrix "
        "multiply, else fp32 (bf16 is emulated, about 17x slower, on AVX2-only CPUs). "
        "fp16: GPUs only",
    )
    g.add_argument(
        "--offload", action="store_true", help="offload the optimizer to CPU (stage>=1); off by default"
    )
    g.add_argument("--nproc", type=int, default=None, help="ranks to launch (default: #GPUs, else 2)")
    g = p.add_argument_group("comparison")
    g.add_argument(
        "--runs",
        default=None,
        help="comma-separated runs to compare, each a registered name or a+b; 'all' for every "
        f"registered run (default: {','.join(run_registry.DEFAULT_RUNS)}, those installed, each "
        "after its like-for-like baselines: zero3 for nvmeswap, fp32 for autocastzero ...)",
    )
    g.add_argument(
        "--same-process",
        action="store_true",
        help="train every run in one launch of the ranks, releasing each engine (engine.destroy(), "
        "which detaches zerohooks) before the next; faster start, but a run's peak memory then "
        "includes what earlier runs left behind. Default: one launch per run",
    )
    g.add_argument("--plugins", default="", help="comma-separated plugin runs applied on top of every run")
    g.add_argument("--list-runs", action="store_true", help="list the registered runs and exit")
    # the `deepspeed` launcher passes --local_rank; LOCAL_RANK in the environment is what we use
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    g.add_argument("--micro-batch", type=int, default=16, help="sequences per rank per micro-step")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    g.add_argument("--seq-len", type=int, default=128, help="context length in bytes")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    g.add_argument("--seed", type=int, default=1234, help="seed of the weights and of the batches")
    g.add_argument(
        "--eval-every",
        type=int,
        default=20,
        help="validation every N steps, before the first and after the last",
    )
    g.add_argument("--eval-batches", type=int, default=4, help="validation batches per rank")
    g.add_argument("--data-mb", type=float, default=4.0, help="MiB of stdlib source to train on")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks")
    g.add_argument("--d-model", type=int, default=128, help="model width")
    g.add_argument("--heads", type=int, default=4, help="attention heads (must divide --d-model)")
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        default=None,
        help="report folder (written by rank 0); refused when it holds an earlier command's report, "
        "unless --force (default: a new folder reports/<UTC time>-<runs> per command, "
        "reports/latest linking to the newest)",
    )
    g.add_argument("--force", action="store_true", help="overwrite the report already in --out")
    emulated.add_arguments(p)
    args = p.parse_args(argv)

    for name in ("steps", "micro_batch", "grad_accum", "seq_len", "layers", "d_model", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.eval_every < 1 or args.eval_batches < 1:
        p.error("--eval-every and --eval-batches must be at least 1")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.offload and args.stage == 0:
        p.error("--offload needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads ZeRO's optimizer)")
    if args.nproc is not None and args.nproc < 1:
        p.error("--nproc must be at least 1")
    emulated.check_args(args, p.error)
    args.plugin_list = tuple(x for x in args.plugins.split(",") if x)
    if args.runs is None:
        args.run_list = run_registry.default_runs(expected_dtype(args), args.stage)
    elif args.runs.strip() == "all":
        args.run_list = list(run_registry.RUNS)
    else:
        args.run_list = [x.strip() for x in args.runs.split(",") if x.strip()]
    if not args.run_list:
        p.error("--runs is empty")
    for spec in args.run_list:
        try:
            run_registry.resolve(spec, args.plugin_list)
        except KeyError as e:
            # said plainly, as zerohooks says a misspelt plugin section, without the usage text
            print(f"train_gpt: error: --runs: {e.args[0]}", file=sys.stderr)
            raise SystemExit(2) from None
    return args


def expected_dtype(args: argparse.Namespace) -> str:
    """The model dtype the ranks will train in (``--dtype auto`` resolved on this machine, as
    ``resolve_dtype`` does in the ranks): it decides the default runs' baselines."""
    if args.dtype != "auto":
        return str(args.dtype)
    import torch

    cuda = torch.cuda.is_available() and args.nodes == 1
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # zerohooks imports deepspeed
    return "bf16" if fast_bf16(cuda) else "fp32"


def baselines_left_out(args: argparse.Namespace) -> dict[str, str]:
    """The like-for-like baselines of the requested runs that this command does not train, and why."""
    runs = [run_registry.resolve(s, args.plugin_list) for s in args.run_list]
    names = {r.name for r in runs}
    out: dict[str, str] = {}
    for run in runs:
        for base in run.baselines(args.dtype, args.stage):
            if base not in names and base not in out:
                why = run_registry.left_out_baseline(base) if base in run_registry.RUNS else None
                out[base] = f"{run.name}'s baseline, " + (why or "not in --runs")
    return out


def list_runs(args: argparse.Namespace) -> None:
    import torch

    cuda = torch.cuda.is_available() and args.nodes == 1
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # zerohooks imports deepspeed
    world = args.nproc or (torch.cuda.device_count() if cuda else 2)
    default = run_registry.default_runs(expected_dtype(args), args.stage)
    print(f"Registered runs (examples/runs.py; * the default; [why not] with {world} rank(s) here):")
    for name, run in run_registry.RUNS.items():
        reason = run.skip_reason(where(args, world, cuda))
        state = f"  [{reason}]" if reason else ""
        print(f"{'*' if name in default else ' '} {name:<17} {run.help}{state}")
    extra = sorted(run_registry.plugin_names() - set(run_registry.RUNS))
    if extra:
        print("zerohooks plugins with no registered run (they run with their default settings):")
        for name in extra:
            reason = run_registry.plugin_default_run(name).skip_reason()
            print(f"  {name:<12} {'[' + reason + ']' if reason else 'installed'}")


# ---------------------------------------------------------------------------- launcher


# ---------------------------------------------------------------------------- worker


def fast_bf16(cuda: bool) -> bool:
    """Whether bf16 matrix multiplies run natively here (GPU, or AVX512/AMX CPUs)."""
    from zerohooks.adapter.compat import native_bf16

    return native_bf16(cuda)


def resolve_dtype(args: argparse.Namespace, cuda: bool) -> str:
    """The dtype for ``--dtype auto``, the same on every rank (slowest rank decides)."""
    import torch
    import torch.distributed as dist

    if args.dtype != "auto":
        return args.dtype
    device = torch.device("cuda") if cuda else torch.device("cpu")
    flag = torch.tensor([1 if fast_bf16(cuda) else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return "bf16" if flag.item() else "fp32"


def ds_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": args.stage}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world_size,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": args.lr,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": args.steps,
                "warmup_num_steps": max(1, args.steps // 10),
                "warmup_type": "linear",
                "cos_min_ratio": 0.1,
            },
        },
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "initial_scale_power": 12},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # keep torch AdamW, no JIT-built cpu_adam
    return cfg


def param_groups(model: Any) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases, LayerNorm or embeddings)."""
    decay: list[Any] = []
    no_decay: list[Any] = []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and "emb" not in name else no_decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_one(
    run: run_registry.Run, args: argparse.Namespace, ctx: dict[str, Any], corpus: Any
) -> dict[str, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist
    from data import BatchSampler
    from gpt import GPT, GPTConfig
    from tqdm import tqdm

    try:
        import zerohooks

        initialize = zerohooks.initialize
    except ImportError:
        initialize = deepspeed.initialize

    rank, world, cuda = ctx["rank"], ctx["world_size"], ctx["cuda"]
    t_run = time.time()
    config = run.config(ds_config(args, world))
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model))
    ctx["n_params"] = model.num_parameters()
    memory_kind = reset_peak_memory(cuda, ctx.get("own_process", False))
    if rank == 0:
        print(
            f"[{run.name}] building the DeepSpeed engine ({ctx['n_params'] / 1e6:.2f} M parameters)",
            flush=True,
        )
    engine, _, _, _ = initialize(model=model, model_parameters=param_groups(model), config=config)
    if rank == 0:
        print(
            f"[{run.name}] engine ready after {time.time() - t_run:.1f} s; validation at step 0", flush=True
        )
    device = engine.device

    train = BatchSampler(corpus.train, args.seq_len, args.micro_batch, args.seed, rank)
    val_batches = BatchSampler(corpus.val, args.seq_len, args.micro_batch, args.seed + 1, rank).fixed(
        args.eval_batches
    )
    tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len * world

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def evaluate(engine: Any) -> float:
        engine.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, y in val_batches:
                total += engine(x.to(device), y.to(device)).double()
        engine.train()
        dist.all_reduce(total)
        return total.item() / (len(val_batches) * world)

    losses: list[float] = []
    times: list[float] = []
    comm: list[dict[str, dict[str, int]] | None] = []
    wire: list[dict[str, dict[str, int]] | None] = []
    val: list[tuple[int, float]] = [(0, evaluate(engine))]  # before training: where every run starts
    if rank == 0:
        print(f"[{run.name}] step 0: val loss {val[0][1]:.4f}", flush=True)
    link = emulated.LinkMeter(args.nodes > 1)
    link.start()
    swap0 = measure.swap_bytes(engine)
    state_step = min(2, args.steps)
    state_bytes: dict[str, int] = {}
    load = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    progress = Progress(run.name, args.steps, rank == 0 and not sys.stdout.isatty())
    bar = tqdm(
        total=args.steps,
        desc=f"{run.name}",
        disable=rank != 0 or not sys.stdout.isatty(),  # else Progress prints lines
        dynamic_ncols=True,
        file=sys.stdout,
        mininterval=0.5,
    )
    for step in range(1, args.steps + 1):
        sync()
        t0 = time.perf_counter()
        step_loss = torch.zeros((), device=device)
        paused = 0.0
        for micro in range(args.grad_accum):
            x, y = train.next()
            loss = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            engine.backward(loss)
            if step == state_step and micro == args.grad_accum - 1:
                # the model state with every kind alive: gradients held, optimizer state made by
                # the first step (the count is not part of the step time)
                t_pause = time.perf_counter()
                state_bytes = measure.model_state_bytes(engine)
                paused = time.perf_counter() - t_pause
            engine.step()
            step_loss += loss.detach().float()
        loss_value = step_loss.item() / args.grad_accum
        sync()
        dt = time.perf_counter() - t0 - paused
        progress.update(step)
        losses.append(loss_value)
        times.append(dt)
        comm.append(measure.step_comm_bytes(engine))
        wire.append(measure.step_comm_bytes(engine, wire=True))
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        if step % args.eval_every == 0 or step == args.steps:
            v = evaluate(engine)
            val.append((step, v))
            if rank == 0:
                bar.write(f"[{run.name}] step {step}: train loss {loss_value:.4f}, val loss {v:.4f}")
    bar.close()
    load += [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    crossed = link.stop()
    swap1 = measure.swap_bytes(engine)
    swapped = None if swap0 is None or swap1 is None else [b - a for a, b in zip(swap0, swap1, strict=True)]
    peak = peak_memory(cuda)
    # what the plugins changed, after the training steps (one more step's micro-steps, not taken)
    dtypes = measure.param_dtypes(engine)
    probe = [train.next() for _ in range(args.grad_accum)]
    grad_error = measure.gradient_error(engine, probe, world)

    # gather every rank's numbers once, at the end (no extra collectives inside the loop)
    mine = {
        "loss": losses,
        "time": times,
        "comm": comm,
        "wire": wire,
        "peak": peak,
        "link": crossed,
        "swap": swapped,
        "state_bytes": state_bytes,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    zero_cfg = config.get("zero_optimization", {})
    offload = (zero_cfg.get("offload_optimizer") or {}).get("device")
    dtype = "bf16" if config.get("bf16", {}).get("enabled") else "fp32"
    dtype = "fp16" if config.get("fp16", {}).get("enabled") else dtype
    autocast = (config.get("autocastzero") or {}).get("dtype") or (
        "bfloat16" if (config.get("torch_autocast") or {}).get("enabled") else None
    )
    if autocast:  # fp32 parameters, the forward in a 16-bit dtype
        dtype = f"{'fp16' if autocast in ('float16', 'fp16') else 'bf16'}-autocast"
    result: dict[str, Any] = {
        "name": run.name,
        "status": "ok",
        "help": run.help,
        # the registered runs that differ from this one only by what it changes (runs.py)
        "baselines": list(run.baselines(args.dtype, args.stage)),
        "zero_stage": zero_cfg.get("stage", 0),
        "dtype": dtype,
        "offload": offload if offload and offload != "none" else None,
        "ds_config": config,
        "tokens_per_step": tokens_per_step,
        "warmup_steps": min(WARMUP_STEPS, max(0, args.steps - 1)),
        "train_loss": [sum(g["loss"][i] for g in gathered) / world for i in range(args.steps)],
        "step_time_s": [max(g["time"][i] for g in gathered) for i in range(args.steps)],
        "val_loss": val,
        "peak_memory_bytes": max(g["peak"] for g in gathered),
        # per rank, bytes of model state by kind (measure.model_state_bytes) at step state_step
        "state_bytes": [g["state_bytes"] for g in gathered],
        "state_step": state_step,
        # the 1-minute load average when the steps started and ended (rank 0), os.getloadavg
        "load_avg": load,
        "memory_kind": memory_kind,
        "per_rank": gathered,
        # per step, summed over ranks: bytes handed to the gradient collectives (what DeepSpeed
        # hands over, in the communication dtype) and bytes sent to other ranks (what an owner
        # of the collective such as loco really sends)
        "comm_bytes": measure.sum_over_ranks([g["comm"] for g in gathered], args.steps),
        "wire_bytes": measure.sum_over_ranks([g["wire"] for g in gathered], args.steps),
        # emulated nodes: bytes that crossed the link during the steps (and their evaluations)
        "link_bytes": None if crossed is None else sum(g["link"] for g in gathered),
        "wall_time_s": round(time.time() - t_run, 1),
        # what the run's plugins changed: parameters by dtype (whole model), the dtype handed to
        # the gradient collectives, the gradient's error after accumulation and reduction against
        # fp64 (see measure.gradient_error), swap-file bytes per step summed over ranks
        "param_dtypes": dtypes,
        "comm_dtypes": measure.comm_dtypes(comm[-1] if comm else None),
        "grad_error": grad_error,
        "disk_bytes_per_step": None
        if any(g["swap"] is None for g in gathered)
        else {
            "written": sum(g["swap"][0] for g in gathered) / args.steps,
            "read": sum(g["swap"][1] for g in gathered) / args.steps,
        },
    }
    release(engine, config, rank)
    del engine, model
    if not ctx.get("own_process"):  # free it for the next run of this process (a rank alone exits)
        gc.collect()
    return result


def worker(args: argparse.Namespace) -> int:
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0:  # start-up takes seconds on a CPU: say what is going on
        print(f"rank 0 of {world}: importing torch and DeepSpeed", flush=True)

    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    elif args.dtype == "fp16":
        raise SystemExit("--dtype fp16 needs GPUs; use bf16 or fp32 on CPU")

    import deepspeed
    import torch.distributed as dist
    from data import ByteCorpus
    from report import write_report

    quiet_deepspeed()
    backend = "nccl" if cuda else "gloo"
    if not cuda:
        skip_shm_build()
    if rank == 0:
        print(f"rank 0 of {world}: joining the {backend} process group", flush=True)
    deepspeed.init_distributed(dist_backend=backend)
    try:
        auto = args.dtype == "auto"
        args.dtype = resolve_dtype(args, cuda)
        if rank == 0 and auto:
            why = (
                "native bf16 matrix multiply"
                if args.dtype == "bf16"
                else "no native bf16 matrix multiply on this CPU, bf16 would be emulated"
            )
            print(f"dtype: {args.dtype} (auto: {why}; choose with --dtype)", flush=True)
        t_start = float(os.environ.get("TRAIN_GPT_T0", "0")) or T_IMPORT
        corpus = ByteCorpus.load(
            train_bytes=int(args.data_mb * 2**20), val_bytes=max(1 << 16, int(args.data_mb * 2**16))
        )
        try:
            import zerohooks

            zh_version = getattr(zerohooks, "__version__", "installed")
        except ImportError:
            zh_version = None
        ctx: dict[str, Any] = {"rank": rank, "world_size": world, "cuda": cuda}
        meta: dict[str, Any] = {
            "command": os.environ.get("TRAIN_GPT_COMMAND") or command_line(),
            "launch_t0": float(os.environ.get("TRAIN_GPT_T0", "0")) or T_IMPORT,
            "world_size": world,
            "cpu_count": os.cpu_count(),
            "backend": backend,
            "device": torch.cuda.get_device_name(0)
            if cuda
            else f"CPU ({platform.processor() or platform.machine()})",
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "zerohooks": zh_version,
            "model": {
                "n_layer": args.layers,
                "d_model": args.d_model,
                "n_head": args.heads,
                "seq_len": args.seq_len,
                "vocab_size": 256,
            },
            "steps": args.steps,
            "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum,
            "tokens_per_step": args.micro_batch * args.grad_accum * args.seq_len * world,
            "warmup_steps": min(WARMUP_STEPS, max(0, args.steps - 1)),
            "seed": args.seed,
            "args": {k: v for k, v in vars(args).items() if k not in ("run_list", "plugin_list")},
            "data": {
                "root": corpus.root,
                "train_bytes": corpus.train.numel(),
                "val_bytes": corpus.val.numel(),
                "train_files": corpus.train_files,
                "val_files": corpus.val_files,
            },
        }
        if rank == 0:
            print(
                f"data: {corpus.train.numel() / 2**20:.1f} MiB train ({corpus.train_files} files), "
                f"{corpus.val.numel() / 2**10:.0f} KiB val ({corpus.val_files} files) from "
                f"{corpus.root}",
                flush=True,
            )
        # under our launcher: the runs of this launch, after those of earlier launches (the state)
        state = os.environ.get("TRAIN_GPT_STATE")
        results: list[dict[str, Any]] = json.loads(Path(state).read_text()) if state else []
        specs = json.loads(os.environ.get("TRAIN_GPT_RUNS") or "null") or args.run_list
        ctx["own_process"] = len(specs) == 1
        meta["registered_runs"] = registered_runs()
        meta["runs_requested"] = [run_registry.resolve(s, args.plugin_list).name for s in args.run_list]
        meta["one_process_per_run"] = not args.same_process and state is not None
        meta["baselines_left_out"] = baselines_left_out(args)
        here = where(args, world, cuda)
        for spec in specs:
            run = run_registry.resolve(spec, args.plugin_list)
            reason = run.skip_reason(here)
            if reason:
                if rank == 0:
                    print(f"[{run.name}] skipped: {reason}", flush=True)
                results.append({"name": run.name, "status": "skipped", "reason": reason})
            else:
                results.append(train_one(run, args, ctx, corpus))
            meta["n_params"] = ctx.get("n_params", 0)
            meta["memory_kind"] = next((r["memory_kind"] for r in results if "memory_kind" in r), "")
            meta["wall_time_s"] = round(time.time() - t_start, 1)
            if rank == 0:  # after every run, so a later failure keeps the finished ones
                folder = write_report(args.out, results, meta)
                if state:
                    Path(state).write_text(json.dumps(results))
                    print(f"[{run.name}] done; report so far: {folder / 'report.md'}", flush=True)
        if rank == 0 and not state:  # under our launcher, the launcher says it at the end
            report = (folder / "report.md").read_text().splitlines()
            table = [ln for ln in report if ln[:1] == "|" or ln[:3] == "## "]
            print("\n".join(table))
            # under our own launcher, the launcher states the command's wall time once the
            # ranks have exited (and writes it into report.md); under torchrun, this rank does
            took = "" if "TRAIN_GPT_T0" in os.environ else f"done in {time.time() - t_start:.0f} s; "
            print(
                f"{took}report: {folder.resolve()} (report.md, loss.png, comm_bytes.png, results.json)",
                flush=True,
            )
        dist.barrier()
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        launched = "RANK" in os.environ and "TRAIN_GPT_ARGV" in os.environ
        argv = json.loads(os.environ["TRAIN_GPT_ARGV"]) if launched else sys.argv[1:]
    args = parse_args(argv)
    if args.list_runs:
        list_runs(args)
        return 0
    if "RANK" not in os.environ:
        try:
            folder = outdir.choose(args.out, args.force, outdir.run_set_tag(args.runs, args.nodes))
        except outdir.OutExists as e:
            print(f"train_gpt: error: {e}", file=sys.stderr)
            return 2
        folder.mkdir(parents=True, exist_ok=True)
        outdir.point_latest(folder)
        args.out = str(folder)
        print(f"train_gpt: report folder {folder}", flush=True)
        return launch(args, [*argv, "--out", str(folder), "--force"], Path(__file__).resolve(), T_IMPORT)
    if args.out is None:  # started by torchrun itself: rank 0 names the folder, the others write nothing
        args.out = str(outdir.new_folder(outdir.run_set_tag(args.runs, args.nodes)))
    try:
        return worker(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        rank = os.environ.get("RANK", "?")
        traceback.print_exc()
        message = f"rank {rank}: {type(e).__name__}: {e}"
        print(f"\ntrain_gpt: {message}", file=sys.stderr, flush=True)
        if os.environ.get("TRAIN_GPT_ERROR_DIR"):
            with contextlib.suppress(OSError):
                Path(os.environ["TRAIN_GPT_ERROR_DIR"], f"rank{rank}.txt").write_text(message)
        return 1


if __name__ == "__main__":
    sys.exit(main())
