"""autocastzero composed with mixedlayers: modules kept in fp32 under autocast.

With autocastzero every parameter is fp32 and the forward runs under ``torch.autocast``; a module
mixedlayers keeps then computes outside autocast (fp32 in, fp32 out), and its gradients are
reduced, and on ZeRO 3 all-gathered, in fp32 although autocastzero would send a Linear's in bf16.
Oracles: autocastzero alone on the same model and data (dtypes seen in the forward, bytes handed
to the collective per dtype, losses), and bf16 representability of the weights the forward sees.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from zerohooks.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
import universal_runs

pytestmark = pytest.mark.multirank

STEPS, GAS = 3, 2
REL = 2e-2
"""Keeping one Linear in fp32 changes each step by bf16 rounding of that layer only: losses of
the tiny model stay within 2% of autocastzero alone over 6 micro-steps."""


def _scenario() -> dict[str, Any]:
    import torch

    import zerohooks
    from zerohooks.testing.toy import ds_config, make_model, train

    out: dict[str, Any] = {}
    for stage in (2, 3):
        for name, sections in (
            ("alone", {"autocastzero": {"dtype": "bfloat16"}}),
            ("mixed", {"autocastzero": {"dtype": "bfloat16"}, "mixedlayers": {"fp32_modules": ["fc2"]}}),
        ):
            model = make_model()
            seen: dict[str, Any] = {}

            def grab(module: torch.nn.Module, output: Any, key: str, seen: dict[str, Any] = seen) -> None:
                w = module.weight.detach().float()
                seen[key] = {
                    "out": str(output.dtype),
                    "autocast": torch.is_autocast_enabled("cpu"),
                    "bf16_exact": bool(torch.equal(w, w.bfloat16().float())),
                }

            for key in ("fc1", "fc2"):
                getattr(model, key).register_forward_hook(lambda m, a, o, key=key: grab(m, o, key))
            cfg = ds_config(stage, "fp32", gas=GAS, sections=sections)
            # every ZeRO 3 parameter gathered for the forward (none kept whole as "persistent")
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
            engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            losses = train(engine, STEPS, GAS)
            att = zerohooks.attachment(engine)
            assert att is not None
            numel = {n: getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters()}
            out[f"z{stage}_{name}"] = {
                "losses": losses,
                "bytes": att.counters.total(),
                "numel": numel,
                "seen": seen,
                "plugins": sorted(p.name for p in att.plugins),
            }
    return out


def _split(numel: dict[str, int], low: tuple[str, ...]) -> tuple[int, int]:
    lo = sum(n for k, n in numel.items() if k.split(".")[0] in low)
    return lo, sum(numel.values()) - lo


def test_autocastzero_with_mixedlayers() -> None:
    for rank in run_distributed(_scenario, 2, timeout=600):
        for stage in (2, 3):
            alone, mixed = rank[f"z{stage}_alone"], rank[f"z{stage}_mixed"]
            assert mixed["plugins"] == ["autocastzero", "mixedlayers"]
            # forward: fc2 kept in fp32 runs outside autocast; fc1 stays a bf16 autocast matmul
            assert alone["seen"]["fc2"]["out"] == "torch.bfloat16"
            assert mixed["seen"]["fc2"] == {**mixed["seen"]["fc2"], "out": "torch.float32", "autocast": False}
            assert mixed["seen"]["fc1"]["out"] == "torch.bfloat16" and mixed["seen"]["fc1"]["autocast"]
            if stage == 3:
                # the all-gather moves the kept weight in fp32, the safe one in bf16
                assert alone["seen"]["fc2"]["bf16_exact"] and mixed["seen"]["fc1"]["bf16_exact"]
                assert not mixed["seen"]["fc2"]["bf16_exact"]
            # gradients handed to the collective: fc2's move from bf16 to fp32
            (got,) = mixed["bytes"].values()
            (ref,) = alone["bytes"].values()
            lo, hi = _split(mixed["numel"], ("fc1",))
            k = got["bfloat16"] // (2 * lo)
            assert k >= 1 and got == {"bfloat16": k * 2 * lo, "float32": k * 4 * hi}, got
            lo_ref, hi_ref = _split(alone["numel"], ("fc1", "fc2"))
            assert ref == {"bfloat16": k * 2 * lo_ref, "float32": k * 4 * hi_ref}, ref
            assert all(math.isfinite(v) for v in mixed["losses"])
            for a, b in zip(mixed["losses"], alone["losses"], strict=True):
                assert math.isclose(a, b, rel_tol=REL), (stage, a, b)


def _pipeline_scenario() -> dict[str, Any]:
    """A 2-stage DeepSpeed pipeline (ZeRO 1, one stage a rank) under autocastzero, alone and with
    mixedlayers keeping the last Linear (pipeline layer 4, on stage 1) in fp32."""
    import torch
    from deepspeed.pipe import PipelineModule
    from torch import nn

    import zerohooks
    from zerohooks.testing.toy import batch, ds_config, make_model, pipeline_layers

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float(), target)

    out: dict[str, Any] = {}
    for name, sections in (
        ("alone", {"autocastzero": {"dtype": "bfloat16"}}),
        ("mixed", {"autocastzero": {"dtype": "bfloat16"}, "mixedlayers": {"fp32_modules": ["4"]}}),
    ):
        model = PipelineModule(
            layers=pipeline_layers(make_model(mult=4)), num_stages=2, loss_fn=loss, partition_method="uniform"
        )
        seen: dict[str, Any] = {}
        for key, layer in model.named_children():
            if isinstance(layer, nn.Linear):

                def grab(m: nn.Module, a: Any, o: Any, key: str = key, seen: dict[str, Any] = seen) -> None:
                    seen[key] = {"out": str(o.dtype), "autocast": torch.is_autocast_enabled("cpu")}

                layer.register_forward_hook(grab)
        cfg = ds_config(1, "fp32", gas=GAS, sections=sections)
        engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = [float(engine.train_batch(iter([batch(s, m, 0) for m in range(GAS)]))) for s in range(STEPS)]
        att = zerohooks.attachment(engine)
        assert att is not None
        out[name] = {
            "losses": losses,
            "seen": seen,
            "plugins": sorted(p.name for p in att.plugins),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        }
    return out


def test_autocastzero_with_mixedlayers_on_a_pipeline() -> None:
    """mixedlayers' fp32 compute beside autocastzero on a 2-stage pipeline: the kept Linear (stage
    1) runs outside autocast in fp32 where autocastzero alone runs it in bf16; the other Linear
    (stage 0) stays under autocast; every parameter stays fp32; the losses (DeepSpeed averages
    them over the stages' last) within :data:`REL` of autocastzero alone."""
    found = run_distributed(_pipeline_scenario, 2, timeout=600)
    for rank, r in enumerate(found):
        alone, mixed = r["alone"], r["mixed"]
        assert mixed["plugins"] == ["autocastzero", "mixedlayers"]
        assert alone["dtypes"] == mixed["dtypes"] == ["torch.float32"]
        if rank == 0:  # stage 0 holds the first Linear (layer 1)
            assert alone["seen"]["1"] == mixed["seen"]["1"] == {"out": "torch.bfloat16", "autocast": True}
        else:  # stage 1 holds the kept one (layer 4)
            assert alone["seen"]["4"] == {"out": "torch.bfloat16", "autocast": True}
            assert mixed["seen"]["4"] == {"out": "torch.float32", "autocast": False}
        assert all(math.isfinite(v) for v in mixed["losses"])
        for a, b in zip(mixed["losses"], alone["losses"], strict=True):
            assert math.isclose(a, b, rel_tol=REL), (rank, a, b)
        assert mixed["losses"] != alone["losses"]  # the kept layer did change the computation


def _universal_scenario(tmp: str) -> dict[str, Any]:
    """autocastzero with mixedlayers on ZeRO 1-3: saved on 2 ranks, converted by ds_to_universal,
    resumed from the universal checkpoint on the same 2 ranks (:mod:`universal_runs`)."""
    import zerohooks
    from zerohooks.testing.toy import ds_config, make_model, train

    sections = {"autocastzero": {"dtype": "bfloat16"}, "mixedlayers": {"fp32_modules": ["fc2"]}}
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):

        def make(universal: bool = False, stage: int = stage) -> tuple[Any, int]:
            cfg = ds_config(stage, "fp32", gas=GAS, sections=sections)
            if universal:
                cfg["checkpoint"] = {"load_universal": True}
            model = make_model()
            engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            return engine, GAS

        engine, _ = make()
        train(engine, universal_runs.SAVED, GAS)
        out[str(stage)] = universal_runs.save_convert_resume(
            engine, lambda make=make: make(True), universal_runs.folder(tmp, "autocast-mixed", stage), GAS
        )
        zerohooks.detach(engine)
    return out


def test_autocastzero_with_mixedlayers_loads_universal_checkpoints(tmp_path: Any) -> None:
    """Both plugins resume from a universal checkpoint (saved and loaded on 2 ranks) with the
    uninterrupted run's losses, identical, on ZeRO 1, 2 and 3."""
    for r in run_distributed(_universal_scenario, 2, args=(str(tmp_path),), timeout=900):
        for stage in ("1", "2", "3"):
            run = r[stage]
            assert run["losses"] == run["continued"], (stage, run)
            assert not [w for w in run["warnings"] if "mixedlayers" in w or "autocastzero" in w], run[
                "warnings"
            ]
