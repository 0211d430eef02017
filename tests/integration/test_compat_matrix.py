"""The compatibility matrix (``tools/compat_matrix.py``), checked cell by cell on 2 gloo ranks (4 for
the rows that need them).

One launch of 2 ranks builds every engine the matrix needs (each configuration once, oracles
shared between cells) and tries every refused configuration; the tests then judge each cell:

* ``works``/``limit`` cells train and match their oracle: gradient clipping against plain
  DeepSpeed with the same clipping (AdamW with ``eps`` 1.0, so the update follows the gradient's
  size and clipping shows in the losses; the tolerance is the plugin's own distance to plain
  DeepSpeed without clipping), the math-neutral features (``prescale_gradients``,
  ``gradient_predivide_factor``, ``offload_param`` to CPU or NVMe, ``sequence_parallel_size``) against the same
  plugin without them (identical losses), nvmeswap against DeepSpeed's CPU optimizer offload with
  the same feature (identical losses); ``engine.compile`` (backend ``aot_eager``) against the
  same plugin uncompiled (nvmeswap: plain DeepSpeed compiled), and its graph breaks (dynamo's
  counter) against plain DeepSpeed compiled on the same stage;
* the universal-checkpoint row (:mod:`universal_runs`): saved on 2 ranks and converted by
  DeepSpeed's ``ds_to_universal``, resumed on 2 ranks (the uninterrupted run's losses, as plain
  DeepSpeed's) and, in a 1-rank launch of its own, on 1 rank (the first step identical, the rest
  within the plugin's tolerance of plain DeepSpeed's own universal load on 1 rank);
* ``refused`` cells raise zerohooks' ``ConfigError`` at ``initialize`` naming the plugin and the
  DeepSpeed key, and saying what to do instead;
* the README's matrix (top level and each package) is the table rendered.

The rows of ``compat_matrix.FOUR_RANK_ROWS`` (the pipeline with data parallelism: 2 stages x data
parallel 2; MoE with expert and data parallelism: 2 experts, each on 2 ranks) take one launch of 4
ranks of their own: each trained cell against DeepSpeed's own equivalent of the plugin (plain bf16
DeepSpeed where it has none) within the cell's tolerance, the data-parallel replicas ending with
the same weights (each pipeline stage's; on the MoE model each expert's, and everything else on
all 4 ranks, the two experts apart), and the refusals (for the pipeline, the stages a cell does
not claim too).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import compat_matrix  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import universal_runs  # noqa: E402

PLUGINS = ("accumdtype", "autocastzero", "mixedlayers", "loco", "nvmeswap")
STEPS, GAS = 3, 2
MIXED = {"fp32_modules": ["fc2"], "fp32_module_types": ["torch.nn.LayerNorm"]}
PIPE_MIXED = {"fp32_module_types": ["torch.nn.LayerNorm"]}
"""mixedlayers' selection on the pipeline (its layers are named by index: the toy's LayerNorm is
layer 2, on the first stage only, which then holds two param groups and the second stage one)."""
PIPE_KEPT = ["2.bias", "2.weight"]
"""The parameters :data:`PIPE_MIXED` keeps in fp32 (on stage 0)."""
SECTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("bf16", {}),
    "accumdtype": ("bf16", {"accumdtype": {"dtype": "fp32"}}),
    "autocastzero": ("fp32", {"autocastzero": {"dtype": "bfloat16"}}),
    "mixedlayers": ("bf16", {"mixedlayers": MIXED}),
    "loco": ("bf16", {"loco": {"exact_below": 0}}),
    "all": ("bf16", {"accumdtype": {"dtype": "fp32"}, "mixedlayers": MIXED, "loco": {"exact_below": 0}}),
    "autocastzero-fp16": ("fp32", {"autocastzero": {"dtype": "float16"}}),
    "ds-accum": ("bf16", {"data_types": {"grad_accum_dtype": "fp32"}}),
    "ds-autocast": ("fp32", {"torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}),
}
"""Each column's plugin sections on the toy model (``none``: plain DeepSpeed, the oracle;
``ds-accum``, ``ds-autocast``: DeepSpeed's own equivalents of accumdtype and autocastzero;
``autocastzero-fp16`` only for a refusal: :data:`LIMIT_REFUSED`)."""
LIMIT_REFUSED = (("universal", "autocastzero-fp16", 2),)
"""The refusals a ``limit`` cell states (row, column, stage): checked as the refused cells are."""
CLIP = 0.05
WIDE = 1024
"""The toy model's width for parameter offload to NVMe: DeepSpeed swaps a parameter's partition
only from 1 MiB up (``MIN_AIO_BYTES``), so fc1 (1024 x 1024 in bf16, 1 MiB a rank on 2 ranks) is
swapped; the toy's usual sizes would all stay in memory."""
NVME_PARAMS = {"buffer_count": 4, "buffer_size": 2_000_000, "max_in_cpu": 0, "pin_memory": False}
"""DeepSpeed's parameter swap buffers for the toy model (its default, 5 of 1e8 elements, would
allocate 1 GB a rank); ``max_in_cpu`` 0: every parameter goes through the files."""
FEATURES: dict[str, dict[str, Any]] = {
    "clip": {"gradient_clipping": CLIP},
    "prescale": {"prescale_gradients": True},
    "predivide": {"gradient_predivide_factor": 2.0},
    "offload_param": {"offload_param": {"device": "cpu"}},
    "offload_nvme": {"offload_param": {"device": "nvme"}},
    "sp": {"sequence_parallel_size": 2},
    "moe": {},
    "moe_dp": {},
    "actckpt": {},
    "pipe": {"train_batch_size": 8},
    "pipe_dp": {"train_batch_size": 16},
    "universal": {"checkpoint": {"load_universal": True}},
    "compile": {},
    "deepcompile": {"compile": {"deepcompile": True}},
    "wide": {},
}
"""Each row's DeepSpeed settings (``offload_param`` goes inside ``zero_optimization``; ``moe`` is
the model: :func:`_model`; ``compile`` calls ``engine.compile`` after ``initialize``: :func:`_run_all`)."""
COMPILE_BACKEND = "aot_eager"
"""``engine.compile``'s backend on CPU: dynamo's graphs and AOTAutograd's forward/backward split
without inductor's C++ build per graph (too slow for CI)."""
COMPARED_WITH_DEEPSPEED = ("clip", "moe", "pipe")
"""The rows whose oracle is plain DeepSpeed with the same feature, within the plugin's own
distance to plain DeepSpeed without it (doubled, plus 1e-3)."""
NO_REDUCE_SCATTER = ("prescale", "predivide", "unscaled")
"""The runs with ``zero_optimization.reduce_scatter`` false (DeepSpeed refuses pre-scaling and
pre-division with it on ZeRO 2/3): the two rows, and ``unscaled``, their oracle without either."""


