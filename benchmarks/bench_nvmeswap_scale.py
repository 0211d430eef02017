"""nvmeswap at the size it exists for: a ~2 B-parameter GPT whose fp32 optimizer state (12 bytes a
parameter, 24 GB) does not fit in this machine's RAM, trained with ZeRO 3 + bf16 on one rank.

    python benchmarks/bench_nvmeswap_scale.py [--small]
        [--runs nvmeswap,nvmeswap_step,nvmeswap_overlap,nvmeswap_unfused,deepspeed_nvme,deepspeed_cpu] [--steps 6]
        [--folder /work/scratch/nvmeswap_scale] [--mem-limit-gib 14] [--prefetch-gib 1.0] [--no-resume]

Each run is its own process (one gloo rank), started inside a memory cgroup limited to
``--mem-limit-gib`` when the cgroup-v1 memory controller is writable (so a run that needs more is
killed alone, never the machine's other work); the cgroup's peak (``memory.max_usage_in_bytes``,
every process of the run together) and the process's ``VmHWM`` are reported.

* Model: GPT (``--layers`` x [LayerNorm, causal attention, LayerNorm, 4x MLP], tied nothing,
  ``--vocab`` tokens), built under ``deepspeed.zero.Init(dtype=bfloat16)``: no fp32 copy of the
  whole model ever exists in RAM.  One fixed batch of random tokens (``--micro-batch`` x ``--seq``)
  every step, so the loss must fall (the model memorises it); torch's AdamW (``torch_adam``) in
  every run, lr 1e-4.
* Runs: ``nvmeswap`` (defaults: fused Adam step, master + 2 moments on disk), ``nvmeswap_overlap``
  (the same with ``prefetch_bytes`` = ``--prefetch-gib``: state read ahead during backward, and its
  last writes left to drain during the next forward), ``nvmeswap_step`` (``step_in_backward``:
  each sub-group read, stepped and written by a background thread during backward as soon as
  its gradients are final, the step only taking those steps), ``nvmeswap_unfused``
  (``fused_adam: false``), ``deepspeed_nvme`` (DeepSpeed's ``offload_optimizer: nvme``, its libaio
  swapper; needs ``libaio-dev`` and builds its ``async_io`` op), ``deepspeed_cpu``
  (``offload_optimizer: cpu``: its need is computed and it is run under the limit to show how it
  fails).
* Per step: forward+backward time, ``engine.step()`` time (for nvmeswap up to its last write
  landing: no credit for overlapping it with the next forward pass; for ``nvmeswap_overlap`` and
  ``nvmeswap_step`` up to the step's return, their last writes draining in the next step), time blocked on the disk inside the
  step (nvmeswap's I/O waits; not measured for DeepSpeed), the time the swap folder's block
  device was busy (``io_ticks`` of ``/sys/dev/block/<dev>/stat``, every process's I/O; none on
  tmpfs), ``/proc/self/io`` read/write bytes
  divided by the parameter count, loss.  Step time = median over the steps after ``--warmup``.
* Disk bound: ``fio`` (O_DIRECT, the swappers' 1 MiB requests, iodepth 8) writing then reading a
  ``--fio-size`` file in the same folder, in the same run; the optimizer phase's bound is bytes
  moved / fio rate, and each step is compared with max(forward+backward, bytes read / fio read
  rate, bytes written / fio write rate), what a fully overlapped step cannot beat if the device
  reads and writes at once at full speed; fio then reads and writes half and half at once on the
  same device, and each step is also compared with max(forward+backward, bytes read and written /
  that summed rate): the bound of a step whose reads and writes share one device.
* Resume (nvmeswap): steps 1-2, ``save_checkpoint`` into the same folder (time and bytes written),
  a new process loads it and runs steps 3-4: losses and a weight checksum must equal the
  uninterrupted run's bit for bit.

Free disk is checked first; every swap file and checkpoint is removed at the end.  Writes
``benchmarks/out/nvmeswap_scale[_small].json``/``.md``/``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "out"
RUNS = (
    "nvmeswap",
    "nvmeswap_step",
    "nvmeswap_overlap",
    "nvmeswap_unfused",
    "deepspeed_nvme",
    "deepspeed_cpu",
)
OVERLAPS = ("nvmeswap_overlap", "nvmeswap_step")
"""The runs whose optimizer I/O overlaps forward and backward (compared with ``nvmeswap``)."""
GIB = 1 << 30


# -- the model ------------------------------------------------------------------------------------
def _gpt(layers: int, d: int, vocab: int, seq: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.fc1 = nn.Linear(d, 4 * d, bias=False)
            self.fc2 = nn.Linear(4 * d, d, bias=False)
            self.heads = max(d // 128, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
            a = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.lnf = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.emb(tokens[:, :-1]) + self.pos.weight[: tokens.shape[1] - 1]
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.lnf(x)).float()
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return GPT()


def param_count(layers: int, d: int, vocab: int, seq: int) -> int:
    return layers * (12 * d * d + 4 * d) + 2 * vocab * d + seq * d + 2 * d


def _config(run: str, folder: str, a: argparse.Namespace) -> dict[str, Any]:
    device = "cpu" if run == "deepspeed_cpu" else "nvme"
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": a.sub_group,
            "reduce_bucket_size": 50_000_000,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_max_live_parameters": 100_000_000,
            "stage3_max_reuse_distance": 100_000_000,
            "offload_optimizer": {"device": device, "pin_memory": False},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "overlap_events": True},
    }
    if device == "nvme":
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = folder
    if run.startswith("nvmeswap"):
        cfg["nvmeswap"] = {"fused_adam": False} if run == "nvmeswap_unfused" else {}
    if run == "nvmeswap_overlap":
        cfg["nvmeswap"]["prefetch_bytes"] = int(a.prefetch_gib * GIB)
    if run == "nvmeswap_step":
        cfg["nvmeswap"]["step_in_backward"] = True
    return cfg


def _early_counts(engine: Any) -> list[int] | None:
    import zerohooks

    att = zerohooks.attachment(engine)
    for p in att.plugins if att is not None else ():
        if p.name == "nvmeswap" and p.early is not None:
            return [p.early.steps, p.early.undone]
    return None


def _disk_busy_ms(folder: str) -> int | None:
    """Milliseconds the block device holding ``folder`` has been busy (``io_ticks`` of its
    ``/sys/dev/block/<major>:<minor>/stat``: time with at least one request in flight, every
    process's); None where the folder is on no block device (tmpfs, overlay)."""
    st = os.stat(folder)
    try:
        fields = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat").read_text().split()
        return int(fields[9])
    except (OSError, IndexError, ValueError):
        return None


# -- one run, in its own process -------------------------------------------------------------------
def _proc_io() -> tuple[int, int]:
    vals = dict(line.split(":") for line in Path("/proc/self/io").read_text().splitlines())
    return int(vals["read_bytes"]), int(vals["write_bytes"])


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _swap_state(engine: Any) -> Any:
    import zerohooks

    att = zerohooks.attachment(engine)
    for p in getattr(att, "plugins", ()) if att is not None else ():
        if getattr(p, "name", "") == "nvmeswap":
            return p.state
    return None


def _weights_checksum(engine: Any) -> str:
    import hashlib

    h = hashlib.sha256()
    for flat in engine.optimizer.fp16_partitioned_groups_flat:
        h.update(flat.detach().view(-1).view(dtype=__import__("torch").int16).numpy().tobytes())
    return h.hexdigest()[:16]


def child(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed

    import zerohooks

    zerohooks.skip_deepspeed_compiles()  # DeepSpeed's shm all-reduce op: minutes of build, never used
    deepspeed.init_distributed(dist_backend="gloo")
    run, phase = a.child, a.phase
    folder = os.path.join(a.folder, run)
    os.makedirs(folder, exist_ok=True)
    cfg = _config(run, folder, a)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
        model = _gpt(a.layers, a.d_model, a.vocab, a.seq + 1)
    numel = sum(p.ds_numel for p in model.parameters())
    print(f"[{run}] model built: {numel / 1e9:.3f} B params, {time.perf_counter() - t0:.0f}s", flush=True)
    t0 = time.perf_counter()
    init = zerohooks.initialize if run.startswith("nvmeswap") else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    start_s = time.perf_counter() - t0
    print(f"[{run}] engine built in {start_s:.0f}s, RSS {_status_kib('VmRSS') / 2**20:.1f} GiB", flush=True)
    state = _swap_state(engine)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=gen)
    out: dict[str, Any] = {"run": run, "phase": phase, "params": numel, "startup_s": start_s, "steps": []}
    first, last = 1, a.steps if run == "nvmeswap" or a.other_steps is None else a.other_steps
    if phase == "save":
        last = 2
    elif phase == "load":
        t0 = time.perf_counter()
        engine.load_checkpoint(os.path.join(a.folder, "ckpt"))
        out["load_s"] = time.perf_counter() - t0
        first, last = 3, 4
    overlap = run in OVERLAPS
    for s in range(first, last + 1):
        r0, w0 = _proc_io()
        wait0 = state.io_wait if state is not None else 0.0
        busy0 = _disk_busy_ms(folder)
        t0 = time.perf_counter()
        loss = engine(tokens)
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        if state is not None and not overlap:  # its last writes: counted (bytes and time) in this step
            from nvmeswap import swapper

            swapper.flush(state)
        # with the overlap, the last writes drain during the next forward (counted in that step:
        # in steady state a step's time is the time from one forward to the next)
        t2 = time.perf_counter()
        r1, w1 = _proc_io()
        busy1 = _disk_busy_ms(folder)
        rec = {
            "step": s,
            "loss": float(loss.detach()),
            "fwd_bwd_s": t1 - t0,
            "opt_s": t2 - t1,
            "step_s": t2 - t0,
            "disk_wait_s": (state.io_wait - wait0) if state is not None else None,
            "disk_busy_s": (busy1 - busy0) / 1000 if busy0 is not None and busy1 is not None else None,
            "prefetch_hits": state.prefetch_hits if state is not None else None,
            # step_in_backward: sub-group steps taken from backward / undone, so far
            "early": _early_counts(engine),
            "read_per_param": (r1 - r0) / numel,
            "write_per_param": (w1 - w0) / numel,
        }
        out["steps"].append(rec)
        if s == 4 and phase in ("load", "full") and run in ("nvmeswap", *OVERLAPS):
            out["weights_sha_step4"] = _weights_checksum(engine)
        print(
            f"[{run}] step {s}: loss {rec['loss']:.4f}  {rec['step_s']:.1f}s (fwd/bwd {rec['fwd_bwd_s']:.1f}s, "
            f"optimizer {rec['opt_s']:.1f}s"
            + (f", disk wait {rec['disk_wait_s']:.1f}s" if state is not None else "")
            + (f", disk busy {rec['disk_busy_s']:.1f}s" if rec["disk_busy_s"] is not None else "")
            + (f", from backward {rec['early'][0]} / undone {rec['early'][1]}" if rec["early"] else "")
            + f")  read {rec['read_per_param']:.2f} B/param, written {rec['write_per_param']:.2f} B/param, "
            f"RSS {_status_kib('VmRSS') / 2**20:.1f} GiB",
            flush=True,
        )
    if phase == "save":
        r0, w0 = _proc_io()
        t0 = time.perf_counter()
        engine.save_checkpoint(os.path.join(a.folder, "ckpt"), tag="step2")
        os.sync()
        out["save_s"] = time.perf_counter() - t0
        r1, w1 = _proc_io()
        out["save_written_bytes"] = w1 - w0
        out["save_read_bytes"] = r1 - r0
        print(
            f"[{run}] checkpoint saved in {out['save_s']:.0f}s, {(w1 - w0) / 1e9:.1f} GB written", flush=True
        )
    out["vm_hwm_gib"] = _status_kib("VmHWM") / 2**20
    Path(a.result).write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # the swap files go with the folder (the parent removes it); no 24 GB restore on exit


# -- the parent --------------------------------------------------------------------------------------
def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fio(folder: str, size: str) -> dict[str, float]:
    if shutil.which("fio") is None:
        return {}
    path = os.path.join(folder, "fio.dat")
    rates = {}
    try:
        for rw in ("write", "read"):
            res = subprocess.run(
                ["fio", "--name=scale", f"--filename={path}", f"--size={size}", "--bs=1M", "--direct=1",
                 f"--rw={rw}", "--ioengine=libaio", "--iodepth=8", "--numjobs=1", "--output-format=json"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            rates[rw] = float(json.loads(res.stdout)["jobs"][0][rw]["bw_bytes"])
        # reads and writes at once, half and half (what a step moves: 12 B/param each way), on
        # the one device: their summed rate is what a step that overlaps them can reach
        res = subprocess.run(
            ["fio", "--name=scale", f"--filename={path}", f"--size={size}", "--bs=1M", "--direct=1",
             "--rw=rw", "--rwmixread=50", "--ioengine=libaio", "--iodepth=8", "--numjobs=1", "--output-format=json"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        job = json.loads(res.stdout)["jobs"][0]
        rates["mixed"] = float(job["read"]["bw_bytes"]) + float(job["write"]["bw_bytes"])
    finally:
        if os.path.exists(path):
            os.remove(path)
    return rates


class _Cgroup:
    """A cgroup-v1 memory cgroup under this process's own, limited to ``limit`` bytes (or nothing
    when the controller is not writable)."""

    def __init__(self, name: str, limit: int) -> None:
        self.path: str | None = None
        try:
            rel = next(
                line.split(":", 2)[2]
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.split(":")[1] == "memory"
            )
            path = f"/sys/fs/cgroup/memory{rel.rstrip('/')}/{name}"
            os.makedirs(path, exist_ok=True)
            Path(path, "memory.limit_in_bytes").write_text(str(limit))
            self.path = path
        except (OSError, StopIteration, IndexError):
            self.path = None

    def enter(self) -> None:  # in the child, before exec
        if self.path is not None:
            Path(self.path, "cgroup.procs").write_text(str(os.getpid()))

    def read(self, name: str) -> int | None:
        if self.path is None:
            return None
        try:
            text = Path(self.path, name).read_text()
        except OSError:
            return None
        if name == "memory.oom_control":
            return int(dict(line.split() for line in text.splitlines()).get("oom_kill", 0))
        return int(text)

    def remove(self) -> None:
        if self.path is not None:
            for _ in range(50):
                try:
                    os.rmdir(self.path)
                    return
                except OSError:
                    time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(run: str, phase: str, a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    result = os.path.join(a.folder, f"{run}.{phase}.json")
    cg = _Cgroup(f"nvmeswap_scale_{os.getpid()}_{run}_{phase}", int(a.mem_limit_gib * GIB))
    env = dict(os.environ, MASTER_PORT=str(_free_port()))
    cmd = [sys.executable, __file__, *argv, "--child", run, "--phase", phase, "--result", result]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, preexec_fn=cg.enter, check=False)
    out: dict[str, Any] = {
        "run": run,
        "phase": phase,
        "wall_s": time.perf_counter() - t0,
        "rc": proc.returncode,
    }
    if os.path.exists(result):
        out.update(json.loads(Path(result).read_text()))
        os.remove(result)
    out["cgroup_peak_gib"] = (cg.read("memory.max_usage_in_bytes") or 0) / GIB if cg.path else None
    out["oom_kills"] = cg.read("memory.oom_control")
    out["mem_limit_gib"] = a.mem_limit_gib if cg.path else None
    cg.remove()
    return out


def _summary(r: dict[str, Any], warmup: int, fio: dict[str, float]) -> dict[str, Any]:
    steps = [s for s in r.get("steps", []) if s["step"] > warmup]
    if not steps:
        return {}

    def med(k: str) -> float | None:
        vals = [s[k] for s in steps if s.get(k) is not None]
        return statistics.median(vals) if vals else None

    out: dict[str, Any] = {k: med(k) for k in ("step_s", "fwd_bwd_s", "opt_s", "disk_wait_s", "disk_busy_s")}
    out["read_per_param"] = sum(s["read_per_param"] for s in steps) / len(steps)
    out["write_per_param"] = sum(s["write_per_param"] for s in steps) / len(steps)
    n = r["params"]
    if out["opt_s"]:
        out["implied_read_GBps"] = out["read_per_param"] * n / out["opt_s"] / 1e9
        out["implied_write_GBps"] = out["write_per_param"] * n / out["opt_s"] / 1e9
    if fio:
        bound = out["read_per_param"] * n / fio["read"] + out["write_per_param"] * n / fio["write"]
        out["disk_bound_s"] = bound
        out["opt_vs_bound"] = out["opt_s"] / bound if bound else None
        # the step against what it cannot beat: forward+backward, or reading (writing) the
        # state at fio's rate, whichever is longest (the overlap's bound), per step
        for step in steps:
            bounds = (
                step["fwd_bwd_s"],
                step["read_per_param"] * n / fio["read"],
                step["write_per_param"] * n / fio["write"],
            )
            step["overlap_bound_s"] = max(bounds)
            step["step_vs_overlap_bound"] = step["step_s"] / max(bounds) if max(bounds) else None
            if fio.get("mixed"):  # reads and writes share the device: their sum at the mixed rate
                moved = (step["read_per_param"] + step["write_per_param"]) * n / fio["mixed"]
                step["disk_bound_s"] = max(step["fwd_bwd_s"], moved)
                step["step_vs_disk_bound"] = (
                    step["step_s"] / step["disk_bound_s"] if step["disk_bound_s"] else None
                )
        out["overlap_bound_s"] = med("overlap_bound_s")
        out["step_vs_overlap_bound"] = med("step_vs_overlap_bound")
        out["mixed_bound_s"] = med("disk_bound_s")
        out["step_vs_mixed_bound"] = med("step_vs_disk_bound")
    return out


def _plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _report import save_figure  # this folder (run as a script)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names, fb, op = [], [], []
    for r in payload["runs"]:
        if r.get("steps"):
            ax1.plot(
                [s["step"] for s in r["steps"]], [s["loss"] for s in r["steps"]], marker="o", label=r["run"]
            )
            sm = r["summary"]
            names.append(r["run"])
            fb.append(sm.get("fwd_bwd_s") or 0)
            op.append(sm.get("opt_s") or 0)
    ax1.set(xlabel="step", ylabel="loss", title=f"{payload['params'] / 1e9:.2f} B params")
    ax1.legend()
    ax2.bar(names, fb, label="forward+backward")
    ax2.bar(names, op, bottom=fb, label="optimizer step")
    ax2.set(ylabel="seconds (median step)", title="step time")
    ax2.legend()
    ax2.tick_params(axis="x", rotation=20)
    save_figure(fig, path, dpi=110)


def _markdown(p: dict[str, Any]) -> str:
    lines = [
        f"Model: {p['params'] / 1e9:.3f} B params ({p['model']}), fp32 state {12 * p['params'] / 1e9:.1f} GB; "
        f"fio on {p['folder']}: write {p['fio'].get('write', 0) / 1e9:.2f} GB/s, read {p['fio'].get('read', 0) / 1e9:.2f} GB/s, "
        f"both at once (50/50) {p['fio'].get('mixed', 0) / 1e9:.2f} GB/s summed",
        "",
        "| run | rc | step s | fwd/bwd s | optimizer s | disk wait s | disk busy s | read B/param | written B/param "
        "| implied read/write GB/s | optimizer / disk bound | step / max(fwd+bwd, read, write bound) "
        "| step / max(fwd+bwd, read+write at the mixed rate) | peak (cgroup / VmHWM) GiB | losses |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: Any, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    for r in p["runs"]:
        s = r.get("summary", {})
        losses = " ".join(f"{x['loss']:.3f}" for x in r.get("steps", []))
        rates = (
            f"{f(s.get('implied_read_GBps'))} / {f(s.get('implied_write_GBps'))}"
            if s.get("implied_read_GBps")
            else "-"
        )
        lines.append(
            f"| {r['run']} | {r['rc']} | {f(s.get('step_s'), '.1f')} | {f(s.get('fwd_bwd_s'), '.1f')} | "
            f"{f(s.get('opt_s'), '.1f')} | {f(s.get('disk_wait_s'), '.1f')} | {f(s.get('disk_busy_s'), '.1f')} | "
            f"{f(s.get('read_per_param'))} | {f(s.get('write_per_param'))} | {rates} | {f(s.get('opt_vs_bound'))} | "
            f"{f(s.get('step_vs_overlap_bound'))} ({f(s.get('overlap_bound_s'), '.1f')} s) | "
            f"{f(s.get('step_vs_mixed_bound'))} ({f(s.get('mixed_bound_s'), '.1f')} s) | "
            f"{f(r.get('cgroup_peak_gib'), '.1f')} / {f(r.get('vm_hwm_gib'), '.1f')} | {losses or r.get('note', '')} |"
        )
    for k, v in p.get("derived", {}).items():
        lines.append(f"\n- {k}: {v}")
    return "\n".join(lines)


def _write(payload: dict[str, Any], a: argparse.Namespace, echo: bool = False) -> None:
    byrun = {r["run"]: r.get("summary", {}) for r in payload["runs"]}
    derived: dict[str, Any] = {}
    if byrun.get("nvmeswap", {}).get("step_s") and byrun.get("deepspeed_nvme", {}).get("step_s"):
        derived["nvmeswap step / DeepSpeed NVMe step"] = round(
            byrun["nvmeswap"]["step_s"] / byrun["deepspeed_nvme"]["step_s"], 3
        )
    if byrun.get("nvmeswap", {}).get("opt_vs_bound"):
        derived["nvmeswap optimizer phase / disk bound"] = round(byrun["nvmeswap"]["opt_vs_bound"], 3)
    for ov in OVERLAPS:
        if not byrun.get(ov, {}).get("step_s"):
            continue
        for other in ("deepspeed_nvme", "nvmeswap"):
            if byrun.get(other, {}).get("step_s"):
                derived[f"{ov} step / {other} step"] = round(byrun[ov]["step_s"] / byrun[other]["step_s"], 3)
        full = {r["run"]: r for r in payload["runs"]}
        on, off = full[ov], full.get("nvmeswap")
        if off is not None and off.get("steps"):
            k = min(len(on.get("steps", [])), len(off["steps"]))
            derived[f"{ov} losses and step-4 weights bit-identical to nvmeswap"] = bool(k) and (
                [x["loss"] for x in on["steps"][:k]] == [x["loss"] for x in off["steps"][:k]]
                and on.get("weights_sha_step4") == off.get("weights_sha_step4")
            )
    if "resume" in payload:
        derived["resume bit-exact"] = payload["resume"]["bit_exact"]
    payload["derived"] = derived
    from _report import write_report  # this folder (run as a script)

    stem = Path(a.out or OUT / ("nvmeswap_scale_small" if a.small else "nvmeswap_scale")).absolute()
    write_report(stem.parent, stem.name, payload, _markdown(payload), _plot, echo=echo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the CI size: ~85 M params, ~1 GB of state")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument(
        "--other-steps", type=int, help="steps of the runs other than nvmeswap (default: --steps)"
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sub-group", type=int, default=50_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--prefetch-gib",
        type=float,
        default=1.0,
        help="nvmeswap_overlap's prefetch_bytes, in GiB (at least one swap buffer: 0.92 GiB at the default 2 B size)",
    )
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--folder", default="/work/scratch/nvmeswap_scale")
    ap.add_argument("--mem-limit-gib", type=float, default=14.0)
    ap.add_argument("--fio-size", default="4G")
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    big = dict(layers=24, d_model=2560, vocab=32000)
    small = dict(layers=8, d_model=896, vocab=4096, fio_size="512M", sub_group=20_000_000)
    for k, v in (small if a.small else big).items():
        if getattr(a, k) is None or (a.small and k in ("fio_size", "sub_group")):
            setattr(a, k, v)
    if a.child:
        child(a)
        return
    argv = [a for a in sys.argv[1:]]
    runs = [r for r in a.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        sys.exit(f"unknown runs {bad}; choose from {list(RUNS)}")
    n = param_count(a.layers, a.d_model, a.vocab, a.seq + 1)
    os.makedirs(a.folder, exist_ok=True)
    need = {
        "nvmeswap": 12 * n, "nvmeswap_overlap": 12 * n, "nvmeswap_unfused": 12 * n, "deepspeed_nvme": 16 * n,
        "deepspeed_cpu": 0, "nvmeswap_step": 24 * n,
    }  # fmt: skip
    ckpt = 0 if a.no_resume or "nvmeswap" not in runs else 14 * n + 12 * n
    needed = int(max([need[r] for r in runs] + [ckpt]) * 1.05) + (4 << 30)
    free = _free(a.folder)
    print(
        f"{n / 1e9:.3f} B params; state {12 * n / 1e9:.1f} GB; disk needed {needed / 1e9:.1f} GB, free {free / 1e9:.1f} GB in {a.folder}",
        flush=True,
    )
    if free < needed:
        sys.exit(f"not enough free disk in {a.folder}: {needed} bytes needed, {free} free")
    payload: dict[str, Any] = {
        "params": n,
        "model": f"{a.layers} layers, d_model {a.d_model}, vocab {a.vocab}, seq {a.seq}, micro-batch {a.micro_batch}",
        "folder": a.folder,
        "sub_group_size": a.sub_group,
        "mem_limit_gib": a.mem_limit_gib,
        "machine": f"{os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GIB:.0f} GiB RAM",
        "runs": [],
    }
    try:
        print("fio ...", flush=True)
        payload["fio"] = {} if a.no_fio else _fio(a.folder, a.fio_size)
        print(f"fio: {payload['fio']}", flush=True)
        for run in runs:
            print(f"== {run}", flush=True)
            r = _launch(run, "full", a, argv)
            shutil.rmtree(os.path.join(a.folder, run), ignore_errors=True)
            if run == "deepspeed_cpu":
                r["need_gib"] = {
                    "bf16 weights": 2 * n / GIB, "bf16 gradients": 2 * n / GIB, "fp32 masters": 4 * n / GIB,
                    "fp32 gradient buffers": 4 * n / GIB, "Adam moments": 8 * n / GIB, "total": 20 * n / GIB,
                }  # fmt: skip
                r["note"] = (
                    f"needs {20 * n / GIB:.1f} GiB of RAM at least (bf16 weights+grads, fp32 masters, grads, moments)"
                )
            r["summary"] = _summary(r, a.warmup, payload["fio"])
            payload["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "steps"}), flush=True)
            _write(payload, a)  # after every run: a later run's failure loses nothing
            if run == "nvmeswap" and not a.no_resume:
                full = r
                print("== resume: steps 1-2, save", flush=True)
                s = _launch("nvmeswap", "save", a, argv)
                shutil.rmtree(os.path.join(a.folder, "nvmeswap"), ignore_errors=True)
                print("== resume: load, steps 3-4", flush=True)
                ld = _launch("nvmeswap", "load", a, argv)
                shutil.rmtree(os.path.join(a.folder, "nvmeswap"), ignore_errors=True)
                shutil.rmtree(os.path.join(a.folder, "ckpt"), ignore_errors=True)  # the next run's disk
                want = [x["loss"] for x in full.get("steps", []) if x["step"] in (3, 4)]
                got = [x["loss"] for x in ld.get("steps", [])]
                payload["resume"] = {
                    "save_rc": s["rc"], "load_rc": ld["rc"], "save_s": s.get("save_s"),
                    "save_written_bytes": s.get("save_written_bytes"), "load_s": ld.get("load_s"),
                    "losses_uninterrupted": want, "losses_resumed": got,
                    "bit_exact": bool(got) and got == want and ld.get("weights_sha_step4") == full.get("weights_sha_step4"),
                    "peak_gib": [s.get("cgroup_peak_gib"), ld.get("cgroup_peak_gib")],
                    "vm_hwm_gib": [s.get("vm_hwm_gib"), ld.get("vm_hwm_gib")],
                    "oom_kills": [s.get("oom_kills"), ld.get("oom_kills")],
                    "steps_saved": s.get("steps"),
                }  # fmt: skip
                print(json.dumps(payload["resume"]), flush=True)
    finally:
        for name in (*RUNS, "ckpt"):
            shutil.rmtree(os.path.join(a.folder, name), ignore_errors=True)
    _write(payload, a, echo=True)


if __name__ == "__main__":
    main()
