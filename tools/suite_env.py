"""The GPU suite's environment on a bare machine: CUDA_HOME from the real nvcc, the bundle's ninja
on PATH.  Standard library only.

torch guesses CUDA_HOME as the folder above ``which nvcc``'s ``bin``: where ``nvcc`` on PATH is
``/usr/local/bin/nvcc``, a script running ``exec /usr/local/cuda-13.0/bin/nvcc "$@"``, it guesses
``/usr/local`` and every CUDA extension build fails on ``cuda_runtime.h: No such file``.  Here
symbolic links and such wrapper scripts are followed to the real compiler, and CUDA_HOME is the
folder above its ``bin`` when that folder has the CUDA headers, else ``/usr/local/cuda``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import MutableMapping
from pathlib import Path

_NVCC_IN_SCRIPT = re.compile(r"""(/[^\s"'`;|&<>()]*/nvcc)(?=[\s"'`;|&<>()]|$)""")


def _headers(home: Path) -> bool:
    return (home / "include" / "cuda_runtime.h").is_file() or any(
        home.glob("targets/*/include/cuda_runtime.h")
    )


def real_nvcc(path: str | Path, chain: list[str] | None = None, depth: int = 8) -> Path:
    """The compiler that ``path`` runs: symbolic links resolved, and a shell script that names an
    absolute ``.../nvcc`` (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``) followed to it."""
    p = Path(os.path.realpath(path))
    if chain is not None:
        chain.append(str(p))
    try:
        with open(p, "rb") as f:
            head = f.read(64 * 1024)
    except OSError:
        return p
    if depth <= 0 or not head.startswith(b"#!"):
        return p
    for m in _NVCC_IN_SCRIPT.finditer(head.decode(errors="replace")):
        target = Path(m.group(1))
        if os.path.realpath(target) != str(p) and target.is_file() and os.access(target, os.X_OK):
            return real_nvcc(target, chain, depth - 1)
    return p


def find_cuda_home(environ: MutableMapping[str, str] | None = None) -> tuple[str | None, str]:
    """(CUDA_HOME, how it was found).  A CUDA_HOME (or CUDA_PATH) already set is kept when it holds
    the headers; else the real nvcc's folder when it does; else /usr/local/cuda when it does; else
    the real nvcc's folder all the same (never the wrapper's); else None (no nvcc)."""
    env = os.environ if environ is None else environ
    notes = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        given = env.get(var)
        if given:
            if _headers(Path(given)):
                return given, f"{var} as set"
            notes.append(f"{var}={given} has no include/cuda_runtime.h: ignored")
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    real_home = None
    if nvcc:
        chain: list[str] = []
        real = real_nvcc(nvcc, chain)
        home = real.parent.parent
        how = f"nvcc on PATH {nvcc}" + "".join(f" -> {c}" for c in chain if c != nvcc)
        if _headers(home):
            return str(home), "; ".join([*notes, how])
        notes.append(f"{how}: {home} has no include/cuda_runtime.h")
        real_home = str(home)
    else:
        notes.append("no nvcc on PATH")
    fallback = Path("/usr/local/cuda")
    if _headers(fallback):
        return str(fallback), "; ".join([*notes, "/usr/local/cuda"])
    notes.append("no /usr/local/cuda with headers: CUDA extensions cannot build")
    # where nvcc exists, its real folder all the same: torch would guess the wrapper's (/usr/local)
    return real_home, "; ".join(notes)


def ninja_dirs(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Folders to put first on PATH for ninja when it is not on PATH: ``bin`` next to each
    PYTHONPATH entry (``pip install --target W/site`` puts the ninja wheel's script in W/site/bin)."""
    env = os.environ if environ is None else environ
    if shutil.which("ninja", path=env.get("PATH")):
        return []
    return [
        str(Path(e) / "bin")
        for e in env.get("PYTHONPATH", "").split(os.pathsep)
        if e and os.access(Path(e) / "bin" / "ninja", os.X_OK)
    ][:1]


def prepare(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set CUDA_HOME and PATH in ``environ`` (default os.environ) for the suite's children; what
    was decided, for results.json."""
    env = os.environ if environ is None else environ
    home, how = find_cuda_home(env)
    done = {"cuda_home_from": how}
    if home:
        env["CUDA_HOME"] = home
        done["CUDA_HOME"] = home
    else:
        env.pop("CUDA_HOME", None)  # torch would otherwise guess from nvcc (e.g. /usr/local)
    extra = ninja_dirs(env)
    if extra:
        env["PATH"] = os.pathsep.join([*extra, env.get("PATH", "")])
        done["ninja"] = f"{extra[0]}/ninja (the bundle's, put on PATH)"
    else:
        done["ninja"] = (
            shutil.which("ninja", path=env.get("PATH"))
            or "not found (torch builds fall back to slow or fail)"
        )
    return done