def _config(column: str, stage: int, feature: str | None, folder: str) -> dict[str, Any]:
    """The DeepSpeed config of one run: ``column``'s plugins, ``feature`` on or off."""
    from zerohooks.testing.toy import ds_config

    extra = dict(FEATURES[feature]) if feature in FEATURES else {}
    zero: dict[str, Any] = {"stage": stage}
    if feature in ("wide", "offload_nvme"):
        # no parameter kept whole in memory for being small (DeepSpeed's persistence threshold):
        # the wide model and its oracle partition alike
        zero["stage3_param_persistence_threshold"] = 0
    if "offload_param" in extra:
        zero["offload_param"] = extra.pop("offload_param")
        if zero["offload_param"]["device"] == "nvme":  # the rank's own folder; buffers for the toy's sizes
            zero["offload_param"] = {**zero["offload_param"], **NVME_PARAMS, "nvme_path": f"{folder}/params"}
    if feature in NO_REDUCE_SCATTER:
        zero["reduce_scatter"] = False
    if column in ("nvmeswap", "nvme-oracle"):
        zero["sub_group_size"] = 2000
        zero["offload_optimizer"] = {
            "device": "nvme" if column == "nvmeswap" else "cpu",
            "nvme_path": folder,
            "pin_memory": False,
        }
        dtype, sections = "bf16", ({"nvmeswap": {}} if column == "nvmeswap" else {})
        extra["zero_force_ds_cpu_optimizer"] = False
    else:
        dtype, sections = SECTIONS[column]
        if feature in ("pipe", "pipe_dp") and "mixedlayers" in sections:
            sections = {**sections, "mixedlayers": PIPE_MIXED}
    # eps 1.0: AdamW's update follows the gradient's size, so clipping changes the losses
    optimizer = {"type": "AdamW", "params": {"lr": 0.5, "eps": 1.0, "torch_adam": True}}
    return ds_config(
        stage, dtype, gas=GAS, sections=sections, optimizer=optimizer, zero_optimization=zero, **extra
    )


def _model(feature: str | None) -> Any:
    """The toy model, or for ``moe`` :class:`~zerohooks.testing.toy.MoENet` (a 2-expert DeepSpeed
    MoE layer, ``ep_size`` 2: one expert per rank, same initial weights on both, no token dropped)."""
    import torch

    from zerohooks.testing.toy import MoENet, make_model

    if feature == "actckpt":
        return _checkpointed_model()
    if feature in ("pipe", "pipe_dp"):
        return _pipeline_model()
    if feature in ("offload_nvme", "wide"):
        return make_model(width=WIDE, mult=1)
    if feature not in ("moe", "moe_dp"):
        return make_model(mult=4)
    torch.manual_seed(0)
    return MoENet()


