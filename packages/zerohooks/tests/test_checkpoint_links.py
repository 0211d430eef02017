"""Checkpoint folders an attacker can write (issue 33, items 1, 2, 8 and 9's temporary files).

Each case is the attack, reproduced on real 2-rank gloo DeepSpeed engines built by zerohooks, then
its outcome checked against an oracle that would catch it: the victim files' bytes and modes
unchanged, the error's text, the weights and plugin state of the checkpoint that was chosen.

* a link at ``<tag>/mp_rank_00_model_states.pt``, at each ``*_optim_states.pt``, at
  ``<save_dir>/zero_to_fp32.py`` (and ``zero_to_torch.py``), at ``<save_dir>/latest``, with and
  without a stateful plugin, on ZeRO 2 and ZeRO 3: the save succeeds, each link is replaced by a
  regular file, the victims are unchanged (the script not made executable);
* a tag folder that is a link, and tags with ``/`` or ``..``: the save is refused naming it, nothing
  is written outside;
* a temporary file left by a killed save is removed by the next save into that folder; a failed
  write leaves none;
* ``latest`` naming ``../outside/other``, an absolute path, ``../../../..``, a missing tag; a
  caller's tag with ``..``, a missing one, a tag folder that is a link: refused with a clear
  ``CheckpointStateError`` (naming the folder and the tags that exist), nothing loaded;
* ``latest`` moved during the load: weights and plugin state both come from the tag read first
  (ZeRO 2); on ZeRO 3 without optimizer states (DeepSpeed reads ``latest`` itself) the move is
  detected, and a caller's tag other than ``latest``'s is refused.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerohooks
from zerohooks import CheckpointSaveError, CheckpointStateError, ZeroPlugin
from zerohooks.adapter import ckpttag, statefile
from zerohooks.testing import run_distributed
from zerohooks.testing.toy import ds_config, make_model, train

GAS = 1


class CountPlugin(ZeroPlugin):
    """A plugin with rank-local state: the number of gradients it saw (differs between checkpoints)."""

    name = "count"
    distribution = "test"

    def __init__(self) -> None:
        super().__init__(self.Config())
        self.seen = 0
        self.loaded: int | None = None

    def attach(self, registry: Any, ctx: Any) -> None:
        registry.register_micro_step_grad(self._grad, name=self.name)
        registry.register_state(self, name=self.name)

    def _grad(self, param: torch.nn.Parameter, ctx: Any) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = self.loaded = int(state["seen"])


def _rank() -> int:
    return int(os.environ["RANK"])


def _engine(stage: int, plugin: bool, seed: int = 0) -> tuple[Any, CountPlugin | None]:
    p = CountPlugin() if plugin else None
    model = make_model(seed)
    engine, *_ = zerohooks.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(stage, gas=GAS),
        plugins=[p] if p else [],
    )
    return engine, p


def _weights(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _victims(root: str, names: list[str]) -> dict[str, bytes]:
    """Rank 0 makes one victim file (outside the checkpoint folder) per name, mode 0644."""
    folder = os.path.join(root, "victims")
    out = {}
    for n in names:
        path = os.path.join(folder, n + ".victim")
        out[path] = f"victim {n}: must stay as it is\n".encode()
    if _rank() == 0:
        os.makedirs(folder, exist_ok=True)
        for path, data in out.items():
            with open(path, "wb") as f:
                f.write(data)
            os.chmod(path, 0o644)
    dist.barrier()
    return out


def _intact(victims: dict[str, bytes]) -> None:
    for path, data in victims.items():
        with open(path, "rb") as f:
            assert f.read() == data, f"{path} was overwritten"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644, f"{path} changed mode"


def _names_of_a_save(engine: Any, root: str) -> list[str]:
    """The files DeepSpeed writes in a tag folder of this engine (a probe save)."""
    probe = os.path.join(root, "probe")
    engine.save_checkpoint(probe, tag="t")
    return sorted(n for n in os.listdir(os.path.join(probe, "t")) if not n.startswith("zerohooks_state"))


def _plant(save_dir: str, tag: str, names: list[str], root: str) -> dict[str, bytes]:
    """Links at every file a save writes (DeepSpeed's in ``tag``, the scripts and ``latest``),
    each to its own victim."""
    top = ["zero_to_fp32.py", "zero_to_torch.py", "latest"]
    victims = _victims(root, [f"{os.path.basename(save_dir)}-{n}" for n in names + top])
    if _rank() == 0:
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        for n in names:
            os.symlink(
                os.path.join(root, "victims", f"{os.path.basename(save_dir)}-{n}.victim"),
                os.path.join(save_dir, tag, n),
            )
        for n in top:
            os.symlink(
                os.path.join(root, "victims", f"{os.path.basename(save_dir)}-{n}.victim"),
                os.path.join(save_dir, n),
            )
    dist.barrier()
    return victims


def _no_links_no_temps(save_dir: str, tag: str) -> None:
    for folder in (save_dir, os.path.join(save_dir, tag)):
        for n in os.listdir(folder):
            assert not os.path.islink(os.path.join(folder, n)), f"{folder}/{n} is still a link"
            assert not n.endswith(".tmp"), f"{folder}/{n} left behind"


# ---- ZeRO 2: saves --------------------------------------------------------------------------------


def _saves_do_not_follow_links(root: str, stage: int) -> dict[str, Any]:
    rank = _rank()
    out: dict[str, Any] = {}
    for plugin in (False, True):
        engine, p = _engine(stage, plugin)
        train(engine, 1, GAS)
        kind = "stateful" if plugin else "plain"
        names = _names_of_a_save(engine, os.path.join(root, kind))
        assert any(n.endswith("optim_states.pt") for n in names) and any(
            n.endswith("model_states.pt") for n in names
        )
        save_dir = os.path.join(root, kind, "ckpt")
        victims = _plant(save_dir, "t1", names, root)
        started = time.perf_counter()
        engine.save_checkpoint(save_dir, tag="t1")
        out[f"save {kind}"] = time.perf_counter() - started
        dist.barrier()
        _intact(victims)
        _no_links_no_temps(save_dir, "t1")
        with open(os.path.join(save_dir, "latest"), "rb") as f:
            assert f.read() == b"t1"
        script = os.path.join(save_dir, "zero_to_fp32.py")
        assert os.stat(script).st_mode & stat.S_IXUSR and os.path.getsize(script) > 1000  # DeepSpeed's script
        # the checkpoint written through the replaced links loads
        other, q = _engine(stage, plugin, seed=5)
        other.load_checkpoint(save_dir)
        if stage != 3:
            assert _same(_weights(other), _weights(engine))
        if p is not None:
            assert q is not None and q.loaded == p.seen

        # a tag folder that is a link: refused naming it, nothing written there
        outside = os.path.join(root, f"outside-{kind}")
        if rank == 0:
            os.makedirs(outside)
            with open(os.path.join(outside, "keep"), "wb") as f:
                f.write(b"keep")
            os.symlink(outside, os.path.join(save_dir, "t2"))
        dist.barrier()
        with pytest.raises(CheckpointSaveError) as info:
            engine.save_checkpoint(save_dir, tag="t2")
        said = str(info.value)
        assert "is a symbolic link" in said and outside in said and "'t2'" in said, said
        assert "'latest' still names the previous checkpoint 't1'" in said, said
        assert sorted(os.listdir(outside)) == ["keep"] and statefile.read_latest(save_dir) == "t1"

        # tags that are not one folder name: refused before anything is written
        for bad in ("../escape", "sub/x", "..", "", "/abs"):
            with pytest.raises(CheckpointSaveError, match="not a checkpoint folder name"):
                engine.save_checkpoint(save_dir, tag=bad)
        assert not os.path.exists(os.path.join(root, kind, "escape"))
        assert not os.path.exists(os.path.join(save_dir, "sub"))

        # temporary files of a killed save: removed by the next save into that folder (a file of
        # the user's that merely ends in .tmp is kept)
        stale = [
            os.path.join(save_dir, "t1", ".zerohooks_state_rank00001.pt.abcd1234.tmp"),
            os.path.join(save_dir, "t1", f".{names[0]}.0123abcd.tmp"),
            os.path.join(save_dir, ".latest.a1b2c3d4.tmp"),
        ]
        mine = os.path.join(save_dir, "t1", "notes.tmp")
        if rank == 0:
            for path in [*stale, mine]:
                with open(path, "wb") as f:
                    f.write(b"partial")
        dist.barrier()
        engine.save_checkpoint(save_dir, tag="t1")
        dist.barrier()
        assert not [s for s in stale if os.path.exists(s)] and os.path.exists(mine)
        dist.barrier()
        if rank == 0:
            os.unlink(mine)
        dist.barrier()

        # a write that fails halfway (a client_state torch cannot pickle) leaves no temporary file
        with pytest.raises(CheckpointSaveError, match="DeepSpeed's save"):
            engine.save_checkpoint(save_dir, tag="t3", client_state={"bad": lambda: None})
        dist.barrier()
        assert not [n for n in os.listdir(os.path.join(save_dir, "t3")) if n.endswith(".tmp")]
        assert statefile.read_latest(save_dir) == "t1"
    return out


@pytest.mark.multirank
def test_zero2_saves_replace_planted_links_and_refuse_linked_tags(tmp_path) -> None:
    started = time.perf_counter()
    results = run_distributed(_saves_do_not_follow_links, 2, args=(str(tmp_path), 2))
    print(f"ZeRO 2 save cases: {time.perf_counter() - started:.1f} s, saves {results[0]}")


# ---- ZeRO 2: which checkpoint a load reads --------------------------------------------------------


def _write_latest_raw(root: str, text: str) -> None:
    if _rank() == 0:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(text)
    dist.barrier()


def _refused(
    engine: Any, p: CountPlugin, before: list[torch.Tensor], root: str, words: list[str], **kw: Any
) -> str:
    with pytest.raises(CheckpointStateError) as info:
        engine.load_checkpoint(root, **kw)
    said = str(info.value)
    for w in words:
        assert w in said, (w, said)
    assert p.loaded is None and _same(_weights(engine), before), "something was loaded"
    return said


@contextlib.contextmanager
def _latest_moves_to_b_during_the_load(loader: Any, ckpt: str) -> Iterator[None]:
    """'latest' names A when the load starts and B once DeepSpeed's own load runs (after zerohooks
    read it, before DeepSpeed reads files)."""
    _write_latest_raw(ckpt, "A")
    inner = loader._load_checkpoint

    def moving(*args: Any, **kwargs: Any) -> Any:
        _write_latest_raw(ckpt, "B")
        return inner(*args, **kwargs)

    loader._load_checkpoint = moving
    try:
        yield
    finally:
        del loader._load_checkpoint


def _loads_choose_one_tag(root: str) -> dict[str, str]:
    ckpt = os.path.join(root, "ckpt")
    other_run = os.path.join(root, "outside")
    engine, p = _engine(2, True)
    assert p is not None
    train(engine, 1, GAS)
    engine.save_checkpoint(other_run, tag="other")  # another run's checkpoint, beside ours
    engine.save_checkpoint(ckpt, tag="A")
    a_weights, a_seen = _weights(engine), p.seen
    train(engine, 1, GAS, first=1)
    engine.save_checkpoint(ckpt, tag="B")
    b_weights, b_seen = _weights(engine), p.seen
    assert a_seen != b_seen and not _same(a_weights, b_weights)

    loader, q = _engine(2, True, seed=9)
    assert q is not None
    fresh = _weights(loader)
    said: dict[str, str] = {}
    # 'latest' pointing out of the folder: refused, though a valid checkpoint is there
    _write_latest_raw(ckpt, "../outside/other")
    said["../outside/other"] = _refused(
        loader, q, fresh, ckpt, ["path separator", "'../outside/other'", "latest"]
    )
    _write_latest_raw(ckpt, os.path.join(other_run, "other"))
    said["absolute"] = _refused(loader, q, fresh, ckpt, ["absolute path"])
    _write_latest_raw(ckpt, "../../../..")
    started = time.perf_counter()
    said["../../../.."] = _refused(loader, q, fresh, ckpt, ["path separator"])
    assert time.perf_counter() - started < 5  # no walk over the file system
    _write_latest_raw(ckpt, "..")
    _refused(loader, q, fresh, ckpt, ["names the checkpoint folder or its parent"])
    _write_latest_raw(ckpt, "")
    _refused(loader, q, fresh, ckpt, ["it is empty"])
    # a missing tag, from 'latest' or from the caller: named, with the tags that exist
    _write_latest_raw(ckpt, "gone")
    said["missing"] = _refused(
        loader, q, fresh, ckpt, ["no checkpoint 'gone'", "named by 'latest'", "'A', 'B'"]
    )
    _refused(loader, q, fresh, ckpt, ["no checkpoint 'nope'", "the tag passed", "'A', 'B'"], tag="nope")
    _refused(loader, q, fresh, ckpt, ["not a checkpoint folder name"], tag="../outside/other")
    # a tag folder that is a link (to the other run's checkpoint)
    if _rank() == 0:
        os.symlink(os.path.join(other_run, "other"), os.path.join(ckpt, "linked"))
    dist.barrier()
    said["linked"] = _refused(
        loader, q, fresh, ckpt, ["is a symbolic link", "/linked'", "outside/other"], tag="linked"
    )

    # 'latest' moved to B while the load runs (after zerohooks read it, before DeepSpeed reads
    # files): weights and plugin state both come from A, the tag read once
    with _latest_moves_to_b_during_the_load(loader, ckpt):
        path, _ = loader.load_checkpoint(ckpt)
    assert path is not None and os.path.basename(os.path.dirname(path)) == "A", path
    assert statefile.read_latest(ckpt) == "B"  # it did move
    assert _same(_weights(loader), a_weights) and q.loaded == a_seen, (q.loaded, a_seen, b_seen)
    return said


@pytest.mark.multirank
def test_zero2_loads_read_latest_once_and_validate_the_tag(tmp_path) -> None:
    started = time.perf_counter()
    first, second = run_distributed(_loads_choose_one_tag, 2, args=(str(tmp_path),))
    print(f"ZeRO 2 load cases: {time.perf_counter() - started:.1f} s")
    assert first == second  # the same error on every rank
    for case, text in first.items():
        print(f"{case}: {text}")


# ---- ZeRO 3 ----------------------------------------------------------------------------------------


def _zero3(root: str) -> None:
    _saves_do_not_follow_links(os.path.join(root, "saves"), 3)
    ckpt = os.path.join(root, "ckpt")
    engine, _ = _engine(3, False)
    train(engine, 1, GAS)
    engine.save_checkpoint(ckpt, tag="A")
    train(engine, 1, GAS, first=1)
    engine.save_checkpoint(ckpt, tag="B")
    loader, _ = _engine(3, False, seed=9)
    # DeepSpeed reads the weights of 'latest' (B) whatever the tag: another tag is refused
    with pytest.raises(CheckpointStateError, match=r"'latest' names 'B'"):
        loader.load_checkpoint(ckpt, tag="A", load_optimizer_states=False)
    # 'latest' moved during the load: detected and named
    moved = pytest.raises(CheckpointStateError, match=r"changed from 'A' to 'B' during the load")
    with _latest_moves_to_b_during_the_load(loader, ckpt), moved:
        loader.load_checkpoint(ckpt, load_optimizer_states=False)


@pytest.mark.multirank
def test_zero3_saves_and_weights_only_loads(tmp_path) -> None:
    started = time.perf_counter()
    run_distributed(_zero3, 2, args=(str(tmp_path),))
    print(f"ZeRO 3 cases: {time.perf_counter() - started:.1f} s")


# ---- single process ---------------------------------------------------------------------------------


def test_tags_and_pointers_are_checked(tmp_path) -> None:
    for good in ("global_step10", "A", "tag with spaces", "é"):
        assert ckpttag.tag_problem(good) is None, good
    for bad in ("", ".", "..", "a/b", "../x", "/abs", "a\\b", "a\0b", "a\nb", "x" * 256):
        assert ckpttag.tag_problem(bad), bad
    root = str(tmp_path)
    assert ckpttag.read_pointer(root) is None
    latest = tmp_path / "latest"
    latest.write_bytes(b"global_step3\n")
    assert ckpttag.read_pointer(root) == "global_step3"
    latest.write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointStateError, match="not UTF-8"):
        ckpttag.read_pointer(root)
    latest.write_bytes(b"x" * 5000)
    with pytest.raises(CheckpointStateError, match="longer than 4096 bytes"):
        ckpttag.read_pointer(root)
    latest.unlink()
    os.mkfifo(latest)  # would block a plain open() for ever
    with pytest.raises(CheckpointStateError, match="not a regular file"):
        ckpttag.read_pointer(root)
    for i in range(8):
        (tmp_path / f"t{i}").mkdir()
    with pytest.raises(CheckpointStateError, match=r"'t0', 't1', 't2', 't3', 't4' and 3 more"):
        ckpttag.check_tag_folder(root, "t9", "the tag passed to load_checkpoint")
