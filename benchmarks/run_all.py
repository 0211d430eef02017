"""Run every benchmark script in this folder (bench_*.py), one after another.

    python benchmarks/run_all.py [--only overhead loco ...]

Each script prints a markdown table and writes JSON to benchmarks/out/; copy the tables you
re-measured into benchmarks/RESULTS.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="names such as overhead (for bench_overhead.py)")
    args = ap.parse_args()
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.only]
    from zerohooks.build import build

    # the plugins' C++ kernels, built once here (announced, with progress) rather than silently
    # inside the first benchmark that needs them: `python -m zerohooks.build`
    build()
    failed = []
    for i, script in enumerate(scripts, 1):
        print(f"[{i}/{len(scripts)}] {script.name}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(script)])
        print(f"[{i}/{len(scripts)}] {script.name}: exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
