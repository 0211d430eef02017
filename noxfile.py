"""Nox sessions for the zerohooks monorepo.

    nox                          the test command: every package's tests, integration, frameworks, lint, typecheck
    nox -l                       list the sessions
    nox -s "tests(zerohooks)"    one package's tests (or: nox -s tests -k zerohooks)
    nox -s tests -- -m "not slow" -x      posargs go to pytest
    nox -s build                 build every package (sdist + wheel), install the wheels in a fresh venv
    nox -s bench                 python benchmarks/run_all.py
    nox -s demo -- --stage 3     python examples/train_gpt.py --stage 3

Each `tests(<pkg>)` session installs ONLY that package and zerohooks (editable, from this tree) plus
pytest, checks that nothing of ours came from an index, and runs pytest on packages/<pkg>/tests.

Environment variables:
    ZEROHOOKS_CONSTRAINTS   constraints file for every install (default: ./constraints.txt, which
                            pins torch to the CPU build used by CI); set it empty to disable the pins,
                            e.g. on a GPU machine where you choose your own torch build.
    ZEROHOOKS_FIND_LINKS    extra wheel folders, os.pathsep-separated (default: /opt/wheels when it
                            exists). pip reads pip.conf; uv does not, so nox passes them explicitly.
    ZEROHOOKS_CPU_ONLY=1    fail a session if any nvidia-* / triton wheel got installed (set by .ci/run).
    ZEROHOOKS_STALE_LOCK_MINUTES  JIT build locks older than this are removed (default 30).
    ZEROHOOKS_NATIVE_CACHE  the folder where the plugins' kernels, built once, are shared by every
                            session's venv (default .torch_extensions/shared-native; see
                            zerohooks.nativecache); set it empty to build in each venv.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import nox
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox depends on tomli on Python 3.10
    import tomli as tomllib

nox.needs_version = ">=2024.10.9"  # nox.options.reuse_venv
nox.options.default_venv_backend = "uv|virtualenv"  # uv when installed (fast), else virtualenv + pip
nox.options.reuse_venv = "yes"  # reuse venvs locally (nox -R also skips installs); CI starts from none
nox.options.error_on_external_run = True
# The test command (`nox`): one tests(<pkg>) session per existing package, then the rest.
nox.options.sessions = ["tests", "integration", "frameworks", "lint", "typecheck"]

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
INTEGRATION_DIR = ROOT / "tests" / "integration"
FRAMEWORKS_DIR = ROOT / "tests" / "frameworks"
TORCH_EXTENSIONS_ROOT = ROOT / ".torch_extensions"
JUNIT_DIR = ROOT / "reports" / "ci" / "junit"
"""Each pytest run's JUnit file (one per session), read by tools/ci_report.py."""
LINT_PATHS = ("packages", "tests", "examples", "benchmarks", "tools", "noxfile.py")


# The packages: every packages/<name>/ with a pyproject.toml (tools/monorepo.py reads them; adding
# a package is adding its folder, nothing here names one)
sys.path.insert(0, str(ROOT / "tools"))
from monorepo import Package  # noqa: E402  (standard library only)
from monorepo import packages as _packages  # noqa: E402

PACKAGES = _packages(ROOT)
CORE = next(p for p in PACKAGES if p.is_core)


# ------------------------------------------------------------------------------------------------
# install helpers
# ------------------------------------------------------------------------------------------------


def _constraints() -> Path | None:
    value = os.environ.get("ZEROHOOKS_CONSTRAINTS")
    if value is None:
        return ROOT / "constraints.txt"
    if not value.strip():
        return None
    path = Path(value).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"ZEROHOOKS_CONSTRAINTS={value!r}: no such file (unset it, or set it empty)")
    return path


def _find_links() -> list[str]:
    value = os.environ.get("ZEROHOOKS_FIND_LINKS")
    if value is None:
        value = "/opt/wheels" if Path("/opt/wheels").is_dir() else ""
    return [v for v in value.split(os.pathsep) if v]