def _checkpointed_model() -> Any:
    """The toy model with its hidden block under ``deepspeed.checkpointing.checkpoint`` (the
    same weights and math as :func:`~zerohooks.testing.toy.make_model`)."""
    import deepspeed
    import torch
    from torch import nn

    from zerohooks.testing.toy import TinyNet

    class Checkpointed(TinyNet):
        def block(self, h: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = nn.functional.gelu(self.norm(self.fc1(h)))
            return out

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = deepspeed.checkpointing.checkpoint(self.block, self.emb(tokens).mean(dim=1))
            out: torch.Tensor = self.fc2(h)
            return out

    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    torch.manual_seed(0)
    return Checkpointed(mult=4)


def _pipeline_model() -> Any:
    """The toy model's layers as a 2-stage ``deepspeed.pipe.PipelineModule`` (one stage a rank)."""
    import torch
    from deepspeed.pipe import PipelineModule
    from torch import nn

    from zerohooks.testing.toy import make_model, pipeline_layers

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float(), target)

    layers = pipeline_layers(make_model(mult=4))
    return PipelineModule(layers=layers, num_stages=2, loss_fn=loss, partition_method="uniform")


def _train_pipeline(engine: Any) -> list[float]:
    """:data:`STEPS` ``train_batch`` calls of :data:`GAS` micro-batches (the same on the stages of
    one data-parallel replica, different between replicas); every step's loss (averaged over the
    replicas by DeepSpeed)."""
    from zerohooks.testing.toy import batch

    replica = engine.grid.data_parallel_id
    return [float(engine.train_batch(iter([batch(s, m, replica) for m in range(GAS)]))) for s in range(STEPS)]


def _parameters(model: Any, feature: str | None) -> Any:
    if feature not in ("moe", "moe_dp"):
        return list(model.parameters())
    from zerohooks.testing.toy import moe_parameters

    return moe_parameters(model)


def _expert(model: Any) -> list[float]:
    """The local expert's weight (ZeRO 1/2: whole on its rank)."""
    (expert,) = model.moe.deepspeed_moe.experts.deepspeed_experts
    return [float(v) for v in expert.weight.detach().float().flatten()]


