"""The GPU suite: every GPU question answered in one slot, in order of value, in at most 4 files.

    python tools/gpu_suite.py --out DIR [--budget 500] [--deadline-s 500 | --deadline-at UNIX]
                              [--skip SECTION,..] [--cpu-smoke]

Normally started by ``run_suite.sh`` (which installs a bundle's wheels first and writes the console
log).  The top of ``--out`` holds at most 4 files: ``results.json``, ``results.md``, ``logs.tgz``
(every section's log and JSON, refreshed after each section) and ``console.log`` (run_suite.sh).
A time plan (tools/suite_plan.py) splits ``--budget`` between the sections, printed at the start;
every section runs in its own process groups, killed with it, and ends in exactly one state: ok,
failed (why), cut by its own limit, cut by the deadline, or skipped (why).  SIGTERM from outside
kills the running groups and writes the results.  ``results.json``'s ``remaining`` lists what a
second run should do (``--skip`` the rest: ``continue_skip``).

Only the standard library is imported here, so a broken install still gives results.
``--cpu-smoke`` runs the same sections on CPU with a tiny model and few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))  # also when loaded by path, not run
import suite_env  # noqa: E402
import suite_plan  # noqa: E402
from _procs import Outcome, kill_all, kill_group, reap, run_group, start  # noqa: E402
from bench_gpu_pairs import AIO_PROBE, DONE_TAG, aio_probe_reason  # noqa: E402
from bench_gpu_pairs import markdown as pairs_markdown  # noqa: E402  (standard library only)
from bench_multirank import DONE_TAG as MULTIRANK_DONE  # noqa: E402
from bench_multirank import markdown as multirank_markdown  # noqa: E402
from monorepo import native_plugins, packages  # noqa: E402  (standard library only)

RENDER = {"pairs": pairs_markdown, "nvme": pairs_markdown, "multirank": multirank_markdown}

INFO = r"""
MODULES = MODULES_HERE
import ctypes.util, json, os, platform, sys
info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                    device_memory_gib=round(p.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
    from torch.utils import cpp_extension
    info["torch_cuda_home"] = cpp_extension.CUDA_HOME
except Exception as e:
    info["torch_error"] = repr(e)
for mod in ("deepspeed", "pydantic", *MODULES, "pytest"):
    try:
        m = __import__(mod)
        info[mod] = getattr(m, "__version__", "?") + " " + os.path.dirname(m.__file__ or "")
    except Exception as e:
        info[mod] = "NOT IMPORTABLE: " + repr(e)[:200]
info["libaio"] = ctypes.util.find_library("aio") or "no libaio.so"
for k in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "MAX_JOBS", "TORCH_EXTENSIONS_DIR"):
    info[k] = os.environ.get(k)
print("SUITE_INFO " + json.dumps(info), flush=True)
"""
INFO = INFO.replace("MODULES_HERE", repr(tuple(p.module for p in packages(ROOT))))


def deepspeed_arch_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``TORCH_CUDA_ARCH_LIST`` as DeepSpeed 0.19.8's op builder can read it.

    Its ``compute_capability_args`` turns every part of an entry into an int, so an
    architecture-specific entry such as ``9.0a`` (what the H100 machine sets) fails the build with
    ``invalid literal for int() with base 10: '0a'`` (GPU suite, H100, 2026-11-27).  The suffix
    only adds sm_90a-only instructions, which DeepSpeed's async_io op does not use: ``9.0a`` becomes
    ``9.0``; ``+PTX`` (which DeepSpeed reads) and the separators are kept.  Our own kernels keep the
    list as given."""
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    if not arch:
        return dict(env)
    fixed = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", arch)
    return dict(env, TORCH_CUDA_ARCH_LIST=fixed)


AIO_BUILD = r"""
from deepspeed.ops.op_builder import AsyncIOBuilder
AsyncIOBuilder().load()
print("SUITE_AIO built", flush=True)
"""