def _pin_args(constraints: Path | None = None) -> list[str]:
    args: list[str] = []
    constraints = constraints or _constraints()
    if constraints is not None:
        args += ["-c", str(constraints)]
    for folder in _find_links():
        args += ["--find-links", folder]
    return args


def _dev_requirement(name: str) -> str:
    """The requirement for tool `name` from [dependency-groups].dev of the root pyproject.toml."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for req in data.get("dependency-groups", {}).get("dev", []):
        if isinstance(req, str) and Requirement(req).name == name:
            return req
    return name


def _prepare(session: nox.Session) -> None:
    """Environment shared by every session that installs torch/DeepSpeed."""
    constraints = _constraints()
    if constraints is not None:
        # pip subprocesses (build isolation, tests that pip install) and uv honour these too
        # (and builds of sdists: a build dependency on torch must not pull the CUDA build either)
        for var in ("PIP_CONSTRAINT", "PIP_BUILD_CONSTRAINT", "UV_CONSTRAINT", "UV_BUILD_CONSTRAINT"):
            session.env[var] = str(constraints)
    links = _find_links()
    if links:
        session.env["UV_FIND_LINKS"] = ",".join(links)  # uv does not read pip.conf
    session.env["DS_BUILD_OPS"] = "0"  # DeepSpeed builds its ops just in time, never at install
    _keep_bytecode(session)


def _keep_bytecode(session: nox.Session) -> None:
    """Every Python process of the session reads its modules' bytecode from a cache in the venv.

    uv installs no ``.pyc`` files, and this machine's environment sets PYTHONDONTWRITEBYTECODE=1,
    so without this every process compiled the modules it imports from source again: each rank,
    torchrun launch and demo run spent 7-8 s of CPU (30 s under load) compiling torch, DeepSpeed
    and torch._dynamo (which a torch optimizer imports) before doing anything (issue 35).  The
    cache is ``<venv>/pycache`` (PYTHONPYCACHEPREFIX: nothing is written into the source tree or
    site-packages; each file is written whole, then renamed, so ranks importing side by side are
    safe); the first process compiles what it imports, the others load it (a venv made again
    starts an empty one).  tests/integration/test_session_bytecode.py checks it."""
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # empty: Python writes bytecode
    session.env["PYTHONPYCACHEPREFIX"] = str(Path(session.virtualenv.location) / "pycache")


def _install(
    session: nox.Session, *args: str, local: Iterable[Package] = (), constraints: Path | None = None
) -> None:
    """session.install with the pins (`constraints` replaces constraints.txt); `local` packages
    are (re)installed editable from the tree."""
    local = list(local)
    extra: list[str] = []
    for pkg in local:
        spec = f"{pkg.rel}[test]" if "test" in pkg.extras else pkg.rel
        extra += ["-e", spec]
        if session.venv_backend == "uv":  # uv does not reinstall local packages on its own
            extra += ["--reinstall-package", pkg.dist]
    start = time.perf_counter()
    session.install(*_pin_args(constraints), *extra, *args, env={"DS_BUILD_OPS": "0"})
    session.log(f"install took {time.perf_counter() - start:.1f} s")


def _use_jit_dir(session: nox.Session, name: str | None = None) -> None:
    """TORCH_EXTENSIONS_DIR = .torch_extensions/<venv name>/ (gitignored), stale locks removed.

    DeepSpeed builds its CPU ops (deepspeed_shm_comm) just in time, at the first
    deepspeed.init_distributed() of a process. torch writes the venv's absolute include/library
    paths into build.ninja, so ONE folder shared by several venvs rebuilds the op (minutes on
    2 cores) every time a different session uses it. One folder per session venv under the shared
    root builds it once per venv: a reused venv (the local default) never rebuilds, a recreated
    one (CI, --reuse-venv=no) rebuilds once. A killed build leaves a `lock` file that makes the
    next build wait forever, so locks older than ZEROHOOKS_STALE_LOCK_MINUTES (30) are deleted.
    """
    if name is None:  # the venv's name plus a hash of its path (nox --envdir may place it elsewhere)
        location = Path(session.virtualenv.location).resolve()
        name = f"{location.name}-{hashlib.sha1(str(location).encode()).hexdigest()[:8]}"
    folder = TORCH_EXTENSIONS_ROOT / name
    folder.mkdir(parents=True, exist_ok=True)
    max_age = float(os.environ.get("ZEROHOOKS_STALE_LOCK_MINUTES", "30")) * 60
    now = time.time()
    for lock in TORCH_EXTENSIONS_ROOT.rglob("lock"):
        try:
            if lock.is_file() and now - lock.stat().st_mtime > max_age:
                session.warn(f"removing stale JIT build lock {lock.relative_to(ROOT)}")
                lock.unlink()
        except FileNotFoundError:
            pass
    session.env["TORCH_EXTENSIONS_DIR"] = str(folder)
    # the plugins' kernels, built once and loaded by every session's venv (zerohooks.nativecache:
    # keyed by sources, flags, torch, Python and compiler, so a venv never loads a stale build)
    session.env.setdefault("ZEROHOOKS_NATIVE_CACHE", str(TORCH_EXTENSIONS_ROOT / "shared-native"))


# ------------------------------------------------------------------------------------------------
# "did it come from this tree?" check, run inside the session's (or a fresh) venv
# ------------------------------------------------------------------------------------------------

_CHECK_INSTALL = r'''
"""Fail unless every package of ours that is installed comes from this repository."""
import importlib.metadata as md
import importlib.util
import json
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

cfg = json.loads(Path(sys.argv[1]).read_text())
prefix = Path(sys.prefix).resolve()
errors = []


def inside(path, root):
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except ValueError:
        return False


for dist, info in cfg["known"].items():
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        if dist in cfg["expected"]:
            errors.append(f"{dist}: not installed")
        continue
    where = d.locate_file("")
    if dist not in cfg["expected"] and cfg["isolated"]:
        errors.append(
            f"{dist} {d.version}: installed, but this session must only have {sorted(cfg['expected'])} "
            "(does a package depend on a sibling plugin?)"
        )
    text = d.read_text("direct_url.json")
    url = json.loads(text).get("url", "") if text else ""
    if not url.startswith("file:"):
        installer = (d.read_text("INSTALLER") or "?").strip()
        errors.append(
            f"{dist} {d.version}: installed by {installer} from an index (PyPI?), not from this "
            f"repository ({where})"
        )
        continue
    source = Path(unquote(urlparse(url).path))
    if not any(inside(source, root) for root in cfg["sources"]):
        errors.append(f"{dist}: installed from {source}, outside {cfg['sources']}")
        continue
    spec = importlib.util.find_spec(info["module"])
    if spec is None:
        errors.append(f"{dist}: installed but `import {info['module']}` finds nothing")
        continue
    origin = spec.origin or next(iter(spec.submodule_search_locations or []), None)
    if origin is None:
        errors.append(f"{dist}: cannot locate module {info['module']}")
        continue
    if cfg["mode"] == "editable":
        if not inside(origin, info["src"]):
            errors.append(f"{dist}: `import {info['module']}` resolves to {origin}, not under {info['src']}")
            continue
    else:  # wheel: the module must be the installed copy, not the tree's source
        if not inside(origin, prefix) or inside(origin, info["src"]):
            errors.append(f"{dist}: `import {info['module']}` resolves to {origin}, not into {prefix}")
            continue
        if not (Path(origin).parent / "py.typed").is_file():
            errors.append(f"{dist}: the wheel has no py.typed next to {origin}")
            continue
    print(f"  ok  {dist:24} {d.version:10} {cfg['mode']:8} {origin}")

if cfg["cpu_only"]:
    cuda = sorted(
        {
            d.metadata["Name"]
            for d in md.distributions()
            if d.metadata["Name"] and d.metadata["Name"].lower().startswith(("nvidia-", "triton", "cuda-"))
        }
    )
    if cuda:
        errors.append(
            "ZEROHOOKS_CPU_ONLY is set but CUDA wheels were installed: " + ", ".join(cuda)
            + " (is torch pinned by the constraints to the local CPU wheel?)"
        )
try:
    print(f"  ok  torch {md.version('torch')}")
except md.PackageNotFoundError:
    pass

if errors:
    print("install check FAILED:", *errors, sep="\n  - ", file=sys.stderr)
    sys.exit(1)
'''


def _check_install(
    session: nox.Session,
    expected: Iterable[Package],
    *,
    isolated: bool,
    mode: str = "editable",
    sources: Iterable[Path] = (ROOT,),
    python: str = "python",
) -> None:
    """Fail the session if any of our packages resolves to something not built from this tree."""
    cfg = {
        "known": {p.dist: {"module": p.module, "src": str(p.src)} for p in PACKAGES},
        "expected": sorted(p.dist for p in expected),
        "isolated": isolated,
        "mode": mode,
        "sources": [str(s) for s in sources],
        "cpu_only": os.environ.get("ZEROHOOKS_CPU_ONLY", "") not in ("", "0"),
    }
    cache = session.cache_dir
    script = cache / "check_install.py"
    script.write_text(_CHECK_INSTALL, encoding="utf-8")
    config = cache / f"check_install-{session.name.replace('(', '-').replace(')', '')}.json"
    config.write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    session.log("checking that our packages come from this repository")
    session.run(python, str(script), str(config), external=True)


def _has_tests(folder: Path) -> bool:
    return folder.is_dir() and any(
        f for pattern in ("test_*.py", "*_test.py") for f in folder.rglob(pattern) if ".nox" not in f.parts
    )


def _pytest(session: nox.Session, folder: Path) -> None:
    # exit code 5 = "no tests collected" (e.g. everything deselected by -m/-k): not a failure.
    # A test past PYTEST_TIMEOUT seconds fails with its traceback (pytest-timeout; see pyproject.toml)
    session.env.setdefault("PYTEST_TIMEOUT", os.environ.get("PYTEST_TIMEOUT", "1200"))
    # every test's time and outcome, for tools/ci_report.py (.ci/run prints where the time went)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", session.name).strip("_")
    junit = JUNIT_DIR / f"{safe}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    session.run(
        "pytest",
        str(folder.relative_to(ROOT)),
        f"--junitxml={junit}",
        *session.posargs,
        success_codes=[0, 5],
    )


# ------------------------------------------------------------------------------------------------
# sessions
# ------------------------------------------------------------------------------------------------


@nox.session(tags=["tests"])
@nox.parametrize("package", [nox.param(p, id=p.name) for p in PACKAGES])
def tests(session: nox.Session, package: Package) -> None:
    """One package in isolation: only it and zerohooks, editable from the tree, plus pytest."""
    _prepare(session)
    wanted = [CORE] if package.is_core else [CORE, package]
    _install(session, _dev_requirement("pytest"), _dev_requirement("pytest-timeout"), local=wanted)
    _check_install(session, wanted, isolated=True)
    if not _has_tests(package.tests):
        session.skip(f"{package.rel}/tests has no test files yet: nothing to run")
    _use_jit_dir(session)
    if package.name == "nvmeswap":
        # nvmeswap's bit-identity oracle is DeepSpeed's own NVMe offload: build its async_io op
        # (minutes, once per venv) where libaio is installed; the test skips where it is not
        session.env.setdefault("NVMESWAP_TEST_DS_NVME", "1")
    _pytest(session, package.tests)


@nox.session(tags=["tests"])
def integration(session: nox.Session) -> None:
    """All packages together: pytest tests/integration."""
    if not _has_tests(INTEGRATION_DIR):
        session.skip("tests/integration has no test files yet: nothing to run")
    _prepare(session)
    args = [_dev_requirement("pytest"), _dev_requirement("pytest-timeout")]
    if (INTEGRATION_DIR / "requirements.txt").is_file():
        args += ["-r", str(INTEGRATION_DIR / "requirements.txt")]
    _install(session, *args, local=PACKAGES)
    _check_install(session, PACKAGES, isolated=False)
    _use_jit_dir(session)
    _pytest(session, INTEGRATION_DIR)


DEEPSPEED_RANGE = ("0.19.8",)
"""The oldest and newest DeepSpeed releases zerohooks claims (zerohooks.adapter.compat.SUPPORTED_DEEPSPEED):
0.19.8 only today; 0.19.0-0.19.7 lack DeepSpeed internals the adapter or plugins use
(zerohooks/tests/test_surface.py names them). Add a release here when the claim widens."""
RANGE_TESTS = (
    "packages/zerohooks/tests/test_surface.py",  # every DeepSpeed name we touch exists
    "packages/zerohooks/tests/test_bit_identity.py",  # no plugin: bit for bit DeepSpeed
    "tests/integration/test_autocastzero_loco.py",  # plugin smoke: autocastzero + loco training
    "tests/integration/test_mixedlayers_compose.py",  # mixedlayers (+ accumdtype, autocastzero)
    "tests/integration/test_nvmeswap_compose.py",  # nvmeswap's swap path
)
"""What ``deepspeed_range`` runs on each release (posargs replace it)."""


@nox.session(tags=["range"])
@nox.parametrize("deepspeed", DEEPSPEED_RANGE)
def deepspeed_range(session: nox.Session, deepspeed: str) -> None:
    """The DeepSpeed surface test, the bit-identity tests and the plugin smoke tests on the oldest
    and newest supported DeepSpeed (``nox -s deepspeed_range``; not in the default run: about 5
    minutes per release on 2 cores, two more venvs).  torch stays pinned by constraints.txt; only
    the deepspeed pin is replaced."""
    _prepare(session)
    pins = _constraints()
    derived = None
    if pins is not None:
        lines = [
            ln for ln in pins.read_text(encoding="utf-8").splitlines() if not ln.startswith("deepspeed==")
        ]
        derived = Path(session.create_tmp()) / "constraints-deepspeed.txt"
        derived.write_text("\n".join([*lines, f"deepspeed=={deepspeed}", ""]), encoding="utf-8")
        for var in ("PIP_CONSTRAINT", "PIP_BUILD_CONSTRAINT", "UV_CONSTRAINT", "UV_BUILD_CONSTRAINT"):
            session.env[var] = str(derived)
    args = [_dev_requirement("pytest"), _dev_requirement("pytest-timeout"), f"deepspeed=={deepspeed}"]
    if (INTEGRATION_DIR / "requirements.txt").is_file():
        args += ["-r", str(INTEGRATION_DIR / "requirements.txt")]
    _install(session, *args, local=PACKAGES, constraints=derived)
    _check_install(session, PACKAGES, isolated=False)
    session.run(
        "python",
        "-c",
        f"import deepspeed; assert deepspeed.__version__ == {deepspeed!r}, deepspeed.__version__",
    )
    _use_jit_dir(session)
    session.run("pytest", *(session.posargs or RANGE_TESTS))


@nox.session(tags=["tests"])
def frameworks(session: nox.Session) -> None:
    """All packages under Hugging Face Trainer, accelerate and Lightning: pytest tests/frameworks.

    transformers, accelerate and lightning (tests/frameworks/requirements.txt) are pinned, with
    what they pull in, by constraints.txt."""
    if not _has_tests(FRAMEWORKS_DIR):
        session.skip("tests/frameworks has no test files yet: nothing to run")
    _prepare(session)
    session.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    args = [
        _dev_requirement("pytest"),
        _dev_requirement("pytest-timeout"),
        "-r",
        str(FRAMEWORKS_DIR / "requirements.txt"),
    ]
    _install(session, *args, local=PACKAGES)
    _check_install(session, PACKAGES, isolated=False)
    _use_jit_dir(session)
    _pytest(session, FRAMEWORKS_DIR)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check (`nox -s lint -- --fix` fixes and formats instead)."""
    session.install(_dev_requirement("ruff"))
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    fix = "--fix" in session.posargs
    commands = (
        [["ruff", "check", "--fix", *paths], ["ruff", "format", *paths]]
        if fix
        else [["ruff", "check", *paths], ["ruff", "format", "--check", "--diff", *paths]]
    )
    failed = []
    for command in commands:  # run both even when the first fails
        try:
            session.run(*command)
        except nox.command.CommandFailed:
            failed.append(" ".join(command[:2]))
    if failed:
        session.error(f"{', '.join(failed)} failed")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on each package's src/<name> (strict for zerohooks; see [tool.mypy] in pyproject.toml)."""
    _prepare(session)
    _install(session, _dev_requirement("mypy"), local=PACKAGES)
    failed = []
    for pkg in PACKAGES:
        target = pkg.src / pkg.module
        if not target.is_dir():
            session.warn(f"{target.relative_to(ROOT)} does not exist; skipped")
            continue
        try:
            session.run("mypy", str(target.relative_to(ROOT)))
        except nox.command.CommandFailed:
            failed.append(pkg.name)
    if failed:
        session.error(f"mypy failed for: {', '.join(failed)}")


