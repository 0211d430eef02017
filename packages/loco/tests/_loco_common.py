"""Helpers shared by the loco tests (imported by the spawned ranks too)."""

from __future__ import annotations

import importlib.util
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loco import reference
from zerohooks.testing import toy

REPO = Path(__file__).resolve().parents[3]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fresh_seed() -> int:
    """A new seed per run (printed by the tests' messages, so a failure can be replayed)."""
    return int(os.environ.get("LOCO_TEST_SEED", secrets.randbelow(2**31)))


def gathered(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``t`` of ``group`` (the world when None), in the group's rank order."""
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def gradient_like(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values with magnitudes spread over many orders (never all zeros), finite in dtype."""
    x = torch.randn(n, generator=gen) * torch.exp(2.0 * torch.randn(n, generator=gen))
    limit = 6e4 if dtype == torch.float16 else 1e30
    return x.clamp(-limit, limit).to(dtype)


def error_like(
    kind: str | None, total: int, group: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    if kind is None:
        return torch.empty(0, dtype=torch.int8), torch.empty(0)
    if kind == "int8":
        codes = torch.randint(-127, 128, (total,), dtype=torch.int8, generator=gen)
        return codes, torch.rand(total // group, generator=gen) * 0.01
    return (0.01 * torch.randn(total, generator=gen)).to(DTYPES[kind]), torch.empty(0)


def quantize_outputs(nrows: int, row_len: int, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    cpad = reference.padded_row_len(row_len, group)
    return torch.zeros(nrows, cpad * bits // 8, dtype=torch.uint8), torch.zeros(nrows, cpad // group)


# ---- models and DeepSpeed configs -----------------------------------------------------------------


MODEL = {"vocab": 64, "width": 64, "mult": 4}
"""zerohooks.testing.toy's TinyNet, widened so its Linear layers fill quantized buckets."""


def make_model(seed: int = 0) -> nn.Module:
    return toy.make_model(seed, **MODEL)


def ds_config(stage: int, dtype: str = "fp32", gas: int = 2, **extra: Any) -> dict[str, Any]:
    return toy.ds_config(stage, dtype, gas=gas, lr=5e-3, **extra)


def train(engine: Any, steps: int, gas: int, first: int = 0) -> list[float]:
    return toy.train(engine, steps, gas, first, vocab=MODEL["vocab"])


def load_demo_modules() -> tuple[Any, Any] | None:
    """examples/gpt.py and examples/data.py of this repository, or None outside the repository."""
    mods = []
    for name in ("gpt", "data"):
        path = REPO / "examples" / f"{name}.py"
        if not path.is_file():
            return None
        module = f"_loco_demo_{name}"
        if module not in sys.modules:
            spec = importlib.util.spec_from_file_location(module, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod  # dataclasses look their module up there
            spec.loader.exec_module(mod)
        mods.append(sys.modules[module])
    return mods[0], mods[1]


def have_demo() -> bool:
    return all((REPO / "examples" / f"{name}.py").is_file() for name in ("gpt", "data"))


def train_demo_lm(
    loco: dict[str, Any] | None, steps: int, stage: int = 2, comm_bf16: bool = True, seed: int = 1234
) -> list[float]:
    """A small demo GPT (examples/gpt.py) on standard-library bytes (examples/data.py), fp32
    compute; ``loco`` None: DeepSpeed's own reduction (in bf16 when ``comm_bf16``)."""
    import torch.distributed as dist

    import zerohooks

    demo = load_demo_modules()
    assert demo is not None
    gpt, data = demo
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = gpt.GPT(gpt.GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=64))
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }
    if comm_bf16:
        cfg["communication_data_type"] = "bf16"
    if loco is not None:
        cfg["loco"] = loco
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    corpus = data.ByteCorpus.load(train_bytes=1 << 20, val_bytes=1 << 16)
    sampler = data.BatchSampler(corpus.train, 64, 8, seed, rank)
    return [toy.mean_loss_step(engine, *sampler.next()) for _ in range(steps)]


def group_bound(values: list[torch.Tensor], group: int, chunk: int, qmax: int) -> torch.Tensor:
    """Per element, half a quantization step of each rank's group (groups laid out per chunk)."""
    bounds = []
    for v in values:
        n = v.numel()
        rows = math.ceil(n / chunk)
        padded = torch.nn.functional.pad(v.float().abs(), (0, rows * chunk - n)).view(rows, chunk)
        cpad = reference.padded_row_len(chunk, group)
        padded = torch.nn.functional.pad(padded, (0, cpad - chunk)).view(rows, -1, group)
        step = padded.amax(dim=-1, keepdim=True) / qmax / 2
        bounds.append(step.expand_as(padded).reshape(rows, cpad)[:, :chunk].reshape(-1)[:n])
    return torch.stack(bounds).sum(dim=0)


def kernels() -> bool:
    """Build (first call in this process) and load the CPU kernels; the ranks spawned later only
    load the build from TORCH_EXTENSIONS_DIR."""
    from loco import ops

    return ops.load("cpu")
