"""The I/O engines (C++ and pure Python): data round trips, checked completions, checksums."""

from __future__ import annotations

import os

import pytest
import torch

from nvmeswap import io

ENGINES = ["native", "python"]


def _engine(kind: str, native_engine: bool) -> object:
    if kind == "native" and not native_engine:
        pytest.skip(f"the C++ engine did not build here: {io.build_error()}")
    return io.engine(3, 64 * 1024, native=kind == "native")


def _random(nbytes: int, seed: int) -> torch.Tensor:
    buf = io.aligned_empty(nbytes)
    buf.copy_(
        torch.randint(
            0, 256, (buf.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
    )
    return buf


@pytest.mark.parametrize("kind", ENGINES)
def test_round_trip_many_requests_in_flight(tmp_path, kind: str, native_engine: bool) -> None:
    eng = _engine(kind, native_engine)
    path = str(tmp_path / "f.bin")
    bufs = [_random(300 * 1024, seed) for seed in range(6)]  # 5 blocks each, 30 in flight
    for k, b in enumerate(bufs):
        eng.submit("w", b, path, k * b.numel())  # type: ignore[attr-defined]
    eng.wait()  # type: ignore[attr-defined]
    with open(path, "rb") as f:  # independent check of the file's bytes
        assert f.read() == b"".join(bytes(b.numpy()) for b in bufs)
    back = [io.aligned_empty(b.numel()) for b in bufs]
    for k, b in enumerate(back):
        eng.submit("r", b, path, k * b.numel())  # type: ignore[attr-defined]
    assert eng.pending() >= 0  # type: ignore[attr-defined]
    eng.wait()  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(bufs, back, strict=True))


@pytest.mark.parametrize("kind", ENGINES)
def test_buffer_dropped_before_wait_is_still_written(tmp_path, kind: str, native_engine: bool) -> None:
    """The engine keeps a submitted buffer alive until wait(): a caller dropping its last reference
    (the memory is returned to the system: 32 MiB allocations are mmap'ed) loses nothing."""
    eng = _engine(kind, native_engine)
    path = str(tmp_path / "dropped.bin")
    buf = _random(32 << 20, seed=7)
    expected = bytes(buf.numpy())
    eng.submit("w", buf, path, 0)  # type: ignore[attr-defined]
    del buf
    scratch = [torch.full((32 << 20,), 0xAB, dtype=torch.uint8) for _ in range(2)]  # reuse freed memory
    eng.wait()  # type: ignore[attr-defined]
    with open(path, "rb") as f:
        assert f.read() == expected
    del scratch


@pytest.mark.parametrize("kind", ENGINES)
def test_unaligned_buffers_still_work(tmp_path, kind: str, native_engine: bool) -> None:
    eng = _engine(kind, native_engine)
    path = str(tmp_path / "u.bin")
    data = torch.randn(1001)  # neither address nor size 4096-aligned: buffered I/O
    eng.submit("w", data, path, 12)  # type: ignore[attr-defined]
    eng.wait()  # type: ignore[attr-defined]
    back = torch.empty(1001)
    eng.submit("r", back, path, 12)  # type: ignore[attr-defined]
    eng.wait()  # type: ignore[attr-defined]
    assert torch.equal(data, back)


@pytest.mark.parametrize("kind", ENGINES)
def test_short_read_names_file_and_offset(tmp_path, kind: str, native_engine: bool) -> None:
    eng = _engine(kind, native_engine)
    path = str(tmp_path / "short.bin")
    with open(path, "wb") as f:
        f.write(b"x" * 100_000)
    buf = io.aligned_empty(128 * 1024)
    eng.submit("r", buf, path, 0)  # type: ignore[attr-defined]
    with pytest.raises(io.SwapIOError, match=r"read of '.*short\.bin' at offset 100000 .*short read"):
        eng.wait()  # type: ignore[attr-defined]
    eng.wait()  # the error was reported once; the engine is usable again


@pytest.mark.parametrize("kind", ENGINES)
def test_failed_write_names_file_and_offset(kind: str, native_engine: bool) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    eng = _engine(kind, native_engine)
    eng.submit("w", _random(8192, 1), "/dev/full", 0)  # type: ignore[attr-defined]
    with pytest.raises(io.SwapIOError, match=r"write of '/dev/full' at offset \d+ .*No space left"):
        eng.wait()  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ENGINES)
