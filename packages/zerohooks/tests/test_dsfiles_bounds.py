"""Reads of DeepSpeed's checkpoint files are bounded before they allocate (issue #33, items 4, 5, 9).

Real files, written by ``torch.save`` and by real 2-rank gloo DeepSpeed engines (ZeRO 2, fp16 for
the loss scaler), then forged as an attacker with write access to the tag folder would:

* an 8 KB model-states file whose ``client_state`` is ``bytearray(1_500_000_000)`` (a pickle
  calling ``bytearray(n)``: torch's weights-only unpickler allows it);
* an optimizer-state file whose storage is a deflated zip member of ~1 MB expanding to 1.3 GiB;
* a tensor view larger than its storage (torch fails on it with a bare ``RuntimeError``);
* a FIFO at the name DeepSpeed reads (must be refused at once, never opened for a blocking read),
  and a FIFO and a 1 MB "bomb" ``junk.pt`` DeepSpeed never reads (must not be opened at all);
* huge strings and deep nesting in ``client_state``;
* DeepSpeed's ``DynamicLossScaler`` with an injected attribute or a mistyped field (before: it
  loaded and the next step failed with a ``TypeError``).

Oracles: a refusal naming the file and the rank; the loading process's peak memory
(``ru_maxrss``) grows by less than 200 MiB where the bomb would take over 1 GiB; the time; the
forged constructs are live (an unbounded weights-only load of a small version of the same forgery
builds it); the resume from the restored files is bit-exact against an uninterrupted run.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import resource
import shutil
import time
import zipfile
from typing import Any

import pytest
import torch

import zerohooks
from zerohooks import CheckpointStateError
from zerohooks.adapter import dsfiles, pickscan
from zerohooks.testing import distributed
from zerohooks.testing.toy import ds_config, make_model, train

GAS = 2
BOMB = 1_500_000_000
"""The bytearray the forged client_state asks for (issue #33)."""
EXPANDED = 1_300 << 20
"""What the deflated storage of the forged optimizer file expands to (issue #33: 1.3 GiB)."""
MEMORY_SLACK = 200 << 20
"""Peak-memory growth allowed while a bomb is refused (each bomb is over 1 GiB)."""


class _Bytearray:
    """Pickles as ``bytearray(n)``: a few bytes in the file, ``n`` bytes when loaded."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple[Any, ...]:
        return (bytearray, (self.n,))


class _View:
    """Pickles as a dense tensor of ``numel`` elements over a 3-element storage."""

    def __init__(self, numel: int) -> None:
        self.numel = numel

    def __reduce__(self) -> tuple[Any, ...]:
        storage = torch.zeros(3).untyped_storage()
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True)
        args = (typed, 0, (self.numel,), (1,), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _check(data: bytes, max_bytes: int = 64 << 20) -> str | None:
    try:
        pickscan.check_zip(io.BytesIO(data), len(data), pickscan.Limits(max_bytes=max_bytes))
    except pickscan.Refused as e:
        return str(e)
    return None


class _Storage:
    """Stands for storage '0' in :func:`_pickle_for`."""


class _Tensor:
    def __init__(self, storage: _Storage, numel: int) -> None:
        self.storage, self.numel = storage, numel

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.storage, 0, (self.numel,), (1,), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


def _pickle_for(numel: int) -> bytes:
    """The data.pkl torch.save writes for ``{"exp_avg": <float32 tensor of numel elements in
    storage '0'>}``, made without allocating the tensor."""
    storage = _Storage()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.FloatStorage, "0", "cpu", numel) if obj is storage else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"exp_avg": _Tensor(storage, numel)})
    return buf.getvalue()


_MADE: dict[int, str] = {}


def _deflated_tensor(path: str, expanded: int = EXPANDED) -> None:
    """A torch.save file of one float32 tensor whose storage record is deflated: about 1 MB on
    disk per GiB, ``expanded`` bytes when torch reads it (made once per process, then copied)."""
    if expanded in _MADE and os.path.exists(_MADE[expanded]):
        shutil.copy(_MADE[expanded], path)
        return
    _MADE[expanded] = path + ".made"
    _write_deflated(_MADE[expanded], expanded)
    shutil.copy(_MADE[expanded], path)


def _write_deflated(path: str, expanded: int) -> None:
    with zipfile.ZipFile(io.BytesIO(_saved({"exp_avg": torch.zeros(4)}))) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    chunk = bytes(64 << 20)
    with zipfile.ZipFile(path, "w") as out:
        for name, data in members:
            if name.endswith("/data/0"):
                info = zipfile.ZipInfo(name)
                info.compress_type = zipfile.ZIP_DEFLATED
                with out.open(info, "w", force_zip64=True) as w:
                    for _ in range(expanded // len(chunk)):
                        w.write(chunk)
                    w.write(bytes(expanded % len(chunk)))
            else:
                out.writestr(name, _pickle_for(expanded // 4) if name.endswith("/data.pkl") else data)


# ----------------------------------------------------------------- files alone (fast, 1 process)


def test_allocating_pickles_are_refused_before_they_allocate(tmp_path) -> None:
    """Each forgery refused by the opcode walk, naming what it holds; peak memory unchanged;
    each is live (a small version loads through torch's weights-only unpickler)."""
    # the forgeries are live: torch's weights-only reader builds them
    small = torch.load(io.BytesIO(_saved({"c": _Bytearray(1000)})), weights_only=True)
    assert small["c"] == bytearray(1000)
    # (a view past its storage: torch's storages from a file cannot grow, so torch fails later
    # with a bare RuntimeError; refused here first, naming it)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(io.BytesIO(_saved({"t": _View(1000)})), weights_only=True)
    deep: Any = []
    for _ in range(200):
        deep = [deep]
    before = _maxrss()
    start = time.perf_counter()
    cases = {
        "bytearray": ({"client_state": _Bytearray(BOMB)}, "calls builtins.bytearray"),
        "view": ({"t": _View(10**9)}, "from a storage of 12 bytes"),
        "string": ({"s": "x" * (17 << 20)}, "a str of 17.00 MiB"),
        "nesting": ({"d": deep}, "deeper than 64"),
        "legacy storage": ({"s": _Legacy(BOMB)}, "calls torch.FloatStorage"),
    }
    for name, (obj, needle) in cases.items():
        data = _saved(obj)
        found = _check(data)
        assert found is not None and needle in found, (name, found)
        if name == "bytearray":
            assert len(data) < 8192, len(data)  # the 8 KB file
    assert time.perf_counter() - start < 10
    assert _maxrss() - before < MEMORY_SLACK
    # what DeepSpeed's files hold passes: tensors, views, parameters, plain data
    good = {
        "a": torch.ones(3, 4)[1:],
        "t": torch.ones(3, 4).t(),
        "p": torch.nn.Parameter(torch.ones(2)),
        "e": torch.empty(0),
        "plain": [1, 2.0, "x", None, True, {1, 2}, torch.Size([3]), torch.bfloat16],
        "od": collections.OrderedDict(w=torch.zeros(2, dtype=torch.bfloat16)),
    }
    assert _check(_saved(good)) is None


class _Legacy:
    """Pickles as ``torch.FloatStorage(n)`` (a legacy constructor in torch's allowlist)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch.FloatStorage, (self.n,))


def test_deflated_storage_and_file_size_are_capped(tmp_path) -> None:
    # the forgery is live: a small one loads through torch's weights-only reader, expanded
    small = str(tmp_path / "small.pt")
    _deflated_tensor(small, 8 << 20)
    assert os.path.getsize(small) < 64 << 10
    assert torch.load(small, weights_only=True)["exp_avg"].numel() == 2 << 20
    path = str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _deflated_tensor(path)
    assert os.path.getsize(path) < 2 << 20  # about 1.3 MB on disk
    with zipfile.ZipFile(path) as z:
        assert max(i.file_size for i in z.infolist()) == EXPANDED  # what torch would allocate
    before = _maxrss()
    start = time.perf_counter()
    fd, st = pickscan.open_regular(path)
    with os.fdopen(fd, "rb") as f, pytest.raises(pickscan.Refused, match=r"compressed .* -> 1300\.00 MiB"):
        pickscan.check_zip(f, st.st_size, pickscan.Limits(max_bytes=16 << 30))
    # stored members count too: a file, or members, larger than the engine's cap are refused
    stored = str(tmp_path / "stored.pt")
    torch.save({"exp_avg": torch.zeros(2 << 20)}, stored)
    with (
        open(stored, "rb") as f,
        pytest.raises(pickscan.Refused, match=r"it is 8\.\d+ MiB, over the 4\.00 MiB"),
    ):
        pickscan.check_zip(f, os.path.getsize(stored), pickscan.Limits(max_bytes=4 << 20))
    assert time.perf_counter() - start < 5
    assert _maxrss() - before < MEMORY_SLACK


def test_fifo_and_links_are_refused_at_once(tmp_path) -> None:
    fifo = str(tmp_path / "mp_rank_00_model_states.pt")
    os.mkfifo(fifo)
    start = time.perf_counter()
    with pytest.raises(pickscan.Refused, match=r"not a regular file \(mode p"):
        pickscan.open_regular(fifo)
    os.symlink(fifo, str(tmp_path / "link.pt"))
    with pytest.raises(pickscan.Refused, match=r"symbolic link"):
        pickscan.open_regular(str(tmp_path / "link.pt"))
    assert time.perf_counter() - start < 1


def test_loss_scaler_attributes_are_checked() -> None:
    """DeepSpeed's loss scalers as they come out of a file: extra or mistyped attributes refused,
    naming them; genuine ones pass."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    classes = [DynamicLossScaler, LossScaler]
    scaler = DynamicLossScaler(
        init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )
    pickscan.check_loaded({"loss_scaler": scaler, "s": LossScaler(4)}, classes)
    back = torch.load(io.BytesIO(_saved({"ls": scaler})), weights_only=True, **_safe(classes))
    pickscan.check_loaded(back, classes)
    limits = pickscan.Limits(max_bytes=1 << 20)

    def scan(obj: Any) -> None:
        data = _saved(obj)
        pickscan.check_zip(io.BytesIO(data), len(data), limits, classes)

    scan({"loss_scaler": scaler, "s": LossScaler(4)})
    scaler.injected = "x"
    # refused from the pickle, before the object is built, and after loading too
    with pytest.raises(pickscan.Refused, match=r"DynamicLossScaler an attribute 'injected' it does not have"):
        scan({"loss_scaler": scaler})
    with pytest.raises(
        pickscan.Refused, match=r"DynamicLossScaler with an attribute 'injected' it does not have"
    ):
        pickscan.check_loaded({"loss_scaler": scaler}, classes)
    del scaler.injected
    scaler.cur_scale = "65536"
    with pytest.raises(pickscan.Refused, match=r"'cur_scale' that is a builtins.str, not int/float"):
        scan({"loss_scaler": scaler})
    with pytest.raises(pickscan.Refused, match=r"'cur_scale' is a builtins.str, not int/float"):
        pickscan.check_loaded({"loss_scaler": scaler}, classes)
    # the attack is live: DeepSpeed's own scaler then fails at its next use with a TypeError
    with pytest.raises(TypeError):
        scaler.update_scale(False)
        scaler.cur_scale * 2.0 + 1


def _safe(classes: list[Any]) -> dict[str, Any]:
    torch.serialization.add_safe_globals(classes)
    return {}


# ------------------------------------------------------- real 2-rank ZeRO 2 engines through zerohooks


def _engine(seed: int, dtype: str = "fp32") -> Any:
    model = make_model(seed)
    cfg = ds_config(2, dtype, gas=GAS)
    return zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _refused(engine: Any, root: str, *needles: str) -> tuple[str, float, int]:
    before, start = _maxrss(), time.perf_counter()
    with pytest.raises(CheckpointStateError) as info:
        engine.load_checkpoint(root)
    took, grew = time.perf_counter() - start, _maxrss() - before
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert grew < MEMORY_SLACK, f"peak memory grew by {grew >> 20} MiB: {message}"
    return message, took, grew


def _replace(path: str, make: Any) -> None:
    """Rank 0 replaces ``path`` with what ``make(original_dict)`` returns (saved by torch.save),
    or ``make(path)`` writes itself when it returns None; the original kept at ``path.orig``."""
    shutil.copy(path, path + ".orig")
    sd = torch.load(path, weights_only=False)  # our own, untouched file
    out = make(sd)
    if out is not None:
        torch.save(out, path)


@distributed(world_size=2, timeout=900, fp16_on_cpu=True)
def _bombs(tmp: str, dtype: str) -> None:
    rank = int(os.environ["RANK"])
    root = os.path.join(tmp, "ckpt")
    folder = os.path.join(root, "t")
    engine = _engine(0, dtype)
    train(engine, steps=1, gas=GAS)
    engine.save_checkpoint(root, tag="t", client_state={"epoch": 3})
    whole = train(engine, steps=2, gas=GAS, first=1)
    torch.distributed.barrier()
    model = os.path.join(folder, "mp_rank_00_model_states.pt")
    prefix = "bf16_" if dtype == "bf16" else ""
    optim1 = os.path.join(folder, f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt")
    fresh = _engine(1, dtype)
    timings = {}

    def attack(name: str, path: str, forge: Any, *needles: str, readers: tuple[int, ...] = (0, 1)) -> None:
        if rank == 0:
            forge(path)
        torch.distributed.barrier()
        who = "rank 1" if readers == (1,) else f"rank {rank}"
        _, took, _ = _refused(fresh, root, path, who, *needles)
        timings[name] = took
        torch.distributed.barrier()
        if rank == 0:
            if os.path.lexists(path):
                os.unlink(path)
            os.replace(path + ".orig", path)
        torch.distributed.barrier()

    def client(value: Any) -> Any:
        def forge(path: str) -> None:
            _replace(path, lambda sd: {**sd, "epoch": value})

        return forge

    # 8 KB of pickle asking for bytearray(1.5e9), returned in client_state
    attack("bytearray", model, client(_Bytearray(BOMB)), "calls builtins.bytearray")
    attack("view", model, client(_View(BOMB)), "from a storage of 12 bytes")
    deep: Any = []
    for _ in range(100):
        deep = [deep]
    attack("nesting", model, client(deep), "deeper than 64")

    def fifo(path: str) -> None:
        shutil.copy(path, path + ".orig")
        os.unlink(path)
        os.mkfifo(path)

    # a FIFO at rank 1's optimizer file: rank 1 refuses it at once; rank 0 never reads it
    attack("fifo", optim1, fifo, "not a regular file", readers=(1,))

    def deflated(path: str) -> None:
        shutil.copy(path, path + ".orig")
        _deflated_tensor(path)

    attack("deflated", optim1, deflated, "compressed", readers=(1,))
    if dtype == "fp16":
        loss_scaler = os.path.join(folder, "zero_pp_rank_1_mp_rank_00_optim_states.pt")

        def inject(path: str) -> None:
            def change(sd: dict[str, Any]) -> dict[str, Any]:
                sd["optimizer_state_dict"]["loss_scaler"].cur_scale = "65536"
                return sd

            _replace(path, change)

        attack("loss scaler", loss_scaler, inject, "'cur_scale' that is a builtins.str", readers=(1,))
    # files DeepSpeed never reads are never opened: a FIFO and a bomb named junk.pt
    if rank == 0:
        os.mkfifo(os.path.join(folder, "fifo.pt"))
        _deflated_tensor(os.path.join(folder, "junk.pt"))
    torch.distributed.barrier()
    assert os.path.join(folder, "junk.pt") not in dsfiles._files(folder, fresh, rank)
    resumed = _engine(2, dtype)
    before, start = _maxrss(), time.perf_counter()
    path, client_state = resumed.load_checkpoint(root)
    took = time.perf_counter() - start
    assert path is not None and client_state["epoch"] == 3
    assert _maxrss() - before < MEMORY_SLACK and took < 60, (took, _maxrss() - before)
    assert train(resumed, steps=2, gas=GAS, first=1) == whole
    assert all(t < 30 for t in timings.values()), timings


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_memory_bombs_and_fifos_in_deepspeed_files_are_refused_per_rank(tmp_path, dtype: str) -> None:
    """Real 2-rank ZeRO 2 engines: every attack refused on the ranks that read the file, fast and
    without the memory it asks for; junk.pt and a FIFO DeepSpeed never reads are not opened; the
    restored checkpoint resumes bit for bit."""
    _bombs(str(tmp_path), dtype)
