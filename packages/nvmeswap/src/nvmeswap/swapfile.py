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

import contextlib
import errno
import json
import os
import re
import stat

import torch

from nvmeswap.io import ALIGN

__all__ = [
    "HEADER",
    "MAGIC",
    "SwapCorruptionError",
    "SwapSpaceError",
    "create",
    "decode_header",
    "encode_header",
    "held_bytes",
    "is_own_file",
    "preallocate",
    "remove_folder",
    "segment_bytes",
]

HEADER = ALIGN
"""Bytes of the header block at the start of every swap file."""
MAGIC = "nvmeswap-1"
OWN_NAMES = frozenset({"owner.lock"})
"""Names of the files nvmeswap creates in a rank's swap folder besides the swap files."""
_SWAP_NAME = re.compile(r"subgroup\d{5,}\.swp")
"""How nvmeswap names its swap files (see :class:`nvmeswap.swapper.SwapState`)."""
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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
    held = held_bytes(files)  # space those files already own
    needed = sum(files.values())
    free = _free_bytes(folder) + held
    if free < needed:
        raise SwapSpaceError(
            errno.ENOSPC,
            f"nvmeswap: not enough disk space for the optimizer swap files in {folder!r}: "
            f"{needed} bytes needed ({len(files)} files), {free} bytes free",
        )
    for path, nbytes in files.items():
        fd = create(path)
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


def held_bytes(files: dict[str, int]) -> int:
    """Bytes the regular files among ``files`` (path -> bytes) already hold on disk (a symbolic
    link or anything else at a path counts for nothing: it is replaced, never followed)."""
    held = 0
    for p in files:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            held += st.st_blocks * 512
    return held


def create(path: str) -> int:
    """A new, empty swap file at ``path`` (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600), opened for
    reading and writing; a file of that name left by an earlier run, or a symbolic link planted
    there, is removed first (the link itself, never its target)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    except OSError as e:
        raise OSError(
            e.errno,
            f"nvmeswap: cannot create the swap file {path!r} ({e.strerror}); something else was "
            "put there while the folder was being prepared",
        ) from None


def is_own_file(name: str) -> bool:
    """Whether ``name`` (a file name in a rank's swap folder) is one nvmeswap creates."""
    return name in OWN_NAMES or _SWAP_NAME.fullmatch(name) is not None


def remove_folder(folder: str) -> None:
    """Delete nvmeswap's own files in a rank's swap folder (clean exit): the swap files
    (``subgroup<N>.swp``) and the claim file (``owner.lock``), nothing else; then the folder if
    that left it empty.  Best effort: errors are ignored."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if is_own_file(name):
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    os.unlink(path)  # a link is removed as a link
    with contextlib.suppress(OSError):  # not empty (a user's file) or already gone: kept
        os.rmdir(folder)
