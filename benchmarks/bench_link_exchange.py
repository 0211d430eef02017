"""How fast gloo exchanges bytes across a shaped link: collectives against point to point.

    python benchmarks/bench_link_exchange.py                       # 100mbit, 1 and 2 ranks per node
    python benchmarks/bench_link_exchange.py --rate 1gbit --mb 20

Two emulated nodes (``zerohooks.testing.nodes``: network namespaces, a veth pair, ``tc tbf`` at
``--rate``), torchrun in each. Every rank exchanges ``--mb`` MB with its peer of the same local
index on the other node, each way, five ways:

* ``all_to_all``: gloo's ``all_to_all_single`` over the pair;
* ``all_gather``: gloo's ``all_gather_into_tensor`` over the pair;
* ``p2p``: ``loco.p2p.all_to_all_single``, an ``isend`` and an ``irecv`` (what loco uses on gloo);
* ``send``: one way only, ``dist.send`` from node 0 (the rate a single direction reaches);
* ``socket``: two plain TCP sockets' worth of the same bytes over one connection, both ways
  (no torch), the rate TCP itself reaches in both directions at once.

Reports, per way and ranks per node, the time of each of ``--reps`` repetitions (between
barriers) and the floor: the payload that crosses each way (``--mb`` times the ranks per node)
over the link rate.  Results: JSON in
benchmarks/out/bench_link_exchange.json, markdown printed and in
benchmarks/out/bench_link_exchange.md.  Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
WAYS = ("all_to_all", "all_gather", "p2p", "send")


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from loco import p2p

    dist.init_process_group("gloo")
    r = dist.get_rank()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    pairs = [dist.new_group([li, li + local]) for li in range(local)]
    pair = pairs[r % local]
    n = int(args.mb * 1e6) // 2  # bf16 elements each way
    mine = torch.randn(n).to(torch.bfloat16)
    two = torch.cat([mine, mine])
    out2 = torch.empty_like(two)
    times: dict[str, list[float]] = {}
    for way in WAYS:
        times[way] = []
        for _ in range(args.reps):
            dist.barrier()
            t = time.perf_counter()
            if way == "all_to_all":
                dist.all_to_all_single(out2, two, group=pair)
            elif way == "all_gather":
                dist.all_gather_into_tensor(out2, mine, group=pair)
            elif way == "p2p":
                p2p.all_to_all_single(out2, two, pair).wait()
            elif r < local:
                dist.send(mine, r + local)
            else:
                dist.recv(out2[:n], r - local)
            dist.barrier()
            times[way].append(time.perf_counter() - t)
    if r == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()
    return 0


def _socket_side(role: str, addr: str, nbytes: int, reps: int) -> list[float]:
    """Both ways over one TCP connection, ``nbytes`` each way, ``reps`` times; the server's times."""
    if role == "server":
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((addr, 29555))
        ls.listen(1)
        s, _ = ls.accept()
    else:
        for _ in range(200):
            try:
                s = socket.create_connection((addr, 29555))
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("socket: could not connect")
    block = b"x" * (1 << 20)

    def drain() -> None:
        left = nbytes
        while left > 0:
            left -= len(s.recv(min(left, 1 << 20)))

    times = []
    for _ in range(reps):
        s.sendall(b"g")
        s.recv(1)
        t = time.perf_counter()
        th = threading.Thread(target=drain)
        th.start()
        left = nbytes
        while left > 0:
            left -= s.send(block[: min(left, len(block))])
        th.join()
        times.append(time.perf_counter() - t)
    return times


def run(rate: str, local: int, args: argparse.Namespace) -> dict[str, list[float]]:
    import tempfile

    from zerohooks.testing.nodes import EmulatedNodes

    with tempfile.TemporaryDirectory() as tmp, EmulatedNodes(2, rate) as nodes:
        out = Path(tmp) / "out.json"
        argv = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--mb", str(args.mb)]
        job = nodes.launch([*argv, "--reps", str(args.reps)], local, env={"PYTHONUNBUFFERED": "1"})
        codes = job.wait(timeout=600)
        if any(codes) or not out.exists():
            raise RuntimeError(f"{rate}, {local} per node: exit codes {codes}\n{job.output(0)[-4000:]}")
        times: dict[str, list[float]] = json.loads(out.read_text())
        if local == 1:
            addr = nodes.nodes[0].addr
            side = [sys.executable, str(Path(__file__).resolve()), "--socket"]
            opts = ["--addr", addr, "--mb", str(args.mb), "--reps", str(args.reps)]
            server = subprocess.Popen(
                ["ip", "netns", "exec", nodes.nodes[0].netns, *side, "server", *opts],
                stdout=subprocess.PIPE,
                text=True,
            )
            client = subprocess.Popen(["ip", "netns", "exec", nodes.nodes[1].netns, *side, "client", *opts])
            stdout, _ = server.communicate(timeout=300)
            client.wait(timeout=60)
            times["socket"] = json.loads(stdout)
        return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100mbit", help="tc rate of the link")
    p.add_argument("--mb", type=float, default=6.45, help="MB each way per rank pair")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--socket", choices=("server", "client"), help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.socket:
        times = _socket_side(args.socket, args.addr, int(args.mb * 1e6), args.reps)
        if args.socket == "server":
            print(json.dumps(times))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_two_nodes import rate_bytes_per_s

    per_s = rate_bytes_per_s(args.rate)
    if per_s is None:
        p.error("--rate must be a tc rate such as 100mbit")
    res: dict[str, Any] = {"rate": args.rate, "mb_each_way_per_pair": args.mb, "floor_s": {}, "runs": {}}
    lines = [
        f"{args.mb} MB each way per rank pair over {args.rate}; floor: the payload each way / the rate",
        "",
        "| way | ranks per node | floor (s) | times (s) | median / floor |",
        "|---|---|---|---|---|",
    ]
    for local in (1, 2):
        floor = local * args.mb * 1e6 / per_s
        res["floor_s"][str(local)] = floor
        print(f"[bench_link_exchange] {args.rate}, {local} rank(s) per node", file=sys.stderr, flush=True)
        times = run(args.rate, local, args)
        res["runs"][str(local)] = times
        for way, ts in times.items():
            med = sorted(ts)[len(ts) // 2]
            shown = ", ".join(f"{t:.3f}" for t in ts)
            lines.append(f"| {way} | {local} | {floor:.3f} | {shown} | {med / floor:.2f}x |")
    from _report import write_report  # this folder (run as a script)

    write_report(OUT, "bench_link_exchange", res, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
