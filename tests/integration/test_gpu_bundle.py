"""`bash run.sh gpu-bundle DIR` writes a folder that installs without an index and runs the GPU
suite; on CPU its smoke check runs every section under a short deadline and still writes its
results.  The bundle is made for this interpreter's Python version (a GPU machine's default is
3.12): its binary wheels must install here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"
SECTIONS = ["info", "build", "gpu-tests", "loco-kernels", "pairs", "ds-aio-build", "nvme", "multirank"]
TOP_FILES = {"results.json", "results.md", "logs.tgz", "console.log"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("gpu") / "bundle"
    # what `bash run.sh gpu-bundle` runs (run.sh would first install nox and uv into this venv);
    # with this interpreter, its pins are this environment's versions
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_bundle.py"), str(dest), "--python-version", VERSION]
    subprocess.run(cmd, check=True, timeout=900)
    return dest


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def test_bundle_contents(bundle: Path) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert size < 64 * 2**20 and manifest["bytes"] <= size
    wheels = {w.name.split("-")[0].lower(): w for w in (bundle / "wheels").glob("*.whl")}
    for name in ("deepspeed", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "hjson"):
        assert name in wheels, f"{name} missing from {sorted(wheels)}"
    for pkg in ("accumdtype", "autocastzero", "mixedlayers", "loco", "nvmeswap"):
        assert f"zerohooks_{pkg}" in wheels
    assert "zerohooks" in wheels
    ds = wheels["deepspeed"]
    assert ds.name == "deepspeed-0.19.8-py3-none-any.whl"
    with zipfile.ZipFile(ds) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")], (
            "DeepSpeed's wheel must be pure (DS_BUILD_OPS=0)"
        )
    # pydantic pins its core exactly: the pair must match
    pin = next(
        x
        for x in _metadata(wheels["pydantic"]).splitlines()
        if x.startswith("Requires-Dist: pydantic-core==")
    )
    core_version = wheels["pydantic_core"].name.split("-")[1]
    assert pin.split("==")[1].split(";")[0].strip() == core_version
    assert f"cp{sys.version_info[0]}{sys.version_info[1]}" in wheels["pydantic_core"].name
    # DeepSpeed's other requirements, each under the module name checked before installing it
    for module in ("einops", "msgpack", "ninja", "numpy", "packaging", "psutil", "cpuinfo", "tqdm"):
        assert list((bundle / "wheels-if-missing" / module).glob("*.whl")), module
    for f in ("run_suite.sh", "project/tools/gpu_suite.py", "project/benchmarks/bench_gpu_pairs.py"):
        assert (bundle / f).is_file(), f
    assert (bundle / "project/packages/loco/tests/test_loco_kernels.py").is_file()
    assert (bundle / "project/pyproject.toml").is_file()
    # libaio for DeepSpeed's NVMe offload, as Debian packages (left out, with the reason, where
    # apt-get cannot download them)
    aio = manifest["debs_if_missing"]["aio"]
    if isinstance(aio, str):
        assert aio.startswith("left out: apt-get download")
    else:
        assert [n.split("_")[0] for n in aio] == ["libaio1", "libaio-dev"]
        assert all((bundle / "debs-if-missing" / "aio" / n).is_file() for n in aio)


def test_bundle_cpu_smoke_writes_results_under_a_short_deadline(bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop("PYTHONPATH", None)  # what the suite imports must come from the bundle's install
    env.pop("ZEROHOOKS_NATIVE_CACHE", None)  # a bare GPU machine: no builds shared by nox's sessions
    # as on a machine without libaio (this one has it): the bundle's copy is unpacked and used
    env["ZEROHOOKS_BUNDLE_UNPACK_DEBS"] = "1"
    cmd = ["bash", str(bundle / "run_suite.sh"), "--cpu-smoke", "--deadline", "60", "--out", str(out)]
    cmd += ["--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, env=env, timeout=400, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} <= TOP_FILES  # at most 4 files, whatever happens
    data = json.loads((out / "results.json").read_text())
    assert data["status"] == "done" and data["cpu_smoke"]
    sections = {s["name"]: s for s in data["sections"]}
    assert list(sections) == SECTIONS
    assert sections["ds-aio-build"]["status"] == "skipped (CPU smoke check)"
    assert all(
        s["state"] in ("ok", "failed", "cut-limit", "cut-deadline", "skipped") for s in data["sections"]
    )
    if isinstance(json.loads((bundle / "manifest.json").read_text())["debs_if_missing"]["aio"], list):
        assert "unpacked libaio from the bundle" in proc.stdout + proc.stderr, proc.stdout[:3000]
        sysroot = tmp_path / "work" / "sysroot"
        assert (sysroot / "usr/include/libaio.h").is_file()
        assert list(sysroot.glob("usr/lib/*/libaio.so.1"))
    info = sections["info"]["data"]
    site = str(tmp_path / "work" / "site")
    for mod in ("deepspeed", "pydantic", "zerohooks", "loco", "nvmeswap", "pytest"):
        assert site in info[mod], f"{mod} not imported from the bundle's install: {info[mod]}"
    tests = sections["gpu-tests"].get("data")
    if tests is not None:  # collected and skipped on CPU (not cut by the deadline)
        assert tests["tests"] > 0 and tests["skipped"] == tests["tests"], tests
    kernels = sections["loco-kernels"].get("data")
    assert kernels is None or "no CUDA device" in kernels["skipped"]
    # The plan cut something (60 s cannot hold the kernel builds and every tiny run) and the
    # results say so, section by section
    cut = [s["name"] for s in data["sections"] if s["state"] in ("cut-limit", "cut-deadline")]
    assert cut and data["remaining"], data
    md = (out / "results.md").read_text()
    for name in SECTIONS:
        assert f"| {name} |" in md
    assert data["seconds"] < 60 + 30

    # a bundle for another Python fails before installing, naming both versions, and says so in its results
    (bundle / "PYTHON_VERSION").write_text("3.99\n")
    try:
        bad = subprocess.run(cmd[:-2], env=env, timeout=120, capture_output=True, text=True)
    finally:
        (bundle / "PYTHON_VERSION").write_text(VERSION + "\n")
    assert bad.returncode == 1
    failed = json.loads((out / "results.json").read_text())
    assert failed["status"] == "failed" and "3.99" in failed["error"] and VERSION in failed["error"]
    assert {p.name for p in out.iterdir()} <= TOP_FILES and (out / "logs.tgz").is_file()
