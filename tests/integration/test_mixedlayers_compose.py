"""mixedlayers composed with the other plugins under real 2-rank DeepSpeed training.

One 2-rank launch runs, on the shared toy model with its LayerNorm and last Linear kept in fp32
(bf16 model): mixedlayers alone, with accumdtype (fp32 accumulation and reduction of the 16-bit
gradients) and with loco (4-bit gradient communication, which owns the collective), on the
ZeRO stages each pairing supports.  Each composed run must keep the kept parameters fp32 and
train: its losses stay finite and within a small distance of mixedlayers alone (accumdtype only
changes the 16-bit gradients' rounding; loco quantizes them to 4 bits with error feedback).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from zerohooks.testing import run_distributed

pytestmark = pytest.mark.multirank

KEPT = {"norm.weight", "norm.bias", "fc2.weight", "fc2.bias"}
SECTION = {"fp32_modules": ["fc2"], "fp32_module_types": ["torch.nn.LayerNorm"]}
CASES: list[tuple[str, int]] = [
    ("mixedlayers", 1),
    ("mixedlayers", 2),
    ("mixedlayers", 3),
    ("mixedlayers+accumdtype", 1),
    ("mixedlayers+accumdtype", 2),
    ("mixedlayers+accumdtype", 3),
    ("mixedlayers+loco", 2),
    ("mixedlayers+loco", 3),
]


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


def _scenarios(cases: list[tuple[str, int]]) -> dict[str, Any]:
    import deepspeed
    import torch

    import zerohooks
    from zerohooks.testing.toy import ds_config, make_model, train

    sections = {
        "mixedlayers": {"mixedlayers": SECTION},
        "accumdtype": {"accumdtype": {"dtype": "fp32"}},
        "loco": {"loco": {}},
    }
    out: dict[str, Any] = {}
    for combo, stage in cases:
        secs: dict[str, Any] = {}
        for name in combo.split("+"):
            secs.update(sections[name])
        model = make_model()
        cfg = ds_config(
            stage,
            "bf16",
            sections=secs,
            optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        )
        engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = train(engine, 4, 2)
        params = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
            dtypes = {n: str(p.dtype) for n, p in params.items()}
        out[f"{combo}/z{stage}"] = {
            "losses": losses,
            "dtypes": dtypes,
            "finite": bool(torch.isfinite(torch.tensor(losses)).all()),
        }
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    if not _installed("mixedlayers"):
        pytest.skip("mixedlayers is not installed")
    cases = [c for c in CASES if _installed(*c[0].split("+"))]
    return run_distributed(_scenarios, 2, args=(cases,), timeout=1200)[0]


@pytest.mark.parametrize(("combo", "stage"), CASES)
def test_composed_runs_keep_fp32_and_train(results: dict[str, Any], combo: str, stage: int) -> None:
    key = f"{combo}/z{stage}"
    if key not in results:
        pytest.skip(f"{combo} not installed")
    res = results[key]
    assert res["finite"], res["losses"]
    for n, d in res["dtypes"].items():
        assert d == ("torch.float32" if n in KEPT else "torch.bfloat16"), (n, d)
    alone = results[f"mixedlayers/z{stage}"]["losses"]
    diff = max(abs(a - b) for a, b in zip(res["losses"], alone, strict=True))
    assert diff < (0.05 if "loco" in combo else 0.02), (res["losses"], alone)
