"""How often a finished two-rank gloo job aborts at exit ("terminate called without an active
exception", SIGABRT), plain PyTorch against the same job through ``python -m zerohooks.run``.

Each launch starts two ranks (``nice -n 10``, ``--parallel`` launches at a time) of a script
that joins a gloo process group, runs one small ``all_gather`` and ends: PyTorch's own
reproducer of the abort (see RELIABILITY.md).  Prints and writes (``--out``, after every launch,
so a long run can be read while it goes) the count of each (exit code, "terminate called" in
stderr) pair per mode, and under "failures" the stderr tail of every rank that did not exit 0.

    python benchmarks/bench_exit_aborts.py --launches 200 --modes zerohooks
    python benchmarks/bench_exit_aborts.py --launches 40 --modes plain
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

WORKER = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
out = [torch.empty(4) for _ in range(dist.get_world_size())]
dist.all_gather(out, torch.full((4,), float(dist.get_rank())))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(mode: str, script: str) -> list[tuple[int, bool, str]]:
    """One two-rank job; (exit code, aborted by std::terminate, stderr's tail) per rank."""
    port = _port()
    cmd = [sys.executable, script] if mode == "plain" else [sys.executable, "-m", "zerohooks.run", script]
    procs = [
        subprocess.Popen(
            ["nice", "-n", "10", *cmd],
            env={
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(r),
                "WORLD_SIZE": "2",
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    out = []
    for p in procs:
        _, err = p.communicate(timeout=600)
        out.append((p.returncode, b"terminate called" in err, err[-4000:].decode(errors="replace")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--modes", default="plain,zerohooks", help="comma-separated: plain, zerohooks")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "exit_aborts.json"))
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "gather_and_exit.py")
        with open(script, "w") as f:
            f.write(WORKER)
        results: dict[str, object] = {}
        failures: list[dict[str, object]] = []
        for mode in args.modes.split(","):
            counts: collections.Counter[str] = collections.Counter()
            t0 = time.monotonic()
            with cf.ThreadPoolExecutor(args.parallel) as ex:
                for i, ranks in enumerate(ex.map(launch, [mode] * args.launches, [script] * args.launches)):
                    counts["launches"] += 1
                    counts["launches exit 0"] += all(rc == 0 for rc, _, _ in ranks)
                    for r, (rc, terminate, err) in enumerate(ranks):
                        counts[f"rank exit {rc}" + (" (terminate called)" if terminate else "")] += 1
                        if rc != 0 or terminate:
                            failures.append({"mode": mode, "launch": i, "rank": r, "rc": rc, "stderr": err})
                    results["failures"] = failures
                    results[mode] = {**dict(counts), "seconds": round(time.monotonic() - t0)}
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
                    if (i + 1) % 10 == 0:
                        print(mode, dict(counts), flush=True)
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
