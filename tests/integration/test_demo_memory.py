"""The demo's model state by kind (``examples/measure.model_state_bytes``) against the bytes of
the very tensors DeepSpeed and the plugins keep, found here by their own names; and a demo
stopped by SIGTERM leaves no temporary folder behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from zerohooks.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _one_engine(stage: int, plugin: str, folder: str) -> dict[str, Any]:
    import torch

    import zerohooks

    sys.path.insert(0, str(EXAMPLES))
    import measure
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=32))
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    if plugin == "loco":
        cfg["loco"] = {"bits": 4}
    else:
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": folder,
            "pin_memory": False,
        }
        cfg["zero_force_ds_cpu_optimizer"] = False
        cfg["nvmeswap"] = {}
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randint(0, 256, (2, 16))
    for step in range(2):
        engine.backward(engine(x, x))
        if step == 1:  # as the demo measures: gradients held, optimizer state made
            got = measure.model_state_bytes(engine)
            opt = engine.optimizer
            plug = next(p for p in zerohooks.attachment(engine).plugins if p.name == plugin)
            if stage == 2:
                want = {
                    "parameters": _nbytes(opt.bit16_groups_flat),
                    "master parameters": _nbytes(opt.single_partition_of_fp32_groups),
                    "gradients": _nbytes(g for gs in opt.averaged_gradients.values() for g in gs),
                    "optimizer state": _nbytes(
                        t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
                    ),
                    "error buffers": _nbytes(
                        t
                        for b in plug.state.buffers.values()
                        for t in (b.data, b.scale)
                        if torch.is_tensor(t)
                    ),
                }
            else:
                want = {
                    "parameters": _nbytes(p.ds_tensor for p in engine.module.parameters()),
                    "swap buffers": _nbytes(slot.buffer for slot in plug.state.slots),
                }
        engine.step()
    engine.destroy()
    return {"got": got, "want": want}


def _state_by_kind() -> list[dict[str, Any]]:
    folder = tempfile.mkdtemp(prefix="zh-memory-")
    return [_one_engine(2, "loco", folder), _one_engine(3, "nvmeswap", folder)]


@pytest.mark.multirank
def test_model_state_by_kind_matches_the_engines_tensors() -> None:
    for rank, (zero2, zero3) in enumerate(run_distributed(_state_by_kind, 2)):
        got, want = zero2["got"], zero2["want"]
        for kind in ("parameters", "master parameters", "optimizer state", "error buffers"):
            assert got.get(kind) == want[kind], (rank, kind, got, want)
        # the gradient partition, plus at most a few scalars DeepSpeed keeps under gradient names
        assert want["gradients"] <= got["gradients"] <= want["gradients"] + 64, (got, want)
        assert "swap buffers" not in got
        got, want = zero3["got"], zero3["want"]
        assert got["parameters"] == want["parameters"] and got["swap buffers"] == want["swap buffers"], (
            got,
            want,
        )
        # nvmeswap keeps the fp32 masters and Adam's moments on disk, not in RAM
        assert got.get("master parameters", 0) == 0 and got.get("optimizer state", 0) <= 64, got


@pytest.mark.multirank
def test_sigterm_cleans_the_demos_temporary_folders(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, str(EXAMPLES / "train_gpt.py"), "--runs", "nvmeswap,baseline", "--steps", "400",
        "--layers", "1", "--d-model", "32", "--heads", "2", "--micro-batch", "2", "--seq-len", "32",
        "--data-mb", "0.25", "--eval-every", "400", "--dtype", "bf16", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.time() + 300
    for line in proc.stdout:  # wait until the first run trains: its swap folder exists
        seen.append(line)
        if "[nvmeswap] step 0:" in line or time.time() > deadline:
            break
    during = sorted(p.name for p in tmp.iterdir())
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert any(n.startswith("train_gpt_") for n in during), (during, out[-3000:])
    assert any(n.startswith("zerohooks-demo-nvme-") for n in during), (during, out[-3000:])
    assert proc.returncode != 0
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("train_gpt_", "zerohooks-demo-nvme-")))
    assert left == [], (left, out[-3000:])
    # the partial report names the run interrupted and the runs not reached
    report = (tmp_path / "out" / "report.md").read_text()
    assert "`nvmeswap` interrupted" in report and "`baseline` not reached" in report, report
