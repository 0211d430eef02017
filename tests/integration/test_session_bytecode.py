"""The nox sessions that install torch keep the bytecode of what their processes import in the
venv (``<venv>/pycache``), so a rank, a torchrun launch or a demo run loads torch, DeepSpeed and
torch._dynamo instead of compiling them from source again (issue 35: 7-8 s of CPU a process,
30 s under load, with PYTHONDONTWRITEBYTECODE=1 in the machine's environment and uv installing
no ``.pyc``).  Checked where it matters: inside a nox session (NOX_CURRENT_SESSION)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(
    "NOX_CURRENT_SESSION" not in os.environ, reason="checks the environment nox gives a test session"
)
def test_a_process_of_the_session_writes_and_finds_bytecode_in_the_venv() -> None:
    assert not sys.flags.dont_write_bytecode, "PYTHONDONTWRITEBYTECODE is set in the session"
    prefix = sys.pycache_prefix
    assert prefix is not None, "PYTHONPYCACHEPREFIX is not set in the session"
    assert Path(prefix).resolve() == Path(sys.prefix).resolve() / "pycache", (prefix, sys.prefix)
    code = "import importlib.util as u, torch.optim as o; print(u.cache_from_source(o.__file__))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    cached = Path(child.stdout.strip().splitlines()[-1])
    assert cached.is_file(), f"the child imported torch.optim but wrote no {cached}"
    assert cached.resolve().is_relative_to(Path(sys.prefix).resolve() / "pycache"), cached
    spec = importlib.util.find_spec("torch.optim")
    assert spec is not None and spec.origin is not None
    assert importlib.util.cache_from_source(spec.origin) == str(cached)
