"""The GPU suite's sections under one deadline; results.json and results.md rewritten after each.

    python tools/gpu_suite.py --out DIR [--deadline-s 480 | --deadline-at UNIX] [--cpu-smoke]

Normally started by ``run_suite.sh`` (which installs a bundle's wheels first).  Sections, in order,
each in its own processes with its own time limit, cut to what is left of the deadline:

``info``          python, torch, CUDA, DeepSpeed, the device, libaio
``build``         the plugins' kernels for this device (``python -m zerohooks.build loco nvmeswap``)
``gpu-tests``     ``pytest -m gpu`` on the test files that carry the mark
``loco-kernels``  loco's three CUDA kernels against the device's copy (bench_loco.bench_cuda_kernels)
``pairs``         each plugin against its DeepSpeed equivalent, ZeRO 2, 3, 1, one process per run
                  (benchmarks/bench_gpu_pairs.py)
``ds-aio-build``  DeepSpeed's async_io op (its NVMe offload needs it), built in the background
                  from the start (GPU runs with libaio only), joined here
``nvme``          nvmeswap against DeepSpeed's NVMe offload (ZeRO 3; libaio may be missing)

Only the standard library is imported here, so a broken install still gives results.
``--cpu-smoke`` runs the same sections on CPU with a tiny model and few steps.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_gpu_pairs import kill_group, run_group  # noqa: E402
from bench_gpu_pairs import markdown as pairs_markdown  # noqa: E402  (standard library only)

INFO = r"""
import ctypes.util, json, os, platform, sys
info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                    device_memory_gib=round(p.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
except Exception as e:
    info["torch_error"] = repr(e)
for mod in ("deepspeed", "pydantic", "zerohooks", "accumdtype", "autocastzero", "mixedlayers", "loco", "nvmeswap", "pytest"):
    try:
        m = __import__(mod)
        info[mod] = getattr(m, "__version__", "?") + " " + os.path.dirname(m.__file__ or "")
    except Exception as e:
        info[mod] = "NOT IMPORTABLE: " + repr(e)[:200]
info["libaio"] = ctypes.util.find_library("aio") or "missing (DeepSpeed's NVMe offload needs libaio: apt install libaio-dev)"
info["TORCH_CUDA_ARCH_LIST"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
print("SUITE_INFO " + json.dumps(info))
"""

AIO_BUILD = r"""
from deepspeed.ops.op_builder import AsyncIOBuilder
b = AsyncIOBuilder()
assert b.is_compatible(verbose=True), "DeepSpeed's async_io op is not compatible here (libaio?)"
b.load()
print("SUITE_AIO built")
"""

KERNELS = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import bench_loco
r = bench_loco.bench_cuda_kernels()
print("SUITE_KERNELS " + json.dumps(r))
"""


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or self.out / "work").resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = args.deadline_at or time.time() + args.deadline_s
        self.t0 = time.time()
        self.data: dict[str, Any] = {
            "status": "running",
            "cpu_smoke": args.cpu_smoke,
            "deadline_s": round(self.deadline - self.t0),
            "command": " ".join(sys.argv),
            "sections": [],
        }

    def left(self) -> float:
        return float(self.deadline - time.time())

    def save(self) -> None:
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.out / "results.json")
        (self.out / "results.md").write_text(markdown(self.data))

    def section(self, name: str, limit: float, cmd: list[str], reserve: float = 0.0) -> dict[str, Any]:
        """Run ``cmd`` for at most ``limit`` seconds (less when the deadline is nearer, keeping
        ``reserve`` for later sections); its output goes to OUT/NAME.log."""
        rec: dict[str, Any] = {"name": name, "command": " ".join(cmd)}
        self.data["sections"].append(rec)
        budget = min(limit, self.left() - reserve)
        if budget < 5:
            rec.update(status="skipped: no time left before the deadline", seconds=0)
            self.save()
            return rec
        print(f"=== [{time.time() - self.t0:.0f}s] {name}: start (limit {budget:.0f} s)", flush=True)
        log = self.out / f"{name}.log"
        t = time.time()
        rc, text = run_group(cmd, budget, log=log)
        if rc is None:
            rec["status"] = f"cut by the deadline after {time.time() - t:.0f} s"
        else:
            rec["status"] = "ok" if rc == 0 else f"failed (exit {rc})"
        rec["seconds"] = round(time.time() - t, 1)
        rec["log"] = str(log)
        rec["log_tail"] = text[-1500:] if rec["status"] != "ok" else text[-300:]
        print(f"=== [{time.time() - self.t0:.0f}s] {name}: {rec['status']}", flush=True)
        self.save()
        return rec

    def join_aio(self, aio: subprocess.Popen[bytes] | None, log: Path, t0: float, smoke: bool) -> str | None:
        """Wait for the background build of DeepSpeed's async_io op (leaving the nvme section at
        least a minute); the reason to skip DeepSpeed's NVMe run, or None when the op is built."""
        rec: dict[str, Any] = {"name": "ds-aio-build", "command": "AsyncIOBuilder().load() (background)"}
        self.data["sections"].append(rec)
        if aio is None:
            why = "CPU smoke check" if smoke else "no GPU or no libaio (apt install libaio-dev)"
            rec.update(status=f"skipped: {why}", seconds=0)
            self.save()
            return None if smoke else f"DeepSpeed's async_io op was not built: {why}"
        try:
            rc = aio.wait(timeout=max(1.0, self.left() - 60))
            rec["status"] = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            kill_group(aio, t0)
            rec["status"] = f"cut by the deadline after {time.time() - t0:.0f} s"
        rec["seconds"] = round(time.time() - t0, 1)
        rec["log"] = str(log)
        rec["log_tail"] = log.read_text(errors="replace")[-1500:]
        self.save()
        return None if rec["status"] == "ok" else f"DeepSpeed's async_io op build: {rec['status']}"

    @staticmethod
    def tagged(rec: dict[str, Any], tag: str) -> Any:
        text = Path(rec["log"]).read_text(errors="replace") if "log" in rec else ""
        line = next((x for x in reversed(text.splitlines()) if x.startswith(tag + " ")), None)
        return json.loads(line[len(tag) + 1 :]) if line else None

    def run(self) -> None:
        py, smoke = sys.executable, self.args.cpu_smoke
        rec = self.section("info", 90, [py, "-c", INFO])
        info = self.tagged(rec, "SUITE_INFO") or {}
        rec["data"] = info
        cuda = bool(info.get("cuda_available")) and not smoke
        self.data["device"] = info.get("device", "cpu") if cuda else "cpu"
        if not cuda and not smoke:
            self.data.setdefault("notes", []).append("no CUDA device visible: GPU sections report skips")
        self.save()

        # DeepSpeed's async_io op (its NVMe offload, the nvme section's baseline) builds for minutes:
        # in the background from now on, joined before the nvme section
        aio: subprocess.Popen[bytes] | None = None
        aio_log = self.out / "ds-aio-build.log"
        aio_t0 = time.time()
        if cuda and not str(info.get("libaio", "missing")).startswith("missing"):
            with aio_log.open("wb") as f:
                aio = subprocess.Popen(
                    [py, "-c", AIO_BUILD], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )

        build = [py, "-m", "zerohooks.build", "loco", "nvmeswap"]
        self.section("build", 20 if smoke else 240, build, reserve=30)

        files = sorted(
            str(p.relative_to(ROOT))
            for p in [*ROOT.glob("packages/*/tests/test_*.py"), *ROOT.glob("tests/*/test_*.py")]
            if "mark.gpu" in p.read_text(errors="replace")
        )
        junit = self.out / "gpu_tests.xml"
        cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", f"--junitxml={junit}", *files]
        rec = self.section("gpu-tests", 40 if smoke else 200, cmd, reserve=30)
        rec["data"] = junit_counts(junit)
        self.save()

        rec = self.section("loco-kernels", 30 if smoke else 90, [py, "-c", KERNELS], reserve=30)
        rec["data"] = self.tagged(rec, "SUITE_KERNELS")
        self.save()

        nvme_reserve = 20 if smoke else 90
        pairs = [py, "benchmarks/bench_gpu_pairs.py", "--out", str(self.out / "pairs.json")]
        tiny = ["--tiny", "--cpu", "--steps", "2", "--warmup", "1", "--rounds", "1"] if smoke else []
        stop = self.deadline - nvme_reserve - 5
        cmd = [*pairs, *tiny, "--stages", "2" if smoke else self.args.stages, "--deadline-at", str(stop)]
        if not smoke:
            cmd += ["--rounds", str(self.args.rounds)]
        rec = self.section("pairs", self.left(), cmd, reserve=nvme_reserve)
        rec["data"] = _read_json(self.out / "pairs.json")
        self.save()

        nvme = [py, "benchmarks/bench_gpu_pairs.py", "--nvme", "--out", str(self.out / "nvme.json")]
        nvme += ["--scratch", str(self.work)]  # swap files: --work must be on a disk (O_DIRECT)
        skip_ds = self.join_aio(aio, aio_log, aio_t0, smoke)
        if skip_ds:
            nvme += ["--skip-ds-nvme", skip_ds]
        cmd = [*nvme, *tiny, "--deadline-at", str(self.deadline - 5)]
        if not smoke:
            cmd += ["--rounds", "2"]
        rec = self.section("nvme", self.left(), cmd)
        rec["data"] = _read_json(self.out / "nvme.json")
        self.data["status"] = "done"
        self.data["seconds"] = round(time.time() - self.t0, 1)
        self.save()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit_counts(path: Path) -> dict[str, Any] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# GPU suite results",
        "",
        f"Device: {data.get('device', '?')}; status: {data['status']}; deadline {data['deadline_s']} s"
        + ("; CPU smoke check (tiny model)" if data.get("cpu_smoke") else ""),
        f"Command: `{data['command']}`",
    ]
    lines += [f"- {n}" for n in data.get("notes", [])]
    lines += ["", "| section | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s.get('seconds', 0)} |" for s in data["sections"]]
    for s in data["sections"]:
        d = s.get("data")
        if not d:
            continue
        lines += ["", f"## {s['name']}", ""]
        if s["name"] == "info":
            lines += [f"- {k}: {v}" for k, v in d.items()]
        elif s["name"] == "gpu-tests":
            lines.append(", ".join(f"{v} {k}" for k, v in d.items()))
        elif s["name"] == "loco-kernels":
            if "skipped" in d:
                lines.append(f"skipped: {d['skipped']}")
            else:
                lines.append(f"device copy {d['copy_GBps']:.0f} GB/s; {d['elements']} elements")
                lines += ["", "| variant | kernel | GB/s | of copy |", "|---|---|---|---|"]
                for variant, figures in d.get("variants", {"warp": d["kernels"]}).items():
                    for k, v in figures.items():
                        lines.append(
                            f"| {variant} | {k} | {v.get('GBps', 0):.0f} | {v.get('fraction_of_copy', 0):.2f} |"
                        )
        elif s["name"] in ("pairs", "nvme"):
            lines.append(pairs_markdown(d))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json, results.md and the logs")
    p.add_argument("--deadline-s", type=float, default=480.0, help="seconds from now (default 480)")
    p.add_argument("--deadline-at", type=float, default=None, help="the deadline as a Unix time")
    p.add_argument("--work", default=None, help="scratch folder (default OUT/work)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model, few steps, on CPU")
    p.add_argument("--stages", default="2,3,1", help="ZeRO stages of the pairs, in order (default 2,3,1)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the pairs, as time allows (default 3)")
    args = p.parse_args(argv)
    suite = Suite(args)

    def stop(signum: int, _frame: Any) -> None:
        suite.data["status"] = f"interrupted by signal {signum}"
        suite.save()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        suite.run()
    except BaseException as e:
        if suite.data["status"] == "running":
            suite.data["status"] = f"suite error: {e!r}"
            suite.save()
        raise
    print((suite.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
