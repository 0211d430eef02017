"""The 2-rank scenarios of the mixedlayers tests (imported by the spawned ranks too).

Each scenario builds real DeepSpeed engines on the shared toy model (``zerohooks.testing.toy``:
embedding, Linear, LayerNorm, GELU, Linear) with its LayerNorm and last Linear (``fc2``) kept in
fp32, and returns what it saw; the test modules assert on it.

The gradient oracle is independent of DeepSpeed and of mixedlayers: a plain-torch copy of the
model that spells out the casts by hand (embedding and ``fc1`` in the 16-bit dtype, LayerNorm
and ``fc2`` in fp32 with their inputs upcast and outputs cast back), computes each rank's
micro-step gradients of the fp32 parameters one by one, and they are averaged in float64.  The
casts are the same single-threaded CPU kernels DeepSpeed's backward runs, so the only
differences left are the fp32 roundings of accumulating and reducing; a reduction in a 16-bit
dtype would show as errors of about 2**-8 relative.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from zerohooks.testing.toy import DTYPES, batch, ds_config, loss_fn, make_model, train

SECTION: dict[str, Any] = {"fp32_modules": ["fc2"], "fp32_module_types": ["torch.nn.LayerNorm"]}
"""The mixedlayers section of every scenario: the LayerNorm (by type) and the last Linear."""
KEPT = ("norm.weight", "norm.bias", "fc2.weight", "fc2.bias")
"""Names of the parameters SECTION keeps in fp32."""
GAS = 2
STEPS = 3
SMALL_BUCKET = 8
"""A ``reduce_bucket_size`` no bucket of the toy model fills less than (fc2.bias has 8 elements)."""

CASES: list[tuple[int, str, bool]] = [
    (0, "bf16", False),
    (1, "bf16", False),
    (2, "bf16", False),
    (3, "bf16", False),
    (0, "fp16", False),
    (2, "fp16", False),
    (3, "fp16", False),
    (1, "bf16", True),
    (2, "fp16", True),
    (3, "bf16", True),
]
"""(ZeRO stage, training dtype, CPU optimizer offload) of the training scenarios."""

OPTIMIZER: dict[str, Any] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}}
"""No weight decay: ZeRO 0's FP16_UnfusedOptimizer takes a zero-gradient step at init, which
would decay the masters before the exact-init check."""

FP16_STATIC = {"loss_scale": 256.0}
"""A static fp16 loss scale for the gradient checks (the boundary gradients carry it)."""


def case_name(stage: int, dtype: str, offload: bool) -> str:
    return f"z{stage}-{dtype}{'-offload' if offload else ''}"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def build(stage: int, dtype: str, offload: bool, *, mixed: bool = True, **kwargs: Any) -> Any:
    import zerohooks

    model = make_model()
    sections = {"mixedlayers": SECTION} if mixed else {}
    cfg = ds_config(stage, dtype, offload, gas=GAS, sections=sections, optimizer=OPTIMIZER, **kwargs)
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def param_dtypes(engine: Any) -> dict[str, str]:
    """The dtype of every parameter as the model computes with it (gathered on ZeRO 3)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(
        list(params.values()), enabled=engine.zero_optimization_stage() == 3
    ):
        return {n: str(p.dtype).removeprefix("torch.") for n, p in params.items()}


def masters(engine: Any) -> dict[str, torch.Tensor]:
    """The fp32 master weight of every parameter (the parameter itself on ZeRO 0)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        if engine.zero_optimization_stage() == 0:
            out[n] = _fp16_optimizer_master(engine, p)
        else:
            out[n] = safe_get_full_fp32_param(p).detach().clone()
    return out


def _fp16_optimizer_master(engine: Any, param: Any) -> torch.Tensor:
    """ZeRO 0's FP16_UnfusedOptimizer keeps one fp32 master per parameter (FP16_Optimizer one
    flat master per param group)."""
    opt = engine.optimizer
    for i, group in enumerate(opt.fp16_groups):
        offset = 0
        for j, p in enumerate(group):
            if p is param:
                if hasattr(opt, "fp32_groups_flat"):
                    flat = opt.fp32_groups_flat[i].detach()
                    return flat[offset : offset + p.numel()].view_as(p).clone()
                return opt.fp32_groups[i][j].detach().clone()
            offset += p.numel()
    raise KeyError("parameter not in the optimizer")


def reference_loss(model: nn.Module, dtype: torch.dtype, tokens: torch.Tensor, target: torch.Tensor) -> Any:
    """The toy model's forward with the mixedlayers casts spelled out by hand."""
    low = dtype
    h = nn.functional.embedding(tokens, model.emb.weight.to(low)).mean(dim=1)
    a = nn.functional.linear(h, model.fc1.weight.to(low), model.fc1.bias.to(low))
    n = nn.functional.layer_norm(a.float(), (a.shape[-1],), model.norm.weight, model.norm.bias).to(low)
    g = nn.functional.gelu(n)
    out = nn.functional.linear(g.float(), model.fc2.weight, model.fc2.bias).to(low)
    return nn.functional.cross_entropy(out.float(), target)


