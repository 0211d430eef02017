"""The GPU suite in one slot, run for real on CPU (issue 34): at most 4 files at the top of --out,
the time plan honoured under a 60 s deadline with one honest state per section, SIGTERM from
outside still writing the results and leaving no process behind, CUDA_HOME found through an
``nvcc`` wrapper script, and a child that prints its result then hangs cut within seconds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_multirank  # noqa: E402
import suite_plan  # noqa: E402
from _procs import run_group  # noqa: E402
from _scripts import run_script  # noqa: E402

TOP_FILES = {"results.json", "results.md", "logs.tgz", "console.log"}
WORDS = {
    "ok": "ok",
    "failed": "failed (",
    "cut-limit": "cut by its own limit",
    "cut-deadline": "cut by the deadline",
    "skipped": "skipped (",
}


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, **extra)
    # kernels already built in this environment are reused (its TORCH_EXTENSIONS_DIR), else built
    # into a fresh folder (and cut by the plan: that is what the test checks)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return env


def _check_results(out: Path) -> dict:
    top = {p.name for p in out.iterdir()}
    assert top <= TOP_FILES and len(top) <= 4, f"files at the top of --out: {sorted(top)}"
    data = json.loads((out / "results.json").read_text())
    names = [s["name"] for s in data["sections"]]
    assert names == list(suite_plan.SECTIONS), names
    for s in data["sections"]:
        assert s["state"] in suite_plan.STATES, s
        assert s["status"].startswith(WORDS[s["state"]]), s
    done = {s["name"] for s in data["sections"] if s["state"] in ("ok", "skipped")}
    assert data["remaining"] == [n for n in suite_plan.SECTIONS if n not in done]
    md = (out / "results.md").read_text()
    for s in data["sections"]:
        assert f"| {s['name']} | {s['status']} |" in md
    return data


def test_cpu_smoke_keeps_the_plan_under_a_60s_deadline(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = ["bash", str(ROOT / "tools" / "run_suite.sh"), "--cpu-smoke", "--deadline", "60"]
    cmd += ["--out", str(out), "--work", str(work)]
    t = time.time()
    proc = subprocess.run(cmd, env=_env(tmp_path), timeout=180, capture_output=True, text=True, cwd=tmp_path)
    wall = time.time() - t
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert wall < 60 + 10, f"the suite took {wall:.0f} s under a 60 s deadline"
    data = _check_results(out)
    assert data["status"] == "done" and data["cpu_smoke"] and data["budget_s"] == 60
    # the plan, printed first, spreads the slot less the reserve over the sections
    console = (out / "console.log").read_text()
    assert console.index("| pairs |") < console.index("info: start"), console[:2000]
    assert sum(data["plan"].values()) <= 60 - suite_plan.RESERVE_S + 0.5
    sections = {s["name"]: s for s in data["sections"]}
    for name, s in sections.items():
        if (
            s["state"] == "ok"
        ):  # an ok section finished inside its planned budget (plus what the earlier ones saved)
            assert (
                s["seconds"]
                <= sum(data["plan"][n] for n in suite_plan.SECTIONS[: suite_plan.SECTIONS.index(name) + 1])
                + 2
            )
        if name in ("pairs", "nvme") and s["state"] == "ok":
            d = s["data"]
            assert d["rounds_done"] == d["rounds"] and all(
                r["status"] in ("ok", "skipped") for r in d["results"]
            )
    assert sections["ds-aio-build"]["status"] == "skipped (CPU smoke check)"
    assert sections["multirank"]["status"].startswith("skipped (CPU smoke check: two ranks on one GPU need")
    # 60 s on 2 cores cannot hold the kernel builds and every tiny run: something is cut, and says so
    assert {s["state"] for s in data["sections"]} & {"cut-limit", "cut-deadline"}, data["sections"]
    # every other file is in logs.tgz, the install log included
    with tarfile.open(out / "logs.tgz") as t:
        members = set(t.getnames())
    assert {"logs/info.log", "logs/install.log", "logs/aio-probe.log"} <= members, members
    info = sections["info"].get("data") or {}
    if info:  # the probe reports DeepSpeed's real reason, or that it can be built
        assert info["async_io"] == "can be built" or "cannot be built: " in info["async_io"]


def _procs_with(mark: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if mark.encode() in (p / "environ").read_bytes():
                    found.append(int(p.name))
            except OSError:
                pass
    return found


def test_sigterm_from_outside_writes_results_and_kills_every_group(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    mark = f"ZH_SUITE_TEST_{uuid.uuid4().hex}"
    cmd = ["bash", str(ROOT / "tools" / "run_suite.sh"), "--cpu-smoke", "--deadline", "300"]
    cmd += ["--out", str(out), "--work", str(work)]
    env = _env(tmp_path, ZH_SUITE_TEST_MARK=mark)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        t = time.time()
        while time.time() - t < 120:  # the info section has run: a child group is running now
            console = (out / "console.log").read_text() if (out / "console.log").is_file() else ""
            if "build: start" in console or "gpu-tests: start" in console:
                break
            time.sleep(0.3)
        else:
            pytest.fail("the suite never reached its build section")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)  # run_suite.sh exec'd the suite: this is its process
        t = time.time()
        rc = proc.wait(timeout=30)
        stopped_in = time.time() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 143 and stopped_in < 15, (rc, stopped_in)
    data = _check_results(out)
    assert data["status"].startswith("stopped by SIGTERM from outside"), data["status"]
    cut = [s for s in data["sections"] if s["status"] == "cut by the deadline (SIGTERM from outside)"]
    assert len(cut) == 1 and cut[0]["name"] in ("build", "gpu-tests"), data["sections"]
    later = suite_plan.SECTIONS[suite_plan.SECTIONS.index(cut[0]["name"]) + 1 :]
    assert all(
        s["status"] == "cut by the deadline (not reached)" for s in data["sections"] if s["name"] in later
    )
    assert cut[0]["name"] in data["remaining"]
    time.sleep(0.5)
    assert _procs_with(mark) == [], "processes of the suite outlived its SIGTERM"


def test_cuda_home_found_through_an_nvcc_wrapper_script(tmp_path: Path) -> None:
    """/usr/local/bin/nvcc-style wrapper (a script exec-ing the real nvcc, reached through a
    symbolic link): CUDA_HOME is the real tree, not the wrapper's folder; the bundle's ninja
    (bin/ next to a PYTHONPATH entry) goes on PATH."""
    cuda = tmp_path / "opt" / "cuda-99.9"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "include").mkdir()
    (cuda / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    shutil.copy("/bin/true", cuda / "bin" / "nvcc")  # a binary, as the real nvcc is
    alias = tmp_path / "alias"
    alias.mkdir()
    (alias / "nvcc").symlink_to(cuda / "bin" / "nvcc")
    wrapper_bin = tmp_path / "local" / "bin"
    wrapper_bin.mkdir(parents=True)
    (wrapper_bin / "nvcc").write_text(f'#!/bin/sh\nexec {alias}/nvcc "$@"\n')
    (wrapper_bin / "nvcc").chmod(0o755)
    site = tmp_path / "work" / "site"
    (site / "bin").mkdir(parents=True)
    shutil.copy("/bin/true", site / "bin" / "ninja")

    env = _env(tmp_path, PATH=str(wrapper_bin))  # no ninja on PATH; nvcc is the wrapper
    env.pop("CUDA_HOME", None)
    env.pop("CUDA_PATH", None)
    env["PYTHONPATH"] = os.pathsep.join(x for x in [env.get("PYTHONPATH", ""), str(site)] if x)
    out = tmp_path / "out"
    skip = ",".join(n for n in suite_plan.SECTIONS if n != "info")
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_suite.py"), "--cpu-smoke", "--deadline-s", "90"]
    cmd += ["--out", str(out), "--work", str(tmp_path / "w"), "--skip", skip]
    proc = subprocess.run(cmd, env=env, timeout=150, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = _check_results(out)
    assert data["env"]["CUDA_HOME"] == str(cuda), data["env"]
    assert str(wrapper_bin / "nvcc") in data["env"]["cuda_home_from"]
    assert data["env"]["ninja"].startswith(str(site / "bin"))
    info = next(s for s in data["sections"] if s["name"] == "info")
    assert info["state"] == "ok", info
    assert info["data"]["CUDA_HOME"] == str(cuda)  # what the children (the kernel builds) see
    assert [s["state"] for s in data["sections"][1:]] == ["skipped"] * (len(suite_plan.SECTIONS) - 1)


def test_a_child_printing_its_result_then_hanging_is_cut_quickly(tmp_path: Path) -> None:
    """The result line is kept, the child (and the process it started) killed ``grace`` seconds
    after it, not at the section's limit; a child that prints nothing runs to its limit."""
    pidfile = tmp_path / "grandchild"
    code = (
        "import json, subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "print('BENCH_GPU_PAIRS_RESULT ' + json.dumps({'step_ms': 1.5}), flush=True)\n"
        "time.sleep(300)  # a hang at exit: a thread that never ends, a comm that never closes\n"
    )
    t = time.time()
    got = run_group([sys.executable, "-c", code], 120, tag="BENCH_GPU_PAIRS_RESULT", grace=2)
    assert time.time() - t < 15, f"cut after {time.time() - t:.0f} s, not 2 s after the result"
    assert got.ok and not got.cut and got.hung_after_result is not None
    assert 'BENCH_GPU_PAIRS_RESULT {"step_ms": 1.5}' in got.text
    grandchild = int(pidfile.read_text())
    time.sleep(0.3)
    state = Path(f"/proc/{grandchild}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z", "the child's own child survived"

    t = time.time()
    silent = run_group(
        [sys.executable, "-c", "import time; time.sleep(300)"], 3, tag="BENCH_GPU_PAIRS_RESULT"
    )
    assert silent.cut and not silent.ok and 2.5 < time.time() - t < 12


def test_multirank_probe_runs_two_ranks_on_cpu(tmp_path: Path) -> None:
    """The multirank section's probe, on CPU tensors (on a GPU it takes CUDA ones): two processes
    over gloo, each operation checked against its value, loco's point-to-point exchange included."""
    out = tmp_path / "multirank.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_multirank.py"), "--cpu", "--out", str(out)]
    proc = subprocess.run(cmd, timeout=150, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        assert r["device"] == "cpu"
        for op in (
            "all_reduce",
            "reduce_scatter_tensor",
            "all_to_all_single",
            "loco_p2p_all_to_all",
            "loco_exchange_all_to_all",
        ):
            assert r["ops"][op].startswith("ok ("), (op, r["ops"][op])
    assert "| loco_p2p_all_gather_uint8 | ok" in proc.stdout


def test_multirank_probe_goes_on_after_an_operation_kills_a_rank(tmp_path: Path) -> None:
    """On an H100 gloo aborted a rank inside one operation on CUDA tensors (``writev ... Bad
    address``) and the whole probe came back empty.  Rank 1 now aborts in ``all_gather``: that
    operation is recorded as crashed on rank 1 and as the error rank 0 saw (the peer gone), the
    ones before and after it still run, in a second pair of processes."""
    out = tmp_path / "multirank.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_multirank.py"), "--cpu", "--out", str(out)]
    env = {**os.environ, "ZEROHOOKS_MULTIRANK_CRASH": "all_gather"}
    proc = subprocess.run(cmd, timeout=200, capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["attempts"] == 2 and "error" not in data
    r0, r1 = (r["ops"] for r in data["ranks"])
    assert r1["all_gather"] == "crashed: terminate called: injected crash in all_gather"
    assert not r0["all_gather"].startswith("ok") and "injected" not in r0["all_gather"], r0["all_gather"]
    for ops in (r0, r1):
        assert ops["broadcast"].startswith("ok (") and ops["all_to_all_single"].startswith("ok (")
        assert list(ops) == list(bench_multirank.OP_NAMES)


def test_a_plan_past_the_deadline_is_cut_by_the_deadline(tmp_path: Path) -> None:
    """--budget scales the plan, the deadline only stops: info planned for 20 s of a 200 s budget
    under an 11 s deadline (3 s left after the reserve) is cut by the deadline (not by its own limit, and not ok).

    The info section is held for 60 s (a ``sitecustomize`` that sleeps in the process whose
    command holds ``SUITE_INFO``): with bytecode cached it can finish in under 3 s, and the test
    is about the deadline, not about how fast the section is."""
    out = tmp_path / "out"
    slow = tmp_path / "slow_info"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import sys, time\nif any('SUITE_INFO' in a for a in sys.orig_argv):\n    time.sleep(60)\n"
    )
    path = os.pathsep.join(x for x in (str(slow), os.environ.get("PYTHONPATH", "")) if x)
    skip = ",".join(n for n in suite_plan.SECTIONS if n != "info")
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_suite.py"), "--cpu-smoke", "--deadline-s", "11"]
    cmd += ["--budget", "200", "--out", str(out), "--work", str(tmp_path / "w"), "--skip", skip]
    t = time.time()
    env = _env(tmp_path, PYTHONPATH=path)
    proc = subprocess.run(cmd, env=env, timeout=120, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.time() - t < 11 + 5
    data = _check_results(out)
    assert data["plan"]["info"] > 11 and data["budget_s"] == 200
    info = data["sections"][0]
    assert info["state"] == "cut-deadline" and info["status"].startswith("cut by the deadline ("), info
    assert data["remaining"] == ["info"]


def test_the_async_io_probe_names_a_missing_distutils(tmp_path: Path) -> None:
    """Python 3.12 has no distutils, and DeepSpeed's libaio check imports it: the probe says so,
    not "libaio missing".  3.12's state is made here with a ``distutils`` that fails to import
    (first on the path, setuptools' own copy switched off)."""
    from bench_gpu_pairs import AIO_PROBE, aio_probe_reason

    shadow = tmp_path / "no-distutils" / "distutils"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'distutils'\")\n")
    env = dict(os.environ, SETUPTOOLS_USE_DISTUTILS="stdlib")
    env["PYTHONPATH"] = os.pathsep.join(x for x in [str(shadow.parent), env.get("PYTHONPATH", "")] if x)
    got = run_group([sys.executable, "-c", AIO_PROBE], 120, env=env, tag="SUITE_AIO_PROBE", grace=5)
    why = aio_probe_reason(got.text)
    assert why is not None and why.startswith("import distutils failed"), got.text[-2000:]
    assert "libaio missing" not in why


