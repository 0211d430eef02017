"""Plugin-state files cannot run code, symbolic links are never followed, old files convert.

Oracles: a marker file that a forged pickle would create (it must stay absent); the target of a
planted symbolic link (it must keep its content); the payload written (it must read back equal).
Real files in a temporary folder; the multi-rank engine cases are in ``test_checkpoint_atomic.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import warnings
from fractions import Fraction
from typing import Any

import pytest
import torch

from zerohooks import CheckpointStateError
from zerohooks.adapter import statefile
from zerohooks.convert_state import main as convert_main


class _Forged:
    """Unpickling it would create the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _forge(payload: dict[str, Any]) -> bytes:
    body = _torch_bytes(payload)
    header = {"format": 2, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    return statefile.MAGIC + json.dumps(header).encode() + b"\n" + body


def _payload(fmt: int = statefile.FORMAT, **extra: Any) -> dict[str, Any]:
    return {
        "format": fmt,
        "rank": 0,
        "world_size": 1,
        "states": {"p": {"t": torch.arange(6.0), "n": 3, "name": "bf16", **extra}},
        "position": {"micro_step": 4, "window_micro_step": 0},
    }


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("fmt", [statefile.FORMAT, statefile.LEGACY_FORMAT])
def test_forged_pickle_is_refused_and_never_runs(tmp_path, fmt: int) -> None:
    marker = str(tmp_path / "marker")
    payload = _payload(fmt, evil=_Forged(marker))
    assert not os.path.exists(marker)
    _torch_bytes(payload)  # pickling it does not create the marker either
    path = str(tmp_path / "zerohooks_state_rank00000.pt")
    _write(path, _forge(payload) if fmt == statefile.FORMAT else _torch_bytes(payload))
    with pytest.raises(CheckpointStateError) as info:
        statefile.read_state(path, 0)
    message = str(info.value)
    assert path in message and "rank 0" in message and "io.open" in message, message
    assert "weights_only=False" not in message  # torch's advice to load it anyway is not passed on
    if fmt == statefile.LEGACY_FORMAT:
        assert f"python -m zerohooks.convert_state --trust {path}" in message, message
        assert "runs any code" in message, message
    else:
        assert "forged" in message and "convert_state" not in message, message
    assert not os.path.exists(marker)
    # the oracle that the forgery is real: an unrestricted load would have created the marker
    torch.load(io.BytesIO(_torch_bytes(payload)), weights_only=False)
    assert os.path.exists(marker)


def test_foreign_plain_objects_are_refused_naming_them(tmp_path) -> None:
    path = str(tmp_path / "s.pt")
    _write(path, _forge(_payload(dtype=torch.float32)))
    with pytest.raises(CheckpointStateError, match=r"torch\.dtype at payload\['states'\]\['p'\]\['dtype'\]"):
        statefile.read_state(path, 0)
    _write(path, _forge({**_payload(), "world_size": True}))
    with pytest.raises(CheckpointStateError, match=r"'world_size' is a bool, not a int"):
        statefile.read_state(path, 0)
    _write(path, _forge([1, 2]))
    with pytest.raises(CheckpointStateError, match=r"found a list"):
        statefile.read_state(path, 0)
    # and zerohooks never writes such a payload
    with pytest.raises(ValueError, match=r"plain data.*torch\.dtype"):
        statefile.encode(_payload(dtype=torch.float32))


def test_plain_payload_round_trips(tmp_path) -> None:
    path = str(tmp_path / "s.pt")
    payload = _payload(pair=(torch.ones(2, dtype=torch.int8), torch.zeros(1)), none=None, flag=True, x=0.25)
    statefile.write_state(path, payload, 0)
    back = statefile.read_state(path, 0)
    assert back["states"]["p"]["name"] == "bf16" and back["states"]["p"]["flag"] is True
    assert torch.equal(back["states"]["p"]["t"], torch.arange(6.0))
    assert torch.equal(back["states"]["p"]["pair"][0], torch.ones(2, dtype=torch.int8))


def test_symlinks_are_never_followed(tmp_path) -> None:
    folder = tmp_path / "ckpt" / "tag"
    folder.mkdir(parents=True)
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    path = str(folder / "zerohooks_state_rank00000.pt")
    # the old predictable temporary name, and the final name, planted as links to the victim
    os.symlink(target, f"{path}.tmp{os.getpid()}")
    os.symlink(target, path)
    statefile.write_state(path, _payload(), 0)
    assert target.read_bytes() == b"precious"
    assert not os.path.islink(path) and os.path.isfile(path)  # the link was replaced, not followed
    assert statefile.read_state(path, 0)["world_size"] == 1
    # a state file that is a link is refused on load, naming the link
    os.unlink(path)
    good = tmp_path / "elsewhere.pt"
    statefile.write_state(str(good), _payload(), 0)
    os.symlink(good, path)
    with pytest.raises(CheckpointStateError, match=r"is a symbolic link"):
        statefile.read_state(path, 0)
    # a FIFO is not read (it would block)
    os.unlink(path)
    os.mkfifo(path)
    with pytest.raises(CheckpointStateError, match=r"not a regular file"):
        statefile.read_state(path, 0)
    # 'latest': written by replacing a planted link, read only when it is a regular file
    root = str(tmp_path / "ckpt")
    latest = os.path.join(root, "latest")
    os.symlink(target, latest)
    with pytest.raises(CheckpointStateError, match=r"'latest'.*symbolic link"):
        statefile.read_latest(root)
    statefile.write_latest(root, "tag")
    assert target.read_bytes() == b"precious" and not os.path.islink(latest)
    assert statefile.read_latest(root) == "tag"
    assert not [f for f in os.listdir(root) + os.listdir(folder) if f.endswith(".tmp")]


def test_convert_state_rewrites_a_trusted_old_file(tmp_path, capsys) -> None:
    np = pytest.importorskip("numpy")
    path = str(tmp_path / "zerohooks_state_rank00000.pt")
    old = _payload(statefile.LEGACY_FORMAT, dtype=torch.bfloat16, size=torch.Size([2, 3]), count=np.int64(7))
    old["states"]["p"]["array"] = np.arange(3, dtype=np.float32)
    _write(path, _torch_bytes(old))
    with pytest.raises(CheckpointStateError, match=r"python -m zerohooks.convert_state"):
        statefile.read_state(path, 0)
    assert convert_main(["--trust", path]) == 0
    assert "converted" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # format 2 now: no warning about a missing checksum
        state = statefile.read_state(path, 0)["states"]["p"]
    assert state["dtype"] == "torch.bfloat16" and state["size"] == (2, 3) and state["count"] == 7
    assert torch.equal(state["array"], torch.arange(3.0)) and torch.equal(state["t"], torch.arange(6.0))
    assert convert_main(["--trust", path]) == 0
    assert "left as it is" in capsys.readouterr().out
    # an object without a plain form: named, and the file is left untouched
    _write(path, _torch_bytes(_payload(statefile.LEGACY_FORMAT, frac=Fraction(1, 3))))
    with open(path, "rb") as f:
        before = f.read()
    assert convert_main(["--trust", path]) == 1
    assert "fractions.Fraction" in capsys.readouterr().err
    with open(path, "rb") as f:
        assert f.read() == before


def test_convert_state_command_line(tmp_path) -> None:
    path = str(tmp_path / "zerohooks_state_rank00000.pt")
    _write(path, _torch_bytes(_payload(statefile.LEGACY_FORMAT)))
    done = subprocess.run(
        [sys.executable, "-m", "zerohooks.convert_state", "--trust", path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert statefile.read_state(path, 0)["format"] == statefile.FORMAT


@pytest.mark.parametrize("fmt", [statefile.FORMAT, statefile.LEGACY_FORMAT])
def test_convert_state_refuses_without_trust_and_says_why(tmp_path, fmt: int) -> None:
    """A forged state file (format 2 with a valid checksum, or format 1) whose pickle would create
    a marker: without --trust the command loads nothing, exits 2 and says why; with --trust it
    unpickles the file as documented, so the forgery runs (the flag is the user's word that they
    made the file)."""
    marker = str(tmp_path / "marker")
    path = str(tmp_path / "zerohooks_state_rank00000.pt")
    payload = _payload(fmt, evil=_Forged(marker))
    _write(path, _forge(payload) if fmt == statefile.FORMAT else _torch_bytes(payload))
    with open(path, "rb") as f:
        before = f.read()
    done = subprocess.run(
        [sys.executable, "-m", "zerohooks.convert_state", path], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "converted" not in done.stdout, done.stdout
    for needle in (path, "--trust", "runs any code", "weights_only=False", "your own runs"):
        assert needle in done.stderr, done.stderr
    assert not os.path.exists(marker), "the forged pickle ran without --trust"
    with open(path, "rb") as f:
        assert f.read() == before  # nothing written
    # the format-1 refusal on load points at the same command, --trust and its risk
    if fmt == statefile.LEGACY_FORMAT:
        with pytest.raises(CheckpointStateError, match=r"convert_state --trust .*runs any code"):
            statefile.read_state(path, 0)
    # with --trust the user vouches for the file: it is unpickled, so this forgery does run
    # (and is then refused for holding no plain form, nothing written)
    done = subprocess.run(
        [sys.executable, "-m", "zerohooks.convert_state", "--trust", path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert os.path.exists(marker), "--trust did not unpickle the file"
    assert done.returncode == 1 and "not converted" in done.stderr, done.stderr
