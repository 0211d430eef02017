"""torch's headers parsed once per build of a many-source C++ extension, not once per source.

Every source of a ``torch.utils.cpp_extension`` build includes ``<torch/extension.h>``, and gcc
spends most of each compile parsing it: DeepSpeed's async_io op (its NVMe offload) has 12
sources, 9 of them about 48 s of CPU each on a 2-core CI machine, 40 of those 48 in the header.
:func:`precompiled_torch_header` makes such a build compile through a wrapper
(:mod:`zerohooks._pchcc`) that precompiles the header once with the build's own flags and hands
it to each compile with ``-include``: the same sources, flags and compiler, the header parsed
once (``benchmarks/op_build_pch.py`` measures it; ``benchmarks/RESULTS.md``).

gcc only loads a precompiled header made with the same options and otherwise parses the header
as usual, so the worst case is the time of precompiling it; a source that does not compile with
the header in front of it is compiled as given.  The precompiled header (about 1 GB for torch's
with ``-g``) lives in a temporary folder for the length of the build.

Used by :func:`zerohooks.nativecache.caching_load` (DeepSpeed's op builds routed through
zerohooks with ``ZEROHOOKS_NATIVE_CACHE`` set); ``ZEROHOOKS_NATIVE_PCH=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from zerohooks import _pchcc

__all__ = ["MIN_SOURCES", "SWITCH", "applies", "precompiled_torch_header"]

SWITCH = "ZEROHOOKS_NATIVE_PCH"
"""``0`` turns precompiled headers off (any other value, or unset: on where :func:`applies`)."""
MIN_SOURCES = 4
"""Builds with fewer sources compile as usual: precompiling torch's header costs about as much
as one source's compile (66 s against 48 s, ``benchmarks/RESULTS.md``) and saves about 34 s on
each of the others, so it pays from the third source that includes torch; one more for the
sources that do not (DeepSpeed's pin_memory op: 3 sources, 2 with torch, left alone)."""


def _is_gcc(cxx: str) -> bool:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    text = out.stdout.lower()
    return (
        out.returncode == 0 and "clang" not in text and ("gcc" in text or "free software foundation" in text)
    )


def applies(sources: Iterable[Path], *, with_cuda: bool | None = None, cxx: str | None = None) -> str | None:
    """Why a build of ``sources`` compiles as usual (None: it goes through the precompiled header)."""
    sources = [Path(s) for s in sources]
    cxx = cxx if cxx is not None else (os.environ.get("CXX") or "c++")
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    if not sys.platform.startswith("linux"):
        return "precompiled headers are used on Linux only"
    if len(sources) < MIN_SOURCES:
        return f"{len(sources)} sources (precompiling pays from {MIN_SOURCES})"
    if with_cuda or any(s.suffix not in _pchcc.SOURCE_SUFFIXES for s in sources):
        return "not only C++ sources"
    if any(c.isspace() for c in cxx) or shutil.which(cxx) is None:
        return f"the compiler {cxx!r} is not one executable found on PATH"
    if not _is_gcc(cxx):
        return f"the compiler {cxx!r} is not gcc"
    return None


@contextlib.contextmanager
def precompiled_torch_header(
    sources: Iterable[Path], *, with_cuda: bool | None = None, folder: Path | None = None
) -> Iterator[bool]:
    """While held, ``torch.utils.cpp_extension`` builds in this process compile through the
    wrapper (``CXX`` names it; put back on leaving), when :func:`applies` to ``sources``; yields
    whether it does.  The precompiled headers go to a temporary folder in ``folder`` (the system's
    temporary folder when None), removed on leaving."""
    cxx = os.environ.get("CXX") or "c++"
    if applies(sources, with_cuda=with_cuda, cxx=cxx) is not None:
        yield False
        return
    real = shutil.which(cxx)
    assert real is not None  # applies() checked
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zerohooks-pch-", dir=folder) as tmp:
        bin_dir = Path(tmp, "bin")
        bin_dir.mkdir()
        script = bin_dir / "pchcc.py"
        shutil.copyfile(_pchcc.__file__, script)
        # named g++ so that torch's compiler check takes it for what it runs
        wrapper = bin_dir / "g++"
        wrapper.write_text(
            f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S {shlex.quote(str(script))} "$@"\n'
        )
        wrapper.chmod(0o755)
        env = {"CXX": str(wrapper), _pchcc.REAL: real, _pchcc.FOLDER: str(Path(tmp, "pch"))}
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield True
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