@functools.cache
def _nvme_params_missing() -> str | None:
    """Why DeepSpeed's parameter offload to NVMe cannot run here (None when it can): it needs
    DeepSpeed's async_io op, built against libaio."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return "DeepSpeed's async_io op cannot be built here (install libaio-dev)"
    except Exception as e:  # DeepSpeed internals moved
        return f"cannot locate DeepSpeed's async_io op: {e}"
    return None


def _plan() -> tuple[list[tuple[str, int, str | None]], list[tuple[str, str, int]]]:
    """Every training run the works/limit cells need (column, stage, feature), each once, and
    every refused cell (row, column, stage)."""
    runs: list[tuple[str, int, str | None]] = []
    refused: list[tuple[str, str, int]] = []

    def need(run: tuple[str, int, str | None]) -> None:
        if run not in runs:
            runs.append(run)

    for (row, column), cell in compat_matrix.MATRIX.items():
        if row in compat_matrix.FOUR_RANK_ROWS:
            continue
        if row == "offload_nvme" and cell.kind != "refused" and _nvme_params_missing():
            continue  # test_parameter_offload_to_nvme_goes_through_files says why
        if cell.kind == "refused":
            # nvmeswap and parameter offload need ZeRO 3; pipelines are refused by the plugin on ZeRO 1
            # (on ZeRO 2/3 zerohooks refuses them first, for DeepSpeed)
            stage = 3 if column == "nvmeswap" or row.startswith("offload") else 1 if row == "pipe" else 2
            refused.append((row, column, stage))
            continue
        for stage in cell.stages:
            if row == "universal":  # oracle: plain DeepSpeed's own universal load (universal_runs)
                need((column, stage, row))
                need(("none", stage, row))
            elif column == "nvmeswap":
                need((column, stage, row))
                need((_nvme_oracle(row), stage, row))
            elif row in COMPARED_WITH_DEEPSPEED:
                for col in (column, "none"):
                    need((col, stage, row))
                    need((col, stage, None))
            elif (row, column) in OWN_ORACLE:
                need((column, stage, row))
                need((OWN_ORACLE[(row, column)], stage, row))
            else:
                need((column, stage, row))
                need((column, stage, _without(row)))
                if row == "compile":  # graph breaks and the tolerance's distance to plain DeepSpeed
                    need(("none", stage, row))
                    need(("none", stage, None))
    # a pipeline engine leaves DeepSpeed's process-wide groups set for model parallelism: an engine
    # built after it in the same rank fails (no mpu), so the pipelines train last; a sequence-parallel
    # engine leaves DeepSpeed's mpu set too (later engines would be sequence parallel): just before
    runs.sort(key=lambda run: 2 if run[2] == "pipe" else 1 if run[2] == "sp" else 0)
    return runs, refused


def _weights_digest(module: Any, skip: str | None = None) -> str:
    """A digest of the bytes of every parameter of this rank's pipeline stage (or model), those
    whose name contains ``skip`` left out."""
    import hashlib

    digest = hashlib.sha256()
    for name, p in module.named_parameters():
        if skip is None or skip not in name:
            digest.update(p.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _nvme_oracle(row: str) -> str:
    """The column nvmeswap's cell in ``row`` is compared with: DeepSpeed's CPU optimizer offload,
    or for ``compile`` plain DeepSpeed compiled (identical losses too; also the graph-break count's
    oracle, so one ZeRO 3 compiled run fewer)."""
    return "none" if row == "compile" else "nvme-oracle"


OWN_ORACLE = {("offload_nvme", "autocastzero"): "ds-autocast", ("sp", "autocastzero"): "ds-autocast"}
"""Cells whose oracle is DeepSpeed's own equivalent of the plugin with the same feature (column),
instead of the same plugin without the feature."""
OWN_LAUNCH = ("ds-autocast",)
"""Columns of the 2-rank rows trained in a launch of their own: an engine with DeepSpeed's
``torch_autocast`` leaves process-wide state that changes the engines built after it in the same
rank (probed: accumdtype's ZeRO-3 losses moved by 1e-3, and a later ZeRO-3 engine's gradient
bucket came out empty)."""


def _without(row: str) -> str | None:
    """The feature of the run a math-neutral row is compared with (the same plugin without it)."""
    if row == "offload_nvme":
        return "wide"  # the same wide model, its parameters in memory
    return "unscaled" if row in NO_REDUCE_SCATTER else None


def _run_all(tmp: str, runs: list[tuple[str, int, str | None]], refused: list[tuple[str, str, int]]) -> str:
    import torch
    from torch._dynamo.utils import counters

    import zerohooks
    from zerohooks import ConfigError
    from zerohooks.testing.toy import train

    rank = int(os.environ["RANK"])
    trained: dict[str, Any] = {}
    for i, (column, stage, feature) in enumerate(runs):
        folder = f"{tmp}/run{i}/r{rank}"
        model = _model(feature)
        # a universal run trains and saves without load_universal, its resumed engine loads with it
        cfg = _config(column, stage, None if feature == "universal" else feature, folder)
        engine, *_ = zerohooks.initialize(
            model=model, model_parameters=_parameters(model, feature), config=cfg, **_sp_mpu(feature)
        )
        if feature == "compile":
            torch._dynamo.reset()
            counters.clear()
            engine.compile(backend=COMPILE_BACKEND)
        if feature == "universal":
            train(engine, universal_runs.SAVED, GAS)
            uni = universal_runs.save_convert_resume(
                engine,
                _universal_engine(column, stage, f"{folder}/resumed"),  # the saving engine holds its folder
                universal_runs.folder(tmp, column, stage),
                GAS,
            )
            trained[json.dumps([column, stage, feature])] = uni
            zerohooks.detach(engine)
            continue
        losses = _train_pipeline(engine) if feature in ("pipe", "pipe_dp") else train(engine, STEPS, GAS)
        norm = engine.get_global_grad_norm()
        # None where DeepSpeed keeps no norm (a plain torch optimizer: ZeRO 0 with an fp32 model)
        found = {"losses": losses, "norm": None if norm is None else float(norm)}
        if feature == "sp":  # DeepSpeed's sequence-parallel world, as its engine took it from the mpu
            found["sp_size"] = engine.sequence_parallel_size
        if feature in ("pipe", "pipe_dp"):
            found["stage_id"] = engine.stage_id
            found["weights"] = _weights_digest(engine.module)
            found["fp32"] = sorted(n for n, p in engine.module.named_parameters() if p.dtype == torch.float32)
        if feature == "compile":
            found["graph_breaks"] = sum(counters["graph_break"].values())
            found["graphs"] = counters["stats"]["unique_graphs"]
            torch._dynamo.reset()
        if feature in ("moe", "moe_dp"):
            found["expert"] = _expert(model)
        if feature == "offload_nvme":  # the parameters' swap files DeepSpeed wrote
            found["swap_files"] = sum(
                f.stat().st_size for f in Path(folder, "params").rglob("*") if f.is_file()
            )
        if feature == "moe_dp":  # every parameter but the local expert's: the same on all ranks
            found["shared"] = _weights_digest(engine.module, skip="deepspeed_experts")
        trained[json.dumps([column, stage, feature])] = found
        if zerohooks.attachment(engine) is not None:
            zerohooks.detach(engine)
    errors: dict[str, Any] = {}
    for row, column, stage in refused:
        folder = f"{tmp}/refused/r{rank}"
        model = _model(row)
        cfg = _config(column, stage, row, folder)
        key = json.dumps([row, column, stage] if (row, column, stage) in LIMIT_REFUSED else [row, column])
        try:
            zerohooks.initialize(model=model, model_parameters=_parameters(model, row), config=cfg)
        except ConfigError as e:
            errors[key] = str(e)
        else:
            errors[key] = None
    return json.dumps({"trained": trained, "errors": errors})


def _sp_mpu(feature: str | None) -> dict[str, Any]:
    """``initialize``'s ``mpu`` for the sequence-parallel row: DeepSpeed's own mpu for Ulysses
    (``deepspeed.runtime.sequence_parallel.parallel_state_sp``, what its Hugging Face integration
    passes), the 2 ranks one sequence-parallel group.  The config key alone only changes
    DeepSpeed's batch-size arithmetic: without the mpu the engine is not sequence parallel."""
    if feature != "sp":
        return {}
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    try:
        parallel_state_sp.get_sequence_parallel_group()
    except AssertionError:  # not yet made in this rank (process-wide, made once)
        parallel_state_sp.initialize_sequence_parallel(2)
    return {"mpu": parallel_state_sp}


