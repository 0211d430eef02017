"""Swap files: layout, header with checksum, preallocation with a clear error when space is short.

One file per swapped sub-group and rank::

    [header, 4096 bytes][fp32 master partition][state tensor 0][state tensor 1]...

each segment padded to 4096 bytes so every read and write is O_DIRECT-aligned.  The master
segment is absent with ``keep_master_in_ram``.  The header (JSON, zero padded) records the
format, the sub-group, the element count, which optimizer-state tensors follow and the 64-bit
checksum of the payload; it is written with the payload in the same request, and verified on
every read against both the payload and the checksum the swapper remembers from its last write
(so a stale file is caught as well as a corrupted one).
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import torch

from nvmeswap.io import ALIGN

__all__ = [
    "HEADER",
    "MAGIC",
    "SwapCorruptionError",
    "SwapSpaceError",
    "decode_header",
    "encode_header",
    "preallocate",
    "segment_bytes",
]

HEADER = ALIGN
"""Bytes of the header block at the start of every swap file."""
MAGIC = "nvmeswap-1"


class SwapSpaceError(OSError):
    """The swap folder's filesystem has no room for the swap files."""


class SwapCorruptionError(RuntimeError):
    """A swap file's content does not match its checksum: it is never trained on."""


def segment_bytes(numel: int) -> int:
    """Bytes one fp32 segment of ``numel`` elements takes in a swap file (4096-aligned)."""
    return -(-numel * 4 // ALIGN) * ALIGN


def encode_header(buffer: torch.Tensor, meta: dict[str, object]) -> None:
    """Write ``meta`` as the header into the first :data:`HEADER` bytes of ``buffer``."""
    raw = json.dumps({"magic": MAGIC, **meta}, sort_keys=True).encode()
    if len(raw) > HEADER:
        raise ValueError(f"swap-file header too long ({len(raw)} bytes)")
    head = buffer[:HEADER]
    head.zero_()
    head[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def decode_header(buffer: torch.Tensor, path: str) -> dict[str, object]:
    """Read the header from the first :data:`HEADER` bytes of ``buffer`` (read from ``path``)."""
    raw = bytes(buffer[:HEADER].numpy().tobytes()).rstrip(b"\0")
    try:
        meta = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SwapCorruptionError(f"swap file {path!r}: the header is unreadable (corrupted file)") from None
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        raise SwapCorruptionError(f"swap file {path!r}: not an nvmeswap swap file (bad header)")
    return meta


def _free_bytes(folder: str) -> int:
    st = os.statvfs(folder)
    return int(st.f_bavail) * int(st.f_frsize)


def preallocate(files: dict[str, int]) -> None:
    """Create every file at its full size before training, or fail naming the space missing.

    ``files`` maps path -> bytes.  Space already held by existing files counts as available.
    Raises :class:`SwapSpaceError` naming the folder, the bytes needed and the bytes free.
    """
    if not files:
        return
    folder = os.path.dirname(next(iter(files)))
    held = sum(
        os.stat(p).st_blocks * 512 for p in files if os.path.exists(p)
    )  # space those files already own
    needed = sum(files.values())
    free = _free_bytes(folder) + held
    if free < needed:
        raise SwapSpaceError(
            errno.ENOSPC,
            f"nvmeswap: not enough disk space for the optimizer swap files in {folder!r}: "
            f"{needed} bytes needed ({len(files)} files), {free} bytes free",
        )
    for path, nbytes in files.items():
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise SwapSpaceError(
                    e.errno,
                    f"nvmeswap: cannot preallocate {nbytes} bytes for swap file {path!r} "
                    f"({e.strerror}); {needed} bytes needed in {folder!r} in all, {_free_bytes(folder)} "
                    "bytes free",
                ) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)  # a filesystem without fallocate: the size at least
        finally:
            os.close(fd)


def remove_folder(folder: str) -> None:
    """Delete a rank's swap folder (clean exit)."""
    shutil.rmtree(folder, ignore_errors=True)