def reference_grads(dtype: str, step: int, world: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Gradients of the kept parameters at step ``step`` of a run from ``make_model()``, float64.

    Only valid for the first step (the weights are the initial ones): each micro-step's loss is
    divided by GAS (as DeepSpeed does) and multiplied by ``scale`` (the fp16 loss scale).
    """
    model = make_model()
    low = DTYPES[dtype]
    # The 16-bit parameters as DeepSpeed casts them; the kept ones stay fp32.
    for p in (model.emb.weight, model.fc1.weight, model.fc1.bias):
        p.data = p.data.to(low).float()
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters() if n in KEPT}
    for r in range(world):
        for m in range(GAS):
            model.zero_grad()
            tokens, target = batch(step, m, r)
            loss = reference_loss(model, low, tokens, target) * (scale / GAS)
            loss.backward()
            for n, p in model.named_parameters():
                if n in KEPT:
                    assert p.grad is not None and p.grad.dtype == torch.float32
                    total[n] += p.grad.double()
    return {n: t / world for n, t in total.items()}


def grads_before_step(engine: Any) -> dict[str, torch.Tensor]:
    """Run step 0's micro-steps and read the gradients at the boundary, before the step."""
    from zerohooks.testing.toy import full_grads

    rank = _rank()
    for m in range(GAS):
        tokens, target = batch(0, m, rank)
        engine.backward(loss_fn(engine, tokens, target))
        if m < GAS - 1:
            engine.step()
    grads = {n: g for n, g in full_grads(engine).items() if n in KEPT}
    engine.step()
    return grads


def training_scenario(
    stage: int, dtype: str, offload: bool, tmp: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Init, gradients, training, checkpoint round trip for one case (``extra``: top-level
    DeepSpeed config keys to override)."""
    extra = extra or {}
    import torch.distributed as dist

    out: dict[str, Any] = {}
    initial = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    fp16 = FP16_STATIC if dtype == "fp16" else None
    engine = build(stage, dtype, offload, fp16=fp16, **extra)
    out["optimizer"] = type(engine.optimizer).__name__
    out["dtypes_init"] = param_dtypes(engine)
    m = masters(engine)
    out["masters_init_exact"] = {n: bool(torch.equal(m[n], initial[n])) for n in KEPT}
    out["grads"] = grads_before_step(engine)
    out["ref_grads"] = reference_grads(
        dtype, 0, dist.get_world_size(), scale=FP16_STATIC["loss_scale"] if fp16 else 1.0
    )
    out["losses"] = train(engine, STEPS - 1, GAS, first=1)
    out["dtypes_trained"] = param_dtypes(engine)
    ckpt = os.path.join(tmp, case_name(stage, dtype, offload))
    engine.save_checkpoint(ckpt, tag="t")
    before = masters(engine)
    after_save = train(engine, 1, GAS, first=STEPS)

    engine2 = build(stage, dtype, offload, fp16=fp16, **extra)
    engine2.load_checkpoint(ckpt, tag="t")
    out["dtypes_loaded"] = param_dtypes(engine2)
    loaded = masters(engine2)
    out["masters_loaded_equal"] = {n: bool(torch.equal(loaded[n], before[n])) for n in before}
    out["resumed_losses"] = (after_save, train(engine2, 1, GAS, first=STEPS))

    ref = build(stage, "fp32", offload, mixed=False, **extra)
    out["fp32_losses"] = train(ref, STEPS - 1, GAS, first=1)
    return out


ROUTER = "moe.deepspeed_moe.gate.wg"
"""The MoE model's router (:class:`zerohooks.testing.toy.MoENet`)."""
ROUTER_GLOB = "*.deepspeed_moe.gate.wg"
"""What mixedlayers' README tells users to keep: every DeepSpeed MoE router of a model."""


def moe_router_scenario(stage: int) -> dict[str, Any]:
    """A bf16 MoE model (2 experts, one per rank) with and without its router kept in fp32."""
    import zerohooks
    from zerohooks.testing.toy import MoENet, moe_parameters

    out: dict[str, Any] = {}
    for name, sections in (("bf16", {}), ("router_fp32", {"mixedlayers": {"fp32_modules": [ROUTER_GLOB]}})):
        torch.manual_seed(0)
        model = MoENet()
        cfg = ds_config(stage, "bf16", gas=GAS, sections=sections, optimizer=OPTIMIZER)
        engine, *_ = zerohooks.initialize(model=model, model_parameters=moe_parameters(model), config=cfg)
        losses = train(engine, STEPS, GAS)
        weight = engine.module.get_submodule(ROUTER).weight
        att = zerohooks.attachment(engine)
        assert att is not None
        out[name] = {
            "losses": losses,
            "dtype": str(weight.dtype).removeprefix("torch."),
            "weight": weight.detach().float().clone(),
            "master": masters(engine)[ROUTER + ".weight"],
            "bytes": att.counters.total(),
            "router_numel": weight.numel(),
        }
    return out


PIPE_KEEP = {"fp32_module_types": ["torch.nn.LayerNorm"]}
"""On the toy's 2-stage pipeline the LayerNorm is layer 2, on the first stage only: that stage
holds two param groups, the second one."""


def _pipeline_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), target)


