"""Every plugin driven as accelerate (hence Hugging Face Trainer) drives the engine.

accelerate sets ``engine.set_gradient_accumulation_boundary(...)`` before every backward and calls
``engine.step()`` only at the boundary, so DeepSpeed's ``engine.micro_steps`` counts optimizer
steps there.  Oracle: DeepSpeed's documented loop (backward + step every micro-step) with the
same plugin, which must give the same losses, parameters and plugin state (loco's error buffers,
accumdtype's accumulation state, ...) bit for bit.  Then a save after an odd number of optimizer
steps under that loop (a real boundary) must resume bit-exact against the uninterrupted run,
with accumdtype and loco on.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from typing import Any

import pytest

from zerohooks.testing import run_distributed

pytestmark = pytest.mark.multirank

MIXED = {"fp32_modules": ["fc2"], "fp32_module_types": ["torch.nn.LayerNorm"]}
# (plugin, stage, model dtype, sections)
CASES: list[tuple[str, int, str, dict[str, Any]]] = [
    ("accumdtype", 1, "bf16", {"accumdtype": {"dtype": "fp32"}}),
    ("accumdtype", 2, "bf16", {"accumdtype": {"dtype": "fp32"}}),
    ("loco", 2, "bf16", {"loco": {"exact_below": 0}}),
    ("loco", 3, "bf16", {"loco": {"exact_below": 0}}),
    ("autocastzero", 2, "fp32", {"autocastzero": {"dtype": "bfloat16"}}),
    ("mixedlayers", 2, "bf16", {"mixedlayers": MIXED}),
    ("nvmeswap", 3, "bf16", {"nvmeswap": {}}),
]
STEPS, GAS = 3, 2


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _same(a: Any, b: Any) -> bool:
    """Exact equality of nested state (tensors bit for bit, NaNs included)."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _config(stage: int, dtype: str, sections: dict[str, Any], folder: str) -> dict[str, Any]:
    from zerohooks.testing.toy import ds_config

    cfg = ds_config(stage, dtype, gas=GAS, lr=1e-3, sections=sections)
    if "nvmeswap" in sections:
        cfg["zero_optimization"]["sub_group_size"] = 2000
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": folder,
            "pin_memory": False,
        }
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def _drive_both(cases: list[tuple[str, int, str, dict[str, Any]]], root: str) -> dict[str, Any]:
    import zerohooks
    from zerohooks.testing.toy import full_params, make_model, train, train_like_accelerate

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    for name, stage, dtype, sections in cases:
        runs = []
        for i, drive in enumerate((train, train_like_accelerate)):
            model = make_model(mult=4)
            cfg = _config(stage, dtype, sections, f"{root}/{name}{stage}-{i}-r{rank}")
            engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            att = zerohooks.attachment(engine)
            assert att is not None and [p.name for p in att.plugins] == [name], name
            losses = drive(engine, STEPS, GAS)
            states = {k: s.state_dict() for k, s in att.registry.states.items()}
            # accumdtype also saves DeepSpeed's own engine.micro_steps (to give it back on load):
            # that counter is the one that differs by design (it counts step() calls)
            states.get("accumdtype", {}).pop("micro_steps", None)
            runs.append((losses, full_params(engine, stage), states))
            zerohooks.detach(engine)
        (l0, p0, s0), (l1, p1, s1) = runs
        out[f"{name}{stage}"] = {
            "losses": l0 == l1,
            "params": _same(p0, p1),
            "state": _same(s0, s1),
            "keys": sorted(s0.get("loco", {}).get("buffers", {})),
        }
    return out


def _resume(root: str) -> dict[str, Any]:
    """accumdtype + loco, ZeRO 2, accelerate's loop: save after 3 optimizer steps, resume."""
    import torch.distributed as dist

    import zerohooks
    from zerohooks.testing.toy import full_params, make_model, train_like_accelerate

    sections = {"accumdtype": {"dtype": "fp32"}, "loco": {"exact_below": 0}}
    box = [tempfile.mkdtemp(prefix="zh_resume_", dir=root) if int(os.environ["RANK"]) == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ckpt = box[0]

    def build() -> Any:
        model = make_model(mult=4)
        engine, *_ = zerohooks.initialize(
            model=model, model_parameters=model.parameters(), config=_config(2, "bf16", sections, root)
        )
        return engine

    whole = build()
    ref = train_like_accelerate(whole, 5, GAS)
    first = build()
    head = train_like_accelerate(first, 3, GAS)
    first.save_checkpoint(ckpt)  # an odd optimizer step: a boundary, not mid-window
    second = build()
    second.load_checkpoint(ckpt)
    tail = train_like_accelerate(second, 2, GAS, first=3)
    return {
        "losses": head + tail == ref,
        "params": _same(full_params(second, 2), full_params(whole, 2)),
        "head": head == ref[: 3 * GAS],
    }


def test_every_plugin_under_the_accelerate_loop() -> None:
    cases = [c for c in CASES if _installed(c[0])]
    if not cases:
        pytest.skip("no plugin installed")
    with tempfile.TemporaryDirectory(prefix="zh_accel_") as root:
        ranks = run_distributed(_drive_both, 2, args=(cases, root), timeout=1200)
    for rank, out in enumerate(ranks):
        for key, r in out.items():
            assert r["losses"], (rank, key, "losses differ between the two loops")
            assert r["params"], (rank, key, "parameters differ between the two loops")
            assert r["state"], (rank, key, "plugin state differs between the two loops")
        for key in ("loco2", "loco3"):
            if key in out:
                # one error-buffer set per bucket of a backward pass, not one per micro-step position
                assert out[key]["keys"] and not any(k.startswith("w1") for k in out[key]["keys"]), out[key][
                    "keys"
                ]


@pytest.mark.skipif(not (_installed("accumdtype") and _installed("loco")), reason="needs accumdtype and loco")
def test_resume_after_an_odd_step_under_the_accelerate_loop() -> None:
    with tempfile.TemporaryDirectory(prefix="zh_resume_") as root:
        for rank, r in enumerate(run_distributed(_resume, 2, args=(root,), timeout=900)):
            assert r["head"] and r["losses"] and r["params"], (rank, r)
