"""Running the repository's own scripts from the integration tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(path: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python <path> <args>`` from the repository root (``path`` relative to it); the test fails
    with the tail of the script's output unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / path), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
