"""``python -m zerohooks.run`` under each launcher's module flag, on the unmodified example scripts
(``--no-enable``: the scripts do not call ``zerohooks.enable()`` themselves).

Each launch starts 2 CPU ranks; each rank writes what it measured to ``<report>.<rank>.json``
(``examples/framework_report.py``): the test checks that zerohooks attached loco and accumdtype to
the engine the framework built, and loco's bytes on the wire against a bf16 all-reduce.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT = 600


def _bin(name: str) -> str:
    """A console script of this interpreter's environment (``torchrun``, ``accelerate``, ...)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            pytest.fail(f"{name} is not installed next to {sys.executable}")
        return found
    return str(path)


def _launch(command: list[str], tmp_path: Path) -> list[dict[str, Any]]:
    report = tmp_path / "report"
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        LOCO_KERNELS="reference",
        PYTHONUNBUFFERED="1",
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    args = ["--steps", "2", "--report", str(report), "--no-enable"]
    proc = subprocess.run(
        [*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    out = proc.stdout[-6000:] + "\n" + proc.stderr[-6000:]
    assert proc.returncode == 0, f"{' '.join(command)} exited with {proc.returncode}:\n{out}"
    ranks = []
    for rank in range(2):
        path = Path(f"{report}.{rank}.json")
        assert path.is_file(), f"rank {rank} wrote no report:\n{out}"
        ranks.append(json.loads(path.read_text()))
    return ranks


def _check(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["attached"], "zerohooks.run did not route deepspeed.initialize through zerohooks"
        assert rank["plugins"] == ["accumdtype", "loco"]
        # 0.266 of a bf16 all-reduce per hop: one hop reduced to the slices' owners (ZeRO 2), two
        # when a bucket is all-reduced
        assert 0.125 <= rank["loco"]["ratio"] <= 0.29, rank["loco"]
        assert rank["collective_bytes_last_step"] and set(rank["collective_bytes_last_step"]) == {"float32"}


def test_torchrun_module_flag(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 -m zerohooks.run examples/hf_trainer.py``"""
    _check(
        _launch(
            [_bin("torchrun"), "--nproc_per_node", "2", "-m", "zerohooks.run", "examples/hf_trainer.py"],
            tmp_path,
        )
    )


def test_accelerate_launch_module_flag(tmp_path: Path) -> None:
    """``accelerate launch --use_deepspeed --num_processes 2 -m zerohooks.run examples/accelerate_loop.py``.

    On CPU ``--use_deepspeed`` is what starts 2 processes (through torch's elastic launcher);
    without it accelerate's "simple" launcher starts one process, in which DeepSpeed then looks
    for MPI (mpi4py) and fails."""
    command = [
        _bin("accelerate"),
        "launch",
        "--use_deepspeed",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "zerohooks.run",
        "examples/accelerate_loop.py",
    ]
    _check(_launch(command, tmp_path))


def test_deepspeed_launcher_module_flag(tmp_path: Path) -> None:
    """``deepspeed --num_gpus 2 --module zerohooks.run examples/hf_trainer.py`` (DeepSpeed's
    launcher runs on CPU: it sets CUDA_VISIBLE_DEVICES, harmless here).  It passes
    ``--local_rank=N`` *before* the script (``python -m zerohooks.run --local_rank=0 script.py``),
    which zerohooks.run hands on after the script."""
    command = [_bin("deepspeed"), "--num_gpus", "2", "--module", "zerohooks.run", "examples/hf_trainer.py"]
    _check(_launch(command, tmp_path))
