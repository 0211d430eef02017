"""A build of a plugin's native extension shared by every environment that can load it.

``torch.utils.cpp_extension.load`` builds in ``TORCH_EXTENSIONS_DIR`` and writes the
environment's absolute include paths into its ``build.ninja``, so two virtual environments
sharing one build folder rebuild each other's extension every time they alternate, and two
folders build it twice.  The test sessions (one venv each) and the demo would build loco's and
nvmeswap's kernels once per venv: minutes on 2 cores for the same bytes.

With ``ZEROHOOKS_NATIVE_CACHE`` set to a folder, :func:`lookup` finds a library built before
from the same inputs and :func:`store` keeps a new build there (copied in under a temporary
name, then renamed, so a reader never sees half a file).  The key covers everything that
decides the binary: the contents of every file in the source folders and the extra include
folders, the flags, the extension's kind, the torch build (version, git revision, CUDA/HIP
version, C++ ABI flag), the Python ABI, the machine, the compiler's own ``--version`` (and nvcc's, for CUDA sources) and
``TORCH_CUDA_ARCH_LIST``.  Anything that changes a byte of these gives another key, so a stale
library is never loaded; unset, nothing is looked up or stored (the default outside nox).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "ENV",
    "build_once",
    "cache_dir",
    "caching_load",
    "key",
    "load_library",
    "lookup",
    "one_builder",
    "store",
]

ENV = "ZEROHOOKS_NATIVE_CACHE"
"""The environment variable naming the shared folder (unset or empty: no sharing)."""

_SUFFIX = sysconfig.get_config_var("SHLIB_SUFFIX") or ".so"


def cache_dir() -> Path | None:
    """The shared folder, or None when sharing is off."""
    folder = os.environ.get(ENV, "")
    return Path(folder) if folder else None


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx}: {type(e).__name__}"
    return f"{cxx}: {out.stdout.strip()}"


def _tree_files(folders: Iterable[Path]) -> list[Path]:
    seen: set[Path] = set()
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                seen.add(path.resolve())
    return sorted(seen)


def key(
    name: str,
    sources: Iterable[Path],
    *,
    flags: Iterable[Iterable[str]],
    include_paths: Iterable[Path] = (),
    python_module: bool,
) -> str:
    """A hex digest naming one build of extension ``name`` from these inputs in this environment."""
    import torch

    sources = [Path(s) for s in sources]
    h = hashlib.sha256()

    def add(label: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        h.update(f"{label}:{len(data)}:".encode())
        h.update(data)

    add("name", name)
    add("python_module", str(python_module))
    for i, group in enumerate(flags):
        add(f"flags{i}", "\0".join(group))
    folders = {s.parent for s in sources} | {Path(p) for p in include_paths}
    for path in _tree_files(folders) + [s.resolve() for s in sources]:
        add("file", path.name)
        add("content", path.read_bytes())
    add("torch", torch.__version__)
    add("torch_git", str(getattr(torch.version, "git_version", "")))
    add("torch_cuda", str(torch.version.cuda))
    add("torch_hip", str(getattr(torch.version, "hip", None)))
    add("cxx11_abi", str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "?")))
    add("python", sys.implementation.cache_tag or "")
    add("abiflags", getattr(sys, "abiflags", ""))
    add("machine", platform.machine())
    add("compiler", _compiler_version(os.environ.get("CXX") or "c++"))
    if any(s.suffix in (".cu", ".cuh") for s in sources):
        cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        add("nvcc", _compiler_version(os.path.join(cuda_home, "bin", "nvcc") if cuda_home else "nvcc"))
    add("arch_list", os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    return h.hexdigest()[:24]


def _entry(folder: Path, name: str, digest: str) -> Path:
    return folder / f"{name}-{digest}" / f"{name}{_SUFFIX}"


def lookup(name: str, digest: str) -> Path | None:
    """The shared library built from the inputs ``digest`` names, when one was stored."""
    folder = cache_dir()
    if folder is None:
        return None
    path = _entry(folder, name, digest)
    return path if path.is_file() else None


def store(name: str, digest: str, built: Path) -> Path | None:
    """Keep ``built`` (the library just built) in the shared folder; its path there, or None when
    sharing is off or the copy failed (a failed copy only costs a later build)."""
    folder = cache_dir()
    if folder is None or not built.is_file():
        return None
    target = _entry(folder, name, digest)
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            shutil.copyfile(built, tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return target
    return None


@contextlib.contextmanager
def one_builder(name: str, digest: str) -> Iterator[None]:
    """Held while this process builds the library ``digest`` names, so that another process
    wanting the same build (a second environment, a test session beside this one) waits for it
    and then finds it stored, instead of compiling the same bytes at the same time.  An ``flock``
    on ``.<name>-<digest>.lock`` in the shared folder: the kernel releases it when its holder
    exits or is killed, so a dead builder never leaves a lock behind.  Does nothing when sharing
    is off or the lock cannot be taken (the build goes on unshared)."""
    folder = cache_dir()
    fd = None
    if folder is not None:
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / f".{name}-{digest}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"zerohooks: another process is building {name} into {folder}; waiting for it",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # a filesystem without locks: build unshared
        yield
    finally:
        os.close(fd)


def build_once(name: str, digest: str, shared: Callable[[], Any], build: Callable[[], Any]) -> Any:
    """``shared()`` (the stored build, loaded; None when there is none or it does not load), else
    ``build()`` (which stores what it builds) under :func:`one_builder`, asking ``shared()`` once
    more first: the process waited for may have built it meanwhile."""
    found = shared()
    if found is not None:
        return found
    with one_builder(name, digest):
        found = shared()
        return found if found is not None else build()


def load_library(name: str, path: Path, python_module: bool) -> Any:
    """Load a stored library as ``cpp_extension.load`` would have: the module for a pybind11
    module, else the path after ``torch.ops.load_library``."""
    if python_module:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path} as the Python module {name!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    import torch

    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    return str(path)


def caching_load(real_load: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.utils.cpp_extension.load`` that first looks in the shared folder and keeps what
    it builds there: for DeepSpeed's own just-in-time ops, whose builder calls ``load`` itself
    (see :func:`zerohooks.adapter.compat.route_deepspeed_op_builds`); a build of many C++ sources
    parses torch's headers once (:mod:`zerohooks.pch`).  Calls it cannot key (no
    sharing, or arguments other than the usual keywords) go straight to ``real_load``."""

    def load(*args: Any, **kwargs: Any) -> Any:
        name, sources = kwargs.get("name"), kwargs.get("sources")
        known = {
            "name",
            "sources",
            "extra_cflags",
            "extra_cuda_cflags",
            "extra_ldflags",
            "extra_include_paths",
            "with_cuda",
            "verbose",
        }
        if cache_dir() is None or args or not name or not sources or set(kwargs) - known:
            return real_load(*args, **kwargs)
        python_module = True  # DeepSpeed's ops are pybind11 modules (load's default)
        digest = key(
            str(name),
            [Path(s) for s in sources],
            flags=(
                list(kwargs.get("extra_cflags") or ()),
                list(kwargs.get("extra_cuda_cflags") or ()),
                list(kwargs.get("extra_ldflags") or ()),
                [str(kwargs.get("with_cuda"))],
            ),
            include_paths=[Path(p) for p in kwargs.get("extra_include_paths") or ()],
            python_module=python_module,
        )

        def shared() -> Any:
            hit = lookup(str(name), digest)
            if hit is not None:
                with contextlib.suppress(Exception):  # damaged or foreign: build it instead
                    return load_library(str(name), hit, python_module)
            return None

        def build() -> Any:
            from zerohooks.pch import precompiled_torch_header

            # a many-source op (DeepSpeed's async_io) parses torch's headers once, not per source
            with precompiled_torch_header(
                [Path(s) for s in sources], with_cuda=kwargs.get("with_cuda"), folder=cache_dir()
            ):
                module = real_load(*args, **kwargs)
            built = getattr(module, "__file__", None)
            if built:
                store(str(name), digest, Path(built))
            return module

        return build_once(str(name), digest, shared, build)

    return load
