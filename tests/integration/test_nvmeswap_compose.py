"""nvmeswap composed with accumdtype (fp32 gradient accumulation) on 2 ranks, ZeRO 3, bf16.

With accumdtype on, DeepSpeed's gradient partitions are fp32: nvmeswap hands them to the
optimizer as they are (no second fp32 buffer, no gradient I/O).  The oracle is the same plugins
with DeepSpeed's own CPU offload: same losses and fp32 masters, bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("nvmeswap")
pytest.importorskip("accumdtype")

from zerohooks.testing import run_distributed


def _config(folder: str, nvme: bool) -> dict[str, Any]:
    from zerohooks.testing.toy import ds_config

    cfg = ds_config(3, "bf16", gas=3, lr=1e-3, sections={"accumdtype": {"dtype": "fp32"}})
    cfg["zero_optimization"]["sub_group_size"] = 2000
    cfg["zero_optimization"]["offload_optimizer"] = {
        "device": "nvme" if nvme else "cpu",
        "nvme_path": folder,
        "pin_memory": False,
    }
    cfg["zero_force_ds_cpu_optimizer"] = False
    if nvme:
        cfg["nvmeswap"] = {}
    return cfg


def _run(tmp: str) -> dict[str, Any]:
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    import zerohooks
    from zerohooks.testing.toy import make_model, train

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    for nvme in (False, True):
        model = make_model(mult=4)
        engine, *_ = zerohooks.initialize(
            model=model, model_parameters=model.parameters(), config=_config(f"{tmp}/r{rank}", nvme)
        )
        losses = train(engine, steps=3, gas=3)
        masters = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
        key = "nvmeswap" if nvme else "cpu"
        out[key] = (losses, masters)
        if nvme:
            att = zerohooks.attachment(engine)
            state = next(p for p in att.plugins if p.name == "nvmeswap").state
            out["swapped"] = len(state.groups)
            out["grad_dtypes"] = sorted({str(t.dtype) for d in [state.grad_partitions] for t in d.values()})
            zerohooks.detach(engine)
    out["masters_equal"] = all(
        torch.equal(a, b) for a, b in zip(out["cpu"][1], out["nvmeswap"][1], strict=True)
    )
    out["cpu"], out["nvmeswap"] = out["cpu"][0], out["nvmeswap"][0]
    return out


@pytest.mark.multirank
def test_nvmeswap_with_accumdtype_matches_cpu_offload(tmp_path) -> None:
    for r in run_distributed(_run, 2, args=(str(tmp_path),), timeout=900):
        assert r["swapped"] >= 2
        assert r["grad_dtypes"] == ["torch.float32"]  # accumdtype's fp32 partitions are what is read
        assert r["nvmeswap"] == r["cpu"]
        assert r["masters_equal"]