def pipeline_scenario() -> dict[str, Any]:
    """A bf16 2-stage ``PipelineModule`` on ZeRO 1: plain, with the LayerNorm kept in fp32, and
    with a selection that matches on no stage (the error every rank must raise, not a hang).
    Last in the launch: a pipeline engine leaves DeepSpeed's process-wide groups its own."""
    from deepspeed.pipe import PipelineModule

    import zerohooks
    from zerohooks import ConfigError
    from zerohooks.testing.toy import pipeline_layers

    def build(sections: dict[str, Any]) -> Any:
        torch.manual_seed(0)
        model = PipelineModule(
            layers=pipeline_layers(make_model(mult=4)),
            num_stages=2,
            loss_fn=_pipeline_loss,
            partition_method="uniform",
        )
        cfg = ds_config(1, "bf16", gas=GAS, sections=sections, train_batch_size=4 * GAS)
        engine, *_ = zerohooks.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        return engine

    out: dict[str, Any] = {}
    try:
        build({"mixedlayers": {"fp32_module_types": ["torch.nn.Conv2d"]}})
        out["nowhere"] = None
    except ConfigError as e:
        out["nowhere"] = str(e)
    for name, sections in (("bf16", {}), ("kept", {"mixedlayers": PIPE_KEEP})):
        engine = build(sections)
        losses = [float(engine.train_batch(iter([batch(s, m, 0) for m in range(GAS)]))) for s in range(STEPS)]
        out[name] = {
            "losses": losses,
            "stage": engine.stage_id,
            "groups": len(engine.optimizer.bit16_groups),
            "fp32": sorted(n for n, p in engine.module.named_parameters() if p.dtype == torch.float32),
            "stage_norm": "scaled_global_norm" in vars(engine.optimizer),
        }
        zerohooks.detach(engine)
    return out


def all_two_rank_scenarios(tmp: str) -> dict[str, Any]:
    """Every 2-rank scenario of the folder (one launch)."""
    results: dict[str, Any] = {}
    for case in CASES:
        results[case_name(*case)] = training_scenario(*case, tmp)
    results["detach"] = detach_scenario()
    results["frozen"] = {f"z{stage}": frozen_scenario(stage) for stage in (2, 3)}
    results["client_optimizer"] = client_optimizer_scenario()
    results["reinit"] = {f"z{stage}": reinit_scenario(stage) for stage in (2, 3)}
    results["moe_router"] = {f"z{stage}": moe_router_scenario(stage) for stage in (1, 2)}
    results["pipeline"] = pipeline_scenario()  # last: see its docstring
    return _portable(results)


