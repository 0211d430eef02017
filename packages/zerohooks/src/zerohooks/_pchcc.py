"""The compiler wrapper behind :mod:`zerohooks.pch`: run as a script (standard library only), in
place of the C++ compiler, by the ``ninja`` that ``torch.utils.cpp_extension.load`` starts.

For a compile of one C++ source (``-c``), it precompiles the header the build shares
(``#include <torch/extension.h>``) with that compile's own flags, once for every compile with the
same flags (a file lock: ``ninja`` runs several at a time), and compiles the source with
``-include`` of it, so gcc loads the parsed header instead of parsing torch's headers again.  A
source that does not compile with the header in front of it (a name it declares too) is compiled
again as given; a header that does not precompile leaves every compile as given.  Anything else
(``--version``, ``-v``, linking) goes to the compiler untouched.

Environment (set by :func:`zerohooks.pch.precompiled_torch_header`): ``ZEROHOOKS_PCH_REAL_CXX``
the compiler, ``ZEROHOOKS_PCH_DIR`` the folder for the precompiled headers,
``ZEROHOOKS_PCH_HEADER`` the header to precompile (``torch/extension.h``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

REAL = "ZEROHOOKS_PCH_REAL_CXX"
FOLDER = "ZEROHOOKS_PCH_DIR"
HEADER = "ZEROHOOKS_PCH_HEADER"
SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx", ".c++", ".C")
_WITH_VALUE = ("-o", "-MF", "-MT", "-MQ")
"""Options whose value is the next argument and that name outputs, not how to compile."""
_OUTPUT_ONLY = ("-c", "-MMD", "-MD", "-MP")
"""Options that change what is written, not how the header is parsed."""


def split(args: list[str]) -> list[str] | None:
    """The flags of a compile of one C++ source (what the header is precompiled with), or None
    when ``args`` is anything else (the compiler then runs them untouched)."""
    if "-c" not in args or any(a in ("-E", "-S", "-include") or a.startswith("-x") for a in args):
        return None
    flags: list[str] = []
    sources = 0
    it = iter(args)
    for a in it:
        if a in _WITH_VALUE:
            next(it, None)
        elif a in _OUTPUT_ONLY:
            continue
        elif not a.startswith("-") and a.endswith(SOURCE_SUFFIXES):
            sources += 1
        else:
            flags.append(a)
    return flags if sources == 1 else None


def precompile(real: str, folder: Path, header_name: str, flags: list[str]) -> Path | None:
    """The header file whose ``.gch`` holds ``header_name`` precompiled with ``flags`` (built by
    the first compile that asks, the others waiting on its lock), or None when it does not
    precompile (recorded, so that the other compiles do not try again)."""
    digest = hashlib.sha256("\0".join([real, header_name, *flags]).encode()).hexdigest()[:16]
    entry = folder / digest
    entry.mkdir(parents=True, exist_ok=True)
    header, gch, failed = entry / "pch.h", entry / "pch.h.gch", entry / "failed"
    with open(entry / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not gch.is_file() and not failed.is_file():
            header.write_text(f"#include <{header_name}>\n")
            tmp = entry / "building.gch"
            done = subprocess.run(
                [real, *flags, "-x", "c++-header", str(header), "-o", str(tmp)],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode == 0:
                os.replace(tmp, gch)
            else:
                failed.write_text(done.stdout + done.stderr)
    return header if gch.is_file() else None


def main(args: list[str]) -> int:
    real = os.environ[REAL]
    flags = split(args)
    if flags is not None:
        header = precompile(
            real, Path(os.environ[FOLDER]), os.environ.get(HEADER, "torch/extension.h"), flags
        )
        if header is not None:
            done = subprocess.run(
                [real, "-include", str(header), "-Winvalid-pch", *args], capture_output=True, check=False
            )
            if done.returncode == 0:  # its warnings, as the compiler would have shown them
                sys.stdout.buffer.write(done.stdout)
                sys.stderr.buffer.write(done.stderr)
                return 0
            # the source's own errors, if any, come from the compile as given
    os.execvp(real, [real, *args])
    return 127  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