def test_pairs_report_spread_and_where_the_time_differs(tmp_path: Path) -> None:
    """The pairs' table gives each side's quartiles of its timed steps, and one profiled step of
    each side (after the timed ones) gives the ops whose time differs most: on a tiny CPU run,
    accumdtype's fp32 accumulation against DeepSpeed's, each op's time within the step's total."""
    out = tmp_path / "pairs.json"
    args = ["--tiny", "--cpu", "--stages", "2", "--pairs", "accumdtype", "--rounds", "1", "--steps", "3"]
    run_script(
        "benchmarks/bench_gpu_pairs.py", *args, "--warmup", "1", "--profile", "--out", str(out), timeout=240
    )
    data = json.loads(out.read_text())
    runs = {r["run"]: r for r in data["results"]}
    assert set(runs) == {"accumdtype", "ds-accum-fp32"}
    for r in runs.values():
        prof = r["profile"]
        assert prof["clock"] == "cpu" and prof["top"] and 0 < prof["top"][0]["self_ms"] <= prof["total_ms"]
        lo, hi = _quartiles(r["step_ms_all"][1:])
        assert lo <= r["step_ms"] <= hi
    (row,) = data["summary"]["pairs"]
    assert row["plugin_step_quartiles_ms"][0] <= row["plugin_step_ms"] <= row["plugin_step_quartiles_ms"][1]
    assert row["profile_diff"] and row["profile_total_ms"] == [
        runs["accumdtype"]["profile"]["total_ms"],
        runs["ds-accum-fp32"]["profile"]["total_ms"],
    ]
    first = row["profile_diff"][0]
    assert abs(first["plugin_ms"] - first["equivalent_ms"]) >= max(
        abs(d["plugin_ms"] - d["equivalent_ms"]) for d in row["profile_diff"]
    )
    md = out.with_suffix(".md").read_text()
    assert "Where the step time differs" in md and f"`{first['op']}`" in md
    assert f"{row['plugin_step_ms']:.1f} ({row['plugin_step_quartiles_ms'][0]:.1f}-" in md


