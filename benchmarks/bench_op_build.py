"""DeepSpeed's async_io op (12 C++ sources) built from nothing, with and without zerohooks'
precompiled torch header (:mod:`zerohooks.pch`): wall time and the compilers' CPU time.

    python benchmarks/bench_op_build.py                 both ways, one after the other
    python benchmarks/bench_op_build.py --modes pch     one way only
    python benchmarks/bench_op_build.py --jobs 2        ninja's parallel compiles (MAX_JOBS)

Each build runs in a process of its own with a new, empty ``TORCH_EXTENSIONS_DIR`` and
``ZEROHOOKS_NATIVE_CACHE`` (so nothing is found built), through ``zerohooks.route_deepspeed_op_builds``
as the test sessions build it; ``ZEROHOOKS_NATIVE_PCH=0`` for the build without.  The built op is
then loaded and asked to write and read back a file (``aio_handle``), so a build that produced a
broken op does not count.  CPU time is the build process's children (ninja and the compilers),
from ``getrusage``.  One JSON line per build goes to stdout and to ``benchmarks/out/op_build.jsonl``.
Needs DeepSpeed, libaio (``libaio-dev``) and gcc; takes 5-10 min on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "out" / "op_build.jsonl"

_CHILD = r"""
import json, os, resource, sys, time
import torch
from deepspeed.ops.op_builder import AsyncIOBuilder
import zerohooks

t0 = time.perf_counter()
with zerohooks.route_deepspeed_op_builds():
    aio = AsyncIOBuilder().load(verbose=False)
wall = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
# the op works: a 1 MiB tensor written through it and read back equal
path = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "probe.bin")
handle = aio.aio_handle(1 << 20, 8, False, False, 1)
data = torch.arange(1 << 18, dtype=torch.float32)
back = torch.empty_like(data)
handle.sync_pwrite(data, path)
handle.sync_pread(back, path)
print(json.dumps({"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                  "max_rss_mb": round(usage.ru_maxrss / 1024), "op_works": bool(torch.equal(data, back))}))
"""


def build_once(mode: str, jobs: int | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix=f"op-build-{mode}-", dir=os.environ.get("TMPDIR")) as tmp:
        env = dict(os.environ)
        env.update(
            TORCH_EXTENSIONS_DIR=str(Path(tmp, "ext")),
            ZEROHOOKS_NATIVE_CACHE=str(Path(tmp, "cache")),
            ZEROHOOKS_NATIVE_PCH="1" if mode == "pch" else "0",
        )
        if jobs:
            env["MAX_JOBS"] = str(jobs)
        start = time.monotonic()
        stop = threading.Event()

        def progress() -> None:  # a build is silent for minutes: say it goes on
            while not stop.wait(30):
                print(f"  {mode}: building, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

        ticker = threading.Thread(target=progress, daemon=True)
        ticker.start()
        try:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=False
            )
        finally:
            stop.set()
        if done.returncode != 0:
            raise SystemExit(f"the {mode} build failed:\n{done.stdout}\n{done.stderr[-4000:]}")
        found: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        return {"mode": mode, "jobs": jobs or "torch's default", "cpus": os.cpu_count(), **found}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", choices=("plain", "pch"), default=["plain", "pch"])
    p.add_argument("--jobs", type=int, default=None, help="MAX_JOBS for ninja (default: torch's)")
    args = p.parse_args()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in args.modes:
        print(f"building DeepSpeed's async_io op: {mode}", file=sys.stderr, flush=True)
        row = build_once(mode, args.jobs)
        row["load_average"] = round(os.getloadavg()[0], 2)
        results.append(row)
        print(json.dumps(row), flush=True)
        with OUT.open("a") as f:
            f.write(json.dumps({**row, "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    if len(results) == 2:
        plain, pch = results
        print(
            f"with the precompiled header: wall {pch['wall_s']} s vs {plain['wall_s']} s, "
            f"CPU {pch['cpu_s']} s vs {plain['cpu_s']} s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