KERNELS = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import bench_loco
r = bench_loco.bench_cuda_kernels()
print("SUITE_KERNELS " + json.dumps(r), flush=True)
"""


class Stopped(BaseException):
    """SIGTERM or SIGINT from outside: the running groups are killed, the results written."""


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or self.out.parent / (self.out.name + ".work")).resolve()
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.deadline = args.deadline_at or now + args.deadline_s
        started = args.t0 or now  # run_suite.sh's start: the install counts against the slot
        self.t0 = started  # times printed and planned ends count from the slot's start
        budget = args.budget or (self.deadline - started)
        self.skip = {x for x in (args.skip or "").split(",") if x} - {"info"}
        unknown = self.skip - set(suite_plan.SECTIONS)
        if unknown:
            raise SystemExit(
                f"gpu_suite: unknown --skip {sorted(unknown)}; sections: {list(suite_plan.SECTIONS)}"
            )
        # --budget scales the plan; the deadline only stops (a plan past it is cut by the deadline)
        total = budget - (now - started) - suite_plan.RESERVE_S
        active = [n for n in suite_plan.SECTIONS if n not in self.skip]
        plan = suite_plan.make_plan(max(total, 1.0))
        # the skipped sections' shares go to the others
        spare = sum(v for n, v in plan.items() if n not in active)
        kept = sum(plan[n] for n in active) or 1.0
        self.plan = {n: (plan[n] * (1 + spare / kept) if n in active else 0.0) for n in suite_plan.SECTIONS}
        self.ends: dict[str, float] = {}
        end = now
        for n in suite_plan.SECTIONS:
            end += self.plan[n]
            self.ends[n] = end
        self.data: dict[str, Any] = {
            "status": "running",
            "cpu_smoke": args.cpu_smoke,
            "budget_s": round(budget),
            "deadline_s": round(self.deadline - started),
            "command": " ".join(sys.argv),
            "skip": sorted(self.skip),
            "plan": {n: round(v, 1) for n, v in self.plan.items()},
            "plan_table": suite_plan.plan_table(self.plan, self.skip, now - started),
            "env": suite_env.prepare(),
            "sections": [],
            "notes": [],
        }

    # ------------------------------------------------------------------------------ records
    def hard_end(self) -> float:
        return self.deadline - suite_plan.RESERVE_S

    def window(self, name: str, end: float | None = None) -> tuple[float, str]:
        """(when the section must stop, what stops it there: ``limit`` or ``deadline``)."""
        end = self.ends[name] if end is None else end
        return (end, "limit") if end <= self.hard_end() + 1 else (self.hard_end(), "deadline")

    def written(self) -> dict[str, Any]:
        """The results as the files say them at this moment: a section still running as cut by
        the deadline, the sections not reached as not started, so that a suite killed without
        warning (SIGKILL) leaves honest files; the next save replaces them."""
        secs = []
        for s in self.data["sections"]:
            if s.get("state") == "running":
                why = "the suite stopped while it ran"
                s = dict(s, state="cut-deadline", status=suite_plan.status_text("cut-deadline", why))
                s.pop("_t", None)
            secs.append(s)
        names = {s["name"] for s in secs}
        why = suite_plan.status_text("cut-deadline", "not reached")
        secs += [
            {"name": n, "state": "cut-deadline", "status": why, "seconds": 0}
            for n in suite_plan.SECTIONS
            if n not in names
        ]
        return dict(self.data, sections=secs)

    def save(self) -> None:
        self.data["remaining"] = suite_plan.remaining(self.data["sections"])
        done = [
            n
            for n in suite_plan.SECTIONS
            if n not in self.data["remaining"] and n not in ("info", "ds-aio-build")
        ]
        self.data["continue_skip"] = ",".join(done)
        self.data["seconds"] = round(time.time() - self.t0, 1)
        tmp = self.out / "results.json.tmp"
        data = self.written()
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.out / "results.json")
        tmp = self.out / "results.md.tmp"
        tmp.write_text(suite_plan.markdown(data, RENDER))
        tmp.replace(self.out / "results.md")
        tmp = self.out / "logs.tgz.tmp"
        with tarfile.open(tmp, "w:gz") as t:
            t.add(self.logs, arcname="logs")
        tmp.replace(self.out / "logs.tgz")

    def say(self, msg: str) -> None:
        with contextlib.suppress(OSError):  # the console is gone: the results files still count
            print(f"=== [{time.time() - self.t0:.0f}s] {msg}", flush=True)

    def open(self, name: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"name": name, "budget_s": round(self.plan[name]), "state": "running"}
        self.data["sections"].append(rec)
        return rec

    def finish(self, rec: dict[str, Any], state: str, detail: str = "", t: float | None = None) -> None:
        rec["state"] = state
        rec["status"] = suite_plan.status_text(state, detail)
        rec["seconds"] = round(time.time() - t, 1) if t else 0
        self.say(f"{rec['name']}: {rec['status']}")
        self.save()

    def pre(self, name: str, why_skip: str | None = None) -> dict[str, Any] | None:
        """Open the section's record; None (it is finished) when skipped or out of time."""
        rec = self.open(name)
        if name in self.skip:
            self.finish(rec, "skipped", "--skip: done by an earlier run")
            return None
        if why_skip:
            self.finish(rec, "skipped", why_skip)
            return None
        end, by = self.window(name)
        if end - time.time() < 2:
            self.finish(rec, f"cut-{by}", f"not started: {max(end - time.time(), 0):.0f} s left")
            return None
        self.say(f"{name}: start (until {end - self.t0:.0f} s, {by})")
        return rec

    def run(
        self, rec: dict[str, Any], cmd: list[str], tag: str | None = None, env: dict[str, str] | None = None
    ) -> Outcome:
        name = rec["name"]
        end, by = self.window(name)
        log = self.logs / f"{name}.log"
        rec["command"] = " ".join(cmd)
        rec["log"] = f"logs/{log.name}"
        rec["limit"] = by
        rec["_t"] = time.time()
        got = run_group(cmd, end - time.time(), env=env, log=log, tag=tag, grace=self.args.exit_grace)
        rec["log_tail"] = got.text[-1500:] if not got.ok else got.text[-300:]
        if got.hung_after_result is not None:
            rec["note"] = f"printed its result, then hung at exit: killed {got.hung_after_result} s later"
        return got

    def verdict(self, rec: dict[str, Any], got: Outcome, detail: str = "") -> None:
        t = rec.pop("_t")
        if got.cut:
            self.finish(rec, f"cut-{rec['limit']}", f"after {got.seconds:.0f} s", t)
        elif not got.ok:
            self.finish(rec, "failed", f"exit {got.rc}: {last_error(got.text)}", t)
        else:
            self.finish(rec, "ok", detail, t)

    @staticmethod
    def tagged(text: str, tag: str) -> Any:
        line = next((x for x in reversed(text.splitlines()) if x.startswith(tag + " ")), None)
        return json.loads(line[len(tag) + 1 :]) if line else None

    # ----------------------------------------------------------------------------- sections
    def sections(self) -> None:
        py, smoke = sys.executable, self.args.cpu_smoke
        # DeepSpeed's async_io probe (a compile-and-link test) alongside the info section
        probe_log = self.logs / "aio-probe.log"
        probe = start([py, "-c", AIO_PROBE], probe_log)
        rec = self.pre("info")
        assert rec is not None
        got = self.run(rec, [py, "-c", INFO], tag="SUITE_INFO")
        info = rec["data"] = self.tagged(got.text, "SUITE_INFO") or {}
        if got.ok and not info:
            got.rc, got.hung_after_result = 1, None
        self.verdict(rec, got)
        wait_until = min(time.time() + 15, self.hard_end())
        while reap(probe) is None and time.time() < wait_until:
            time.sleep(0.2)
        if probe.poll() is None:
            kill_group(probe)
            aio_why: str | None = "DeepSpeed's async_io probe did not finish in time"
        else:
            aio_why = aio_probe_reason(probe_log.read_text(errors="replace"))
        info["async_io"] = "can be built" if aio_why is None else f"cannot be built: {aio_why}"
        self.save()
        cuda = bool(info.get("cuda_available")) and not smoke
        self.data["device"] = info.get("device", "cpu") if cuda else "cpu"
        no_gpu = (
            None if cuda or smoke else "no CUDA device visible (--cpu-smoke checks the suite itself on CPU)"
        )
        if no_gpu:
            self.data["notes"].append(no_gpu)

        cpus = os.cpu_count() or 1
        aio = None
        aio_t0 = time.time()
        if cuda and aio_why is None and "nvme" not in self.skip:
            env = deepspeed_arch_env(dict(os.environ, MAX_JOBS=str(max(1, cpus // 3))))
            aio = start([py, "-c", AIO_BUILD], self.logs / "ds-aio-build.log", env)

        self.build(cpus, no_gpu, background=aio is not None)

        rec = self.pre("gpu-tests", no_gpu)
        if rec:
            files = sorted(
                str(p.relative_to(ROOT))
                for p in [*ROOT.glob("packages/*/tests/test_*.py"), *ROOT.glob("tests/*/test_*.py")]
                if "mark.gpu" in p.read_text(errors="replace")
            )
            files.sort(key=lambda f: "loco" not in f)  # loco's kernels (bitwise) first
            junit = self.logs / "gpu_tests.xml"
            cmd = [
                py,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "gpu",
                f"--junitxml={junit}",
                *files,
            ]
            got = self.run(rec, cmd)
            rec["data"] = counts = junit_counts(junit)
            self.verdict(rec, got, ", ".join(f"{v} {k}" for k, v in (counts or {}).items() if v))

        rec = self.pre("loco-kernels", no_gpu)
        if rec:
            got = self.run(rec, [py, "-c", KERNELS], tag="SUITE_KERNELS")
            rec["data"] = d = self.tagged(got.text, "SUITE_KERNELS")
            if got.ok and d and "skipped" in d:
                rec.pop("_t")
                self.finish(rec, "skipped", d["skipped"])
            else:
                if got.ok and not d:
                    got.rc, got.hung_after_result = 1, None
                self.verdict(rec, got)

        tiny = ["--tiny", "--cpu", "--steps", "2", "--warmup", "1", "--rounds", "1"] if smoke else []
        rec = self.pre("pairs", no_gpu)
        if rec:
            end, _ = self.window("pairs")
            cmd = self.pairs_cmd(
                py, "pairs", end, *tiny, "--profile", "--stages", "2" if smoke else self.args.stages
            )
            if self.args.pairs:
                cmd += ["--pairs", self.args.pairs]
            if not smoke:
                # H100, 2026-11-26: a run took 25 s (imports, engine build 10 s, first step 2.5 s),
                # a step 70-180 ms; so 12 timed steps cost little and give each run its spread
                cmd += ["--rounds", str(self.args.rounds), "--steps", "12", "--warmup", "2"]
            self.bench(rec, cmd)

        skip_ds = self.join_aio(aio, aio_t0, aio_why, no_gpu, smoke)

        rec = self.pre("nvme", no_gpu)
        if rec:
            end, _ = self.window("nvme")
            cmd = self.pairs_cmd(
                py, "nvme", end, "--nvme", *tiny, "--scratch", str(self.work)
            )  # swap files: O_DIRECT, a disk
            if skip_ds:
                cmd += ["--skip-ds-nvme", skip_ds]
            if not smoke:
                cmd += ["--rounds", "1", "--steps", "4", "--warmup", "2"]
            self.bench(rec, cmd)

        smoke_why = "CPU smoke check: two ranks on one GPU need a CUDA device (bench_multirank.py --cpu checks the probe)"
        rec = self.pre("multirank", no_gpu or (smoke_why if smoke else None))
        if rec:
            end, _ = self.window("multirank")
            out = self.logs / "multirank.json"
            cmd = [
                py,
                "benchmarks/bench_multirank.py",
                "--out",
                str(out),
                "--timeout",
                f"{max(end - time.time() - 3, 3):.0f}",
            ]
            got = self.run(rec, cmd, tag=MULTIRANK_DONE)
            rec["data"] = d = _read_json(out)
            ranks = (d or {}).get("ranks", [])
            ops = ranks[0]["ops"] if ranks else {}
            works = [op for op in ops if all(r["ops"].get(op, "").startswith("ok") for r in ranks)]
            self.verdict(rec, got, f"{len(works)} of {len(ops)} operations work on both ranks")

    def build(self, cpus: int, no_gpu: str | None, background: bool) -> None:
        """The plugins' kernels (loco's and nvmeswap's today) side by side where there are >= 4 cores."""
        rec = self.pre("build", no_gpu)
        if rec is None:
            return
        py, t = sys.executable, time.time()
        end, by = self.window("build")
        targets = native_plugins(ROOT)  # the plugins that ship kernels (tools/monorepo.py)
        parallel = cpus >= 4
        share = max(1, cpus // (len(targets) + int(background))) if parallel else cpus
        groups = (
            {tg: [py, "-m", "zerohooks.build", tg] for tg in targets}
            if parallel
            else {"+".join(targets): [py, "-m", "zerohooks.build", *targets]}
        )
        rec["data"] = {
            "mode": f"{'side by side' if parallel else 'one after the other'} ({cpus} cores, MAX_JOBS={share} each)"
        }
        env = dict(os.environ, MAX_JOBS=str(share))
        procs = {k: start(cmd, self.logs / f"build-{k}.log", env) for k, cmd in groups.items()}
        rec["command"] = " & ".join(" ".join(c) for c in groups.values())
        rcs: dict[str, int | None] = {}
        try:
            while len(rcs) < len(procs) and time.time() < end:
                for k, p in procs.items():
                    if k not in rcs and reap(p) is not None:
                        rcs[k] = p.returncode
                time.sleep(0.2)
        finally:
            for k, p in procs.items():
                if k not in rcs:
                    kill_group(p, t)
        for k in procs:
            rec["data"][k] = "cut" if k not in rcs else "ok" if rcs[k] == 0 else f"failed (exit {rcs[k]})"
        failed = {k: rc for k, rc in rcs.items() if rc}
        if failed:
            why = "; ".join(
                f"{k}: {last_error((self.logs / f'build-{k}.log').read_text(errors='replace'))}"
                for k in failed
            )
            self.finish(rec, "failed", why, t)
        elif len(rcs) < len(procs):
            self.finish(
                rec,
                f"cut-{by}",
                f"after {time.time() - t:.0f} s: {', '.join(k for k in procs if k not in rcs)}",
                t,
            )
        else:
            self.finish(rec, "ok", rec["data"]["mode"], t)

    def pairs_cmd(self, py: str, name: str, end: float, *args: str) -> list[str]:
        """A ``bench_gpu_pairs.py`` run writing ``<logs>/<name>.json`` and starting no run
        after 3 s before ``end``, with ``args``."""
        out = str(self.logs / f"{name}.json")
        return [py, "benchmarks/bench_gpu_pairs.py", "--out", out, "--deadline-at", str(end - 3), *args]

    def bench(self, rec: dict[str, Any], cmd: list[str]) -> None:
        """pairs and nvme: ok only when every planned run ran and none failed (DeepSpeed's runs
        build or load its ops: :func:`deepspeed_arch_env`)."""
        got = self.run(rec, cmd, tag=DONE_TAG, env=deepspeed_arch_env(dict(os.environ)))
        d = rec["data"] = _read_json(Path(cmd[cmd.index("--out") + 1]))
        if d is None or not got.ok:
            return self.verdict(rec, got)
        results = d.get("results", [])
        bad = [
            r
            for r in results
            if r.get("status") not in ("ok", "skipped") and not str(r["status"]).startswith("cut")
        ]
        ran = len([r for r in results if r.get("status") == "ok"])
        stopped = (
            any(str(n).startswith("deadline") for n in d.get("notes", []))
            or d["rounds_done"] < d["rounds"]
            or any(str(r["status"]).startswith("cut") for r in results)
        )
        t = rec.pop("_t")
        if bad:
            self.finish(rec, "failed", f"{len(bad)} run(s) failed: {bad[0]['run']} {bad[0]['status']}", t)
        elif stopped:
            why = f"{ran} runs done, {d['rounds_done']} of {d['rounds']} rounds complete"
            self.finish(rec, f"cut-{rec['limit']}", why, t)
        else:
            skipped = [f"{r['run']}: {r.get('error', '')}" for r in results if r.get("status") == "skipped"]
            self.finish(rec, "ok", f"{ran} runs" + (f"; skipped {'; '.join(skipped)}" if skipped else ""), t)

    def join_aio(self, aio: Any, t0: float, why: str | None, no_gpu: str | None, smoke: bool) -> str | None:
        """Wait for DeepSpeed's async_io build (at most a third of the nvme budget past the pairs'
        planned end); the reason to skip DeepSpeed's NVMe run, None when it is built (or CPU smoke)."""
        rec = self.open("ds-aio-build")
        if aio is None:
            reason = (
                "--skip nvme"
                if "nvme" in self.skip
                else no_gpu
                or ("CPU smoke check" if smoke else f"DeepSpeed's async_io op cannot be built: {why}")
            )
            self.finish(rec, "skipped", reason)
            return None if smoke or no_gpu else reason
        end, by = self.window("ds-aio-build", self.ends["ds-aio-build"] + self.plan["nvme"] / 3)
        rec["log"] = "logs/ds-aio-build.log"
        rc = None
        try:
            while time.time() < end and (rc := reap(aio)) is None:
                time.sleep(0.2)
        finally:
            if rc is None:
                kill_group(aio, t0)
        if rc is None:
            self.finish(rec, f"cut-{by}", f"still building after {time.time() - t0:.0f} s", t0)
            return f"DeepSpeed's async_io op was not built in time ({time.time() - t0:.0f} s)"
        if rc != 0:
            self.finish(
                rec, "failed", last_error((self.logs / "ds-aio-build.log").read_text(errors="replace")), t0
            )
            return f"DeepSpeed's async_io op failed to build: {rec['status']}"
        self.finish(rec, "ok", "built in the background", t0)
        return None


def last_error(text: str) -> str:
    """The line of ``text`` that best says why it failed (the last error-looking one)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    keys = ("Error", "error:", "FAILED", "failed", "Traceback", "No such file")
    hit = next((x for x in reversed(lines) if any(k in x for k in keys)), lines[-1] if lines else "no output")
    return hit[:200]


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json, results.md and logs.tgz")
    p.add_argument(
        "--deadline-s", type=float, default=500.0, help="hard stop, seconds from now (default 500)"
    )
    p.add_argument("--deadline-at", type=float, default=None, help="the hard stop as a Unix time")
    p.add_argument(
        "--budget", type=float, default=None, help="seconds the time plan spreads (default: to the deadline)"
    )
    p.add_argument("--t0", type=float, default=None, help="Unix time the slot started (run_suite.sh's start)")
    p.add_argument(
        "--skip",
        default="",
        help="sections done by an earlier run, comma-separated (results.json's continue_skip)",
    )
    p.add_argument("--work", default=None, help="scratch folder: logs, swap files (default OUT.work)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model, few steps, on CPU")
    p.add_argument("--stages", default="2,3", help="ZeRO stages of the pairs, in order (default 2,3)")
    p.add_argument(
        "--pairs",
        default=None,
        help="plugins the pairs section compares, comma-separated (default: bench_gpu_pairs.py's, "
        "all but loco); a second slot can rerun only the pairs a fix touched",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="interleaved rounds of the pairs (default 1: one round of 12 runs took 283 s on an H100)",
    )
    p.add_argument(
        "--exit-grace", type=float, default=10.0, help="seconds a child may take to exit after its result"
    )
    args = p.parse_args(argv)
    suite = Suite(args)

    def stop(signum: int, _frame: Any) -> None:
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    suite.say(
        f"time plan ({suite.data['budget_s']} s slot, deadline {suite.data['deadline_s']} s):\n"
        + suite.data["plan_table"]
    )
    suite.save()
    rc = 0
    try:
        suite.sections()
        suite.data["status"] = "done"
    except Stopped as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_all()
        suite.data["status"] = f"stopped by {e} from outside after {time.time() - suite.t0:.0f} s"
        for rec in suite.data["sections"]:
            if rec.get("state") == "running":
                rec["state"], rec["status"] = (
                    "cut-deadline",
                    suite_plan.status_text("cut-deadline", f"{e} from outside"),
                )
                rec.pop("_t", None)
        rc = 143 if str(e) == "SIGTERM" else 130
    except BaseException as e:
        kill_all()
        suite.data["status"] = f"suite error: {e!r}"
        suite.save()
        raise
    finally:
        kill_all()
    suite.save()  # the sections never reached (stopped from outside) are written as such
    with contextlib.suppress(OSError):
        print((suite.out / "results.md").read_text(), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