@nox.session
def build(session: nox.Session) -> None:
    """Build every package (sdist, then wheel from the sdist); install the wheels in a fresh venv."""
    _prepare(session)
    uv = session.venv_backend == "uv" and shutil.which("uv") is not None
    build_req = Requirement(_dev_requirement("build"))
    if uv:
        build_req.extras.add("uv")
    session.install(str(build_req))
    tmp = Path(session.create_tmp()).resolve()
    dist = tmp / "dist"
    venv = tmp / "fresh-venv"
    for folder in (dist, venv):
        shutil.rmtree(folder, ignore_errors=True)
    for pkg in PACKAGES:
        session.run(
            "python", "-m", "build", *(["--installer", "uv"] if uv else []), "--outdir", str(dist), pkg.rel
        )
    wheels = sorted(str(w) for w in dist.glob("*.whl"))
    session.log("built:\n    " + "\n    ".join(sorted(f.name for f in dist.iterdir())))

    py = str(venv / "bin" / "python")
    start = time.perf_counter()
    if uv:
        session.run("uv", "venv", "--python", sys.executable, str(venv), external=True)
        session.run("uv", "pip", "install", "--python", py, *_pin_args(), *wheels, external=True)
    else:
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
        session.run(py, "-m", "pip", "install", *_pin_args(), *wheels, external=True)
    session.log(f"fresh venv + wheel install took {time.perf_counter() - start:.1f} s")

    _check_install(session, PACKAGES, isolated=False, mode="wheel", sources=[dist], python=py)
    _use_jit_dir(session, name="build-fresh-venv")
    with session.chdir(tmp):  # away from the tree, so nothing can be imported from it by accident
        for pkg in PACKAGES:
            session.run(
                py,
                "-c",
                f"import {pkg.module}, importlib.metadata as m; "
                f"print('imported', {pkg.module}.__name__, m.version({pkg.dist!r}), 'from', {pkg.module}.__file__)",
                external=True,
            )


