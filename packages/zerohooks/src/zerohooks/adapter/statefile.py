"""The per-rank plugin-state file of a checkpoint, and the ``latest`` pointer, written durably.

A state file is a short header and a ``torch.save`` payload::

    b"zerohooks-state\\n"                                  16 bytes, the magic
    {"format": 2, "size": N, "sha256": "<hex>"}\\n        one line of JSON
    <N bytes: torch.save(payload)>

The SHA-256 covers the payload, so a single flipped bit anywhere in it (an error-feedback scale,
a step counter) is detected on load, and so is a truncated file: both are a
:class:`~zerohooks.errors.CheckpointStateError` naming the file and the rank, never a raw
``OSError`` or ``UnpicklingError`` and never a silent load.

The checksum protects against damage, not against a forger (who recomputes it).  So the payload
is plain data (dicts, lists, tuples, strings, numbers, booleans, None and tensors) and is read
with ``torch.load(..., weights_only=True)``, which cannot run code: a pickle that names any other
class or function is refused, naming the file, the rank and what it holds, without running it.

A file is written to a fresh temporary name ``.<name>.<8 characters>.tmp`` (``O_CREAT``,
``O_EXCL``, ``O_NOFOLLOW``, relative to the open target folder) in the target folder, flushed and
``fsync``-ed, renamed over the final name (a symbolic link planted there is replaced, never
followed), the folder ``fsync``-ed, and read back to check its checksum before the save may
commit.  DeepSpeed's own files of a checkpoint are written the same way
(:mod:`zerohooks.adapter.ckptwrite`).  Files are read with ``O_NOFOLLOW`` and must be regular files.

Files of format 1 (a bare ``torch.save`` of the payload, written by zerohooks before checksums
existed) are read with ``weights_only=True`` too, with a warning that their damage cannot be
detected; one holding anything else is refused with the command that converts a trusted one
(:mod:`zerohooks.convert_state`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import re
import secrets
import stat
import warnings
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from zerohooks.adapter import pickscan
from zerohooks.errors import CheckpointStateError

__all__ = [
    "CONVERT_COMMAND",
    "FORMAT",
    "LEGACY_FORMAT",
    "MAGIC",
    "TEMP_NAME",
    "check_plain",
    "encode",
    "fsync_dir",
    "load_plain",
    "open_folder",
    "read_bytes",
    "read_latest",
    "read_state",
    "refusal",
    "state_file",
    "verify_file",
    "write_atomic",
    "write_latest",
    "write_state",
    "write_via_temp",
]

MAGIC = b"zerohooks-state\n"
"""First bytes of every state file of :data:`FORMAT`."""
FORMAT = 2
"""The format written now: header with the payload's size and SHA-256."""
LEGACY_FORMAT = 1
"""A bare ``torch.save`` of the payload dict, without checksum (read with a warning)."""
CONVERT_COMMAND = "python -m zerohooks.convert_state --trust"
"""The command that rewrites a trusted old state file as plain data (:mod:`zerohooks.convert_state`)."""
_HEADER_MAX = 4096
"""A header line longer than this is damage, not a header."""
_ZIP_MAGIC = b"PK\x03\x04"
"""How ``torch.save`` files (format 1) begin."""
_MAX_DEPTH = 32
"""Nesting of containers deeper than this is not what a plugin writes."""
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_LATEST_MAX = 4096
"""Bytes of ``latest`` read at most (a tag name; DeepSpeed writes a few dozen)."""


def state_file(ckpt_dir: str, tag: str, rank: int) -> str:
    """Where rank ``rank`` keeps its plugin state for checkpoint ``tag``."""
    return os.path.join(ckpt_dir, str(tag), f"zerohooks_state_rank{rank:05d}.pt")


