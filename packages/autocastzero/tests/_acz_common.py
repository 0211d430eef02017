"""The multi-rank scenarios of the autocastzero tests (imported by the spawned ranks too).

Each scenario returns plain data; the test modules assert on it.  Oracles: DeepSpeed's own
``torch_autocast`` (same model, batches and optimizer), plain fp32 training, parameter counts of
the model, and snapshots taken before a step that must be skipped.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerohooks.testing.toy import ds_config, full_params, make_model, train

STAGES = (0, 1, 2, 3)
STEPS, GAS = 3, 2
FP16_SECTION: dict[str, Any] = {
    "dtype": "float16",
    "initial_scale_power": 8,
    "loss_scale_window": 2,
    "hysteresis": 1,
}
"""fp16 settings of the tests: scale 256, doubling after 2 good steps, halving at every overflow."""


def build(
    stage: int, sections: dict[str, Any] | None = None, offload: bool = False, gas: int = GAS, **extra: Any
) -> Any:
    import zerohooks

    model = make_model()
    cfg = ds_config(stage, "fp32", offload, gas=gas, sections=sections, **extra)
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def deepspeed_autocast(stage: int, dtype: str = "bfloat16") -> Any:
    """An engine with DeepSpeed's own ``torch_autocast`` (run these last: DeepSpeed keeps a
    process-wide flag once one exists)."""
    import deepspeed

    model = make_model()
    cfg = ds_config(stage, "fp32", gas=GAS, torch_autocast={"enabled": True, "dtype": dtype})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def counted_bytes(engine: Any) -> dict[str, dict[str, int]]:
    import zerohooks

    att = zerohooks.attachment(engine)
    assert att is not None
    return att.counters.total()


def safe_numel(engine: Any) -> tuple[int, int]:
    """(elements of lower-precision-safe parameters, all elements), from the model itself."""
    safe = total = 0
    for module in engine.module.modules():
        for p in module.parameters(recurse=False):
            n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
            total += n
            if isinstance(module, torch.nn.Linear):
                safe += n
    return safe, total


def optimizer_state(engine: Any, stage: int) -> list[torch.Tensor]:
    opt = engine.optimizer if stage == 0 else engine.optimizer.optimizer
    out = []
    for st in opt.state.values():
        out += [v.detach().clone() for v in st.values() if torch.is_tensor(v)]
    return out


def forward_weights_z3() -> dict[str, Any]:
    """ZeRO 3 without persistent parameters: per parameter, the largest difference between the
    weight the first forward computes with (as gathered) and the initial fp32 weight, rounded to
    bf16 and not."""
    engine = build(
        3,
        {"autocastzero": {"dtype": "bfloat16"}},
        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0},
    )
    seen: dict[str, torch.Tensor] = {}

    def grab(module: torch.nn.Module, args: Any) -> None:
        for n, p in module.named_parameters(recurse=False):
            seen.setdefault(f"{names[id(module)]}.{n}", p.detach().clone())

    names = {id(m): n for n, m in engine.module.named_modules()}
    handles = [m.register_forward_pre_hook(grab) for n, m in engine.module.named_modules() if n]
    train(engine, 1, 1)
    for h in handles:
        h.remove()
    from autocastzero import autocast_state

    safe = set(autocast_state(engine).safe.values())
    out = {}
    for n, p in make_model().named_parameters():
        w = p.detach()
        g = seen[n]
        out[n] = {
            "safe": n in safe,
            "dtype": str(g.dtype),
            "vs_bf16_rounded": float((g - w.bfloat16().float()).abs().max()),
            "vs_fp32": float((g - w).abs().max()),
        }
    return out


def scenario_bf16(stage: int) -> dict[str, Any]:
    """autocastzero bf16, plain fp32 and (ZeRO 1-3) DeepSpeed torch_autocast: losses and bytes."""
    out: dict[str, Any] = {}
    engine = build(stage, {"autocastzero": {"dtype": "bfloat16"}})
    out["params_fp32"] = all(p.dtype == torch.float32 for p in engine.module.parameters())
    out["losses"] = train(engine, STEPS, GAS)
    out["bytes"] = counted_bytes(engine)
    out["numel"] = safe_numel(engine)
    if stage == 3:
        out["forward_weights"] = forward_weights_z3()
        opt = engine.optimizer
        out["bucket_numel"] = {str(dt): b.buffer.numel() for dt, b in opt.ipg_buckets.items()}
        out["reduce_bucket_size"] = int(opt.reduce_bucket_size)
    if stage in (2, 3):
        off = build(stage, {"autocastzero": {"dtype": "bfloat16"}}, offload=True)
        out["offload_losses"] = train(off, STEPS, GAS)
    import zerohooks

    out["attached_forward"] = engine.torch_autocast_enabled()
    zerohooks.detach(engine)
    out["detached_forward"] = engine.torch_autocast_enabled() or "torch_autocast_dtype" in vars(engine)
    if stage == 3:  # DeepSpeed's own bucket back at full size: detached, it reduces everything in fp32
        out["detached_losses"] = train(engine, 1, GAS, first=STEPS)
        out["detached_bucket_numel"] = engine.optimizer.ipg_buckets[torch.float32].buffer.numel()
    fp32 = build(stage)
    out["fp32_losses"] = train(fp32, STEPS, GAS)
    out["fp32_bytes"] = counted_bytes(fp32)
    return out


def scenario_fp16(stage: int) -> dict[str, Any]:
    """fp16 autocast with dynamic scaling; rank 1 injects an inf in the loss of step 2."""
    from autocastzero import autocast_state

    rank = int(os.environ.get("RANK", "0"))
    out: dict[str, Any] = {}
    engine = build(stage, {"autocastzero": FP16_SECTION})
    scale = autocast_state(engine).scale
    assert scale is not None
    losses = train(engine, 2, GAS)
    out["scales"] = [scale.scale]
    before_p = full_params(engine, stage)
    before_s = optimizer_state(engine, stage)
    skipped0, global0 = engine.skipped_steps, engine.global_steps
    _overflow_step(engine, 2, rank)
    after_p = full_params(engine, stage)
    after_s = optimizer_state(engine, stage)
    out["skip_params_equal"] = len(before_p) == len(after_p) and all(
        torch.equal(a, b) for a, b in zip(before_p, after_p, strict=True)
    )
    out["skip_state_equal"] = len(before_s) == len(after_s) > 0 and all(
        torch.equal(a, b) for a, b in zip(before_s, after_s, strict=True)
    )
    out["skipped"] = engine.skipped_steps - skipped0
    out["global_advanced"] = engine.global_steps - global0
    out["scales"].append(scale.scale)
    losses += train(engine, 4, GAS, first=3)
    after_recovery = full_params(engine, stage)
    out["moved_after"] = any(not torch.equal(a, b) for a, b in zip(after_p, after_recovery, strict=True))
    out["scales"].append(scale.scale)
    out["overflows"] = scale.overflows
    out["oracle_scales"] = deepspeed_scale_oracle([False, False, True, False, False, False, False])
    out["losses"] = losses
    out["detached"] = _detach_restores(engine, stage)
    fp32 = build(stage)
    ref = train(fp32, 2, GAS)
    # the reference skips nothing: its step 2 is what the fp16 run skipped; compare steps 0-1
    out["fp32_losses"] = ref
    return out


def _detach_restores(engine: Any, stage: int) -> dict[str, bool]:
    """After ``zerohooks.detach``: is every slot the plugin filled back to what DeepSpeed built?"""
    import zerohooks

    opt = engine.optimizer
    zerohooks.detach(engine)
    checks = {"forward": not engine.torch_autocast_enabled() and "torch_autocast_dtype" not in vars(engine)}
    if stage == 0:
        checks["gradscaler"] = engine.torch_autocast_z0_gradscaler is None
        checks["overflow_attr"] = "overflow" not in vars(opt)
    else:
        checks["loss_scaler"] = type(opt.loss_scaler).__module__.startswith("deepspeed.")
        checks["dynamic_flag"] = opt.dynamic_loss_scale is False
        if stage == 3:
            checks["overflow_check"] = "_overflow_check_and_loss_scale_update" not in vars(opt)
        else:
            checks["check_grad_overflow"] = opt.check_grad_overflow is False
    return checks


def deepspeed_scale_oracle(overflows: list[bool]) -> list[float]:
    """DeepSpeed's own fp16 DynamicLossScaler on the same settings and overflow sequence: the
    scale after steps 2, 3 and 7 (what :func:`scenario_fp16` records)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    ref = DynamicLossScaler(
        init_scale=2.0 ** FP16_SECTION["initial_scale_power"],
        scale_window=FP16_SECTION["loss_scale_window"],
        min_scale=1.0,
        delayed_shift=FP16_SECTION["hysteresis"],
        consecutive_hysteresis=False,
    )
    scales = []
    for i, o in enumerate(overflows):
        ref.update_scale(o)
        if i in (1, 2, len(overflows) - 1):
            scales.append(float(ref.cur_scale))
    return scales