@nox.session
def bench(session: nox.Session) -> None:
    """python benchmarks/run_all.py [posargs] with every package installed."""
    _run_script(session, "benchmarks", "run_all.py")


@nox.session
def demo(session: nox.Session) -> None:
    """python examples/train_gpt.py [posargs], e.g. `nox -s demo -- --stage 3 --plugins loco`."""
    _run_script(session, "examples", "train_gpt.py")


EXAMPLE_SCRIPTS = ("hf_trainer.py", "accelerate_loop.py")
"""The framework examples `nox -s examples` runs, each under torchrun."""


@nox.session
def examples(session: nox.Session) -> None:
    """The framework examples (examples/hf_trainer.py, examples/accelerate_loop.py) under torchrun,
    2 CPU ranks or one rank per GPU, with transformers and accelerate installed; posargs go to
    both scripts (e.g. `nox -s examples -- --steps 4 --stage 3`)."""
    _install_once(session, [ROOT / "examples" / "requirements.txt", FRAMEWORKS_DIR / "requirements.txt"])
    session.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    gpus = session.run(
        "python", "-c", "import torch; print(torch.cuda.device_count())", silent=True, log=False
    )
    nproc = int(str(gpus).strip().splitlines()[-1] or 0) or 2
    for name in EXAMPLE_SCRIPTS:
        script = (ROOT / "examples" / name).relative_to(ROOT)
        session.run("torchrun", f"--nproc_per_node={nproc}", str(script), *session.posargs)


