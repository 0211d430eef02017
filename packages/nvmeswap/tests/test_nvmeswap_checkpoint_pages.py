"""The pages of a checkpoint loaded with ``mmap=True`` are dropped from the process once a
sub-group is written back (issue 37): :func:`nvmeswap.checkpoint.drop_pages` lowers the
process's resident memory by the mapped bytes, and the tensor still reads what the file holds
(the oracle: the tensor that was saved)."""

from __future__ import annotations

import torch

from nvmeswap.checkpoint import _inside, drop_pages, file_mappings

MIB = 1 << 20


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_mapped_checkpoint_pages_are_dropped_and_read_again(tmp_path) -> None:
    saved = torch.randn(16 * MIB)  # 64 MiB
    torch.save({"t": saved}, tmp_path / "ckpt.pt")
    t = torch.load(tmp_path / "ckpt.pt", mmap=True, weights_only=True)["t"]
    assert _inside(t, file_mappings())
    assert float(t.sum()) == float(saved.sum())  # every page touched: mapped in the process
    before = _rss_file_kib()
    dropped = drop_pages(t)
    after = _rss_file_kib()
    assert dropped >= 64 * MIB - 8192
    assert before - after >= 60 * 1024, (before, after)
    assert torch.equal(t, saved)  # read again from the file: nothing lost


def test_anonymous_memory_is_never_taken_for_a_mapping() -> None:
    """Only views of file mappings may be dropped (MADV_DONTNEED zeroes anonymous memory)."""
    t = torch.randn(MIB)
    assert not _inside(t, file_mappings())
    assert not _inside(torch.empty(0), file_mappings())