def check_plain(obj: Any, where: str = "payload", depth: int = 0) -> str | None:
    """None when ``obj`` is plain data (dicts with string or integer keys, lists, tuples,
    strings, numbers, booleans, None, CPU or device tensors); else what was found and where."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return None
    if depth >= _MAX_DEPTH:
        return f"containers nested deeper than {_MAX_DEPTH} levels at {where}"
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                return f"a key of type {type(k).__name__} at {where}"
            bad = check_plain(v, f"{where}[{k!r}]", depth + 1)
            if bad:
                return bad
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = check_plain(v, f"{where}[{i}]", depth + 1)
            if bad:
                return bad
        return None
    return f"an object of type {type(obj).__module__}.{type(obj).__qualname__} at {where}"


def encode(payload: dict[str, Any]) -> bytes:
    """The bytes of a state file holding ``payload``: header and ``torch.save`` body.

    ``ValueError`` when the payload is not plain data (see :func:`check_plain`): a plugin's
    ``state_dict`` must return strings for dtypes and the like, so that the file can be read
    without running code."""
    bad = check_plain(payload)
    if bad:
        raise ValueError(
            f"zerohooks plugin state must be plain data (dicts, lists, tuples, strings, numbers, booleans, "
            f"None, tensors) so that it can be loaded with weights_only=True; found {bad}"
        )
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


TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.[0-9a-z_]{8}\.tmp$")
"""How the temporary files of :func:`write_via_temp` (and of older zerohooks, ``mkstemp``) are
named: ``.<final name>.<8 characters>.tmp`` in the final file's folder."""


def _temp_name(name: str) -> str:
    return f".{name}.{secrets.token_hex(4)}.tmp"


