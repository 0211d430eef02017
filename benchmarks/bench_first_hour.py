"""A new user's first hour: clone the repository fresh and run a README command in it, timing
what the user waits through.

    python benchmarks/bench_first_hour.py --dest /tmp/fresh -- bash run.sh demo
    python benchmarks/bench_first_hour.py --dest /tmp/fresh --no-clone -- bash run.sh demo --nodes 2 ...

Measures the command's wall time, the time to its first report (the first output line that names
a ``report.md``) and the longest silence (the longest time without any output byte, progress bars
included), with where it happened (the last line before it).  The whole output goes to
``<dest>.<name>.log``; one JSON line (``--json``) goes to stdout and is appended to
``benchmarks/out/first_hour.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default=str(ROOT), help="repository to clone (default: this one)")
    p.add_argument("--dest", required=True, help="where to clone it (must not exist unless --no-clone)")
    p.add_argument("--no-clone", action="store_true", help="run in --dest as it is (a later command)")
    p.add_argument("--name", default="run", help="label of this measurement")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given (put it after --)")
    dest = Path(args.dest)
    t0 = time.monotonic()
    if not args.no_clone:
        subprocess.run(["git", "clone", "--quiet", args.source, str(dest)], check=True)
    log_path = dest.parent / f"{dest.name}.{args.name}.log"
    first_report = None
    longest, longest_after = 0.0, ""
    last_out = time.monotonic()
    tail = b""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=dest, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            now = time.monotonic()
            if not chunk:
                break
            if now - last_out > longest:
                longest = now - last_out
                lines = tail.replace(b"\r", b"\n").decode(errors="replace").split("\n")
                longest_after = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")[-200:]
            last_out = now
            log.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            tail = (tail + chunk)[-2000:]
            if first_report is None and b"report.md" in chunk:
                first_report = now - t0
        rc = proc.wait()
    result = {
        "name": args.name,
        "command": shlex.join(command),
        "clone": not args.no_clone,
        "exit_status": rc,
        "wall_s": round(time.monotonic() - t0, 1),
        "first_report_s": None if first_report is None else round(first_report, 1),
        "longest_silence_s": round(longest, 1),
        "longest_silence_after": longest_after,
        "log": str(log_path),
        "load_avg_at_end": os.getloadavg(),
    }
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "first_hour.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result))
    return rc


if __name__ == "__main__":
    sys.exit(main())
