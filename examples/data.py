"""Byte-level text from the Python standard library's own source files.

Every machine with Python has this corpus, so the demo needs no download. Files are listed
from ``sysconfig.get_paths()["stdlib"]`` (installed third-party packages excluded), sorted by
path, then put in a fixed pseudo-random order (by a hash of the relative path) so that the
few megabytes we read cover many modules instead of those whose names start with "_" or "a".
The first files in that order form the validation split, the following ones the training
split; only as many bytes as requested are read.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
SEPARATOR = b"\n\n"


def stdlib_sources(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The standard library's .py files, in a fixed order that does not depend on the OS."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    if not files:
        raise RuntimeError(f"no .py files found under the standard library directory {base}")
    files.sort(key=lambda p: p.relative_to(base).as_posix())

    def key(p: Path) -> str:
        return hashlib.sha1(p.relative_to(base).as_posix().encode()).hexdigest()

    return sorted(files, key=key)


def _read_until(files: list[Path], start: int, budget: int) -> tuple[bytes, int, int]:
    """Concatenate files from ``files[start:]`` until ``budget`` bytes; return (data, next, n)."""
    parts: list[bytes] = []
    total = 0
    i = start
    while i < len(files) and total < budget:
        try:
            blob = files[i].read_bytes()
        except OSError:
            blob = b""
        i += 1
        if blob:
            parts.append(blob)
            parts.append(SEPARATOR)
            total += len(blob) + len(SEPARATOR)
    return b"".join(parts)[:budget], i, i - start


@dataclass
class ByteCorpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    root: str
    train_files: int
    val_files: int

    @classmethod
    def load(
        cls, train_bytes: int = 4 << 20, val_bytes: int = 256 << 10, root: str | None = None
    ) -> ByteCorpus:
        files = stdlib_sources(root)
        val, nxt, n_val = _read_until(files, 0, val_bytes)
        train, _, n_train = _read_until(files, nxt, train_bytes)
        if len(train) < 1 << 16 or len(val) < 1 << 12:
            raise RuntimeError(
                f"the standard library under {root or sysconfig.get_paths()['stdlib']} is too "
                f"small for the demo ({len(train)} train / {len(val)} validation bytes)"
            )

        def as_tensor(b: bytes) -> torch.Tensor:
            return torch.frombuffer(bytearray(b), dtype=torch.uint8)

        return cls(
            train=as_tensor(train),
            val=as_tensor(val),
            root=str(root or sysconfig.get_paths()["stdlib"]),
            train_files=n_train,
            val_files=n_val,
        )


class BatchSampler:
    """Random windows of ``seq_len + 1`` bytes; deterministic for a given (seed, rank)."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int, rank: int):
        if data.numel() <= seq_len + 1:
            raise ValueError(f"split of {data.numel()} bytes is too short for seq_len {seq_len}")
        self.data = data
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + 17)
        self._window = torch.arange(seq_len + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        high = self.data.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.gen)
        chunk = self.data[starts[:, None] + self._window].long()
        return chunk[:, :-1], chunk[:, 1:]

    def fixed(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n_batches`` batches drawn once (e.g. a validation set evaluated repeatedly)."""
        return [self.next() for _ in range(n_batches)]