def _universal_engine(column: str, stage: int, folder: str) -> Any:
    """How :mod:`universal_runs` builds the engine that loads a universal checkpoint: a fresh
    model, ``column``'s plugins, ``"checkpoint": {"load_universal": true}``."""

    def make() -> tuple[Any, int]:
        import zerohooks

        model = _model("universal")
        cfg = _config(column, stage, "universal", folder)
        engine, *_ = zerohooks.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        return engine, GAS

    return make


def _resume_one_rank(tmp: str, runs: list[tuple[str, int]]) -> str:
    """On 1 rank: each universal checkpoint the 2-rank launch converted, resumed (its losses)."""
    out = {}
    for column, stage in runs:
        make = _universal_engine(column, stage, f"{tmp}/one/{column}-{stage}")
        resumed = universal_runs.resume(make, universal_runs.folder(tmp, column, stage))
        out[json.dumps([column, stage])] = resumed["losses"]
    return json.dumps(out)


def _launch(
    tmp_path_factory: pytest.TempPathFactory,
    world: int,
    runs: list[tuple[str, int, str | None]],
    refused: list[tuple[str, str, int]],
    timeout: float,
) -> list[dict[str, Any]]:
    """:func:`_run_all` on ``world`` ranks; each rank's findings."""
    for name in PLUGINS:
        pytest.importorskip(name)
    from zerohooks.testing import run_distributed

    tmp = str(tmp_path_factory.mktemp(f"compat{world}"))
    found = [
        json.loads(r) for r in run_distributed(_run_all, world, args=(tmp, runs, refused), timeout=timeout)
    ]
    return [{**rank, "tmp": tmp} for rank in found]


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    runs, refused = _plan()
    if any(feature == "offload_nvme" for *_, feature in runs):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        import zerohooks

        with zerohooks.route_deepspeed_op_builds():  # built (or found built) once, not in each rank
            AsyncIOBuilder().load(verbose=False)
    apart = [run for run in runs if run[0] in OWN_LAUNCH]
    main = _launch(
        tmp_path_factory, 2, [r for r in runs if r not in apart], [*refused, *LIMIT_REFUSED], timeout=1200
    )
    if apart:
        for rank, more in zip(main, _launch(tmp_path_factory, 2, apart, [], timeout=600), strict=True):
            rank["trained"].update(more["trained"])
    return main


