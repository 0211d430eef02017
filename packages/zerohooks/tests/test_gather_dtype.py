"""The ``gather_dtype`` hook (ZeRO-3 all-gather dtype): registration, order, and the adapter's
per-parameter switch, set at attach and removed on detach (2 ranks, real ZeRO-3 engine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerohooks import HookRegistry
from zerohooks.testing import distributed


def test_registration_order_and_seal() -> None:
    reg = HookRegistry()
    reg.register_gather_dtype(lambda p, d: d, name="b", order=1)
    h = reg.register_gather_dtype(lambda p, d: torch.bfloat16, name="a")
    assert reg.summary()["gather_dtype"] == ["a", "b"]
    h.remove()
    assert reg.summary()["gather_dtype"] == ["b"]
    reg.seal()
    with pytest.raises(RuntimeError, match="before the engine is attached"):
        reg.register_gather_dtype(lambda p, d: d, name="c")


@distributed(world_size=2)
def test_zero3_gather_dtype_set_and_removed() -> None:
    import zerohooks
    from zerohooks import ZeroPlugin
    from zerohooks.testing.toy import ds_config, make_model, train

    class Gather(ZeroPlugin):
        name = "gather_test"

        def attach(self, registry: Any, ctx: Any) -> None:
            registry.register_gather_dtype(
                lambda p, d: torch.bfloat16 if id(p) in chosen else d, name=self.name
            )

    model = make_model()
    chosen = {id(model.fc1.weight), id(model.fc2.weight)}
    cfg = ds_config(3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    engine, *_ = zerohooks.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=cfg,
        plugins=[Gather(None)],  # type: ignore[arg-type]
    )
    assert all(vars(p).get("comm_dtype") is torch.bfloat16 for p in model.parameters() if id(p) in chosen)
    assert all("comm_dtype" not in vars(p) for p in model.parameters() if id(p) not in chosen)
    seen: dict[str, torch.Tensor] = {}

    def grab(module: torch.nn.Module, args: Any) -> None:
        seen.setdefault("w", module.weight.detach().clone())

    handle = model.fc1.register_forward_pre_hook(grab)
    torch.manual_seed(0)
    initial = make_model().fc1.weight.detach()
    train(engine, 1, 1, n=4)
    handle.remove()
    assert seen["w"].dtype == torch.float32
    assert torch.equal(seen["w"], initial.bfloat16().float())  # travelled in bf16
    zerohooks.detach(engine)
    assert all("comm_dtype" not in vars(p) for p in model.parameters())
