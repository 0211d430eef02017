"""The asynchronous file I/O engine of the swapper: C++ (JIT-built) or a pure-Python fallback.

:func:`engine` returns an object with ``submit(kind, buffer, path, offset)`` (``kind`` is ``"r"``
or ``"w"``, ``buffer`` a contiguous CPU tensor), ``wait()`` and ``pending()``.  Requests run
asynchronously on a pool of threads, split into ``block_size`` pieces so several are in flight
at once; files are opened with ``O_DIRECT`` when buffer address, size and offset are 4096-byte
aligned (the swapper allocates them so), falling back to buffered I/O on filesystems without
``O_DIRECT`` (tmpfs).  Every completion is checked: a failed or short read or write makes
``wait()`` raise :class:`SwapIOError` naming the file and offset.

The C++ engine (``csrc/nvmeswap_io.cpp``, a pybind11 module built with
``torch.utils.cpp_extension.load``) needs neither libaio nor io_uring headers: plain
``pread``/``pwrite`` on worker threads.  If it cannot be built, a warning is issued and
:class:`PyEngine` (``os.preadv``/``os.pwritev`` on a thread pool, same semantics) is used.
``NVMESWAP_IO=python`` in the environment forces the fallback.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Protocol

import torch

from zerohooks.native import NativeExtension

__all__ = [
    "ALIGN",
    "EXTENSION",
    "IOEngine",
    "PyEngine",
    "SwapIOError",
    "aligned_empty",
    "build_error",
    "checksum",
    "engine",
    "load_native",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
LINK_REFUSED = "it is a symbolic link, and nvmeswap never follows links in its swap folder"
"""Why a swap file that is a symbolic link is refused (``O_NOFOLLOW`` gave ``ELOOP``)."""
ALIGN = 4096
"""Alignment of O_DIRECT buffers, sizes and file offsets."""
CSRC = Path(__file__).resolve().parent / "csrc"


class SwapIOError(RuntimeError):
    """A swap file could not be read or written (names the file and the offset)."""


class IOEngine(Protocol):
    """What the swapper needs from an I/O engine."""

    def submit(self, kind: str, buffer: torch.Tensor, path: str, offset: int) -> bool: ...

    def wait(self) -> None: ...

    def pending(self) -> int: ...


EXTENSION = NativeExtension(
    owner="nvmeswap",
    name="nvmeswap_io",
    what="the C++ I/O engine",
    sources=(CSRC / "nvmeswap_io.cpp",),
    why="asynchronous swap-file reads and writes; NVMESWAP_IO=python skips it (slower)",
    eta="about 30 s on 2 CPU cores",
    fallback="the pure-Python engine (same files, slower)",
    python_module=True,
    disable_env=("NVMESWAP_IO", "python"),
    verbose_env="NVMESWAP_VERBOSE_BUILD",
)
"""The C++ I/O engine (one of ``NvmeSwapPlugin.native``)."""


def load_native(build: bool = True) -> Any:
    """Build (once per process) and return the C++ module, or None when it cannot be built;
    ``build=False`` gives up without trying (local rank 0 of this machine tried and failed)."""
    EXTENSION.load(build)
    return EXTENSION.module


def load_native_distributed() -> Any:
    """:func:`load_native`, built by local rank 0 of each machine while the other ranks wait."""
    EXTENSION.load_distributed()
    return EXTENSION.module


def build_error() -> str | None:
    """Why the C++ engine is not in use (None when it is, or was not tried yet)."""
    return EXTENSION.error


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` (rounded up to 4096) whose data starts on a 4096 boundary."""
    n = -(-nbytes // ALIGN) * ALIGN
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    out = raw[skip : skip + n]
    assert out.data_ptr() % ALIGN == 0
    return out


def checksum(buffer: torch.Tensor, algorithm: int) -> int:
    """64-bit checksum of ``buffer``'s bytes: algorithm 1 is the C++ hash, 2 is BLAKE2b-64."""
    if algorithm == 1:
        mod = load_native()
        if mod is None:
            raise SwapIOError(
                "this swap file was checksummed by the C++ engine, which is not available in this process "
                f"({EXTENSION.error})"
            )
        return int(mod.checksum(buffer))
    if algorithm == 2:
        data = buffer.contiguous().view(torch.uint8).numpy()
        return int.from_bytes(hashlib.blake2b(data.data, digest_size=8).digest(), "little")
    raise SwapIOError(f"unknown swap-file checksum algorithm {algorithm} (known: 1 C++ hash, 2 BLAKE2b)")


class PyEngine:
    """The pure-Python engine: ``os.preadv``/``os.pwritev`` of ``block_size`` pieces on threads."""

    def __init__(self, threads: int, block_size: int) -> None:
        if threads < 1 or block_size < ALIGN or block_size % ALIGN:
            raise ValueError(f"threads must be >= 1 and block_size a multiple of {ALIGN}")
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="nvmeswap-io")
        self._block = block_size
        self._futures: list[concurrent.futures.Future[None]] = []

    def submit(self, kind: str, buffer: torch.Tensor, path: str, offset: int) -> bool:
        if kind not in ("r", "w"):
            raise ValueError(f"kind must be 'r' or 'w', not {kind!r}")
        if not buffer.is_contiguous() or buffer.device.type != "cpu":
            raise ValueError("the buffer must be a contiguous CPU tensor")
        view = buffer.view(torch.uint8).numpy().data
        nbytes = len(view)
        aligned = buffer.data_ptr() % ALIGN == 0 and nbytes % ALIGN == 0 and offset % ALIGN == 0
        # never through a symbolic link planted at the path (O_NOFOLLOW: ELOOP instead)
        flags = (os.O_RDONLY if kind == "r" else os.O_WRONLY | os.O_CREAT) | _NOFOLLOW
        fd, direct = -1, False
        if aligned and hasattr(os, "O_DIRECT"):
            try:
                fd, direct = os.open(path, flags | os.O_DIRECT, 0o600), True
            except OSError:
                fd = -1
        if fd < 0:
            try:
                fd = os.open(path, flags, 0o600)
            except OSError as e:
                why = LINK_REFUSED if e.errno == errno.ELOOP else str(e)
                raise SwapIOError(
                    f"nvmeswap: cannot open {path!r} for {'reading' if kind == 'r' else 'writing'}: {why}"
                ) from None
        parts = [(s, min(self._block, nbytes - s)) for s in range(0, nbytes, self._block)]
        left = [len(parts)]
        lock = threading.Lock()

        def one(start: int, n: int) -> None:
            try:
                done = 0
                while done < n:
                    piece = view[start + done : start + n]
                    pos = offset + start + done
                    try:
                        got = os.preadv(fd, [piece], pos) if kind == "r" else os.pwritev(fd, [piece], pos)
                    except OSError as e:
                        raise SwapIOError(
                            f"nvmeswap: {'read' if kind == 'r' else 'write'} of {path!r} at offset {pos} "
                            f"failed after {done} of {n} bytes: {e.strerror} (errno {e.errno})"
                        ) from None
                    if got <= 0:
                        raise SwapIOError(
                            f"nvmeswap: {'read' if kind == 'r' else 'write'} of {path!r} at offset {pos} "
                            f"failed after {done} of {n} bytes: short {'read' if kind == 'r' else 'write'}"
                        )
                    done += got
            finally:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        os.close(fd)

        if not parts:
            os.close(fd)
        self._futures += [self._pool.submit(one, s, n) for s, n in parts]
        return direct

    def wait(self) -> None:
        futures, self._futures = self._futures, []
        errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            extra = f" (and {len(failed) - 1} more failed piece(s))" if len(failed) > 1 else ""
            raise SwapIOError(f"{failed[0]}{extra}")

    def pending(self) -> int:
        return sum(not f.done() for f in self._futures)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Native:
    """The C++ engine with failures raised as :class:`SwapIOError`."""

    def __init__(self, mod: Any, threads: int, block_size: int) -> None:
        self._e = mod.Engine(threads, block_size)
        self._held: list[torch.Tensor] = []
        """The buffers of submitted requests: kept alive until ``wait()`` (the C++ side holds
        raw pointers only, so that its threads never release a Python-owned tensor)."""

    def submit(self, kind: str, buffer: torch.Tensor, path: str, offset: int) -> bool:
        self._held.append(buffer)  # before the request exists: nothing can drop it in between
        try:
            return bool(self._e.submit(kind, buffer, path, offset))
        except RuntimeError as e:
            self._held.pop()  # nothing was queued
            raise SwapIOError(str(e)) from None
        except BaseException:
            if self._e.pending() == 0:
                self._held.pop()
            raise

    def wait(self) -> None:
        try:
            self._e.wait()
        except RuntimeError as e:
            raise SwapIOError(str(e)) from None
        finally:
            if self._e.pending() == 0:
                self._held.clear()

    def pending(self) -> int:
        return int(self._e.pending())

    def close(self) -> None:
        self._e = None


def engine(threads: int = 4, block_size: int = 1 << 20, native: bool = True) -> Any:
    """An I/O engine: the C++ one when ``native`` and it builds, else :class:`PyEngine`."""
    mod = load_native() if native else None
    if mod is not None:
        return _Native(mod, threads, block_size)
    return PyEngine(threads, block_size)