def _portable(obj: Any) -> Any:
    """Tensors as numpy arrays: torch shares tensor storage between processes through file
    descriptors that die with the rank, numpy arrays are pickled by value."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def three_rank_scenario(tmp: str) -> dict[str, Any]:
    """ZeRO 3 on 3 ranks with no persistent parameters: every kept parameter is partitioned, and
    partitions of sizes not divisible by 3 (fc2.bias, 8 elements) are padded."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    return _portable(training_scenario(3, "bf16", False, tmp, {"zero_optimization": zero}))


def frozen_scenario(stage: int) -> dict[str, Any]:
    """A kept module with frozen parameters (the LayerNorm) stays fp32 and unchanged."""
    import zerohooks

    model = make_model()
    for p in model.norm.parameters():
        p.requires_grad_(False)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    cfg = ds_config(stage, "bf16", gas=GAS, sections={"mixedlayers": SECTION}, optimizer=OPTIMIZER)
    engine, *_ = zerohooks.initialize(model=model, model_parameters=trainable, config=cfg)
    losses = train(engine, 2, GAS)
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        norm = {n: p.detach().clone() for n, p in engine.module.named_parameters() if n.startswith("norm.")}
    return {
        "dtypes": param_dtypes(engine),
        "norm_unchanged": {n: bool(torch.equal(t, initial[n])) for n, t in norm.items()},
        "losses": losses,
    }


def client_optimizer_scenario() -> dict[str, Any]:
    """An optimizer object (one mixed group) instead of model_parameters, ZeRO 2."""
    import zerohooks

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    cfg = ds_config(2, "bf16", gas=GAS, sections={"mixedlayers": SECTION})
    cfg.pop("optimizer")
    engine, *_ = zerohooks.initialize(model=model, optimizer=opt, config=cfg)
    losses = train(engine, 2, GAS)
    return {"dtypes": param_dtypes(engine), "groups": len(opt.param_groups), "losses": losses}


def reinit_scenario(stage: int) -> dict[str, Any]:
    """A second ``zerohooks.initialize`` on a model mixedlayers already prepared for an engine:
    the error it gets, and the first engine's losses around it (against an engine that never saw
    a second initialize)."""
    import zerohooks

    def config() -> dict[str, Any]:
        return ds_config(stage, "bf16", gas=GAS, sections={"mixedlayers": SECTION}, optimizer=OPTIMIZER)

    model = make_model()
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=config())
    losses = train(engine, 1, GAS)
    try:
        zerohooks.initialize(model=model, model_parameters=model.parameters(), config=config())
        error = ""
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    losses += train(engine, 1, GAS, first=1)
    return {"error": error, "losses": losses, "reference": train(build(stage, "bf16", False), 2, GAS)}


def detach_scenario() -> dict[str, Any]:
    """Detaching removes the boundary casts: the kept modules then see their inputs as given."""
    import zerohooks
    from mixedlayers import mixed_state

    engine = build(2, "bf16", False)
    state = mixed_state(engine)
    kept_modules = sorted(state.modules) if state is not None else []
    norm = engine.module.norm
    seen: list[torch.dtype] = []
    handle = norm.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    tokens, _ = batch(0, 0, _rank())
    with torch.no_grad():
        engine.module(tokens)
        hooks_before = len(norm._forward_pre_hooks) + len(norm._forward_hooks)
        patched = "setup_buckets" in engine.optimizer.__dict__
        zerohooks.detach(engine)
        unpatched = "setup_buckets" not in engine.optimizer.__dict__
        hooks_after = len(norm._forward_pre_hooks) + len(norm._forward_hooks)
        engine.module.norm(torch.zeros(2, 48, dtype=torch.bfloat16).float())
        try:
            engine.module(tokens)
        except RuntimeError as e:  # bf16 activations now meet the fp32 LayerNorm unconverted
            seen.append(torch.float64)
            error = str(e)
        else:
            error = ""
    handle.remove()
    return {
        "seen": [str(d).removeprefix("torch.") for d in seen],
        "hooks": (hooks_before, hooks_after),
        "to_shadowed": "to" in engine.module.__dict__,
        "error": error,
        "kept_modules": kept_modules,
        "staging_patch": (patched, unpatched),
        "state_after_detach": state is not None and state.handles == [] and mixed_state(engine) is None,
        "z3_retype": z3_retype_detach(),
    }


