"""Conformance: without a plugin section, ``zerohooks.initialize`` is ``deepspeed.initialize``.

Every row of :data:`CASES` is one ``deepspeed.initialize`` call (a config, an optimizer, a
scheduler, data, a model) run twice in the same process, through ``deepspeed.initialize`` and
through ``zerohooks.initialize``, each on a fresh model drawn from the same seed.  Both must have
the same outcome:

* both succeed: the returned tuples hold items of the same types (and the caller's own optimizer
  and scheduler objects come back, or not, alike), the engines and their optimizers are of the
  same classes, and a few steps give bit-identical losses, learning rates and parameters; or
* both raise, at the same point (in ``initialize`` or at the same step), exceptions of exactly
  the same type.

The rows follow DeepSpeed's own tests (``tests/unit/runtime/test_ds_initialize.py``:
``TestOptimizerImplementation``'s ZeRO stage x model dtype x ``grad_accum_dtype`` grid,
``TestClientOptimizer``, ``TestClientLrScheduler``, ``TestNoOptim``; the ZeRO tests' offload and
communication-dtype settings), plus the engines DeepSpeed builds besides the ZeRO optimizers
(``BF16_Optimizer``, ``FP16_Optimizer``, ``DeepSpeedZeRoOffload``, none for inference, a
``PipelineEngine``) and the ways a config reaches ``initialize`` (dict, JSON/HJSON file, base64,
``args.deepspeed_config``, ``config_params``).  One process group per world size, many engines
in it, three optimizer steps each.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import deepspeed
import pytest
import torch
from torch import nn

import zerohooks
from zerohooks.testing import distributed
from zerohooks.testing.toy import FP16_DYNAMIC, batch, loss_fn, make_model, pipeline_layers

STEPS = 3
GAS = 2
MICRO = 4
LR = 1e-2


@dataclasses.dataclass(frozen=True)
class Case:
    """One ``initialize`` call.  ``optimizer``: ``config`` (an ``"optimizer"`` section, torch's
    AdamW), ``object`` (a torch AdamW built on the model's parameters), ``sgd`` (a torch SGD
    object, not a ZeRO-tested optimizer), ``callable`` (a factory of AdamW) or ``none``.
    ``scheduler``: ``config`` (WarmupLR section), ``object`` (a LambdaLR on the optimizer object),
    ``foreign`` (a LambdaLR on another optimizer), ``callable`` or None.  ``drive``: ``train``
    (backward + step every micro-step), ``eval`` (forward only, no grad) or ``pipe``
    (``train_batch``).  ``config_as``: how the config is passed.  ``extra``: top-level keys
    merged into the config (a None value deletes the key); ``zero``: keys merged into
    ``zero_optimization``."""

    name: str
    stage: int = 0
    dtype: str = "fp32"
    grad_accum: str | None = None
    comm: str | None = None
    offload: bool = False
    offload_param: bool = False
    optimizer: str = "config"
    scheduler: str | None = None
    data: bool = False
    drive: str = "train"
    pipeline: bool = False
    params: str = "list"  # list | none | groups
    config_as: str = "dict"  # dict | file | hjson | base64 | args | config_params | args_and_dict | none
    model_none: bool = False
    extra: tuple[tuple[str, Any], ...] = ()
    zero: tuple[tuple[str, Any], ...] = ()  # more zero_optimization keys


def _grid() -> list[Case]:
    """DeepSpeed's TestOptimizerImplementation grid: ZeRO stage x model dtype x grad_accum_dtype
    (NotImplementedError where DeepSpeed has no optimizer for the mix)."""
    rows = []
    for stage in (0, 1, 2, 3):
        for dtype in ("fp32", "bf16", "fp16"):
            for acc in (None, "fp32", "bf16", "fp16"):
                rows.append(Case(f"grid z{stage} {dtype} acc={acc}", stage, dtype, acc))
    return rows


def _offload() -> list[Case]:
    rows = [
        Case(f"offload z{stage} {dtype}", stage, dtype, offload=True)
        for stage in (1, 2, 3)
        for dtype in ("fp32", "bf16", "fp16")
    ]
    rows += [
        # offload disables BF16_Optimizer: the ZeRO 1 optimizer accumulates in fp32
        Case("offload z1 bf16 acc=fp32", 1, "bf16", "fp32", offload=True),
        Case("offload z3 bf16 + offload_param", 3, "bf16", offload=True, offload_param=True),
        # a torch optimizer with ZeRO-Offload is refused unless zero_force_ds_cpu_optimizer=false
        Case(
            "offload z2 optimizer object, zero_force_ds_cpu_optimizer: refused",
            2,
            offload=True,
            optimizer="object",
            extra=(("zero_force_ds_cpu_optimizer", None),),
        ),
    ]
    return rows


def _optimizers() -> list[Case]:
    rows = []
    for stage in (0, 1, 2, 3):
        for kind in ("object", "callable"):
            rows.append(Case(f"{kind} optimizer z{stage} bf16", stage, "bf16", optimizer=kind))
        rows.append(Case(f"object optimizer z{stage} fp16", stage, "fp16", optimizer="object"))
    rows += [
        Case("object optimizer z2 offload fp32", 2, offload=True, optimizer="object"),
        Case("callable optimizer z3 offload bf16", 3, "bf16", offload=True, optimizer="callable"),
        Case("BF16_Optimizer from an object (z1 bf16 acc=fp32)", 1, "bf16", "fp32", optimizer="object"),
        Case("BF16_Optimizer from a callable (z0 bf16 acc=bf16)", 0, "bf16", "bf16", optimizer="callable"),
        Case("untested ZeRO optimizer (SGD z2): refused", 2, optimizer="sgd"),
        Case(
            "untested ZeRO optimizer (SGD z2) allowed",
            2,
            optimizer="sgd",
            extra=(("zero_allow_untested_optimizer", True),),
        ),
        Case("SGD z0 fp16", 0, "fp16", optimizer="sgd"),
        # no optimizer: evaluation (the inference path of HF Trainer), and a training attempt
        Case("no optimizer z0 fp32 eval (inference)", 0, optimizer="none", drive="eval"),
        Case("no optimizer z0 bf16 eval (inference)", 0, "bf16", optimizer="none", drive="eval"),
        Case("no optimizer z0 fp16 eval (inference)", 0, "fp16", optimizer="none", drive="eval"),
        Case("no optimizer z1 eval", 1, optimizer="none", drive="eval"),
        Case("no optimizer z2 bf16 eval", 2, "bf16", optimizer="none", drive="eval"),
        Case("no optimizer z0 train", 0, optimizer="none"),
        Case("no optimizer z2 train", 2, optimizer="none"),
        # DeepSpeedZeRoOffload: ZeRO 3 without an optimizer (TestNoOptim)
        Case("DeepSpeedZeRoOffload z3 fp32 eval", 3, optimizer="none", drive="eval"),
        Case(
            "DeepSpeedZeRoOffload z3 bf16 offload_param eval",
            3,
            "bf16",
            offload_param=True,
            optimizer="none",
            drive="eval",
        ),
        Case(
            "DeepSpeedZeRoOffload z3 fp16 offload_param eval",
            3,
            "fp16",
            offload_param=True,
            optimizer="none",
            drive="eval",
        ),
        Case("DeepSpeedZeRoOffload z3 offload_param train", 3, offload_param=True, optimizer="none"),
    ]
    return rows


def _comm() -> list[Case]:
    rows = []
    for stage in (0, 1, 2, 3):
        rows.append(Case(f"comm fp32 z{stage} bf16", stage, "bf16", comm="fp32"))
        rows.append(Case(f"comm bf16 z{stage} fp32", stage, "fp32", comm="bf16"))
    rows += [
        Case("comm fp32 z2 fp16", 2, "fp16", comm="fp32"),
        Case("comm fp32 z3 fp16", 3, "fp16", comm="fp32"),
        Case("comm fp16 z2 bf16", 2, "bf16", comm="fp16"),
        Case("comm fp32 z1 bf16 acc=fp32 (BF16_Optimizer)", 1, "bf16", "fp32", comm="fp32"),
        Case("comm fp32 z3 bf16 offload", 3, "bf16", comm="fp32", offload=True),
    ]
    return rows


def _zero_knobs() -> list[Case]:
    """Settings that switch DeepSpeed's gradient reduction onto other code paths (DeepSpeed's
    zero tests vary them)."""
    return [
        Case("z0 prescale_gradients", 0, extra=(("prescale_gradients", True),)),
        Case("z0 gradient_predivide_factor 2", 0, extra=(("gradient_predivide_factor", 2.0),)),
        Case("z0 fp16 gradient_clipping", 0, "fp16", extra=(("gradient_clipping", 1.0),)),
        Case("z1 reduce_scatter off", 1, zero=(("reduce_scatter", False),)),
        Case("z2 reduce_scatter off bf16", 2, "bf16", zero=(("reduce_scatter", False),)),
        Case("z2 contiguous_gradients off", 2, zero=(("contiguous_gradients", False),)),
        Case(
            "z2 overlap_comm + round_robin_gradients fp16",
            2,
            "fp16",
            zero=(("overlap_comm", True), ("round_robin_gradients", True)),
        ),
        Case(
            "z2 gradient_predivide_factor 2 with reduce_scatter: refused",
            2,
            extra=(("gradient_predivide_factor", 2.0),),
        ),
        Case(
            "z2 gradient_predivide_factor 2, reduce_scatter off + clipping",
            2,
            zero=(("reduce_scatter", False),),
            extra=(("gradient_predivide_factor", 2.0), ("gradient_clipping", 0.5)),
        ),
        Case("z3 reduce_scatter off", 3, zero=(("reduce_scatter", False),)),
        Case("z3 contiguous_gradients off bf16", 3, "bf16", zero=(("contiguous_gradients", False),)),
        Case(
            "z3 no persistence, small live params",
            3,
            zero=(("stage3_param_persistence_threshold", 0), ("stage3_max_live_parameters", 100)),
        ),
        Case("z3 MiCS (removed in DeepSpeed 0.19.8): refused", 3, zero=(("mics_shard_size", 1),)),
        Case("z3 hpZ (zero_hpz_partition_size 2)", 3, "bf16", zero=(("zero_hpz_partition_size", 2),)),
        Case("gradient_accumulation_steps 1 z2", 2, extra=(("gradient_accumulation_steps", 1),)),
    ]


def _schedulers() -> list[Case]:
    return [
        Case("scheduler config z0", 0, scheduler="config"),
        Case("scheduler config z2 bf16", 2, "bf16", scheduler="config"),
        Case("scheduler object + object optimizer z0", 0, optimizer="object", scheduler="object"),
        Case(
            "scheduler object + object optimizer z3 bf16", 3, "bf16", optimizer="object", scheduler="object"
        ),
        Case("scheduler callable + config optimizer z1", 1, scheduler="callable"),
        Case(
            "scheduler callable + callable optimizer z2 fp16",
            2,
            "fp16",
            optimizer="callable",
            scheduler="callable",
        ),
        Case("scheduler callable + BF16_Optimizer", 1, "bf16", "fp32", scheduler="callable"),
        # TestClientLrScheduler: a scheduler object on another optimizer is refused
        Case("scheduler object on a foreign optimizer z0", 0, scheduler="foreign"),
        Case("scheduler object on a foreign optimizer z2", 2, optimizer="callable", scheduler="foreign"),
        Case(
            "scheduler config + callable z2: callable wins",
            2,
            scheduler="callable",
            extra=(("scheduler", {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}),),
        ),
    ]


def _data_and_params() -> list[Case]:
    # DeepSpeed's dataloader starts two worker processes per iteration (seconds on CPU): one row
    # here and one PipelineEngine row iterate the returned dataloader; the others feed batches
    return [
        Case("training_data z2 bf16", 2, "bf16", data=True),
        Case("model_parameters=None z1", 1, params="none"),
        Case("model_parameters=None z3 bf16", 3, "bf16", params="none"),
        Case("param groups (weight decay) z2", 2, params="groups"),
        Case("param groups (weight decay) z3 bf16", 3, "bf16", params="groups"),
    ]


def _pipeline() -> list[Case]:
    """A PipelineModule of TinyNet's layers, one stage per rank (a real two-stage pipeline over
    gloo on two ranks), driven by ``train_batch``."""
    return [
        Case("PipelineEngine z1 bf16 training_data", 1, "bf16", pipeline=True, drive="pipe", data=True),
        Case("PipelineEngine z0 fp32", 0, pipeline=True, drive="pipe"),
        Case("PipelineEngine z0 fp16", 0, "fp16", pipeline=True, drive="pipe"),
        Case(
            "PipelineEngine z1 object optimizer + callable scheduler",
            1,
            pipeline=True,
            drive="pipe",
            optimizer="object",
            scheduler="callable",
        ),
        Case("PipelineEngine z2: refused", 2, pipeline=True, drive="pipe"),
    ]


def _config_forms() -> list[Case]:
    return [
        Case("config as a JSON file z2", 2, config_as="file"),
        Case("config as an HJSON file (comments) z1", 1, config_as="hjson"),
        Case("config as base64 z0", 0, config_as="base64"),
        Case("config as args.deepspeed_config z3", 3, config_as="args"),
        Case("config as config_params z2", 2, config_as="config_params"),
        Case("config file with duplicate keys", 1, config_as="duplicate"),
        Case("config file that does not exist", 1, config_as="missing"),
        Case("config in args and in config=", 1, config_as="args_and_dict"),
        Case("no config at all", 1, config_as="none"),
        Case("model=None", 1, model_none=True),
        Case('legacy "zero_optimization": true', 0, extra=(("zero_optimization", True),)),
        Case("bf16 and fp16 both enabled", 0, "bf16", extra=(("fp16", {"enabled": True}),)),
        Case("zero stage 4", 0, extra=(("zero_optimization", {"stage": 4}),)),
        Case('"bfloat16" section (old name) z2', 2, extra=(("bfloat16", {"enabled": True}),)),
    ]


CASES: list[Case] = [
    *_grid(),
    *_offload(),
    *_optimizers(),
    *_comm(),
    *_zero_knobs(),
    *_schedulers(),
    *_data_and_params(),
    *_config_forms(),
    # last: after a PipelineEngine of two stages, DeepSpeed itself builds no other engine in the
    # process (its module-level model-parallel state keeps the pipeline's grid: AttributeError
    # 'NoneType' object has no attribute 'get_model_parallel_rank' in deepspeed.initialize)
    *_pipeline(),
]


# -- building one call -------------------------------------------------------------------------------
def _pipeline_model(world: int) -> nn.Module:
    from deepspeed.pipe import PipelineModule

    net = make_model()  # the same weights as TinyNet, as a sequence of layers
    layers = pipeline_layers(net)
    return PipelineModule(
        layers=layers,
        num_stages=world,
        loss_fn=lambda logits, target: nn.functional.cross_entropy(logits.float(), target),
        partition_method="uniform",
    )


def _dataset(n: int = 96) -> torch.utils.data.Dataset[Any]:
    g = torch.Generator().manual_seed(1234)
    return torch.utils.data.TensorDataset(
        torch.randint(0, 32, (n, 6), generator=g), torch.randint(0, 8, (n,), generator=g)
    )


def _config(case: Case) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": case.stage},
    }
    if case.optimizer == "config":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}
    if case.offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if case.offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    cfg["zero_optimization"].update(case.zero)
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif case.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, **FP16_DYNAMIC}
    if case.grad_accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": case.grad_accum}
    if case.comm is not None:
        cfg["communication_data_type"] = case.comm
    if case.scheduler == "config":
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": LR}}
    for key, value in case.extra:
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _lambda(step: int) -> float:
    return 1.0 / (step + 1)


def _scheduler_factory(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, _lambda)


@dataclasses.dataclass
class Call:
    kwargs: dict[str, Any]
    clients: dict[str, Any]  # the caller's objects, to see whether they come back
    args: Any = None


def _call(case: Case, workdir: str) -> Call:
    world = torch.distributed.get_world_size()
    model: nn.Module | None = _pipeline_model(world) if case.pipeline else make_model()
    assert model is not None
    cfg = _config(case)
    kwargs: dict[str, Any] = {"model": None if case.model_none else model}
    if case.params == "list":
        kwargs["model_parameters"] = list(model.parameters())
    elif case.params == "groups":
        decay = [p for n, p in model.named_parameters() if p.dim() > 1]
        rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
        kwargs["model_parameters"] = [
            {"params": decay, "weight_decay": 0.1},
            {"params": rest, "weight_decay": 0.0},
        ]
    clients: dict[str, Any] = {}
    if case.optimizer == "object":
        clients["optimizer"] = _adamw(model.parameters())
    elif case.optimizer == "sgd":
        clients["optimizer"] = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    elif case.optimizer == "callable":
        clients["optimizer"] = _adamw
    if "optimizer" in clients:
        kwargs["optimizer"] = clients["optimizer"]
    if case.scheduler == "object":
        clients["lr_scheduler"] = _scheduler_factory(clients["optimizer"])
    elif case.scheduler == "foreign":
        clients["lr_scheduler"] = _scheduler_factory(_adamw(make_model().parameters()))
    elif case.scheduler == "callable":
        clients["lr_scheduler"] = _scheduler_factory
    if "lr_scheduler" in clients:
        kwargs["lr_scheduler"] = clients["lr_scheduler"]
    if case.data:
        kwargs["training_data"] = _dataset()
    call = Call(kwargs, clients)
    path = os.path.join(workdir, "ds_config.json")
    if case.config_as == "dict":
        kwargs["config"] = cfg
    elif case.config_as in ("file", "args", "args_and_dict"):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f)
        if case.config_as == "file":
            kwargs["config"] = path
        else:
            call.args = argparse.Namespace(deepspeed_config=path, local_rank=-1)
            kwargs["args"] = call.args
            if case.config_as == "args_and_dict":
                kwargs["config"] = cfg
    elif case.config_as == "hjson":
        body = json.dumps(cfg, indent=1)
        with open(path, "w", encoding="utf-8") as f:
            f.write("# a DeepSpeed config with comments (DeepSpeed reads HJSON)\n" + body + "\n")
        kwargs["config"] = path
    elif case.config_as == "duplicate":
        body = json.dumps(cfg)
        with open(path, "w", encoding="utf-8") as f:
            f.write(body[:-1] + ', "steps_per_print": 7}')
        kwargs["config"] = path
    elif case.config_as == "missing":
        kwargs["config"] = os.path.join(workdir, "no_such_config.json")
    elif case.config_as == "base64":
        kwargs["config"] = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    elif case.config_as == "config_params":
        kwargs["config_params"] = cfg
    elif case.config_as != "none":
        raise ValueError(case.config_as)
    return call


# -- running one call ---------------------------------------------------------------------------------
def _name(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _params(engine: Any) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def _lr(engine: Any) -> list[float] | None:
    try:
        return [float(x) for x in engine.get_lr()]
    except Exception:
        return None


def _batches(engine: Any, loader: Any) -> Any:
    rank = torch.distributed.get_rank()
    if loader is not None:
        while True:
            yield from loader
    s = 0
    while True:
        for m in range(GAS):
            yield batch(s, m, rank, n=MICRO)
        s += 1


def _drive(engine: Any, loader: Any, case: Case, record: dict[str, Any]) -> None:
    data = _batches(engine, loader)
    losses: list[float] = record.setdefault("losses", [])
    lrs: list[Any] = record.setdefault("lrs", [])
    for step in range(STEPS):
        record["at"] = f"step {step}"
        if case.drive == "pipe":
            losses.append(float(engine.train_batch(data_iter=data)))
        elif case.drive == "eval":
            with torch.no_grad():
                tokens, target = next(data)
                losses.append(float(loss_fn(engine, tokens, target)))
        else:
            for _ in range(GAS):
                tokens, target = next(data)
                loss = loss_fn(engine, tokens, target)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        lrs.append(_lr(engine))
    record["at"] = "params"
    record["params"] = _params(engine)
    del record["at"]


def _outcome(init: Callable[..., Any], case: Case, workdir: str) -> dict[str, Any]:
    record: dict[str, Any] = {}
    try:
        call = _call(case, workdir)
        record["at"] = "initialize"
        result = init(**call.kwargs)
        record["returned"] = (
            [type(x).__qualname__ for x in result] if isinstance(result, tuple) else type(result)
        )
        engine, optimizer, loader, scheduler = result
        record["engine"] = type(engine).__qualname__
        record["engine.optimizer"] = type(engine.optimizer).__qualname__
        record["client optimizer returned"] = optimizer is call.clients.get("optimizer", object())
        record["client scheduler returned"] = scheduler is call.clients.get("lr_scheduler", object())
        if call.args is not None:
            record["args"] = dict(vars(call.args))
        _drive(engine, loader, case, record)
    except Exception as exc:
        record["raised"] = _name(exc)
        record["message"] = str(exc).splitlines()[0][:160] if str(exc) else ""
    return record


def _compare(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    problems = []
    for key in sorted(set(ref) | set(got)):
        if key in ("message", "params"):
            continue
        if ref.get(key) != got.get(key):
            problems.append(f"{key}: deepspeed {ref.get(key)!r} / zerohooks {got.get(key)!r}")
    if "raised" in got and "raised" not in ref:
        problems.append(f"zerohooks raised: {got['message']}")
    a, b = ref.get("params"), got.get("params")
    if (a is None) != (b is None) or (
        a is not None and (len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)))
    ):
        problems.append("parameters differ")
    return problems


def _summary(ref: dict[str, Any]) -> str:
    if "raised" in ref:
        return f"both raise {ref['raised'].rsplit('.', 1)[-1]} at {ref['at']}"
    return f"same losses ({ref['engine']}, {ref['engine.optimizer']})"


def run_table(cases: list[Case]) -> list[tuple[str, str, list[str]]]:
    """Every case through both functions; (name, outcome, problems) per case."""
    rank = torch.distributed.get_rank()
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"zh_conf{rank}_") as workdir:
        for case in cases:
            start = time.perf_counter()
            ref = _outcome(deepspeed.initialize, case, workdir)
            got = _outcome(zerohooks.initialize, case, workdir)
            took = f"{time.perf_counter() - start:5.2f}s"
            rows.append((case.name, f"{took}  {_summary(ref)}", _compare(ref, got)))
    return rows


def _check(world: int) -> list[tuple[str, str, list[str]]]:
    rows = run_table(CASES)
    if torch.distributed.get_rank() == 0:
        width = max(len(n) for n, _, _ in rows)
        report = [f"{n:<{width}}  {o}  {'OK' if not p else 'DIFFERS'}" for n, o, p in rows]
        print(f"\nconformance on {world} rank(s):\n" + "\n".join(report))
    failures = [f"{n}: {'; '.join(p)}" for n, _, p in rows if p]
    assert not failures, f"{len(failures)} of {len(rows)} rows differ:\n" + "\n".join(failures)
    return rows


def test_cases_have_unique_names() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


@pytest.mark.slow
@pytest.mark.multirank
@distributed(world_size=1, fp16_on_cpu=True, timeout=600)
def test_conformance_one_rank() -> None:
    _check(1)


@pytest.mark.slow
@pytest.mark.multirank
@distributed(world_size=2, fp16_on_cpu=True, timeout=600)
def test_conformance_two_ranks() -> None:
    _check(2)


@pytest.mark.multirank
@distributed(world_size=1, fp16_on_cpu=True)
def test_adapter_stays_out_of_the_way_without_plugins() -> None:
    """A DeepSpeed internal the adapter needs is missing on the engine (as after a DeepSpeed
    refactor): without plugins the engine is left as DeepSpeed built it (nothing patched, same
    losses); with a plugin it is an error naming the internal."""
    from zerohooks import DeepSpeedInternalMissing
    from zerohooks.adapter import base
    from zerohooks.adapter.initialize import _engine_context, setup_context
    from zerohooks.testing.recording import RecordingPlugin
    from zerohooks.testing.toy import ds_config, train

    real = base.require_attr

    def missing(obj: Any, name: str, what: str | None = None) -> Any:
        if name == "_backward_epilogue":
            raise DeepSpeedInternalMissing(f"zerohooks needs {what}.{name} (test)")
        return real(obj, name, what)

    base.require_attr = missing
    try:
        for stage in (0, 2, 3):
            model = make_model()
            ref, *_ = deepspeed.initialize(model=model, config=ds_config(stage, "bf16"))
            model = make_model()
            engine, *_ = zerohooks.initialize(model=model, config=ds_config(stage, "bf16"))
            att = zerohooks.attachment(engine)
            assert att is not None and att.inert and "_backward_epilogue" in att.inert
            assert not any(k in vars(engine) for k in ("backward", "_take_model_step", "step")), stage
            assert not any(k in vars(engine.optimizer) for k in ("allreduce_bucket", "process_gradients"))
            assert train(engine, 2, 2) == train(ref, 2, 2), stage
            # what the adapter is told when the config is DeepSpeed's to judge: read from the engine
            for cfg in (ds_config(stage, "bf16"), ds_config(stage, "fp16", offload=stage > 0)):
                model = make_model()
                built, *_ = deepspeed.initialize(model=model, config=cfg)
                a, b = _engine_context(built, cfg), setup_context(cfg)
                assert (a.zero_stage, a.train_dtype, a.offload_optimizer) == (
                    b.zero_stage,
                    b.train_dtype,
                    b.offload_optimizer,
                ), (stage, cfg)
            model = make_model()
            with pytest.raises(DeepSpeedInternalMissing, match="_backward_epilogue"):
                zerohooks.initialize(model=model, config=ds_config(stage), plugins=[RecordingPlugin()])
    finally:
        base.require_attr = real
