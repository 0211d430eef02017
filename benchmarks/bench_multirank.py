"""Two ranks on one GPU: what torch.distributed allows there, and loco's exchange on CUDA buffers.

    python benchmarks/bench_multirank.py --out multirank.json            # needs a CUDA device
    python benchmarks/bench_multirank.py --out multirank.json --cpu      # the same probe on CPU

NCCL refuses two ranks on one device ("Duplicate GPU detected"), and the GPU machines at hand
have one GPU, so the multi-rank CUDA paths (device buffers, streams, the exchange) never ran on a
GPU.  This starts two processes on the one device joined over gloo (TCP on 127.0.0.1) and tries,
on device tensors, each operation ZeRO and loco use; each is checked against the value it must
give.  The answer (which operations gloo takes on CUDA tensors, whether loco's point-to-point
exchange moves device buffers between two processes) is the JSON ``--out``, per rank and op:
``ok``, ``wrong result``, or the error.  NCCL across GPUs stays unverified either way.
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
DONE_TAG = "MULTIRANK_DONE"


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
        side_stream_all_reduce,
    )}  # fmt: skip


def child(rank: int, world: int, port: int, cpu: bool) -> dict[str, Any]:
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
    res: dict[str, Any] = {"rank": rank, "device": str(dev), "torch": torch.__version__, "ops": {}}
    if dev.type == "cuda":
        res["device_name"] = torch.cuda.get_device_name()
    for name, fn in _ops(dev).items():
        t = time.perf_counter()
        try:
            ok = fn(rank, world)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            res["ops"][name] = "ok" if ok else "wrong result"
        except Exception as e:
            res["ops"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        res["ops"][name] += f" ({1e3 * (time.perf_counter() - t):.0f} ms)"
        dist.barrier()  # on gloo's CPU path: a failed op leaves both ranks in step
    dist.destroy_process_group()
    return res


def markdown(data: dict[str, Any]) -> str:
    ranks = data.get("ranks", [])
    if not ranks:
        return f"no result: {data.get('error', '?')}\n"
    lines = [
        f"Two ranks over gloo on {ranks[0].get('device_name', ranks[0]['device'])} (torch {ranks[0]['torch']}).",
        "",
        "| operation | " + " | ".join(f"rank {r['rank']}" for r in ranks) + " |",
        "|---|" + "---|" * len(ranks),
    ]
    for op in ranks[0]["ops"]:
        lines.append(f"| {op} | " + " | ".join(r["ops"].get(op, "-") for r in ranks) + " |")
    return "\n".join(lines) + "\n"


def parent(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = str(Path(__file__).resolve())
    procs = []
    for r in range(2):
        cmd = [sys.executable, me, "--child", str(r), "--port", str(port)] + (["--cpu"] if args.cpu else [])
        procs.append(start(cmd, out.with_name(f"{out.stem}-rank{r}.log"), dict(os.environ)))
    end = time.time() + args.timeout
    while time.time() < end and any(reap(p) is None for p in procs):
        time.sleep(0.2)
    data: dict[str, Any] = {"ranks": []}
    for r, p in enumerate(procs):
        if p.poll() is None:
            kill_group(p)
        text = out.with_name(f"{out.stem}-rank{r}.log").read_text(errors="replace")
        line = next((x for x in text.splitlines() if x.startswith(RESULT_TAG)), None)
        if line:
            data["ranks"].append(json.loads(line[len(RESULT_TAG) :]))
        else:
            data.setdefault("error", f"rank {r}: no result (exit {p.returncode}): {text.strip()[-500:]}")
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
    args = p.parse_args(argv)
    if args.child is not None:
        print(RESULT_TAG + json.dumps(child(args.child, 2, args.port, args.cpu)), flush=True)
        return 0
    data = parent(args)
    print(markdown(data))
    print(DONE_TAG, flush=True)
    return 0 if len(data["ranks"]) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
