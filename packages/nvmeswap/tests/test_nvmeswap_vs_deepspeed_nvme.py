"""nvmeswap against DeepSpeed's own NVMe offload, bit for bit (2 gloo ranks).

The model has no bias and 1024 x 1024 weights, so every gradient partition starts 4 KiB-aligned
inside its sub-group: DeepSpeed 0.19.8's NVMe path then trains exactly like its CPU offload.
(With a parameter starting at an unaligned offset, e.g. after a 500-element bias, DeepSpeed's NVMe
path gives that parameter different moments and masters from its own CPU offload after the first
step; nvmeswap writes no gradient, so it has no such case; see the README.)

Needs DeepSpeed's async_io op (Debian's libaio-dev), whose first build takes minutes: the test
runs when the op is already built in this TORCH_EXTENSIONS_DIR or NVMESWAP_TEST_DS_NVME=1.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from zerohooks.testing import run_distributed

pytestmark = pytest.mark.multirank


def _aio_ready() -> str | None:
    """Why the test cannot run here (None when it can)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from torch.utils.cpp_extension import _get_build_directory

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return "DeepSpeed's async_io op cannot be built here (install libaio-dev)"
        built = os.path.exists(os.path.join(_get_build_directory("async_io", False), "async_io.so"))
    except Exception as e:  # pragma: no cover - DeepSpeed internals moved
        return f"cannot locate DeepSpeed's async_io op: {e}"
    if not built and os.environ.get("NVMESWAP_TEST_DS_NVME") != "1":
        return "DeepSpeed's async_io op is not built yet (minutes); set NVMESWAP_TEST_DS_NVME=1 to build it"
    return None


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(3)]
    return torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2])


def _run(tmp: str) -> dict[str, Any]:
    import deepspeed
    from _nvme_common import config, masters, moments

    import zerohooks

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    for name, section in (("deepspeed", None), ("nvmeswap", {"min_swap_numel": 262_144})):
        cfg = config(f"{tmp}/{name}{rank}", nvmeswap=section)
        cfg["zero_optimization"]["sub_group_size"] = 600_000
        model = _model()
        init = zerohooks.initialize if section is not None else deepspeed.initialize
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
        losses = []
        for s in range(3):
            for m in range(2):
                g = torch.Generator().manual_seed(1000 * s + 10 * m + rank)
                x = torch.randn(4, 1024, generator=g).to(torch.bfloat16)
                loss = (engine(x).float() - x.float()).pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
        out[name] = (losses, masters(engine), moments(engine))
        if section is not None:
            att = zerohooks.attachment(engine)
            out["fused_steps"] = next(p for p in att.plugins if p.name == "nvmeswap").state.fused_steps
        if name == "deepspeed":
            opt = engine.optimizer
            out["swapped"] = sum(opt._swappable_optimizer_subgroup(i) for i in range(len(opt.fp16_groups)))
    ds, ns = out["deepspeed"], out["nvmeswap"]
    return {
        "losses": (ds[0], ns[0]),
        "masters_equal": all(torch.equal(a, b) for a, b in zip(ds[1], ns[1], strict=True)),
        "moments_equal": all(torch.equal(a, b) for a, b in zip(ds[2], ns[2], strict=True)),
        "swapped": out["swapped"],
        "fused_steps": out["fused_steps"],
    }


def test_bit_identical_to_deepspeed_nvme_offload(tmp_path, native_engine: bool, fused_kernel: bool) -> None:
    reason = _aio_ready()
    if reason is not None:
        pytest.skip(reason)
    from deepspeed.ops.op_builder import AsyncIOBuilder

    import zerohooks

    # built once here, not in both ranks; through the shared cache, so a session beside this one
    # that builds it too waits for one build instead of compiling it again
    with zerohooks.route_deepspeed_op_builds():
        AsyncIOBuilder().load(verbose=False)
    for r in run_distributed(_run, 2, args=(str(tmp_path),), timeout=1200):
        assert r["swapped"] >= 2  # DeepSpeed did swap: the oracle is its NVMe path
        ds_losses, ns_losses = r["losses"]
        assert ns_losses == ds_losses
        assert r["masters_equal"] and r["moments_equal"]
        assert r["fused_steps"] > 0  # torch's AdamW: the fused kernel stepped the swapped sub-groups