@pytest.fixture(scope="module")
def one_rank(found: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The universal checkpoints the 2-rank launch converted, each resumed on 1 rank."""
    from zerohooks.testing import run_distributed

    tmp = found[0]["tmp"]
    runs = sorted({tuple(json.loads(k)[:2]) for k in found[0]["trained"] if json.loads(k)[2] == "universal"})
    (out,) = run_distributed(_resume_one_rank, 1, args=(tmp, runs), timeout=600)
    return dict(json.loads(out))


def test_table_is_whole() -> None:
    """Every row has every column; a trained claim names its stages; a refusal its key words."""
    for row in compat_matrix.ROWS:
        assert set(row.cells) == set(compat_matrix.COLUMNS), row.key
        assert row.key in FEATURES, row.key
        for column, cell in row.cells.items():
            assert cell.text and "\n" not in cell.text, (row.key, column)
            assert cell.tolerance >= 0.0, (row.key, column)
            if cell.kind == "refused":
                assert cell.keywords and not cell.stages, (row.key, column)
            else:
                assert cell.stages and set(cell.stages) <= {0, 1, 2, 3}, (row.key, column)


def test_readmes_show_the_table() -> None:
    bad = compat_matrix.check()
    assert not bad, f"{bad}: run python tools/compat_matrix.py --write"


def _losses(rank: dict[str, Any], column: str, stage: int, feature: str | None) -> list[float]:
    return list(rank["trained"][json.dumps([column, stage, feature])]["losses"])


def _dist(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _tolerance(rank: dict[str, Any], column: str, stage: int) -> float:
    """The plugin's own distance to plain DeepSpeed on the toy model without any feature,
    doubled, plus 1e-3: how far from plain DeepSpeed a feature may leave it."""
    return 2 * _dist(_losses(rank, column, stage, None), _losses(rank, "none", stage, None)) + 1e-3


def _spread(found: list[dict[str, Any]], column: str, stage: int) -> float:
    """How far apart the two ranks' experts ended (they start equal)."""
    e0, e1 = (rank["trained"][json.dumps([column, stage, "moe"])]["expert"] for rank in found)
    return _dist(e0, e1)


def _check_compiled(found: list[dict[str, Any]], column: str, stage: int, cell: Any) -> None:
    """A compiled cell: dynamo captured the model (the count of graphs can fail), no more graph
    breaks than plain DeepSpeed compiled; with a tolerance, as close to plain DeepSpeed compiled as
    the plugin uncompiled is to plain DeepSpeed (doubled, plus 1e-3)."""
    for rank in found:
        got = rank["trained"][json.dumps([column, stage, "compile"])]
        ds = rank["trained"][json.dumps(["none", stage, "compile"])]
        assert got["graphs"] >= 1 and ds["graphs"] >= 1, (column, stage, got, ds)
        assert got["graph_breaks"] <= ds["graph_breaks"], (column, stage, got, ds)
        if cell.tolerance > 0:
            tol = _tolerance(rank, column, stage)
            assert _dist(got["losses"], ds["losses"]) <= tol, (column, stage, got, ds, tol)


@pytest.mark.multirank
def test_trained_cells_match_their_oracle(found: list[dict[str, Any]]) -> None:
    for (row, column), cell in compat_matrix.MATRIX.items():
        if cell.kind == "refused" or row in compat_matrix.FOUR_RANK_ROWS or row == "universal":
            continue
        if row == "offload_nvme" and _nvme_params_missing():
            continue  # test_parameter_offload_to_nvme_goes_through_files says why
        for stage in cell.stages:
            for rank in found:
                got = _losses(rank, column, stage, row)
                assert all(math.isfinite(v) for v in got), (row, column, stage, got)
                if column == "nvmeswap":
                    assert got == _losses(rank, _nvme_oracle(row), stage, row), (row, stage)
                elif row in COMPARED_WITH_DEEPSPEED:
                    tol = _tolerance(rank, column, stage)
                    assert _dist(got, _losses(rank, "none", stage, row)) <= tol, (
                        row,
                        column,
                        stage,
                        got,
                        tol,
                    )
                else:
                    oracle = OWN_ORACLE.get((row, column))
                    want = (
                        _losses(rank, column, stage, _without(row))
                        if oracle is None
                        else _losses(rank, oracle, stage, row)
                    )
                    assert _dist(got, want) <= cell.tolerance, (row, column, stage, got, want)
            if row == "compile":
                _check_compiled(found, column, stage, cell)
            if row == "sp":  # the engines were sequence parallel (the oracle's too, for nvmeswap)
                for rank in found:
                    oracle = _nvme_oracle(row) if column == "nvmeswap" else OWN_ORACLE.get((row, column))
                    for col in (column, oracle) if oracle else (column,):
                        assert rank["trained"][json.dumps([col, stage, row])]["sp_size"] == 2, (col, stage)
            if row == "pipe" and column in ("mixedlayers", "all"):
                _kept_on_first_stage(found, row, column, stage)
            if row == "clip" and column != "nvmeswap":
                for rank in found:
                    ds_clip, ds = _losses(rank, "none", stage, "clip"), _losses(rank, "none", stage, None)
                    # the test can fail: clipping moves plain DeepSpeed's losses well beyond the tolerance
                    tol = _tolerance(rank, column, stage)
                    assert _dist(ds_clip, ds) > 3 * tol, (column, stage, _dist(ds_clip, ds), tol)
                    norm = rank["trained"][json.dumps([column, stage, row])]["norm"]
                    ds_norm = rank["trained"][json.dumps(["none", stage, row])]["norm"]
                    assert math.isclose(norm, ds_norm, rel_tol=0.1), (column, stage, norm, ds_norm)
            if row == "moe":
                # experts reduced within their own (one-rank) groups move apart as in plain
                # DeepSpeed; reduced across the world they would stay equal
                ds, got = _spread(found, "none", stage), _spread(found, column, stage)
                assert ds > 0 and 0.5 * ds <= got <= 2 * ds, (column, stage, got, ds)


@pytest.mark.multirank
def test_parameter_offload_to_nvme_goes_through_files(found: list[dict[str, Any]]) -> None:
    """The NVMe row's runs did swap: DeepSpeed wrote the parameters to files in each rank's folder
    (its oracle, the same plugin without offload, says nothing of that)."""
    reason = _nvme_params_missing()
    if reason is not None:
        pytest.skip(reason)
    for (row, column), cell in compat_matrix.MATRIX.items():
        if row != "offload_nvme" or cell.kind == "refused":
            continue
        for stage in cell.stages:
            for rank in found:
                run = rank["trained"][json.dumps([column, stage, row])]
                assert run["swap_files"] > 0, (column, stage, run)


@pytest.mark.multirank
def test_refused_cells_raise_our_error(found: list[dict[str, Any]]) -> None:
    for rank in found:
        for (row, column), cell in compat_matrix.MATRIX.items():
            if cell.kind != "refused" or row in compat_matrix.FOUR_RANK_ROWS:
                continue
            _check_refusal(rank["errors"][json.dumps([row, column])], row, column, cell.keywords)


def _check_refusal(message: str | None, row: str, column: str, keywords: tuple[str, ...]) -> None:
    """Our error: it names the plugin (one of them for ``all``), the cell's key words, and what
    to do instead."""
    assert message is not None, f"{row} with {column}: initialize accepted it"
    names = ("accumdtype", "mixedlayers", "loco") if column == "all" else (column,)
    assert any(n in message for n in names), (row, column, message)
    for word in keywords:
        assert word in message, (row, column, word, message)
    assert any(w in message for w in ("remove", "use ", "load a regular")), (row, column, message)


@pytest.mark.multirank
def test_universal_cells_match_their_oracle(
    found: list[dict[str, Any]], one_rank: dict[str, list[float]]
) -> None:
    """Saved on 2 ranks and converted by ``ds_to_universal``: resumed on 2 ranks, the
    uninterrupted run's losses (as plain DeepSpeed's own universal load gives; loco, whose error
    feedback restarts: the first step identical, then within the cell's tolerance of it and within
    the plugin's own distance to plain DeepSpeed, doubled plus 1e-3, of DeepSpeed's); resumed on 1 rank,
    the first step identical to rank 0's uninterrupted one (the weights were carried), the later
    steps those of 1 rank (not the 2-rank run's), within the plugin's own distance to plain
    DeepSpeed (doubled, plus 1e-3) of plain DeepSpeed's universal load on 1 rank."""
    for (row, column), cell in compat_matrix.MATRIX.items():
        if row == "universal" and cell.kind != "refused":
            universal_runs.check_cell(found, one_rank, column, cell, GAS)


@pytest.mark.multirank
def test_limits_refused_as_stated(found: list[dict[str, Any]]) -> None:
    """What a ``limit`` cell says is refused raises our error naming the plugin, the key and the fix."""
    for rank in found:
        for row, column, stage in LIMIT_REFUSED:
            message = rank["errors"][json.dumps([row, column, stage])]
            assert message is not None, f"{row} with {column} on ZeRO {stage}: initialize accepted it"
            name = "mixedlayers" if column == "all" else column.split("-")[0]
            assert name in message and "load_universal" in message, (column, message)
            assert "load a regular" in message, (column, message)


# -- the 4-rank rows (compat_matrix.FOUR_RANK_ROWS): one launch of 4 ranks for all their cells -------
PIPE_STAGES = (0, 1)
"""The ZeRO stages DeepSpeed allows pipelines on: a trained cell of a 4-rank row must be refused
by the plugin on a stage it does not claim."""
PIPE_DP_ORACLE = {
    "accumdtype": "ds-accum",
    "autocastzero": "ds-autocast",
    "loco": "none",
    "mixedlayers": "none",
    "all": "none",
}
"""Each trained column's oracle on the 4-rank pipeline: DeepSpeed's own equivalent of the plugin
(``data_types.grad_accum_dtype``, ``torch_autocast``), for loco plain bf16 DeepSpeed."""
MOE_STAGES = (1, 2)
"""The ZeRO stages DeepSpeed's native MoE layers train on (ZeRO 3 only with its AutoEP layers)."""
MOE_DP_ORACLE = {
    "accumdtype": "ds-accum@2",
    "autocastzero": "ds-autocast",
    "mixedlayers": "none",
    "loco": "none",
    "all": "none",
}
"""Each trained column's oracle on the 4-rank MoE model (2 experts, ``ep_size`` 2: each expert on
2 ranks): DeepSpeed's own equivalent of the plugin where it has one, else plain bf16 DeepSpeed;
``@2``: on ZeRO 2 whatever the cell's stage (DeepSpeed ignores ``grad_accum_dtype`` with MoE on
ZeRO 1: its losses there equal plain bf16's, so they could not tell fp32 accumulation apart)."""


def _oracle_run(oracle: str, stage: int) -> tuple[str, int]:
    """An oracle of :data:`FOUR_RANK` as (column, stage) for a cell's ``stage``."""
    col, _, at = oracle.partition("@")
    return col, int(at) if at else stage


FOUR_RANK = {"pipe_dp": (PIPE_STAGES, PIPE_DP_ORACLE), "moe_dp": (MOE_STAGES, MOE_DP_ORACLE)}
"""Each 4-rank row's ZeRO stages (a trained cell must be refused on those it does not claim) and
its columns' oracles."""


def _plan_four() -> tuple[list[tuple[str, int, str | None]], list[tuple[str, str, int, tuple[str, ...]]]]:
    """The runs of the 4-rank rows (column, stage, row), each once, and their refusals (row,
    column, stage, the words the error must contain)."""
    runs: list[tuple[str, int, str | None]] = []
    refused: list[tuple[str, str, int, tuple[str, ...]]] = []
    for row in compat_matrix.FOUR_RANK_ROWS:
        stages, oracles = FOUR_RANK[row]
        for column in compat_matrix.COLUMNS:
            cell = compat_matrix.MATRIX[(row, column)]
            if cell.kind == "refused":
                refused.append((row, column, 3 if column == "nvmeswap" else 1, cell.keywords))
                continue
            for stage in stages:
                if stage not in cell.stages:
                    refused.append((row, column, stage, ("PipelineModule", f"ZeRO {stage}")))
                    continue
                for col, st in ((column, stage), _oracle_run(oracles[column], stage)):
                    if (col, st, row) not in runs:
                        runs.append((col, st, row))
    # a pipeline engine leaves DeepSpeed's process-wide groups set for model parallelism: the
    # pipelines train last
    runs.sort(key=lambda run: run[2] == "pipe_dp")
    return runs, refused


@pytest.fixture(scope="module")
def found_four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    runs, refused = _plan_four()
    triples = [(row, column, stage) for row, column, stage, _ in refused]
    apart = [run for run in runs if run[0] in OWN_LAUNCH]
    found = _launch(tmp_path_factory, 4, [r for r in runs if r not in apart], triples, timeout=900)
    if apart:  # as in the 2-rank launch: DeepSpeed's torch_autocast engines in a launch of their own
        for rank, more in zip(found, _launch(tmp_path_factory, 4, apart, [], timeout=600), strict=True):
            rank["trained"].update(more["trained"])
    return found


def _replicas_agree(found_four: list[dict[str, Any]], row: str, col: str, stage: int) -> None:
    """The data-parallel replicas ended with the same weights: each pipeline stage's two replicas;
    on the MoE model every parameter but the experts on all 4 ranks, each expert's two replicas
    alike, and the two experts (equal at the start) apart."""
    runs = [rank["trained"][json.dumps([col, stage, row])] for rank in found_four]
    if row == "pipe_dp":
        digests: dict[int, set[str]] = {}
        for run in runs:
            digests.setdefault(run["stage_id"], set()).add(run["weights"])
        assert sorted(digests) == [0, 1], (row, col, stage, digests)
        assert all(len(d) == 1 for d in digests.values()), (row, col, stage, digests)
        return
    assert len({run["shared"] for run in runs}) == 1, (row, col, stage, [r["shared"] for r in runs])
    experts: dict[str, int] = {}
    for run in runs:
        key = json.dumps(run["expert"])
        experts[key] = experts.get(key, 0) + 1
    assert sorted(experts.values()) == [2, 2], (row, col, stage, list(experts.values()))


def _kept_on_first_stage(found: list[dict[str, Any]], row: str, column: str, stage: int) -> None:
    """mixedlayers on a pipeline: the LayerNorm's parameters fp32 on the first stage's ranks, none
    on the second's (the stages hold different numbers of param groups: the case that hung)."""
    for rank in found:
        run = rank["trained"][json.dumps([column, stage, row])]
        assert run["fp32"] == (PIPE_KEPT if run["stage_id"] == 0 else []), (row, column, stage, run)


@pytest.mark.multirank
def test_four_rank_cells_match_their_oracle(found_four: list[dict[str, Any]]) -> None:
    """Losses within the cell's tolerance of the oracle on every rank; loco's differ from plain
    DeepSpeed's (its 4-bit exchange shows, so the comparison can fail); the data-parallel
    replicas, trained on different batches, end with the same weights (their gradients were
    reduced over the data-parallel group, the experts' over the expert-data-parallel group), for
    the plugin and its oracle alike."""
    for row in compat_matrix.FOUR_RANK_ROWS:
        _stages, oracles = FOUR_RANK[row]
        for column in compat_matrix.COLUMNS:
            cell = compat_matrix.MATRIX[(row, column)]
            if cell.kind == "refused":
                continue
            for stage in cell.stages:
                oracle, at = _oracle_run(oracles[column], stage)
                for rank in found_four:
                    got, want = _losses(rank, column, stage, row), _losses(rank, oracle, at, row)
                    assert all(math.isfinite(v) for v in got), (row, column, stage, got)
                    assert _dist(got, want) <= cell.tolerance, (row, column, stage, got, want)
                    if column == "loco":
                        assert got != want, (row, column, stage, got)
                for col, st in ((column, stage), (oracle, at)):
                    _replicas_agree(found_four, row, col, st)
                if row == "pipe_dp" and column in ("mixedlayers", "all"):
                    _kept_on_first_stage(found_four, row, column, stage)


@pytest.mark.multirank
def test_four_rank_refusals_raise_our_error(found_four: list[dict[str, Any]]) -> None:
    """The refused cells, and the stages a trained cell does not claim, raise our error."""
    _, refused = _plan_four()
    assert refused
    for rank in found_four:
        for row, column, _stage, keywords in refused:
            _check_refusal(rank["errors"][json.dumps([row, column])], row, column, keywords)
