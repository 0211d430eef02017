"""The per-rank plugin-state file of a checkpoint, and the ``latest`` pointer, written durably.

A state file is a short header and a ``torch.save`` payload::

    b"zerohooks-state\\n"                                  16 bytes, the magic
    {"format": 2, "size": N, "sha256": "<hex>"}\\n        one line of JSON
    <N bytes: torch.save(payload)>

The SHA-256 covers the payload, so a single flipped bit anywhere in it (an error-feedback scale,
a step counter) is detected on load, and so is a truncated file: both are a
:class:`~zerohooks.errors.CheckpointStateError` naming the file and the rank, never a raw
``OSError`` or ``UnpicklingError`` and never a silent load.  A file is written to a temporary
name, flushed and ``fsync``-ed, renamed over the final name, the folder ``fsync``-ed, and read
back to check its checksum before the save may commit.

Files of format 1 (a bare ``torch.save`` of the payload, written by zerohooks before checksums
existed) are still read, with a warning that their damage cannot be detected.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import warnings
from typing import Any

import torch

from zerohooks.errors import CheckpointStateError

__all__ = [
    "FORMAT",
    "LEGACY_FORMAT",
    "MAGIC",
    "encode",
    "fsync_dir",
    "read_latest",
    "read_state",
    "state_file",
    "verify_file",
    "write_latest",
    "write_state",
]

MAGIC = b"zerohooks-state\n"
"""First bytes of every state file of :data:`FORMAT`."""
FORMAT = 2
"""The format written now: header with the payload's size and SHA-256."""
LEGACY_FORMAT = 1
"""A bare ``torch.save`` of the payload dict, without checksum (read with a warning)."""
_HEADER_MAX = 4096
"""A header line longer than this is damage, not a header."""
_ZIP_MAGIC = b"PK\x03\x04"
"""How ``torch.save`` files (format 1) begin."""


def state_file(ckpt_dir: str, tag: str, rank: int) -> str:
    """Where rank ``rank`` keeps its plugin state for checkpoint ``tag``."""
    return os.path.join(ckpt_dir, str(tag), f"zerohooks_state_rank{rank:05d}.pt")


def encode(payload: dict[str, Any]) -> bytes:
    """The bytes of a state file holding ``payload``: header and ``torch.save`` body."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    header = {"format": FORMAT, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    return MAGIC + json.dumps(header, sort_keys=True).encode("ascii") + b"\n" + body


def fsync_dir(path: str) -> None:
    """Make a rename or creation inside folder ``path`` durable (a no-op where folders cannot be
    opened, e.g. on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename is still atomic
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, ``fsync``, rename and folder fsync."""
    folder = os.path.dirname(path) or "."
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def write_state(path: str, payload: dict[str, Any], rank: int) -> None:
    """Write ``payload`` to ``path`` durably, then read the file back and check its checksum.

    Raises ``OSError`` / ``RuntimeError`` from the write, or :class:`CheckpointStateError` when the
    file read back differs from what was written."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_atomic(path, encode(payload))
    verify_file(path, rank)


def _damaged(path: str, rank: int, why: str) -> CheckpointStateError:
    return CheckpointStateError(
        f"the zerohooks plugin-state file of rank {rank}, {path!r}, is damaged: {why}. The checkpoint "
        "cannot be resumed as saved: resume from an earlier checkpoint, or load weights only with "
        "load_checkpoint(..., load_module_only=True)"
    )


def verify_file(path: str, rank: int) -> bytes | None:
    """The checked payload bytes of the state file ``path`` (rank ``rank``), or None for a file of
    :data:`LEGACY_FORMAT` (no checksum to check).

    Raises :class:`CheckpointStateError` naming the file and the rank when it cannot be read, is
    not a zerohooks state file, is truncated or fails its checksum."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointStateError(
            f"cannot read the zerohooks plugin-state file of rank {rank}, {path!r}: {e}"
        ) from e
    if data.startswith(_ZIP_MAGIC):
        return None
    if not data.startswith(MAGIC):
        raise CheckpointStateError(
            f"{path!r} (rank {rank}) is not a zerohooks plugin-state file: it does not begin with "
            f"{MAGIC!r} (nor is it a format-{LEGACY_FORMAT} torch.save file); it was damaged or replaced"
        )
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + _HEADER_MAX)
    if end < 0:
        raise _damaged(path, rank, "its header is cut off or unreadable")
    try:
        header = json.loads(data[len(MAGIC) : end].decode("ascii"))
        fmt, size, digest = header["format"], header["size"], header["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise _damaged(path, rank, "its header is not valid") from None
    if fmt != FORMAT:
        raise CheckpointStateError(
            f"{path!r} (rank {rank}) is a zerohooks plugin-state file of format {fmt!r}; this zerohooks "
            f"reads formats {LEGACY_FORMAT} and {FORMAT} (was it written by a newer zerohooks?)"
        )
    body = data[end + 1 :]
    if not isinstance(size, int) or len(body) != size:
        raise _damaged(
            path, rank, f"it is truncated or padded ({len(body)} payload bytes, header says {size})"
        )
    if hashlib.sha256(body).hexdigest() != digest:
        raise _damaged(path, rank, "its SHA-256 checksum does not match its content")
    return body


def read_state(path: str, rank: int) -> dict[str, Any]:
    """The payload dict of the state file ``path`` of rank ``rank``, checked.

    Raises :class:`CheckpointStateError` naming the file and the rank for any damage; a file of
    :data:`LEGACY_FORMAT` is read with a ``RuntimeWarning`` (its damage cannot be detected)."""
    body = verify_file(path, rank)
    source: Any = path if body is None else io.BytesIO(body)
    try:
        payload = torch.load(source, map_location="cpu", weights_only=False)
    except Exception as e:  # a legacy file has no checksum: this is where its damage shows
        raise _damaged(path, rank, f"its payload cannot be unpickled ({type(e).__name__}: {e})") from e
    fmt = LEGACY_FORMAT if body is None else FORMAT
    if not isinstance(payload, dict) or payload.get("format") != fmt:
        raise CheckpointStateError(
            f"{path!r} (rank {rank}) is not a zerohooks plugin-state file: its payload is not a "
            f"format-{fmt} state dict"
        )
    for key in ("states", "world_size"):
        if key not in payload:
            raise _damaged(path, rank, f"its payload lacks {key!r}")
    if body is None:
        warnings.warn(
            f"{path!r} (rank {rank}) is a zerohooks plugin-state file of format {LEGACY_FORMAT}, written "
            "before state files carried a checksum: damage to it cannot be detected. Save a new "
            "checkpoint to get a checked one",
            RuntimeWarning,
            stacklevel=2,
        )
    return payload


def read_latest(folder: str, name: str = "latest") -> str | None:
    """The tag that ``folder/latest`` names (as DeepSpeed reads it), or None without one."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def write_latest(folder: str, tag: str) -> None:
    """Point ``folder/latest`` at ``tag`` atomically, with the content DeepSpeed writes (the tag,
    no newline): readers see the old tag or the new one, never a torn file."""
    _write_atomic(os.path.join(folder, "latest"), str(tag).encode("utf-8"))
