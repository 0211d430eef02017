"""A rank's swap folder: claimed by one engine at a time, and disk space checked for every rank.

Claim
    ``<folder>/owner.lock`` is held with ``flock`` while an engine uses the folder (released on
    detach, and by the kernel when the process ends, so a killed run leaves no stale claim).  It
    records who holds it (host, pid, rank, since when), so a second engine, of this process or
    another, is refused naming the folder and the holder: two engines in one folder would
    overwrite each other's swap files, and the first would stop on a "corrupted" file.

Space
    Every rank's need (bytes of its swap files, bytes those files already hold, free bytes, the
    filesystem's ``st_dev`` and the host) is exchanged with one bounded collective,
    :func:`exchange_needs`, before any rank allocates; the ranks of one host whose folders lie on
    one filesystem are counted together, so the check sees what all of them will take, not only
    this rank's share.  Every rank reaches the same verdict and all fail together (no rank waits
    in a later collective for a peer that stopped).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import os
import socket
import stat
import warnings
from typing import Any

import torch.distributed as dist

from nvmeswap.io import LINK_REFUSED
from nvmeswap.swapfile import SwapSpaceError, held_bytes, remove_folder
from zerohooks import watchdog

__all__ = ["DiskNeed", "FolderClaim", "SwapFolderInUseError", "claim", "exchange_needs", "prepare"]

LOCK = "owner.lock"
"""Name of the claim file in a rank's swap folder."""

_claims: dict[str, FolderClaim] = {}
"""Folders claimed by engines of this process (real path -> claim)."""


class SwapFolderInUseError(RuntimeError):
    """The swap folder is used by another engine (of this process or of another one)."""


class FolderClaim:
    """One engine's hold on a swap folder; :meth:`release` gives it up (idempotent)."""

    __slots__ = ("fd", "key", "owner", "path")

    def __init__(self, path: str, key: str, fd: int | None, owner: dict[str, Any]) -> None:
        self.path = path
        self.key = key
        self.fd = fd
        self.owner = owner

    def release(self) -> None:
        if _claims.get(self.key) is self:
            del _claims[self.key]
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "holder unknown: its claim file is empty"
    where = f"rank {owner.get('rank', '?')}, pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"
    if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        where += " (this process)"
    return f"{where}, since {owner.get('since', '?')}"


def _in_use(folder: str, owner: dict[str, Any]) -> SwapFolderInUseError:
    return SwapFolderInUseError(
        f"nvmeswap: the swap folder {folder!r} is in use by another engine ({_describe(owner)}). Two engines "
        "swapping to one folder overwrite each other's swap files (the first would then stop on a "
        'corrupted swap file). Give this engine its own folder ("nvmeswap": {"folder": ...} or '
        "zero_optimization.offload_optimizer.nvme_path), or detach the other engine first "
        "(zerohooks.detach(engine))"
    )


def _read_owner(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0).rstrip(b"\0").decode()
        owner = json.loads(raw) if raw else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return owner if isinstance(owner, dict) else {}


