"""Lightning scenarios, run in one 2-rank launch (see conftest.py).

Lightning 2.6.6's ``DeepSpeedStrategy`` (``lightning.fabric`` and ``lightning.pytorch``) refuses
any accelerator but CUDA in ``setup_environment``; nothing else in its DeepSpeed path needs a GPU.
These scenarios go as far as CPU allows: the stock strategy's refusal is recorded, and a test-only
subclass that skips that one check (and gives the CPU devices the indices Lightning's device check
expects) runs the rest of Lightning's code, including its own ``deepspeed.initialize(...)`` call.
"""

from __future__ import annotations

from typing import Any

from _frameworks_common import (
    GAS,
    LR,
    WORLD,
    attachment_summary,
    ds_config,
    enabled,
    hand_loop,
    make_model,
    run_scenarios,
    shard_batch,
)

STEPS = 2


def _cpu_devices() -> list[Any]:
    import torch

    return [torch.device("cpu", i) for i in range(WORLD)]


def _fabric_strategy(config: dict[str, Any], cpu_ok: bool) -> Any:
    from lightning.fabric.strategies import DeepSpeedStrategy

    if not cpu_ok:
        return DeepSpeedStrategy(config=config)

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):  # type: ignore[misc]
        def setup_environment(self) -> None:  # skips only the "CUDA GPUs only" check
            super(DeepSpeedStrategy, self).setup_environment()

    return CPUDeepSpeedStrategy(config=config, parallel_devices=_cpu_devices())


def _fabric_refuses_cpu() -> str:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_fabric_strategy(ds_config(2), cpu_ok=False))
    try:
        fabric.launch()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("Fabric's DeepSpeedStrategy ran on CPU: the CUDA-only check is gone")


def _fabric(step_with: str) -> dict[str, Any]:
    """Fabric's documented loop (``fabric.backward``, then ``optimizer.step()``), or the same loop
    stepping the engine (``engine.step()``) as DeepSpeed's own loop does."""
    import torch
    from lightning.fabric import Fabric

    config = ds_config(2, {"accumdtype": {"dtype": "fp32"}, "loco": {}})
    with enabled():
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_fabric_strategy(config, cpu_ok=True))
        fabric.launch()
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        module, optimizer = fabric.setup(model, optimizer)
        engine = fabric.strategy.model  # the DeepSpeedEngine behind the _FabricModule
        losses = []
        for k in range(STEPS * GAS):
            x = shard_batch(k, fabric.global_rank)
            loss = module(input_ids=x, labels=x).loss
            losses.append(loss.item())
            fabric.backward(loss)
            if step_with == "optimizer":
                optimizer.step()
            else:
                engine.step()
    return {
        "losses": losses,
        "global_steps": int(engine.global_steps),
        "optimizer_type": type(optimizer.optimizer).__name__,
        **attachment_summary(engine),
    }


def _pytorch_strategy_initialize() -> dict[str, Any]:
    """``lightning.pytorch``'s DeepSpeedStrategy builds its engine in
    ``_setup_model_and_optimizer`` with ``deepspeed.initialize(args=Namespace(device_rank=...),
    config=..., model=..., model_parameters=filter(...), optimizer=..., lr_scheduler=...,
    dist_init_required=False)``, the attribute looked up at call time: enable() must reach it."""
    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(
        config=ds_config(2, {"accumdtype": {"dtype": "fp32"}, "loco": {}}), parallel_devices=_cpu_devices()
    )
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    with enabled():
        engine, _ = strategy._setup_model_and_optimizer(model, optimizer)
    return attachment_summary(engine)


def all_lightning_scenarios(tmp: str) -> dict[str, Any]:
    config = ds_config(2, {"accumdtype": {"dtype": "fp32"}, "loco": {}})
    return run_scenarios(
        {
            "fabric_refuses_cpu": _fabric_refuses_cpu,
            "fabric_engine_step": lambda: _fabric("engine"),
            "fabric_optimizer_step": lambda: _fabric("optimizer"),
            "pytorch_strategy": _pytorch_strategy_initialize,
            "hand": lambda: hand_loop(config, STEPS),
        }
    )