def scenario_resume(stage: int, ckpt_dir: str) -> dict[str, Any]:
    """fp16: 3 steps (one skipped), save, 2 more steps; a fresh engine loads and runs the same 2."""
    import torch.distributed as dist

    from autocastzero import autocast_state

    rank = int(os.environ.get("RANK", "0"))
    engine = build(stage, {"autocastzero": FP16_SECTION})
    train(engine, 2, GAS)
    _overflow_step(engine, 2, rank)
    path = os.path.join(ckpt_dir, f"z{stage}")
    engine.save_checkpoint(path, tag="t")
    saved_scale = autocast_state(engine).scale
    assert saved_scale is not None
    scale_at_save = saved_scale.scale
    straight = train(engine, 2, GAS, first=3)
    dist.barrier()
    fresh = build(stage, {"autocastzero": FP16_SECTION})
    fresh.load_checkpoint(path, tag="t")
    loaded = autocast_state(fresh).scale
    assert loaded is not None
    scale_loaded = loaded.scale
    resumed = train(fresh, 2, GAS, first=3)
    return {
        "straight": straight,
        "resumed": resumed,
        "scale_at_save": scale_at_save,
        "scale_loaded": scale_loaded,
        "final_scales": (saved_scale.scale, loaded.scale),
    }


def _overflow_step(engine: Any, step: int, rank: int) -> None:
    """One optimizer step whose last micro-step has an inf loss on rank 1."""
    from zerohooks.testing.toy import batch, loss_fn

    for m in range(GAS):
        tokens, target = batch(step, m, rank)
        loss = loss_fn(engine, tokens, target)
        if m == GAS - 1 and rank == 1:
            loss = loss * torch.tensor(float("inf"))
        engine.backward(loss)
        engine.step()