def claim(folder: str, rank: int) -> FolderClaim:
    """Create ``folder`` if needed and claim it for one engine, or raise
    :class:`SwapFolderInUseError` naming the engine that holds it."""
    _check_no_links(folder)
    os.makedirs(folder, exist_ok=True)
    key = os.path.realpath(folder)
    held = _claims.get(key)
    if held is not None:
        raise _in_use(folder, held.owner)
    owner = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    fd: int | None = _open_lock(os.path.join(folder, LOCK))
    assert fd is not None
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_owner(fd)
        os.close(fd)
        raise _in_use(folder, holder) from None
    except (ImportError, OSError) as e:  # no flock here (some network filesystems, non-POSIX)
        warnings.warn(
            f"nvmeswap: cannot lock the swap folder {folder!r} ({e}); an engine of another process using "
            "the same folder would not be detected",
            RuntimeWarning,
            stacklevel=2,
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    taken = _claims[key] = FolderClaim(folder, key, fd, owner)
    return taken


def _check_no_links(folder: str) -> None:
    """Refuse a rank folder, or the ``nvmeswap`` folder above it, that is a symbolic link: nvmeswap
    creates both itself, so a link there was planted (it would send the swap files elsewhere)."""
    for path in (os.path.dirname(folder.rstrip(os.sep)), folder):
        if os.path.islink(path):
            raise OSError(
                errno.ELOOP,
                f"nvmeswap: {path!r} is a symbolic link (to {os.readlink(path)!r}); nvmeswap creates this "
                "folder itself and never follows links in it. Remove the link, or point nvmeswap's folder "
                "(or offload_optimizer.nvme_path) at the real place",
            )


def _open_lock(path: str) -> int:
    """The claim file, opened (created if absent, mode 0600) without following a symbolic link,
    and checked to be a regular file."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o600)
    except OSError as e:
        why = e.strerror
        if e.errno == errno.ELOOP:
            try:
                why = f"{LINK_REFUSED} (to {os.readlink(path)!r})"
            except OSError:  # replaced since: still a link refused
                why = LINK_REFUSED
        raise OSError(
            e.errno, f"nvmeswap: cannot open the swap folder's claim file {path!r}: {why}"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(
            errno.EEXIST,
            f"nvmeswap: the swap folder's claim file {path!r} is not a regular file; remove what is there",
        )
    return fd


@dataclasses.dataclass(frozen=True)
class DiskNeed:
    """What one rank will take on its swap folder's filesystem (exchanged between ranks)."""

    rank: int
    host: str
    folder: str
    device: int | None
    """``st_dev`` of the folder's filesystem (None: nothing to swap on this rank)."""
    needed: int
    """Bytes of this rank's swap files."""
    held: int
    """Bytes those files already hold on disk (left by an earlier run; reused)."""
    free: int
    """Bytes free on the filesystem, measured before any rank allocated."""
    error: str | None = None
    """Why this rank could not get as far as the check (its folder in use, not writable, ...)."""
    error_type: str | None = None
    """The class name of that error."""


def exchange_needs(need: DiskNeed) -> list[DiskNeed]:
    """Every rank's :class:`DiskNeed`, in rank order; every rank must call it.

    The single collective of the start-up check, bounded in time by zerohooks' watchdog (a rank
    that stopped responding is named instead of waited for; a rank still alive, e.g. slower to
    build its engine, is waited for).  Without a process group: ``[need]``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [need]
    return watchdog.gather_objects(need, "nvmeswap's disk-space check", patient=True)


def _measure(folder: str, rank: int, files: dict[str, int]) -> DiskNeed:
    st = os.statvfs(folder)
    held = held_bytes(files)
    return DiskNeed(
        rank=rank,
        host=socket.gethostname(),
        folder=folder,
        device=os.stat(folder).st_dev,
        needed=sum(files.values()),
        held=held,
        free=int(st.f_bavail) * int(st.f_frsize),
    )


def _short(needs: list[DiskNeed]) -> list[str]:
    """One line per (host, filesystem) whose ranks need more than it has free."""
    groups: dict[tuple[str, int], list[DiskNeed]] = {}
    for n in needs:
        if n.device is not None and n.needed:
            groups.setdefault((n.host, n.device), []).append(n)
    lines = []
    for (host, _), group in groups.items():
        needed = sum(n.needed for n in group)
        free = min(n.free for n in group) + sum(n.held for n in group)
        if needed > free:
            ranks = [n.rank for n in group]
            folders = sorted({os.path.dirname(n.folder.rstrip(os.sep)) for n in group})
            lines.append(
                f"{len(group)} rank(s) {ranks} on host {host} swap to the same filesystem ({', '.join(folders)}): "
                f"{needed} bytes needed in all ({', '.join(f'rank {n.rank}: {n.needed}' for n in group)}), "
                f"{free} bytes free"
            )
    return lines


def prepare(folder: str, rank: int, files: dict[str, int]) -> FolderClaim | None:
    """Claim ``folder`` (when this rank has ``files`` to swap: path -> bytes) and check, with every
    rank, that the swap files of all ranks sharing a filesystem fit on it.

    Every rank calls it.  On any rank's failure every rank raises: the failing rank its own error
    (:class:`SwapFolderInUseError`, :class:`~nvmeswap.swapfile.SwapSpaceError`, ...), the others
    an error of the same class naming that rank.  Returns the claim (None without files)."""
    taken: FolderClaim | None = None
    error: BaseException | None = None
    need = DiskNeed(rank, socket.gethostname(), folder, None, 0, 0, 0)
    try:
        if files:
            taken = claim(folder, rank)
            need = _measure(folder, rank, files)
    except Exception as e:
        error = e
        need = dataclasses.replace(need, error=f"{type(e).__name__}: {e}", error_type=type(e).__name__)
    try:
        needs = exchange_needs(need)
        if error is not None:
            raise error
        failed = [n for n in needs if n.error is not None]
        if failed:
            in_use = failed[0].error_type == SwapFolderInUseError.__name__
            kind: type[Exception] = SwapFolderInUseError if in_use else RuntimeError
            raise kind(
                f"nvmeswap: rank {rank} stops because rank(s) {[n.rank for n in failed]} could not prepare "
                "their swap folder: " + "; ".join(f"rank {n.rank}: {n.error}" for n in failed)
            )
        short = _short(needs)
        if short:
            raise SwapSpaceError(
                errno.ENOSPC,
                "nvmeswap: not enough disk space for the optimizer swap files of every rank sharing a "
                f"filesystem (this rank's folder: {folder!r}): " + "; ".join(short),
            )
    except BaseException:
        if taken is not None:  # the folder is this engine's: leave nothing behind in it
            remove_folder(folder)
            taken.release()
        raise
    return taken
