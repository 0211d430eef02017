"""A damaged loco checkpoint is refused, never loaded silently.

The case of issue #18: one flipped bit in an error-feedback scale of a saved loco checkpoint
unpickles without complaint (the oracle below shows it: exactly that scale differs), and loading
it would silently change the losses that follow.  zerohooks' per-file checksum turns it into a
``CheckpointStateError`` on every rank naming the file and the rank; the same file, intact,
loads and restores every buffer exactly.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
from _loco_common import ds_config, make_model, train

import zerohooks
from loco import LocoPlugin
from zerohooks import CheckpointStateError
from zerohooks.adapter import statefile
from zerohooks.testing import distributed

LOCO = {"kernels": "reference"}  # no kernel build needed; the state format is the same


def _engine(seed: int = 0):
    model = make_model(seed)
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(2, "bf16", loco=LOCO)
    )
    att = zerohooks.attachment(engine)
    assert att is not None
    (plugin,) = [p for p in att.plugins if isinstance(p, LocoPlugin)]
    return engine, plugin


def _payload(data: bytes, body_len: int) -> dict:
    """The unpickled payload of a state file's bytes (no checksum checked)."""
    return torch.load(io.BytesIO(data[len(data) - body_len :]), weights_only=False)


def _flip_one_scale_bit(path: str, scale: torch.Tensor) -> bytes:
    """Flip the lowest bit of ``scale``'s first element in the file; return the original bytes."""
    with open(path, "rb") as f:
        original = f.read()
    needle = scale.float().cpu().numpy().tobytes()
    at = original.find(needle)
    assert at > 0 and original.count(needle) == 1, "the scale's bytes are not unique in the file"
    flipped = bytearray(original)
    flipped[at] ^= 0x01
    # oracle: without the checksum the payload still unpickles, with exactly this scale changed
    body = statefile.verify_file(path, 1)
    assert body is not None
    intact = _payload(original, len(body))["states"]["loco"]["buffers"]
    silent = _payload(bytes(flipped), len(body))["states"]["loco"]["buffers"]
    changed = [k for k, (_, s) in silent.items() if not torch.equal(s, intact[k][1])]
    assert len(changed) == 1, changed
    with open(path, "wb") as f:
        f.write(bytes(flipped))
    return original


@pytest.mark.multirank
@distributed(world_size=2)
def test_a_flipped_bit_in_an_error_scale_is_refused(tmp_path) -> None:
    rank = int(os.environ["RANK"])
    box = [str(tmp_path / "ckpt") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one folder for both ranks
    root = box[0]
    engine, plugin = _engine()
    train(engine, 2, 2)
    engine.save_checkpoint(root, tag="t")
    saved = {k: (b.data.clone(), b.scale.clone()) for k, b in plugin.state.buffers.items()}
    path = statefile.state_file(root, "t", 1)
    original = None
    if rank == 1:
        key = max(saved, key=lambda k: saved[k][1].numel())
        original = _flip_one_scale_bit(path, saved[key][1])
    dist.barrier()

    resumed, fresh = _engine(seed=5)
    with pytest.raises(CheckpointStateError) as info:
        resumed.load_checkpoint(root, tag="t")
    message = str(info.value)
    assert path in message and "rank 1" in message and "checksum" in message, message
    assert not fresh.state.buffers  # nothing was loaded, on any rank

    # the same file intact: it loads, every buffer exactly as saved
    if rank == 1:
        assert original is not None
        with open(path, "wb") as f:
            f.write(original)
    dist.barrier()
    resumed.load_checkpoint(root, tag="t")
    assert fresh.state.buffers.keys() == saved.keys()
    for k, (data, scale) in saved.items():
        buf = fresh.state.buffers[k]
        assert torch.equal(buf.data.cpu(), data.cpu()) and torch.equal(buf.scale.cpu(), scale.cpu()), k
