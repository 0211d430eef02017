"""The 2 B-parameter benchmark's path (``benchmarks/bench_nvmeswap_scale.py``) at the CI size: an
85 M-parameter GPT (about 1 GB of fp32 optimizer state) built under ``zero.Init`` in bf16, trained
by nvmeswap in its own process for 3 steps.  The kernel's own count of the bytes the process read
from and wrote to the disk (``/proc/self/io``) must be 12.00 a parameter each way in a steady step
(master + 2 moments, never a gradient), the loss must fall, and no swap file may stay behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_nvmeswap_scale.py"
EXTRA_READ = 0.25
"""Bytes a parameter the process may read beyond the swap files in a step (files it imports)."""


@pytest.mark.skipif(not BENCH.exists(), reason="needs the repository's benchmarks/ folder")
def test_small_scale_run_moves_twelve_bytes_per_parameter(tmp_path: Path) -> None:
    folder = tmp_path / "swap"
    out = tmp_path / "result"
    cmd = [sys.executable, str(BENCH), "--small", "--runs", "nvmeswap", "--steps", "3", "--no-resume", "--no-fio",
           "--folder", str(folder), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ), check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    payload = json.loads(Path(str(out) + ".json").read_text())
    (run,) = payload["runs"]
    assert run["rc"] == 0, run
    assert 80e6 < run["params"] < 90e6  # ~1 GB of fp32 optimizer state
    steps = run["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # step 1 reads the masters only (the moments do not exist yet): 4 bytes; writes all 12.
    # /proc/self/io counts every read of the process: a library or bytecode file read from disk
    # the first time something is imported in a step adds a little (0.18 B/param once in a CI
    # run); a gradient written and read back would add 2-4 B/param
    assert 4.0 - 0.02 <= steps[0]["read_per_param"] <= 4.0 + EXTRA_READ, steps[0]
    for s in steps:
        assert s["write_per_param"] == pytest.approx(12.0, abs=0.02), s
    for s in steps[1:]:
        assert 12.0 - 0.02 <= s["read_per_param"] <= 12.0 + EXTRA_READ, s
    losses = [s["loss"] for s in steps]
    assert losses[0] > losses[1] > losses[2]
    assert sorted(os.listdir(folder)) == [], "swap files left behind"


@pytest.mark.skipif(not BENCH.exists(), reason="needs the repository's benchmarks/ folder")
def test_small_scale_overlap_run_is_bit_identical(tmp_path: Path) -> None:
    """The benchmark's ``nvmeswap_overlap`` run (state read ahead during backward, last writes
    drained in the next forward) against its ``nvmeswap`` run: the same losses and step-4 weight
    checksum, sub-groups were read ahead, the same bytes read; the disk's busy time is reported
    wherever the folder is on a block device."""
    folder, out = tmp_path / "swap", tmp_path / "result"
    cmd = [sys.executable, str(BENCH), "--small", "--runs", "nvmeswap,nvmeswap_overlap", "--steps", "4",
           "--no-resume", "--no-fio", "--prefetch-gib", "0.5", "--folder", str(folder), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1200, env=dict(os.environ), check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    payload = json.loads(Path(str(out) + ".json").read_text())
    off, on = payload["runs"]
    assert (off["run"], on["run"], off["rc"], on["rc"]) == ("nvmeswap", "nvmeswap_overlap", 0, 0)
    assert [s["loss"] for s in on["steps"]] == [s["loss"] for s in off["steps"]]
    assert on["weights_sha_step4"] == off["weights_sha_step4"]
    assert payload["derived"]["nvmeswap_overlap losses and step-4 weights bit-identical to nvmeswap"] is True
    assert on["steps"][-1]["prefetch_hits"] >= 1 and off["steps"][-1]["prefetch_hits"] == 0
    for a, b in zip(on["steps"], off["steps"], strict=True):
        assert a["read_per_param"] == pytest.approx(b["read_per_param"], abs=EXTRA_READ)  # (a re-read: 12)
        assert "disk_busy_s" in a
