"""DeepSpeed's own checkpoint files cannot run code at resume through an engine built by zerohooks.

Real 2-rank gloo DeepSpeed engines and real checkpoint files.  Oracles: a marker file that a
forged pickle would create (it must stay absent, and an unrestricted ``torch.load`` of the same
file does create it, so the forgery is live); an uninterrupted run (the resume after the
refusals must give its losses bit for bit); DeepSpeed's own engine, built by plain
``deepspeed.initialize`` in the same process (it must still load what zerohooks refuses).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
from typing import Any

import deepspeed
import pytest
import torch
from test_statefile_trust import _Forged

import zerohooks
from zerohooks import CheckpointStateError
from zerohooks.adapter import dsfiles
from zerohooks.testing import distributed
from zerohooks.testing.toy import ds_config, make_model, train

GAS = 2


@dataclasses.dataclass
class Epoch:
    """A user's own object in ``client_state`` (the legitimate case the refusal names)."""

    number: int
    note: str


def _engine(stage: int, seed: int = 0, plain: bool = False) -> Any:
    model = make_model(seed)
    build = deepspeed.initialize if plain else zerohooks.initialize
    cfg = ds_config(stage, "bf16" if stage == 3 else "fp32", gas=GAS)
    engine, *_ = build(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _rank() -> int:
    return int(os.environ["RANK"])


def _forge(path: str, marker: str, optim: bool) -> None:
    """Rewrite DeepSpeed's file ``path`` with a pickle that would create ``marker`` when loaded."""
    sd = torch.load(path, weights_only=False)  # our own, untouched file
    (sd["optimizer_state_dict"] if optim else sd)["evil"] = _Forged(marker)
    torch.save(sd, path)


def _refused(engine: Any, folder: str, marker: str, *needles: str) -> str:
    with pytest.raises(CheckpointStateError) as info:
        engine.load_checkpoint(folder)
    message = str(info.value)
    for needle in (*needles, "io.open", "trust_checkpoint_code", "client_state"):
        assert needle in message, message
    assert not os.path.exists(marker), "the forged pickle ran"
    return message


@distributed(world_size=2)
def _forged_files(tmp: str, stage: int) -> None:
    rank = _rank()
    root = os.path.join(tmp, "ckpt")
    marker = os.path.join(tmp, "marker")  # one path: rank 0 forges, both ranks read
    engine = _engine(stage)
    train(engine, steps=1, gas=GAS)
    engine.save_checkpoint(root, tag="t")
    whole = train(engine, steps=2, gas=GAS, first=1)  # the uninterrupted run
    torch.distributed.barrier()
    folder = os.path.join(root, "t")
    models = sorted(glob.glob(os.path.join(folder, "*mp_rank_*_model_states.pt")))  # one per rank on ZeRO 3
    model_file = models[-1]
    optim_file = sorted(glob.glob(os.path.join(folder, "*zero_pp_rank_1_*optim_states.pt")))[0]
    fresh = _engine(stage, seed=1)
    for path, optim in ((model_file, False), (optim_file, True)):
        if rank == 0:
            shutil.copy(path, path + ".orig")
            _forge(path, marker, optim)
        torch.distributed.barrier()
        # every rank refuses, naming the forged file and the rank that reads it: the model file
        # is scanned by each rank, rank 1's optimizer file by rank 1 only (rank 0 never reads it)
        _refused(fresh, root, marker, path, "rank 1" if optim else f"rank {rank}")
        torch.distributed.barrier()
        if rank == 0:
            os.replace(path + ".orig", path)
    # the scan is the first line; the reader itself is weights-only too (a file swapped after
    # the scan): every rank reads the model-states file and refuses it while reading
    if rank == 0:
        for path in models:
            shutil.copy(path, path + ".orig")
            _forge(path, marker, False)
    torch.distributed.barrier()
    scan, dsfiles.scan = dsfiles.scan, lambda *_: None
    try:
        _refused(fresh, root, marker, "model_states.pt", f"(rank {rank})", "refused without running it")
    finally:
        dsfiles.scan = scan
    torch.distributed.barrier()
    # the forgery is live: an unrestricted load runs it
    torch.load(model_file, weights_only=False)
    assert os.path.exists(marker)
    torch.distributed.barrier()
    if rank == 0:
        for path in models:
            os.replace(path + ".orig", path)
    torch.distributed.barrier()
    resumed = _engine(stage, seed=2)
    path, _ = resumed.load_checkpoint(root)
    assert path is not None
    assert train(resumed, steps=2, gas=GAS, first=1) == whole
    # nothing of ours is left allowed process-wide (torch registers a few classes of its own)
    left = {f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals()}
    assert not left & set(dsfiles.DEEPSPEED_GLOBALS), left


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_forged_deepspeed_files_are_refused_and_never_run(tmp_path, stage: int) -> None:
    _forged_files(str(tmp_path), stage)


@distributed(world_size=2)
def _client_state(tmp: str) -> None:
    root = os.path.join(tmp, "ckpt")
    engine = _engine(2)
    train(engine, steps=1, gas=GAS)
    engine.save_checkpoint(root, tag="t", client_state={"epoch": Epoch(3, "warm")})
    whole = train(engine, steps=1, gas=GAS, first=1)
    fresh = _engine(2, seed=1)
    with pytest.raises(CheckpointStateError) as info:
        fresh.load_checkpoint(root)
    message = str(info.value)
    assert f"{__name__}.Epoch" in message and "client_state" in message, message
    assert "trust_checkpoint_code" in message, message
    # the documented opt-out loads the trusted folder, custom objects and all
    with zerohooks.trust_checkpoint_code():
        path, client = fresh.load_checkpoint(root)
    assert path is not None and client["epoch"] == Epoch(3, "warm")
    assert train(fresh, steps=1, gas=GAS, first=1) == whole
    assert not dsfiles.trusted()  # the context ended with the block
    # an engine of plain deepspeed.initialize in the same process is untouched: DeepSpeed's own
    # reader (weights_only=False) loads the same folder, and no reader was left replaced
    plain = _engine(2, seed=1, plain=True)
    assert zerohooks.attachment(plain) is None
    path, client = plain.load_checkpoint(root)
    assert path is not None and client["epoch"] == Epoch(3, "warm")
    assert "load" not in vars(plain.checkpoint_engine) and "load" not in vars(fresh.checkpoint_engine)
    assert train(plain, steps=1, gas=GAS, first=1) == whole


@pytest.mark.multirank
def test_client_state_objects_need_the_opt_out_and_plain_deepspeed_is_untouched(tmp_path) -> None:
    _client_state(str(tmp_path))


def test_allowlist_names_real_deepspeed_classes() -> None:
    """Every allowed name resolves to a class of the installed DeepSpeed (a renamed class would
    otherwise make every checkpoint of that kind unloadable)."""
    for name in dsfiles.DEEPSPEED_GLOBALS:
        cls = dsfiles._resolve(name)
        assert isinstance(cls, type) and f"{cls.__module__}.{cls.__qualname__}" == name


def _kinds(which: str) -> list[tuple[int, str, bool, dict[str, Any] | None, bool]]:
    """(stage, dtype, CPU offload, plugin sections, WarmupLR scheduler) of every checkpoint kind
    the allowlist was made from."""
    if which == "deepspeed":
        return [
            (stage, dtype, offload, None, dtype != "fp32")
            for stage in (0, 1, 2, 3)
            for dtype in ("fp32", "bf16", "fp16")
            for offload in ((False, True) if stage else (False,))
        ]
    sections: list[tuple[str, dict[str, Any]]] = [
        ("bf16", {"loco": {"kernels": "reference"}}),
        ("bf16", {"accumdtype": {"dtype": "fp32"}}),
        ("fp32", {"autocastzero": {"dtype": "fp16"}}),
        ("bf16", {"mixedlayers": {"fp32_modules": ["fc2"]}}),
    ]
    return [(stage, dtype, False, section, True) for stage in (0, 1, 2, 3) for dtype, section in sections]


@distributed(world_size=2, timeout=1200, fp16_on_cpu=True)
def _every_kind(tmp: str, which: str) -> None:
    reads = []
    make = dsfiles._weights_only_load

    def counted(allowed: list[Any], rank: int, mmap: bool, *limit: int) -> Any:
        load = make(allowed, rank, mmap, *limit)

        def spy(path: str, map_location: Any = None) -> Any:
            reads.append(path)
            return load(path, map_location)

        return spy

    dsfiles._weights_only_load = counted
    for i, (stage, dtype, offload, sections, scheduler) in enumerate(_kinds(which)):
        extra = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}} if scheduler else {}

        def build(seed: int) -> Any:
            model = make_model(seed)
            cfg = ds_config(stage, dtype, offload, GAS, sections=sections, **extra)  # noqa: B023
            return zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

        root = os.path.join(tmp, f"kind{i}")
        engine = build(0)
        train(engine, steps=1, gas=GAS)
        engine.save_checkpoint(root, tag="t", client_state={"epoch": 3})
        whole = train(engine, steps=1, gas=GAS, first=1)
        before = len(reads)
        resumed = build(1)
        path, client = resumed.load_checkpoint(root)
        assert path is not None and client["epoch"] == 3
        assert len(reads) > before, "DeepSpeed's files were not read by the weights-only reader"
        assert train(resumed, steps=1, gas=GAS, first=1) == whole, (stage, dtype, offload, sections)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(
    os.environ.get("ZEROHOOKS_LONG_TESTS") != "1", reason="a long sweep: ZEROHOOKS_LONG_TESTS=1"
)
@pytest.mark.parametrize("which", ["deepspeed", "plugins"])
def test_every_checkpoint_kind_loads_weights_only_and_resumes_exactly(tmp_path, which: str) -> None:
    """ZeRO 0-3 x fp32/bf16/fp16 x CPU offload with a scheduler, and each plugin on ZeRO 0-3:
    DeepSpeed's files all pass the weights-only reader, and the resume is bit-exact (about 40 s
    each on 2 cores, hence slow)."""
    if which == "plugins":
        for name in ("loco", "accumdtype", "autocastzero", "mixedlayers"):
            pytest.importorskip(name)
    _every_kind(str(tmp_path), which)
