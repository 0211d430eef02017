"""accelerate scenarios, all run in one 2-rank launch (see conftest.py).

``accelerator.prepare`` builds the engine (``deepspeed.initialize(model=..., model_parameters=...,
config_params=<dict>)``); the loop is accelerate's own: ``with accelerator.accumulate(engine)``,
``accelerator.backward(loss)``, which calls ``engine.set_gradient_accumulation_boundary(sync)``,
``engine.backward(loss)`` and ``engine.step()`` only when ``sync``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from _frameworks_common import (
    GAS,
    LR,
    MICRO_BATCH,
    NVMESWAP_SECTION,
    attachment_summary,
    ds_config,
    effects,
    enabled,
    full_params_digest,
    grad_accum_dtypes,
    hand_loop,
    make_model,
    nvme_config,
    proc_io,
    reset_frameworks,
    run_scenarios,
    swap_files,
    token_ids,
)

RESUME_STEPS, SAVE_AT = 5, 3


def train(
    ds: dict[str, Any],
    steps: int,
    *,
    save_at: int | None = None,
    save_dir: str | None = None,
    load_dir: str | None = None,
    probe: Any = None,
) -> dict[str, Any]:
    """accelerate's documented DeepSpeed loop for ``steps`` optimizer steps of ``GAS`` micro-steps.

    ``save_dir``: ``accelerator.save_state`` after optimizer step ``save_at``; ``load_dir``:
    ``accelerator.load_state`` right after ``prepare``, then the batches of the steps already
    taken are skipped.  ``probe(when, engine)`` is called after each micro-step ("micro") and
    after each optimizer step ("step").
    """
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    reset_frameworks()  # accelerate's singletons: one Accelerator per state
    PartialState(cpu=True)  # before Accelerator: Accelerator(cpu=True) would drop DeepSpeed
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds)), gradient_accumulation_steps=GAS
    )
    assert str(accelerator.distributed_type) == "DistributedType.DEEPSPEED", accelerator.distributed_type
    model = make_model()
    loader = torch.utils.data.DataLoader(token_ids(), batch_size=MICRO_BATCH, shuffle=False)
    optimizer = DummyOptim([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    done = 0
    if load_dir is not None:
        accelerator.load_state(load_dir)
        done = engine.global_steps
    losses: list[float] = []
    step = done
    for k, x in enumerate(loader):
        if k < done * GAS:
            continue  # the batches of the steps the checkpoint already holds
        if step >= steps:
            break
        with accelerator.accumulate(engine):
            loss = engine(input_ids=x, labels=x).loss
            losses.append(loss.item())
            accelerator.backward(loss)
        if probe is not None:
            probe("micro", engine)
        if accelerator.sync_gradients:
            step += 1
            if probe is not None:
                probe("step", engine)
            if save_dir is not None and step == save_at:
                accelerator.save_state(save_dir)
    return {"losses": losses, "engine": engine, "model": model, "accelerator": accelerator}


def _plugin_run(name: str, ds: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    with enabled():
        run = train(ds, steps)
    return {"losses": run["losses"], **effects(run["engine"], run["model"], name.split("-")[0])}


def _accumdtype() -> dict[str, Any]:
    seen: list[Any] = []
    micro = [0]

    def probe(when: str, engine: Any) -> None:
        if when == "micro":
            micro[0] += 1
            if micro[0] % GAS == 1:  # between the two micro-steps of a window
                seen.append(grad_accum_dtypes(engine))

    with enabled():
        run = train(ds_config(2, {"accumdtype": {"dtype": "fp32"}}), 2, probe=probe)
    return {"mid_window_dtypes": seen, **effects(run["engine"], run["model"], "accumdtype")}


def _nvmeswap(tmp: str) -> dict[str, Any]:
    folder = os.path.join(tmp, "acc-nvme")
    io: list[tuple[int, int]] = []
    files: list[dict[str, int]] = []

    def probe(when: str, engine: Any) -> None:
        if when == "step":
            io.append(proc_io())
            files.append(swap_files(folder))

    with enabled():
        run = train(nvme_config(folder, {"nvmeswap": NVMESWAP_SECTION}), 4, probe=probe)
    engine = run["engine"]
    part = sum(p.ds_tensor.numel() for p in engine.module.parameters())
    return {"io": io, "files": files, "partition_numel": part, **effects(engine, run["model"], "nvmeswap")}


def _no_enable() -> dict[str, Any]:
    run = train(ds_config(2, {"loco": {}, "accumdtype": {"dtype": "fp32"}}), 1)
    engine = run["engine"]
    cfg = engine.config if isinstance(engine.config, dict) else {}
    return {
        **attachment_summary(engine),
        "losses": run["losses"],
        "sections_in_engine_config": sorted(k for k in ("loco", "accumdtype") if k in cfg),
    }


def _resume(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    ds = ds_config(2, {"accumdtype": {"dtype": "fp32"}, "loco": {}})
    save_dir = os.path.join(tmp, "acc-state")
    with enabled():
        full = train(ds, RESUME_STEPS, save_at=SAVE_AT, save_dir=save_dir)
        full_params = full_params_digest(full["engine"])
        full_summary = attachment_summary(full["engine"])
        layout = sorted(
            os.path.relpath(os.path.join(r, f), save_dir) for r, _, fs in os.walk(save_dir) for f in fs
        )
        dist.barrier()
        resumed = train(ds, RESUME_STEPS, load_dir=save_dir)
        resumed_params = full_params_digest(resumed["engine"])
    hand = hand_loop(ds, RESUME_STEPS)
    return {
        "full": {"losses": full["losses"], "params": full_params, **full_summary},
        "resumed": {"losses": resumed["losses"], "params": resumed_params},
        "hand": hand,
        "layout": layout,
    }


def all_accelerate_scenarios(tmp: str) -> dict[str, Any]:
    scenarios = {
        "plain": lambda: _plugin_run("plain", ds_config(2)),
        "loco": lambda: _plugin_run("loco", ds_config(2, {"loco": {}})),
        "accumdtype": _accumdtype,
        "autocastzero": lambda: _plugin_run("autocastzero", ds_config(2, {"autocastzero": {}}, bf16=False)),
        "mixedlayers": lambda: _plugin_run(
            "mixedlayers", ds_config(2, {"mixedlayers": {"fp32_module_types": ["torch.nn.LayerNorm"]}})
        ),
        "nvmeswap": lambda: _nvmeswap(tmp),
        "no_enable": _no_enable,
        "resume": lambda: _resume(tmp),
    }
    only = os.environ.get("FRAMEWORKS_ONLY")  # debugging: FRAMEWORKS_ONLY=loco,resume
    if only:
        scenarios = {k: v for k, v in scenarios.items() if k in only.split(",")}
    return run_scenarios(scenarios)
