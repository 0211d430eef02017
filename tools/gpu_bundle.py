"""Write a self-contained folder that runs the project's GPU suite on a machine without network.

    bash run.sh gpu-bundle DIR                      # for CPython 3.12, manylinux x86_64 (the default)
    python tools/gpu_bundle.py DIR --python-version 3.11

The GPU machine needs Python (the version given) and a CUDA build of torch; everything else
comes in the folder:

    DIR/run_suite.sh           installs the wheels with ``pip --target`` (no index), builds the
                               kernels for the device, runs the suite under one deadline
    DIR/wheels/                installed always: DeepSpeed (a pure wheel, ``DS_BUILD_OPS=0``),
                               pydantic with its exactly pinned pydantic_core, annotated_types,
                               typing_inspection, typing_extensions, hjson, pytest (the suite's
                               own: the project needs pytest >= 9) and the project's packages
    DIR/wheels-if-missing/M/   installed only where ``import M`` fails: DeepSpeed's other
                               requirements (einops, msgpack, ninja, numpy, packaging, psutil,
                               cpuinfo, tqdm), so the machine's own copies are not shadowed
    DIR/debs-if-missing/L/     Debian packages of the C library libL, unpacked (``dpkg-deb -x``)
                               into the scratch folder only where the machine has no libL:
                               libaio (``libaio1``, ``libaio-dev``), which DeepSpeed's NVMe
                               offload (async_io) builds against; an H100 machine had none
    DIR/project/               the working tree's tracked and untracked, not ignored, files
                               (tests, benchmarks, examples, pyproject.toml)
    DIR/manifest.json          what is in it: Python version, wheels, git revision, sizes

Third-party wheels are downloaded (``pip download --only-binary``, binary ones for the target
Python and platform) at the versions of this environment where it has them, and kept in a
cache (``--cache``; a second bundle needs no network for them); the packages' wheels (every
``packages/<name>/``, see tools/monorepo.py) are built from the working tree every time.  The
folder must stay under ``--max-mib`` (64).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # also when loaded by path, not run
from monorepo import packages  # noqa: E402  (standard library only)

PACKAGES = tuple(p.name for p in packages(ROOT))
"""The project's packages: every packages/<name>/ with a pyproject.toml (tools/monorepo.py)."""
ALWAYS = (
    "pydantic",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "hjson",
    "pytest",
    "pluggy",
    "iniconfig",
    "pygments",
)
"""Distributions installed on the GPU machine in every case (its own may be missing or too old)."""
IF_MISSING = {
    "einops": "einops",
    "msgpack": "msgpack",
    "ninja": "ninja",
    "numpy": "numpy",
    "packaging": "packaging",
    "psutil": "psutil",
    "py-cpuinfo": "cpuinfo",
    "tqdm": "tqdm",
}
"""DeepSpeed's other requirements (its METADATA), distribution -> import name: installed only
where the import fails, so a machine's own numpy (say) is not shadowed by another version."""
DEBS_IF_MISSING = {"aio": ("libaio1", "libaio-dev")}
"""C libraries (``lib<key>``) carried as Debian packages (``apt-get download``, from this
machine's Debian release: libaio depends on nothing but libc), unpacked on the GPU machine only
where ``ctypes.util.find_library`` finds none."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def log(msg: str) -> None:
    print(f"gpu-bundle: {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw: object) -> None:
    log(" ".join(cmd))
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


@functools.lru_cache(maxsize=1)
def _pip() -> tuple[str, ...]:
    """A pip to run: this interpreter's, else ``python3 -m pip`` on PATH, else ``uvx pip`` (a venv
    made by uv has no pip).  Downloads name the target Python and platform, so any pip will do."""
    candidates = [[sys.executable, "-m", "pip"]]
    if shutil.which("python3"):
        candidates.append([str(shutil.which("python3")), "-m", "pip"])
    if shutil.which("uv"):
        candidates.append([str(shutil.which("uv")), "tool", "run", "pip"])
    for cmd in candidates:
        if subprocess.run([*cmd, "--version"], capture_output=True).returncode == 0:
            return tuple(cmd)
    raise SystemExit("gpu-bundle: no pip found (python -m pip, python3 -m pip, uv tool run pip): install pip")


def _has_torch(pip: tuple[str, ...]) -> bool:
    """Whether the interpreter behind ``pip`` imports torch and setuptools (then DeepSpeed's
    setup.py is run without build isolation and sees torch; it needs neither with DS_BUILD_OPS=0)."""
    if pip[1:3] != ("-m", "pip"):
        return False
    code = "import torch, setuptools, wheel"
    return subprocess.run([pip[0], "-c", code], capture_output=True).returncode == 0


def _pin(dist: str) -> str:
    """``dist==version`` of this environment, or ``dist`` (the newest) where it is not installed."""
    try:
        return f"{dist}=={importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return dist


def _download(spec: str, dest: Path, pyver: str) -> Path:
    """One binary wheel for CPython ``pyver`` on manylinux x86_64 (cached in ``dest``)."""
    name = spec.split("==")[0].replace("-", "_").lower()
    version = spec.split("==")[1] if "==" in spec else None

    def found() -> list[Path]:
        hits = []
        for w in dest.glob("*.whl"):
            wname, wver = w.name.split("-")[:2]
            if wname.lower() == name and (version is None or wver == version):
                hits.append(w)
        return hits

    if version is None or not found():
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        cmd = [*_pip(), "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", pyver, "--implementation", "cp", *platforms, "-d", str(dest), spec]
        _run(cmd)
    hits = sorted(found(), key=lambda w: w.stat().st_mtime)
    if not hits:
        raise SystemExit(f"gpu-bundle: pip download {spec} left no wheel in {dest}")
    return hits[-1]


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _deepspeed(version: str, cache: Path) -> Path:
    """DeepSpeed ``version`` as a pure-Python wheel (``DS_BUILD_OPS=0``), built once into ``cache``."""
    hits = list(cache.glob(f"deepspeed-{version}-py3-none-any.whl"))
    if not hits:
        env = dict(os.environ, DS_BUILD_OPS="0")
        pip = _pip()
        isolated = not _has_torch(pip)
        if not isolated:
            # pip >= 26.3 refuses build constraints (which nox sets) without build isolation, and
            # without isolation there is no build environment for them to constrain
            env.pop("PIP_BUILD_CONSTRAINT", None)
        cmd = [*pip, "wheel", "-q", "--no-deps", *([] if isolated else ["--no-build-isolation"])]
        _run([*cmd, f"deepspeed=={version}", "-w", str(cache)], env=env)
        hits = list(cache.glob(f"deepspeed-{version}-*.whl"))
    if len(hits) != 1 or not hits[0].name.endswith("py3-none-any.whl"):
        raise SystemExit(f"gpu-bundle: expected one pure deepspeed {version} wheel in {cache}, found {hits}")
    with zipfile.ZipFile(hits[0]) as z:
        binaries = [n for n in z.namelist() if n.endswith((".so", ".pyd"))]
    if binaries:
        raise SystemExit(
            f"gpu-bundle: {hits[0].name} holds compiled ops ({binaries[:3]}): build it with DS_BUILD_OPS=0"
        )
    return hits[0]


def _own_wheels(dest: Path) -> None:
    """The packages' wheels, built from the working tree: with ``uv build`` where uv is
    installed (it keeps the build backend's environment: seconds), else ``pip wheel``."""
    uv = shutil.which("uv")
    if uv:
        for pkg in PACKAGES:
            _run([uv, "build", "-q", "--wheel", "-o", str(dest), str(ROOT / "packages" / pkg)])
    else:
        _run(
            [
                *_pip(),
                "wheel",
                "-q",
                "--no-deps",
                *(str(ROOT / "packages" / p) for p in PACKAGES),
                "-w",
                str(dest),
            ]
        )
    built = sorted(w.name for w in dest.glob("zerohooks*.whl"))
    if len(built) != len(PACKAGES):
        raise SystemExit(
            f"gpu-bundle: expected {len(PACKAGES)} wheels of the packages in {dest}, found {built}"
        )


def _project_files() -> list[str]:
    """The working tree's tracked and untracked (not ignored) files that exist."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


def _revision() -> str:
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _debs(dest: Path, cache: Path) -> dict[str, object]:
    """Copy :data:`DEBS_IF_MISSING` into ``dest`` (downloaded into ``cache`` once); a library that
    cannot be downloaded here (no apt-get, no package lists) is left out with the reason, so the
    bundle still works without it (the nvme section then says libaio is missing)."""
    out: dict[str, object] = {}
    for lib, debs in DEBS_IF_MISSING.items():
        where = cache / "debs" / lib
        where.mkdir(parents=True, exist_ok=True)
        have = {p: sorted(where.glob(f"{p}_*.deb")) for p in debs}
        missing = [p for p, found in have.items() if not found]
        if missing:
            try:
                subprocess.run(
                    ["apt-get", "download", *missing], cwd=where, check=True, timeout=120, capture_output=True
                )
            except (OSError, subprocess.SubprocessError) as e:
                why = getattr(e, "stderr", b"") or str(e).encode()
                out[lib] = (
                    f"left out: apt-get download {' '.join(missing)} failed ({why.decode(errors='replace').strip()[-200:]})"
                )
                log(f"warning: lib{lib} {out[lib]}")
                continue
        (dest / "debs-if-missing" / lib).mkdir(parents=True)
        names = []
        for p in debs:
            deb = sorted(where.glob(f"{p}_*.deb"))[-1]
            shutil.copy2(deb, dest / "debs-if-missing" / lib / deb.name)
            names.append(deb.name)
        out[lib] = names
    return out


def build(dest: Path, pyver: str, ds_version: str, cache: Path, max_mib: float) -> dict[str, object]:
    t0 = time.time()
    if dest.exists() and any(dest.iterdir()):
        if not (dest / "manifest.json").is_file():
            raise SystemExit(
                f"gpu-bundle: {dest} exists, is not empty and is not a bundle: not overwriting it"
            )
        shutil.rmtree(dest)
    wheels, if_missing = dest / "wheels", dest / "wheels-if-missing"
    wheels.mkdir(parents=True)
    third = cache / f"cp{pyver.replace('.', '')}"
    third.mkdir(parents=True, exist_ok=True)

    chosen: dict[str, Path] = {}
    for dist in ALWAYS:
        chosen[dist] = _download(_pin(dist), third, pyver)
    core_pin = next((r for r in _requires(chosen["pydantic"]) if r.startswith("pydantic-core==")), None)
    if core_pin is None:
        raise SystemExit(f"gpu-bundle: {chosen['pydantic'].name} pins no pydantic-core version")
    chosen["pydantic-core"] = _download(core_pin.split(";")[0].strip(), third, pyver)
    chosen["deepspeed"] = _deepspeed(ds_version, cache)
    for w in chosen.values():
        shutil.copy2(w, wheels / w.name)
    for dist, module in IF_MISSING.items():
        w = _download(_pin(dist), third, pyver)
        (if_missing / module).mkdir(parents=True)
        shutil.copy2(w, if_missing / module / w.name)
    _own_wheels(wheels)
    debs = _debs(dest, cache)

    project = dest / "project"
    project.mkdir()
    files = _project_files()
    for f in files:
        (project / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, project / f)
    shutil.copy2(ROOT / "tools" / "run_suite.sh", dest / "run_suite.sh")
    (dest / "run_suite.sh").chmod(0o755)
    (dest / "PYTHON_VERSION").write_text(pyver + "\n")

    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    manifest: dict[str, object] = {
        "python": pyver,
        "platforms": list(PLATFORMS),
        "revision": _revision(),
        "made": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wheels": sorted(w.name for w in wheels.glob("*.whl")),
        "wheels_if_missing": {
            m: sorted(w.name for w in (if_missing / m).glob("*.whl")) for m in IF_MISSING.values()
        },
        "debs_if_missing": debs,
        "project_files": len(files),
        "bytes": size,
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if size > max_mib * 2**20:
        raise SystemExit(f"gpu-bundle: {dest} is {size / 2**20:.1f} MiB, over the {max_mib} MiB limit")
    log(f"wrote {dest} ({size / 2**20:.1f} MiB, {len(files)} project files) in {time.time() - t0:.0f} s")
    return manifest


def archive(dest: Path) -> Path:
    """A .tar.gz of the folder next to it (to copy to the GPU machine in one file)."""
    tar = dest.with_name(dest.name + ".tar.gz")
    with tarfile.open(tar, "w:gz") as t:
        t.add(dest, arcname=dest.name)
    return tar


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="the folder to write (replaced if it holds an older bundle)")
    p.add_argument("--python-version", default="3.12", help="X.Y of the GPU machine's CPython (default 3.12)")
    p.add_argument("--deepspeed", default="0.19.8", help="DeepSpeed version (default 0.19.8)")
    p.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zerohooks-gpu-bundle",
        help="where downloaded and built third-party wheels are kept between bundles",
    )
    p.add_argument("--max-mib", type=float, default=64.0, help="fail when the folder is larger (default 64)")
    p.add_argument("--tar", action="store_true", help="also write DEST.tar.gz")
    args = p.parse_args(argv)
    parts = args.python_version.split(".")
    if len(parts) != 2 or not all(x.isdigit() for x in parts):
        p.error(f"--python-version {args.python_version!r}: expected X.Y, e.g. 3.12")
    build(args.dest.resolve(), args.python_version, args.deepspeed, args.cache.resolve(), args.max_mib)
    if args.tar:
        log(f"wrote {archive(args.dest.resolve())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