INSTALL_STAMP = ".zerohooks-install-stamp"
"""File in a session's venv holding :func:`install_fingerprint` of its last complete install."""


def install_fingerprint(files: Iterable[Path], args: Iterable[str] = ()) -> str:
    """A hash of what decides a session's install: the packages' pyproject.toml files, the
    constraints, the requirements files (``files``, missing ones count as missing) and the
    install arguments.  Editable installs pick up source changes by themselves, so an unchanged
    fingerprint means the venv is up to date."""
    digest = hashlib.sha256()
    for path in sorted({Path(f).resolve() for f in files}):
        digest.update(str(path).encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
        digest.update(b"\0")
    for arg in args:
        digest.update(arg.encode() + b"\1")
    return digest.hexdigest()


def venv_up_to_date(venv: Path, fingerprint: str) -> bool:
    """Whether ``venv`` exists (has a python) and its last install had ``fingerprint``."""
    stamp = venv / INSTALL_STAMP
    has_python = (venv / "bin" / "python").exists() or (venv / "Scripts" / "python.exe").exists()
    try:
        return has_python and stamp.read_text(encoding="utf-8").strip() == fingerprint
    except OSError:
        return False


def _run_script(session: nox.Session, folder: str, name: str) -> None:
    """Every package plus ``<folder>/requirements.txt`` installed, then ``python <folder>/<name>``.

    A reused venv whose :func:`install_fingerprint` is unchanged skips the install (seconds
    instead of a minute; ``ZEROHOOKS_REINSTALL=1`` forces it).  Then the plugins' C++ kernels are
    built ahead of time (``python -m zerohooks.build``), announced, once per venv."""
    script = ROOT / folder / name
    if not script.is_file():
        session.skip(f"{folder}/{name} does not exist yet")
    _install_once(session, [ROOT / folder / "requirements.txt"])
    session.run("python", str(script.relative_to(ROOT)), *session.posargs)


def _install_once(session: nox.Session, requirements: list[Path]) -> None:
    """Every package plus the ``requirements`` files (those that exist), unless the venv's last
    install had the same :func:`install_fingerprint`; then the JIT build folder of the venv."""
    _prepare(session)
    args = [a for req in requirements if req.is_file() for a in ("-r", str(req))]
    constraints = _constraints()
    files = [p.path / "pyproject.toml" for p in PACKAGES] + [*requirements, ROOT / "pyproject.toml"]
    if constraints is not None:
        files.append(constraints)
    fingerprint = install_fingerprint(files, [*args, *_pin_args(), *(p.name for p in PACKAGES)])
    venv = Path(session.virtualenv.location)
    if venv_up_to_date(venv, fingerprint) and os.environ.get("ZEROHOOKS_REINSTALL", "") in ("", "0"):
        session.log(
            "venv up to date (packages' pyproject.toml, constraints, requirements unchanged): no install"
        )
    else:
        (venv / INSTALL_STAMP).unlink(missing_ok=True)
        _install(session, *args, local=PACKAGES)
        _check_install(session, PACKAGES, isolated=False)
        (venv / INSTALL_STAMP).write_text(fingerprint + "\n", encoding="utf-8")
    _use_jit_dir(session)
