"""Checkpoints with plugin state are all or nothing, checked, and fail clearly.

* a rank that dies between DeepSpeed's write and zerohooks' leaves ``latest`` on the previous
  checkpoint, and resuming from ``latest`` continues bit for bit like the run that was never
  interrupted (the oracle: its losses after that checkpoint);
* a rank that fails its write makes every rank raise the same error naming it, and the save
  commits nothing; ``save_latest=False`` never moves ``latest``; without plugin state the save is
  DeepSpeed's;
* a damaged, truncated or foreign state file is a ``CheckpointStateError`` on every rank naming
  the file and the rank (the oracle for "damaged": the flipped payload still unpickles, so without
  the checksum it would load silently); format-1 files load with a warning;
* a forged state file (a pickle that would create a file, with its checksum recomputed, or as a
  format-1 file) is refused on every rank and never runs; so is plain data of another shape;
* ``load_optimizer_states=False`` loads the weights, warns once and leaves the plugins fresh;
* a full file system is a ``CheckpointDiskFullError`` (errno ENOSPC) and the previous checkpoint
  still resumes exactly.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import subprocess
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerohooks
from zerohooks import CheckpointDiskFullError, CheckpointSaveError, CheckpointStateError, ZeroPlugin
from zerohooks.adapter import checkpoint as ckpt
from zerohooks.adapter import statefile
from zerohooks.testing import MultiRankError, distributed, run_distributed
from zerohooks.testing.toy import ds_config, make_model, train

GAS = 2
STAGE = 2


class FeedbackPlugin(ZeroPlugin):
    """A plugin with rank-local state that changes training: each micro-step's gradient gets half
    of the previous one added (an error-feedback stand-in), so a resume without its state, or
    with a damaged one, gives other losses."""

    name = "feedback"
    distribution = "test"

    def __init__(self) -> None:
        super().__init__(self.Config())
        self.names: dict[int, str] = {}
        self.err: dict[str, torch.Tensor] = {}
        self.loaded = False

    def attach(self, registry: Any, ctx: Any) -> None:
        registry.register_prepare_model(self._prepare, name=self.name)
        registry.register_micro_step_grad(self._grad, name=self.name)
        registry.register_state(self, name=self.name)

    def _prepare(self, model: torch.nn.Module, ctx: Any) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}

    def _grad(self, param: torch.nn.Parameter, ctx: Any) -> None:
        if param.grad is None:
            return
        name = self.names[id(param)]
        previous = self.err.get(name)
        self.err[name] = 0.5 * param.grad.detach().clone()
        if previous is not None:
            param.grad.add_(previous)

    def state_dict(self) -> dict[str, Any]:
        return {"err": {k: v.clone() for k, v in self.err.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.err = {k: v.clone() for k, v in state["err"].items()}
        self.loaded = True


def _engine(seed: int = 0, plugin: bool = True) -> tuple[Any, FeedbackPlugin | None]:
    p = FeedbackPlugin() if plugin else None
    model = make_model(seed)
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(STAGE), plugins=[p] if p else []
    )
    return engine, p


def _rank() -> int:
    return int(os.environ["RANK"])


def _latest(root: str) -> str | None:
    return statefile.read_latest(root)


@contextlib.contextmanager
def _failing_state_write(ranks: tuple[int, ...], action: Any):
    """Make ``action()`` run instead of the plugin-state write on ``ranks`` (after DeepSpeed's
    write, before zerohooks')."""
    original = ckpt._write_state

    def write(att: Any, save_dir: str, tag: str) -> str:
        if _rank() in ranks:
            action()
        return original(att, save_dir, tag)

    ckpt._write_state = write
    try:
        yield
    finally:
        ckpt._write_state = original


# ---- a rank dies between DeepSpeed's write and ours -----------------------------------------------


def _crash_while_saving(root: str) -> None:
    engine, _ = _engine()
    train(engine, 2, GAS)
    engine.save_checkpoint(root, tag="A")
    after_a = train(engine, 2, GAS, first=2)  # the uninterrupted run: the oracle of the resume
    with open(os.path.join(root, f"oracle{_rank()}.json"), "w") as f:
        json.dump(after_a, f)
    dist.barrier()
    with _failing_state_write((1,), lambda: os._exit(17)):
        engine.save_checkpoint(root, tag="B")
    raise AssertionError("the save of B went on although rank 1 died")


def _resume_and_fail_cleanly(root: str) -> dict[str, Any]:
    rank = _rank()
    engine, plugin = _engine(seed=7)
    path, _ = engine.load_checkpoint(root)
    assert path is not None and os.path.basename(os.path.dirname(path)) == "A", path
    assert plugin is not None and plugin.loaded
    with open(os.path.join(root, f"oracle{rank}.json")) as f:
        oracle = json.load(f)
    assert train(engine, 2, GAS, first=2) == oracle  # bit for bit

    # rank 1 fails its plugin-state write: every rank raises the same error, naming it
    def fail() -> None:
        raise OSError(errno.EIO, "injected write failure")

    with _failing_state_write((1,), fail), pytest.raises(CheckpointSaveError) as failed:
        engine.save_checkpoint(root, tag="C")
    assert not isinstance(failed.value, CheckpointDiskFullError)
    message = str(failed.value)
    assert "rank(s) [1] failed" in message and "injected write failure" in message, message
    assert "'latest' still names the previous checkpoint 'A'" in message, message
    assert _latest(root) == "A"
    assert not os.path.exists(statefile.state_file(root, "C", rank))  # the half-saved state is gone
    # loading the incomplete checkpoint by its tag is refused on every rank
    other, other_plugin = _engine(seed=3)
    with pytest.raises(CheckpointStateError) as refused:
        other.load_checkpoint(root, tag="C")
    assert "save did not complete" in str(refused.value) and other_plugin is not None
    assert not other_plugin.loaded

    # DeepSpeed's own write fails on rank 1 only (rank 0's completes): every rank raises, naming it
    writer = engine.checkpoint_engine
    if rank == 1:

        def broken(state: Any, path: str) -> None:
            raise RuntimeError("injected DeepSpeed write failure")

        writer.save = broken
    try:
        with pytest.raises(CheckpointSaveError, match=r"rank 1: DeepSpeed's save: .*injected DeepSpeed"):
            engine.save_checkpoint(root, tag="C2")
    finally:
        writer.__dict__.pop("save", None)
    assert _latest(root) == "A" and not os.path.exists(statefile.state_file(root, "C2", rank))

    # a save that succeeds commits; save_latest=False never moves 'latest'
    engine.save_checkpoint(root, tag="D")
    assert _latest(root) == "D"
    engine.save_checkpoint(root, tag="E", save_latest=False)
    assert _latest(root) == "D" and os.path.exists(statefile.state_file(root, "E", rank))
    assert not [f for f in os.listdir(root) if ".tmp" in f]

    # without plugin state the save is DeepSpeed's own: no state file, 'latest' as DeepSpeed writes it
    plain, _ = _engine(plugin=False)
    plain_dir = os.path.join(root, "plain")
    plain.save_checkpoint(plain_dir, tag="P")
    with open(os.path.join(plain_dir, "latest"), "rb") as f:
        assert f.read() == b"P"
    assert not os.path.exists(statefile.state_file(plain_dir, "P", rank))
    return {"save": message, "load": str(refused.value)}


@pytest.mark.multirank
def test_crash_between_writes_keeps_latest_on_the_previous_checkpoint(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    with pytest.raises(MultiRankError) as crashed:
        run_distributed(_crash_while_saving, 2, args=(root,))
    # rank 1 died; rank 0 either waited for it or learnt that it was gone, and did not go on
    assert "went on although" not in str(crashed.value), crashed.value
    assert _latest(root) == "A"
    b = os.path.join(root, "B")
    assert any(f.endswith("optim_states.pt") for f in os.listdir(b))  # DeepSpeed had written B
    assert not os.path.exists(statefile.state_file(root, "B", 1))
    # a fresh process group resumes from 'latest'
    first, second = run_distributed(_resume_and_fail_cleanly, 2, args=(root,))
    assert first == second  # the same error on every rank


# ---- damaged state files ----------------------------------------------------------------------------


def _expect_refused(engine: Any, plugin: FeedbackPlugin, root: str, path: str, case: str) -> None:
    with pytest.raises(CheckpointStateError) as info:
        engine.load_checkpoint(root, tag="t")
    message = str(info.value)
    assert path in message and "rank 1" in message, (case, message)
    assert not plugin.loaded, case  # no rank applied anything


def _damage(path: str, original: bytes, data: bytes | None) -> None:
    """Rank 0 replaces rank 1's file (``data``; None restores it); every rank then sees it."""
    if _rank() == 0:
        with open(path, "wb") as f:
            f.write(original if data is None else data)
    dist.barrier()


def _check_damaged_files_are_refused(root: str) -> None:
    engine, plugin = _engine()
    train(engine, 2, GAS)
    engine.save_checkpoint(root, tag="t")
    assert plugin is not None
    saved = plugin.state_dict()
    path = statefile.state_file(root, "t", 1)
    with open(path, "rb") as f:
        original = f.read()
    loader, fresh = _engine(seed=3)
    assert fresh is not None

    # one flipped bit in an error-feedback value: the payload still unpickles (the silent load
    # this checksum exists for), yet loading is refused
    body = statefile.verify_file(path, 1)
    assert body is not None
    needle = saved["err"]["fc2.bias"].numpy().tobytes()
    if _rank() == 1:  # rank 1's own state is the one in the file
        at = original.find(needle)
        assert at > 0 and original.count(needle) == 1
        flipped = bytearray(original)
        flipped[at + 1] ^= 0x01
        start = len(original) - len(body)
        silent = torch.load(io.BytesIO(bytes(flipped[start:])), weights_only=True)
        assert not torch.equal(silent["states"]["feedback"]["err"]["fc2.bias"], saved["err"]["fc2.bias"])
        box = [bytes(flipped)]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=1)
    flipped_file = box[0]
    cut = len(original) // 2
    cases = {
        "one flipped bit in a value": flipped_file,
        "a flipped byte in the header": original[:20] + bytes([original[20] ^ 0xFF]) + original[21:],
        "truncated": original[:cut],
        "truncated header": original[:10],
        "empty": b"",
        "not a zerohooks file": b"hello, this is not a checkpoint\n" * 8,
        "another torch file": _torch_bytes({"weights": torch.zeros(3)}),
    }
    for case, data in cases.items():
        _damage(path, original, data)
        _expect_refused(loader, fresh, root, path, case)

    # forged files: a pickle that would create a marker file, with a recomputed checksum (format 2)
    # and as a format-1 file; foreign plain data; wrong shapes. Each refused, the marker never made
    marker = os.path.join(root, f"forged-ran-{_rank()}")
    good = torch.load(io.BytesIO(body), weights_only=True)
    forged = {
        **good,
        "states": {"feedback": {"err": good["states"]["feedback"]["err"], "x": _Forged(marker)}},
    }
    forged_cases = {
        "forged pickle, checksum recomputed": (_forge(forged), "replaced or forged"),
        "forged format-1 pickle": (
            _torch_bytes({**forged, "format": 1}),
            "python -m zerohooks.convert_state",
        ),
        "a torch.dtype in the payload": (
            _forge({**good, "states": {"feedback": {"err": {}, "dtype": torch.float32}}}),
            "torch.dtype",
        ),
        "states not a dict": (_forge({**good, "states": [1, 2]}), "'states' is a list"),
        "a plugin state of the wrong shape": (
            _forge({**good, "states": {"feedback": {"err": [1, 2]}}}),
            "a plugin refused",
        ),
    }
    for case, (data, words) in forged_cases.items():
        _damage(path, original, data)
        with pytest.raises(CheckpointStateError) as info:
            loader.load_checkpoint(root, tag="t")
        message = str(info.value)
        assert path in message and "rank 1" in message and words in message, (case, message)
        if case != "a plugin state of the wrong shape":  # applied on rank 0, refused on rank 1
            assert not fresh.loaded, case
        assert not os.path.exists(marker), case  # the forged pickle never ran
        fresh.loaded = False

    # a format-1 file (no checksum, written by an older zerohooks) loads, with a warning
    legacy = torch.load(io.BytesIO(original[len(original) - len(body) :]), weights_only=False)
    legacy["format"] = statefile.LEGACY_FORMAT
    _damage(path, original, _torch_bytes(legacy))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_checkpoint(root, tag="t")
    assert fresh.loaded
    old = [w for w in caught if "format 1" in str(w.message)]
    assert len(old) == (1 if _rank() == 1 else 0), [str(w.message) for w in caught]
    for k, v in saved["err"].items():
        assert torch.equal(fresh.err[k], v), k
    # a damaged format-1 file is refused like any other
    fresh.loaded = False
    _damage(path, original, _torch_bytes(legacy)[:200])
    _expect_refused(loader, fresh, root, path, "truncated format-1 file")


class _Forged:
    """What an attacker puts in a pickle: unpickling it would create the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _forge(payload: dict[str, Any]) -> bytes:
    """A format-2 state file holding any ``payload``, its checksum recomputed as a forger would."""
    body = _torch_bytes(payload)
    header = {"format": 2, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    return statefile.MAGIC + json.dumps(header).encode() + b"\n" + body


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_every_single_bit_flip_is_detected(tmp_path) -> None:
    """Oracle: the file as written; every one-bit change anywhere in it is refused."""
    payload = {"format": statefile.FORMAT, "states": {"x": {"t": torch.arange(16.0)}}, "world_size": 1}
    data = statefile.encode(payload)
    path = str(tmp_path / "s.pt")
    statefile.write_state(path, payload, 0)
    with open(path, "rb") as f:
        assert f.read() == data
    assert torch.equal(statefile.read_state(path, 0)["states"]["x"]["t"], torch.arange(16.0))
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 1 << (i % 8)
        with open(path, "wb") as f:
            f.write(bad)
        with pytest.raises(CheckpointStateError, match=r"rank 0"):
            statefile.read_state(path, 0)


def test_full_disk_is_recognised() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    assert ckpt._is_disk_full(full, 10**12)
    wrapped = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert ckpt._is_disk_full(wrapped, 4096) and not ckpt._is_disk_full(wrapped, 10**12)
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("basic_ios::clear: iostream error") from e
    except RuntimeError as e:
        assert ckpt._is_disk_full(e, 10**12)
    assert not ckpt._is_disk_full(ValueError("bad value"), 0)
    err = ckpt._save_error({1: "disk full (0 bytes free) during x: y"}, "/ck", "B", "A")
    assert isinstance(err, OSError) and isinstance(err, CheckpointSaveError) and err.errno == errno.ENOSPC
    assert err.filename == "/ck" and "'A', which is intact" in str(err)


# ---- load_optimizer_states=False ------------------------------------------------------------------


def _check_weights_only_load(root: str) -> None:
    engine, _ = _engine()
    train(engine, 2, GAS)
    engine.save_checkpoint(root, tag="t")
    weights = [p.detach().clone() for p in engine.module.parameters()]
    path = statefile.state_file(root, "t", _rank())
    with open(path, "wb") as f:
        f.write(b"damaged")  # not even read in this mode
    dist.barrier()
    other, plugin = _engine(seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, _ = other.load_checkpoint(root, tag="t", load_optimizer_states=False)
    assert loaded is not None and plugin is not None
    assert all(torch.equal(a, b) for a, b in zip(other.module.parameters(), weights, strict=True))
    assert not plugin.loaded and plugin.err == {} and zerohooks.step_context(other).micro_step == 0
    said = [w for w in caught if "load_optimizer_states=False" in str(w.message)]
    assert len(said) == (1 if _rank() == 0 else 0), [str(w.message) for w in caught]
    assert "fresh state" in str(said[0].message) if said else True
    train(other, 1, GAS, first=2)  # and it trains on
    assert plugin.err


@pytest.mark.multirank
@distributed(world_size=2)
def test_damaged_state_is_refused_and_weights_only_loads_start_fresh(tmp_path) -> None:
    box = [str(tmp_path) if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # each rank has its own tmp_path: use rank 0's
    _check_damaged_files_are_refused(os.path.join(box[0], "damaged"))
    _check_weights_only_load(os.path.join(box[0], "weights_only"))


# ---- a full file system -----------------------------------------------------------------------------


def _fill(root: str, leave: int) -> None:
    """Fill the file system of ``root`` until ``leave`` bytes are free (rank 0)."""
    import shutil

    if _rank() == 0:
        free = shutil.disk_usage(root).free
        with open(os.path.join(root, "filler"), "wb") as f:
            f.write(b"\0" * max(0, free - leave))
    dist.barrier()


def _disk_full_run(root: str) -> None:
    rank = _rank()
    engine, _ = _engine()
    train(engine, 2, GAS)
    engine.save_checkpoint(root, tag="A")
    size = sum(e.stat().st_size for e in os.scandir(os.path.join(root, "A")))
    after_a = train(engine, 2, GAS, first=2)
    _fill(root, size // 3)
    with pytest.raises(CheckpointDiskFullError) as info:
        engine.save_checkpoint(root, tag="B")
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename == root
    message = str(err)
    assert "bytes free" in message and root in message, message
    assert "'latest' still names the previous checkpoint 'A', which is intact" in message, message
    assert _latest(root) == "A"
    resumed, plugin = _engine(seed=7)
    path, _ = resumed.load_checkpoint(root)
    assert path is not None and os.path.basename(os.path.dirname(path)) == "A"
    assert plugin is not None and plugin.loaded
    assert train(resumed, 2, GAS, first=2) == after_a, rank


def _mount_tmpfs(where: str, size: str) -> str | None:
    """Mount a small tmpfs at ``where``; the reason it cannot be done, or None."""
    if os.geteuid() != 0:
        return "needs root to mount a small file system"
    os.makedirs(where, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], capture_output=True, text=True
    )
    return None if done.returncode == 0 else f"mount -t tmpfs failed: {done.stderr.strip()}"


@pytest.mark.multirank
def test_full_disk_is_a_clear_error_and_the_previous_checkpoint_resumes(tmp_path) -> None:
    root = str(tmp_path / "small")
    why = _mount_tmpfs(root, "4m")
    if why is not None:
        pytest.skip(why)
    try:
        run_distributed(_disk_full_run, 2, args=(root,))
    finally:
        subprocess.run(["umount", root], check=False)