def scenario_always_overflows() -> dict[str, Any]:
    """fp16 on ZeRO 2 with an inf loss at every step: every step is skipped, the scale backs off
    from 4 to min_loss_scale 1 (steps 0-1), then stays there; the steps at which each rank warned."""
    import warnings

    from autocastzero import autocast_state
    from autocastzero.scaling import STUCK_STEPS
    from zerohooks.testing.toy import batch, loss_fn

    rank = int(os.environ.get("RANK", "0"))
    section = {"dtype": "float16", "initial_scale_power": 2, "hysteresis": 1}
    engine = build(2, {"autocastzero": section}, gas=1)
    scale = autocast_state(engine).scale
    assert scale is not None
    warned: list[tuple[int, str]] = []
    for step in range(2 + STUCK_STEPS + 3):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tokens, target = batch(step, 0, rank)
            engine.backward(loss_fn(engine, tokens, target) * torch.tensor(float("inf")))
            engine.step()
        warned += [(step, str(w.message)) for w in seen if "autocastzero" in str(w.message)]
    return {"warned": warned, "skipped": engine.skipped_steps, "scale": scale.scale, "steps": step + 1}


def scale_rule_vs_deepspeed() -> list[tuple[int, int, int]]:
    """The plugin's scale rule and DeepSpeed's fp16 DynamicLossScaler on random overflow
    sequences: (window, hysteresis, first step where they disagree or -1)."""
    import random

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from autocastzero.scaling import ScaleState, update

    rng = random.Random(0)
    out = []
    for window, hysteresis in [(1, 1), (2, 1), (3, 2), (5, 3)]:
        ours = ScaleState(2.0**10, True, window, hysteresis, 1.0)
        ref = DynamicLossScaler(2.0**10, window, 1.0, hysteresis, False, raise_error_at_min_scale=False)
        first_diff = -1
        for i in range(300):
            overflow = rng.random() < 0.2
            update(ours, overflow)
            ref.update_scale(overflow)
            if ours.scale != ref.cur_scale and first_diff < 0:
                first_diff = i
        out.append((window, hysteresis, first_diff))
    return out


def tiny_gpt2() -> Any:
    """A 2-block Hugging Face GPT-2 (its linear layers are ``transformers.pytorch_utils.Conv1D``)."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def scenario_gpt2() -> dict[str, Any] | None:
    """ZeRO 2 on Hugging Face GPT-2, one step: bytes per dtype against the Conv1D elements, and
    the warnings of the default section and of one that leaves Conv1D out.  None without
    transformers."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("transformers") is None:
        return None
    import zerohooks

    rank = int(os.environ.get("RANK", "0"))
    out: dict[str, Any] = {}
    linear_only = {"lower_precision_safe_modules": ["torch.nn.Linear"]}
    for name, section in (("default", {}), ("linear_only", linear_only)):
        model = tiny_gpt2()
        cfg = ds_config(2, "fp32", gas=1, sections={"autocastzero": section})
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(rank))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        conv = sum(
            p.numel()
            for m in engine.module.modules()
            if type(m).__name__ == "Conv1D"
            for p in m.parameters(recurse=False)
        )
        out[name] = {
            "bytes": counted_bytes(engine),
            "conv_numel": conv,
            "numel": sum(p.numel() for p in engine.module.parameters()),
            "warnings": [str(w.message) for w in seen if "autocastzero" in str(w.message)],
            "loss": float(loss.detach()),
        }
        zerohooks.detach(engine)
    return out


