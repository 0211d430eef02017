"""Two ranks on one GPU: what torch.distributed allows there, and loco's exchange on CUDA buffers.

    python benchmarks/bench_multirank.py --out multirank.json            # needs a CUDA device
    python benchmarks/bench_multirank.py --out multirank.json --cpu      # the same probe on CPU

NCCL refuses two ranks on one device ("Duplicate GPU detected"), and the GPU machines at hand
have one GPU, so the multi-rank CUDA paths (device buffers, streams, the exchange) never ran on a
GPU.  This starts two processes on the one device joined over gloo (TCP on 127.0.0.1) and tries,
on device tensors, each operation ZeRO and loco use; each is checked against the value it must
give.  The answer (which operations gloo takes on CUDA tensors, whether loco's point-to-point
exchange moves device buffers between two processes) is the JSON ``--out``, per rank and op:
``ok``, ``wrong result``, the error, or ``crashed: <the rank's last error>`` where the operation
killed a rank (gloo aborts the process on a device pointer it cannot write: ``writev ... Bad
address``, seen on an H100); the probe then goes on from the next operation with a fresh pair of
processes, so one crash loses nothing else.  ``loco_exchange_all_to_all`` is the all-to-all as
loco issues it, which keeps gloo's collective for device buffers (the point-to-point rows crashed
on the H100, 2026-11-27).  ``ZEROHOOKS_MULTIRANK_CRASH=<operation>`` makes
rank 1 abort in that operation (the test of that path, on CPU).  NCCL across GPUs stays
unverified either way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import kill_group, reap, start

RESULT_TAG = "MULTIRANK_RESULT "
META_TAG = "MULTIRANK_META "
OP_TAG = "MULTIRANK_OP "
DONE_TAG = "MULTIRANK_DONE"
OP_NAMES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "isend_irecv", "loco_p2p_all_to_all", "loco_p2p_all_gather_uint8",
    "loco_exchange_all_to_all", "side_stream_all_reduce",
)  # fmt: skip
"""The operations, in the order they run (``_ops`` builds them)."""


def _ops(dev: Any) -> dict[str, Any]:
    """name -> a function of (rank, world) running one operation and returning whether its result
    is right."""
    import torch
    import torch.distributed as dist

    def full(v: float, n: int = 8) -> Any:
        return torch.full((n,), float(v), device=dev)

    def all_reduce(r: int, w: int) -> bool:
        t = full(r + 1)
        dist.all_reduce(t)
        return bool((t == w * (w + 1) / 2).all())

    def broadcast(r: int, w: int) -> bool:
        t = full(7 if r == 0 else 0)
        dist.broadcast(t, 0)
        return bool((t == 7).all())

    def all_gather(r: int, w: int) -> bool:
        outs = [full(-1) for _ in range(w)]
        dist.all_gather(outs, full(r))
        return all(bool((o == i).all()) for i, o in enumerate(outs))

    def all_gather_into_tensor(r: int, w: int) -> bool:
        out = full(-1, 8 * w)
        dist.all_gather_into_tensor(out, full(r))
        return bool((out.view(w, -1) == torch.arange(w, device=dev).view(w, 1)).all())

    def reduce_scatter_tensor(r: int, w: int) -> bool:
        out = full(-1)
        dist.reduce_scatter_tensor(out, full(r + 1, 8 * w))
        return bool((out == w * (w + 1) / 2).all())

    def all_to_all_single(r: int, w: int) -> bool:
        inp = torch.arange(w, device=dev, dtype=torch.float32).repeat_interleave(8) + 10 * r
        out = full(-1, 8 * w)
        dist.all_to_all_single(out, inp)
        want = torch.arange(w, device=dev, dtype=torch.float32).view(w, 1) * 10 + r
        return bool((out.view(w, -1) == want).all())

    def isend_irecv(r: int, w: int) -> bool:
        peer = (r + 1) % w
        got = full(-1)
        works = [dist.isend(full(r), peer), dist.irecv(got, (r - 1) % w)]
        for x in works:
            if x is not None:
                x.wait()
        return bool((got == (r - 1) % w).all())

    def loco_p2p_all_to_all(r: int, w: int) -> bool:
        from loco import p2p

        inp = torch.arange(w, device=dev, dtype=torch.float32).repeat_interleave(8) + 10 * r
        out = full(-1, 8 * w)
        p2p.all_to_all_single(out, inp, dist.group.WORLD).wait(timeout=datetime.timedelta(seconds=20))
        want = torch.arange(w, device=dev, dtype=torch.float32).view(w, 1) * 10 + r
        return bool((out.view(w, -1) == want).all())

    def loco_p2p_all_gather_uint8(r: int, w: int) -> bool:
        from loco import p2p

        inp = torch.full((64,), r + 1, dtype=torch.uint8, device=dev)  # quantized codes are bytes
        out = torch.zeros(64 * w, dtype=torch.uint8, device=dev)
        p2p.all_gather(out, inp, dist.group.WORLD).wait(timeout=datetime.timedelta(seconds=20))
        return bool(
            (out.view(w, -1) == torch.arange(1, w + 1, device=dev, dtype=torch.uint8).view(w, 1)).all()
        )

    def loco_exchange_all_to_all(r: int, w: int) -> bool:
        """The all-to-all as loco issues it (``point_to_point`` on): on gloo, point to point for
        host buffers and gloo's collective for device ones (the p2p rows above crash there)."""
        from types import SimpleNamespace

        from loco import comm

        inp = torch.arange(w, device=dev, dtype=torch.float32).repeat_interleave(8) + 10 * r
        out = full(-1, 8 * w)
        work = comm._all_to_all(SimpleNamespace(point_to_point=True), out, inp, dist.group.WORLD)
        work.wait()
        want = torch.arange(w, device=dev, dtype=torch.float32).view(w, 1) * 10 + r
        return bool((out.view(w, -1) == want).all())

    def side_stream_all_reduce(r: int, w: int) -> bool:
        if dev.type != "cuda":
            return all_reduce(r, w)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t = full(r + 1, 1 << 20) * 1  # made on the side stream, as the adapter's reducers do
            ev = torch.cuda.Event()
            ev.record(s)
        ev.synchronize()
        dist.all_reduce(t)
        return bool((t == w * (w + 1) / 2).all())

    return {f.__name__: f for f in (
        all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor,
        all_to_all_single, isend_irecv, loco_p2p_all_to_all, loco_p2p_all_gather_uint8,
        loco_exchange_all_to_all, side_stream_all_reduce,
    )}  # fmt: skip