def write_via_temp(
    dir_fd: int, name: str, fill: Callable[[BinaryIO], object], mode: int | None = None
) -> None:
    """Create ``name`` in the folder open as ``dir_fd`` without following any link: ``fill``
    writes the content into a fresh temporary file (``O_CREAT|O_EXCL|O_NOFOLLOW``, relative to
    ``dir_fd``, mode 0666 less the umask, or ``mode``), which is flushed, ``fsync``-ed and renamed
    over ``name`` (a link planted at ``name`` is replaced, never followed), then the folder is
    ``fsync``-ed.  On any failure the temporary file is removed and the error raised."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = _temp_name(name)
        try:
            fd = os.open(tmp, flags, 0o666, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, f"no free temporary name for {name!r}")
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    with contextlib.suppress(OSError):  # some file systems refuse fsync on a folder
        os.fsync(dir_fd)


def open_folder(path: str) -> int:
    """A file descriptor of the folder ``path`` (its own path followed: the caller chose it)."""
    return os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))


def write_atomic(path: str, data: bytes, dir_fd: int | None = None) -> None:
    """Write ``data`` to ``path`` through :func:`write_via_temp` (a link at ``path`` is replaced,
    never followed).  With ``dir_fd`` (the folder of ``path``, already open) only the last
    component of ``path`` is used, so a folder swapped for a link meanwhile is not followed."""
    name = os.path.basename(path)
    if dir_fd is not None:
        write_via_temp(dir_fd, name, lambda f: f.write(data))
        return
    fd = open_folder(os.path.dirname(path))
    try:
        write_via_temp(fd, name, lambda f: f.write(data))
    finally:
        os.close(fd)


def write_state(path: str, payload: dict[str, Any], rank: int, dir_fd: int | None = None) -> None:
    """Write ``payload`` to ``path`` durably, then read the file back and check its checksum.

    Raises ``OSError`` / ``RuntimeError`` from the write, ``ValueError`` for a payload that is not
    plain data, or :class:`CheckpointStateError` when the file read back differs from what was
    written."""
    data = encode(payload)
    if dir_fd is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, data, dir_fd)
    verify_file(path, rank)


def _damaged(path: str, rank: int, why: str) -> CheckpointStateError:
    return CheckpointStateError(
        f"the zerohooks plugin-state file of rank {rank}, {path!r}, is damaged: {why}. The checkpoint "
        "cannot be resumed as saved: resume from an earlier checkpoint, or load weights only with "
        "load_checkpoint(..., load_module_only=True)"
    )


def read_bytes(
    path: str, rank: int, limit: int | None = None, what: str | None = None, max_size: int | None = None
) -> bytes:
    """The content of the regular file ``path`` (at most ``limit`` bytes), opened without
    following a symbolic link and without blocking; :class:`CheckpointStateError` naming the file
    (``what``, by default rank ``rank``'s plugin-state file) when it is a link, not a regular file
    (a FIFO or a device is never read), larger than ``max_size`` bytes (checked with ``fstat``
    before anything is read), or cannot be read."""
    what = what or f"the zerohooks plugin-state file of rank {rank}"
    flags = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if os.path.islink(path):
            raise CheckpointStateError(
                f"{what}, {path!r}, is a symbolic link (to {os.readlink(path)!r}); zerohooks does not "
                "follow links in checkpoint folders: put the file itself there"
            ) from None
        raise CheckpointStateError(f"cannot read {what}, {path!r}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointStateError(
                f"{what}, {path!r}, is not a regular file (mode {stat.filemode(st.st_mode)}); zerohooks "
                "reads only plain files in checkpoint folders"
            )
        if max_size is not None and st.st_size > max_size:
            raise CheckpointStateError(
                f"{what}, {path!r}, is {st.st_size} bytes, over the {max_size} accepted; it was not read"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read() if limit is None else f.read(limit)
    except OSError as e:
        raise CheckpointStateError(f"cannot read {what}, {path!r}: {e}") from e
    finally:
        os.close(fd)


def verify_file(path: str, rank: int) -> bytes | None:
    """The checked payload bytes of the state file ``path`` (rank ``rank``), or None for a file of
    :data:`LEGACY_FORMAT` (no checksum to check).

    Raises :class:`CheckpointStateError` naming the file and the rank when it cannot be read, is
    not a zerohooks state file, is truncated or fails its checksum."""
    data = read_bytes(path, rank)
    if data.startswith(_ZIP_MAGIC):
        return None
    return _checked_body(path, rank, data)


def _checked_body(path: str, rank: int, data: bytes) -> bytes:
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


def refusal(text: str) -> str:
    """What torch's weights-only unpickler found, without its advice to load with
    ``weights_only=False``."""
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return f"its pickle calls or builds {named[1]}"
    said = re.search(r"WeightsUnpickler error: ([^\n]*?)(?:\. |\n|$)", text)
    if said:
        return f"its pickle holds {said[1].strip()}"
    return "its pickle holds an object outside torch's weights-only allowlist"


def load_plain(body: bytes, path: str, rank: int, fmt: int) -> Any:
    """``torch.load(..., weights_only=True)`` of ``body`` (the payload of ``path``), checked to
    be plain data: code, classes and other objects are refused without being run or built.

    Before it is unpickled, ``body`` is checked without building any object
    (:func:`zerohooks.adapter.pickscan.check_zip`): its zip members may not expand beyond its own
    size (``torch.save`` stores them uncompressed), and its pickle may not call ``bytearray(n)``,
    a legacy storage or tensor constructor, hold a string over 16 MiB, nest deeper than
    :data:`_MAX_DEPTH` or view beyond a storage: the memory the load takes is bounded by the
    file's size."""
    try:
        pickscan.check_zip(
            io.BytesIO(body), len(body), pickscan.Limits(max_bytes=len(body), max_depth=_MAX_DEPTH + 2)
        )
    except pickscan.Refused as e:
        if not body.startswith(_ZIP_MAGIC):
            raise _damaged(path, rank, "its payload is not a torch.save zip file") from None
        raise _foreign(path, rank, fmt, f"refused before it was unpickled: {e}") from None
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise _damaged(path, rank, f"its payload cannot be unpickled (UnpicklingError: {e})") from None
        raise _foreign(path, rank, fmt, f"refused without running it: {refusal(str(e))}") from None
    except Exception as e:  # a legacy file has no checksum: this is where its damage shows
        raise _damaged(path, rank, f"its payload cannot be unpickled ({type(e).__name__}: {e})") from e
    bad = check_plain(payload)
    if bad:
        raise _foreign(path, rank, fmt, f"it holds {bad}")
    return payload


def _foreign(path: str, rank: int, fmt: int, found: str) -> CheckpointStateError:
    """The refusal of a payload that holds more than plain data (``found``: what it holds)."""
    why = (
        f"{path!r} (rank {rank}) holds more than the plain data zerohooks plugins write (dicts, lists, "
        f"tuples, strings, numbers, booleans, None, tensors): {found}."
    )
    if fmt == LEGACY_FORMAT:
        return CheckpointStateError(
            f"{why} If this format-{LEGACY_FORMAT} file was written by your own run with an older zerohooks "
            f"and nobody else could write to its folder, convert it with `{CONVERT_COMMAND} {path}` "
            "(--trust because converting unpickles the file, which runs any code it holds: a forged "
            "file would run its author's code as you; never convert a file you did not make); else "
            "resume from another checkpoint, or load weights only with "
            "load_checkpoint(..., load_module_only=True)"
        )
    return CheckpointStateError(
        f"{why} zerohooks never writes such a file: it was replaced or forged. Resume from a checkpoint "
        "you trust, or load weights only with load_checkpoint(..., load_module_only=True)"
    )


def _check_shape(path: str, rank: int, payload: Any, fmt: int) -> None:
    """Refuse a payload that is not a state dict of format ``fmt``, naming what was found."""
    if not isinstance(payload, dict) or payload.get("format") != fmt:
        found = (
            f"a dict with format {payload.get('format')!r}"
            if isinstance(payload, dict)
            else f"a {type(payload).__name__}"
        )
        raise CheckpointStateError(
            f"{path!r} (rank {rank}) is not a zerohooks plugin-state file: its payload is not a "
            f"format-{fmt} state dict (found {found})"
        )
    for key in ("states", "world_size"):
        if key not in payload:
            raise _damaged(path, rank, f"its payload lacks {key!r}")
    kinds = {"states": dict, "world_size": int, "rank": int, "position": dict}
    for key, kind in kinds.items():
        if key in payload and (not isinstance(payload[key], kind) or isinstance(payload[key], bool)):
            raise CheckpointStateError(
                f"{path!r} (rank {rank}) is not what zerohooks writes: its {key!r} is a "
                f"{type(payload[key]).__name__}, not a {kind.__name__}"
            )
    for name, state in payload["states"].items():
        if not isinstance(name, str) or not isinstance(state, dict):
            raise CheckpointStateError(
                f"{path!r} (rank {rank}) is not what zerohooks writes: its plugin states must map plugin "
                f"names to dicts (found {name!r}: {type(state).__name__})"
            )
    position = payload.get("position", {})
    for key in ("micro_step", "window_micro_step"):
        if key in position and (not isinstance(position[key], int) or isinstance(position[key], bool)):
            raise CheckpointStateError(
                f"{path!r} (rank {rank}) is not what zerohooks writes: position.{key} is "
                f"{position[key]!r}, not an integer"
            )


def read_state(path: str, rank: int, max_size: int | None = None) -> dict[str, Any]:
    """The payload dict of the state file ``path`` of rank ``rank`` (refused unread when larger
    than ``max_size`` bytes), checked and loaded as plain data (``weights_only=True``, after
    :func:`load_plain`'s allocation-free check).

    Raises :class:`CheckpointStateError` naming the file and the rank for any damage or foreign
    content; a file of :data:`LEGACY_FORMAT` is read with a ``RuntimeWarning`` (its damage cannot
    be detected)."""
    data = read_bytes(path, rank, max_size=max_size)
    legacy = data.startswith(_ZIP_MAGIC)
    fmt = LEGACY_FORMAT if legacy else FORMAT
    body = data if legacy else _checked_body(path, rank, data)
    payload = load_plain(body, path, rank, fmt)
    _check_shape(path, rank, payload, fmt)
    if legacy:
        warnings.warn(
            f"{path!r} (rank {rank}) is a zerohooks plugin-state file of format {LEGACY_FORMAT}, written "
            "before state files carried a checksum: damage to it cannot be detected. Save a new "
            f"checkpoint (or run `{CONVERT_COMMAND} {path}`) to get a checked one",
            RuntimeWarning,
            stacklevel=2,
        )
    return dict(payload)


def read_latest(folder: str, name: str = "latest") -> str | None:
    """The tag that ``folder/latest`` names (as DeepSpeed reads it), or None without one.

    :class:`CheckpointStateError` when it is a symbolic link or not a regular file (zerohooks
    does not follow links in checkpoint folders)."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    what = f"the checkpoint pointer {name!r}"
    if os.path.islink(path) or not os.path.isfile(path):
        read_bytes(path, 0, _LATEST_MAX, what=what)  # raises, naming what is there instead
    try:
        return read_bytes(path, 0, _LATEST_MAX, what=what).decode("utf-8").strip()
    except (CheckpointStateError, UnicodeDecodeError):
        return None  # unreadable: as if absent, as before (DeepSpeed reports it in its own words)


def write_latest(folder: str, tag: str, dir_fd: int | None = None) -> None:
    """Point ``folder/latest`` at ``tag`` atomically, with the content DeepSpeed writes (the tag,
    no newline): readers see the old tag or the new one, never a torn file (``dir_fd``: ``folder``
    already open)."""
    write_atomic(os.path.join(folder, "latest"), str(tag).encode("utf-8"), dir_fd)