def scenario_as_on_a_gpu() -> dict[str, str]:
    """The dtype the first Linear computes in, per ZeRO stage, with DeepSpeed's forward seeing the
    autocast the way it does on a GPU.

    DeepSpeed's ``engine.forward`` turns off an autocast already on when its own ``torch_autocast``
    is not enabled, and asks ``torch.is_autocast_enabled()``: on a GPU that reads the
    accelerator's (CUDA's) autocast, here it reads CUDA's too, which the CPU accelerator never
    uses, so the check never fired on CPU (the H100 ran autocastzero's forward in fp32). The
    GPU cannot exist here; its view can: the call without a device is made to read the CPU's
    autocast, the accelerator's, for the length of the scenario."""
    import zerohooks

    real = torch.is_autocast_enabled

    def accelerators(*args: Any) -> bool:
        return bool(real(*args) if args else real("cpu"))

    out: dict[str, str] = {}
    torch.is_autocast_enabled = accelerators  # type: ignore[assignment]
    try:
        for stage in (0, 2, 3):
            engine = build(stage, {"autocastzero": {"dtype": "bfloat16"}})
            seen: list[str] = []
            hook = engine.module.fc1.register_forward_hook(
                lambda m, a, o, seen=seen: seen.append(str(o.dtype))
            )
            train(engine, 1, GAS)
            hook.remove()
            out[f"z{stage}"] = seen[0]
            zerohooks.detach(engine)
    finally:
        torch.is_autocast_enabled = real  # type: ignore[assignment]
    return out


def checkpointed_model(how: str) -> Any:
    """The toy model with its hidden block recomputed in backward: ``how`` is ``"deepspeed"``
    (``deepspeed.checkpointing.checkpoint``), ``"torch"`` (``torch.utils.checkpoint``, not
    reentrant) or ``"none"``; the same weights and math each way."""
    import deepspeed
    import torch.utils.checkpoint as torch_checkpoint
    from torch import nn

    from zerohooks.testing.toy import TinyNet

    class Blocked(TinyNet):
        def block(self, h: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = nn.functional.gelu(self.norm(self.fc1(h)))
            return out

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.emb(tokens).mean(dim=1)
            if how == "deepspeed":
                h = deepspeed.checkpointing.checkpoint(self.block, h)
            elif how == "torch":
                h = torch_checkpoint.checkpoint(self.block, h, use_reentrant=False)
            else:
                h = self.block(h)
            out: torch.Tensor = self.fc2(h)
            return out

    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    torch.manual_seed(0)
    return Blocked()


def scenario_checkpointing(stage: int, deepspeed_own: bool = False) -> dict[str, list[float]]:
    """Losses of the block recomputed each way under bf16 autocast: autocastzero's, or with
    ``deepspeed_own`` DeepSpeed's ``torch_autocast`` with DeepSpeed's checkpointing (run it last)."""
    import deepspeed

    import zerohooks

    out: dict[str, list[float]] = {}
    ways = ("deepspeed",) if deepspeed_own else ("deepspeed", "torch", "none")
    for how in ways:
        model = checkpointed_model(how)
        if deepspeed_own:
            cfg = ds_config(stage, "fp32", gas=GAS, torch_autocast={"enabled": True, "dtype": "bfloat16"})
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        else:
            cfg = ds_config(stage, "fp32", gas=GAS, sections={"autocastzero": {"dtype": "bfloat16"}})
            engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out[how] = train(engine, STEPS, GAS)
    return out


def all_two_rank_scenarios(ckpt_dir: str) -> dict[str, Any]:
    """Every 2-rank scenario, in one launch."""
    res: dict[str, Any] = {"scale_rule": scale_rule_vs_deepspeed()}
    res["always_overflows"] = scenario_always_overflows()
    res["gpt2"] = scenario_gpt2()
    res["as_on_a_gpu"] = scenario_as_on_a_gpu()
    for stage in STAGES:
        res[f"bf16_z{stage}"] = scenario_bf16(stage)
    for stage in STAGES:
        res[f"fp16_z{stage}"] = scenario_fp16(stage)
        res[f"resume_z{stage}"] = scenario_resume(stage, ckpt_dir)
    for stage in (2, 3):
        res[f"ckpt_z{stage}"] = scenario_checkpointing(stage)
    # DeepSpeed's own torch_autocast last: it sets process-wide flags
    for stage in (1, 2, 3):
        engine = deepspeed_autocast(stage)
        res[f"ds_z{stage}"] = {"losses": train(engine, STEPS, GAS)}
    for stage in (2, 3):
        res[f"ds_ckpt_z{stage}"] = scenario_checkpointing(stage, deepspeed_own=True)
    return res