def test_missing_file_is_a_clear_error(tmp_path, kind: str, native_engine: bool) -> None:
    eng = _engine(kind, native_engine)
    with pytest.raises(io.SwapIOError, match=r"cannot open .*nothere.* for reading"):
        eng.submit("r", io.aligned_empty(4096), str(tmp_path / "nothere"), 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("algorithm", [1, 2])
def test_checksum_sees_one_flipped_bit(algorithm: int, native_engine: bool) -> None:
    if algorithm == 1 and not native_engine:
        pytest.skip("C++ engine not built")
    buf = _random(1 << 20, 7)
    for nbytes in (1 << 20, 1000, 33):  # full words, and tails shorter than a word group
        ref = io.checksum(buf[:nbytes], algorithm)
        assert io.checksum(buf[:nbytes].clone(), algorithm) == ref
        for pos in (0, nbytes // 2, nbytes - 1):
            flipped = buf[:nbytes].clone()
            flipped[pos] ^= 4
            assert io.checksum(flipped, algorithm) != ref
    a = buf[:64].clone()
    b = torch.cat([a[32:], a[:32]])  # the same bytes in another order
    assert io.checksum(a, algorithm) != io.checksum(b, algorithm)


def test_aligned_empty_is_aligned() -> None:
    for n in (1, 4096, 5000, 1 << 20):
        t = io.aligned_empty(n)
        assert t.data_ptr() % io.ALIGN == 0 and t.numel() % io.ALIGN == 0 and t.numel() >= n


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("op", ["r", "w"])
def test_a_planted_symlink_is_never_followed(tmp_path, kind: str, op: str, native_engine: bool) -> None:
    """Oracle: the link's target keeps its bytes; the open is refused naming the link."""
    eng = _engine(kind, native_engine)
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 8192)
    link = tmp_path / "subgroup00000.swp"
    os.symlink(victim, link)
    buf = _random(8192, 3)
    with pytest.raises(io.SwapIOError, match=r"subgroup00000\.swp.*symbolic link"):
        eng.submit(op, buf, str(link), 0)  # type: ignore[attr-defined]
    assert victim.read_bytes() == b"v" * 8192
    assert os.path.islink(link)


def _checksum_reference(data: bytes) -> int:
    """The C++ hash (algorithm 1) written out again in Python, from its description."""
    mask = (1 << 64) - 1
    p1, p2 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F
    h = [p1, p2, p1 ^ p2, ~p1 & mask]
    full = len(data) // 32 * 32
    for k in range(4):
        words = memoryview(data[:full]).cast("Q")[k::4]
        x = h[k]
        for w in words:
            x ^= (w * p2) & mask
            x = ((((x << 31) | (x >> 33)) & mask) * p1) & mask
        h[k] = x
    acc = (len(data) * p1) & mask
    for k in range(4):
        acc = (((acc ^ h[k]) * p2) + (acc >> 29)) & mask
    for b in data[full:]:
        acc = ((acc ^ b) * p1) & mask
    acc ^= acc >> 33
    acc = (acc * p2) & mask
    return acc ^ (acc >> 29)


def test_checksum_equals_the_reference(native_engine: bool) -> None:
    """The C++ hash is the function the swap files' headers were written with (algorithm 1):
    an independent Python copy gives the same value, full 32-byte groups and tails alike."""
    if not native_engine:
        pytest.skip("C++ engine not built")
    buf = _random(1 << 18, 11)
    for nbytes in (1 << 18, 4096 + 37, 31, 0):
        assert io.checksum(buf[:nbytes], 1) == _checksum_reference(buf[:nbytes].numpy().tobytes()), nbytes