def child(rank: int, world: int, port: int, cpu: bool, first: int = 0) -> dict[str, Any]:
    """Run the operations from index ``first`` on, printing one tagged line per operation as it
    ends (so a crash in the next one loses nothing); the rank's description is returned."""
    import torch
    import torch.distributed as dist

    dev = torch.device("cpu" if cpu else "cuda:0")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    res: dict[str, Any] = {"rank": rank, "device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        res["device_name"] = torch.cuda.get_device_name()
    print(META_TAG + json.dumps(res), flush=True)
    ops = _ops(dev)
    assert tuple(ops) == OP_NAMES, (tuple(ops), OP_NAMES)
    for name in OP_NAMES[first:]:
        t = time.perf_counter()
        if rank == 1 and os.environ.get("ZEROHOOKS_MULTIRANK_CRASH") == name:
            print(f"terminate called: injected crash in {name}", flush=True)
            os.abort()
        try:
            ok = ops[name](rank, world)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            result = "ok" if ok else "wrong result"
        except Exception as e:
            result = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        result += f" ({1e3 * (time.perf_counter() - t):.0f} ms)"
        print(OP_TAG + json.dumps({"op": name, "result": result}), flush=True)
        dist.barrier()  # on gloo's CPU path: a failed op leaves both ranks in step
    dist.destroy_process_group()
    return res


def _last_error(text: str) -> str:
    """The line that says why a rank ended: gloo's ``what():``, else the last exception line."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    for key in ("what():", "Error", "error", "Killed", "Segmentation"):
        hits = [x for x in lines if key in x]
        if hits:
            return hits[-1].replace("what():", "").strip()[:200]
    return lines[-1][:200] if lines else "no output"


def markdown(data: dict[str, Any]) -> str:
    ranks = data.get("ranks", [])
    if not ranks:
        return f"no result: {data.get('error', '?')}\n"
    lines = [
        f"Two ranks over gloo on {ranks[0].get('device_name', ranks[0]['device'])} (torch {ranks[0]['torch']}), "
        f"{data.get('attempts', 1)} pair(s) of processes (a fresh pair after each crash)."
        + (f" Not finished: {data['error']}." if data.get("error") else ""),
        "",
        "| operation | " + " | ".join(f"rank {r['rank']}" for r in ranks) + " |",
        "|---|" + "---|" * len(ranks),
    ]
    for op in ranks[0]["ops"]:
        lines.append(f"| {op} | " + " | ".join(r["ops"].get(op, "-") for r in ranks) + " |")
    return "\n".join(lines) + "\n"


def _attempt(args: argparse.Namespace, out: Path, first: int, end: float, n: int) -> list[str]:
    """One pair of rank processes from operation ``first``; each rank's new log text."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = str(Path(__file__).resolve())
    procs, logs, offsets = [], [], []
    for r in range(2):
        log = out.with_name(f"{out.stem}-rank{r}.log")
        with open(log, "a") as f:
            f.write(f"=== attempt {n}: operations from {OP_NAMES[first]}\n")
        offsets.append(log.stat().st_size)
        logs.append(log)
        cmd = [sys.executable, me, "--child", str(r), "--port", str(port), "--first", str(first)]
        procs.append(start(cmd + (["--cpu"] if args.cpu else []), log, dict(os.environ), append=True))
    while time.time() < end and any(reap(p) is None for p in procs):
        time.sleep(0.2)
    texts = []
    for p, log, off in zip(procs, logs, offsets, strict=True):
        if p.poll() is None:
            kill_group(p)
        with open(log, "rb") as f:
            f.seek(off)
            texts.append(f.read().decode(errors="replace"))
    return texts


def parent(args: argparse.Namespace) -> dict[str, Any]:
    """Run every operation on two ranks.  An operation that kills a rank (gloo aborts the process
    on some device pointers: ``writev ... Bad address``) is recorded as crashed, with each rank's
    own last error, and the probe goes on with a fresh pair of processes from the next one."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in range(2):
        out.with_name(f"{out.stem}-rank{r}.log").write_text("")
    end = time.time() + args.timeout
    metas: list[dict[str, Any] | None] = [None, None]
    ops: list[dict[str, str]] = [{}, {}]
    first, attempts, error = 0, 0, None
    while first < len(OP_NAMES):
        if time.time() >= end:
            error = f"time limit ({args.timeout:.0f} s) reached before {OP_NAMES[first]}"
            break
        attempts += 1
        texts = _attempt(args, out, first, end, attempts)
        for r, text in enumerate(texts):
            for line in text.splitlines():
                if line.startswith(META_TAG):
                    metas[r] = json.loads(line[len(META_TAG) :])
                elif line.startswith(OP_TAG):
                    d = json.loads(line[len(OP_TAG) :])
                    ops[r][d["op"]] = d["result"]
        missing = [i for i in range(first, len(OP_NAMES)) if any(OP_NAMES[i] not in o for o in ops)]
        if not missing:
            break
        i = missing[0]
        if time.time() >= end:
            error = f"time limit ({args.timeout:.0f} s) reached in {OP_NAMES[i]}"
            break
        for r in range(2):
            if OP_NAMES[i] not in ops[r]:
                ops[r][OP_NAMES[i]] = "crashed: " + _last_error(texts[r])
        first = i + 1
    data: dict[str, Any] = {"ranks": [], "attempts": attempts}
    for r in range(2):
        if metas[r] is not None:
            data["ranks"].append({**metas[r], "ops": {k: ops[r][k] for k in OP_NAMES if k in ops[r]}})
        else:
            data.setdefault("error", f"rank {r} never started: {error or 'no output'}")
    if error:
        data["error"] = error
    out.write_text(json.dumps(data, indent=1))
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="multirank.json")
    p.add_argument(
        "--cpu", action="store_true", help="the same probe on CPU tensors (checks the probe itself)"
    )
    p.add_argument("--timeout", type=float, default=90.0, help="seconds for both ranks (default 90)")
    p.add_argument("--child", type=int, default=None, help="internal: this process's rank")
    p.add_argument("--port", type=int, default=0, help="internal (--child)")
    p.add_argument("--first", type=int, default=0, help="internal (--child): index of the first operation")
    args = p.parse_args(argv)
    if args.child is not None:
        print(RESULT_TAG + json.dumps(child(args.child, 2, args.port, args.cpu, args.first)), flush=True)
        return 0
    data = parent(args)
    print(markdown(data))
    print(DONE_TAG, flush=True)
    return 0 if len(data["ranks"]) == 2 and "error" not in data else 1


if __name__ == "__main__":
    sys.exit(main())