def _quartiles(values: list[float]) -> tuple[float, float]:
    """Independent of the benchmark's own: linear interpolation between order statistics (the
    'exclusive' method of statistics.quantiles, written out)."""
    v = sorted(values)
    if len(v) < 2:
        return v[0], v[0]

    def q(p: float) -> float:
        h = (len(v) + 1) * p - 1
        lo = min(max(int(h // 1), 0), len(v) - 1)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (h - lo) * (v[hi] - v[lo]) if h >= 0 else v[0]

    return q(0.25), q(0.75)


_DS_ARCH_PROBE = r"""
import sys
from deepspeed.ops.op_builder.builder import CUDAOpBuilder

class Probe(CUDAOpBuilder):  # the nvcc arguments of any DeepSpeed CUDA op, async_io's included
    BUILD_VAR = "DS_BUILD_PROBE"
    NAME = "probe"
    def __init__(self):
        super().__init__(name="probe")
    def absolute_name(self):
        return "probe"
    def sources(self):
        return []

try:
    print(" ".join(Probe().compute_capability_args()))
except ValueError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("arch", ["9.0a", "9.0a 10.0a", "8.0;9.0a+PTX"])
def test_deepspeed_builds_with_the_arch_list_the_suite_hands_it(arch: str) -> None:
    """The H100 machine sets TORCH_CUDA_ARCH_LIST=9.0a, which DeepSpeed 0.19.8's op builder
    cannot parse (the suite's async_io build failed on it). DeepSpeed's own builder is the oracle:
    it refuses the raw list and takes the one ``deepspeed_arch_env`` gives, with the same
    architectures."""
    import gpu_suite

    def nvcc_args(value: str) -> str:
        env = dict(os.environ, TORCH_CUDA_ARCH_LIST=value, DS_ACCELERATOR="cpu")
        r = subprocess.run(
            [sys.executable, "-c", _DS_ARCH_PROBE], env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip().splitlines()[-1]

    assert nvcc_args(arch).startswith("REFUSED")
    fixed = gpu_suite.deepspeed_arch_env({"TORCH_CUDA_ARCH_LIST": arch, "PATH": "/bin"})
    assert fixed["PATH"] == "/bin"
    args = nvcc_args(fixed["TORCH_CUDA_ARCH_LIST"])
    assert not args.startswith("REFUSED"), args
    for cc in ("80", "90", "100"):
        assert (f"sm_{cc}" in args) == (cc[:-1] + "." + cc[-1] in arch), (arch, args)
    assert ("code=compute_90" in args) == ("+PTX" in arch)
    assert gpu_suite.deepspeed_arch_env({}) == {}