def bucket_scenario() -> dict[str, Any]:
    """ZeRO 2, bf16, mixedlayers: the gradients go to two IPG buckets (bf16 and the fp32 modules'
    fp32).  Trained twice from the same start: with DeepSpeed's default ``reduce_bucket_size``
    (500 M elements), where zerohooks sizes each bucket's buffers to its gradients, and with
    ``reduce_bucket_size`` 8 (``SMALL_BUCKET``), where every bucket needs its whole size and
    DeepSpeed's own buffers stay.  On 2 ranks a reduction sums two values per element whatever
    the bucketing, so both must train bitwise alike.  Returns the buffers seen during the first
    backward, the parameters' sizes counted from the model, the losses and the final masters."""
    import zerohooks

    out: dict[str, Any] = {}
    for run in ("fitted", "deepspeed"):
        small = {"zero_optimization": {"stage": 2, "reduce_bucket_size": SMALL_BUCKET}}
        engine = build(2, "bf16", False, **(small if run == "deepspeed" else {}))
        opt = engine.optimizer
        out[f"{run}_reduce_bucket_size"] = int(opt.reduce_bucket_size)
        seen: dict[str, Any] = {}
        setup = opt.setup_buckets

        def spy(setup: Any = setup, seen: dict[str, Any] = seen, opt: Any = opt) -> Any:
            made: list[tuple[int, str]] = []
            empty = torch.empty

            def counted(*args: Any, **kwargs: Any) -> torch.Tensor:  # every buffer allocated
                t = empty(*args, **kwargs)
                made.append((t.numel(), str(t.dtype).removeprefix("torch.")))
                return t

            torch.empty = counted  # type: ignore[assignment]
            try:
                result = setup()  # the buffers exist from here until the backward's epilogue
            finally:
                torch.empty = empty  # type: ignore[assignment]
            seen.setdefault("allocated", sorted(made))
            seen.setdefault("buffers", {
                str(d).removeprefix("torch."): [(b.numel(), str(b.dtype).removeprefix("torch.")) for b in bucket.buffer]
                for d, bucket in opt.ipg_buckets.items()
            })  # fmt: skip
            return result

        opt.setup_buckets = spy
        tokens, target = batch(0, 0, _rank())
        engine.backward(loss_fn(engine, tokens, target))
        out[f"{run}_buffers"] = seen.get("buffers")
        out[f"{run}_allocated"] = seen.get("allocated")
        opt.setup_buckets = setup
        engine.step()
        out[f"{run}_losses"] = train(engine, STEPS, GAS, first=1)
        out[f"{run}_masters"] = {n: t.tolist() for n, t in masters(engine).items()}
        out["overlap_comm"] = bool(opt.overlap_comm)
        zerohooks.detach(engine)
    model = make_model()
    out["numel"] = {n: p.numel() for n, p in model.named_parameters()}
    return out


def z3_retype_detach() -> dict[str, Any]:
    """ZeRO 3: the kept parameters' fp32 partitions (the adapter's retype) go back to DeepSpeed's
    bf16 buffers at detach, holding the fp32 values rounded to bf16."""
    import zerohooks

    engine = build(3, "bf16", False)
    opt = engine.optimizer
    attached = [str(t.dtype).removeprefix("torch.") for t in opt.fp16_partitioned_groups_flat]
    kept = [p for p in engine.module.parameters() if p.ds_tensor.dtype == torch.float32]
    values = [p.ds_tensor.detach().clone() for p in kept]
    zerohooks.detach(engine)
    after = [str(t.dtype).removeprefix("torch.") for t in opt.fp16_partitioned_groups_flat]
    rounded = all(
        p.ds_tensor.dtype == torch.bfloat16 and torch.equal(p.ds_tensor, v.to(torch.bfloat16))
        for p, v in zip(kept, values, strict=True)
    )
    in_flat = all(
        any(
            t is not None
            and t.data_ptr() <= p.ds_tensor.data_ptr() < t.data_ptr() + t.numel() * t.element_size()
            for t in opt.fp16_partitioned_groups_flat
        )
        for p in kept
    )
    return {"attached": attached, "after": after, "kept": len(kept), "rounded": rounded, "in_flat": in_flat}
