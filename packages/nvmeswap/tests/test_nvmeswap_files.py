"""nvmeswap's files are created safely and only its own are removed.

Oracles: the target of a planted symbolic link keeps its content; a user's file in a rank's swap
folder survives; the files nvmeswap names itself are the only ones removed.  Real files in a
temporary folder (the engine-level case is ``test_nvmeswap_faults.py::test_clean_exit_...``).
"""

from __future__ import annotations

import errno
import os

import pytest

from nvmeswap.folder import LOCK, claim
from nvmeswap.swapfile import is_own_file, preallocate, remove_folder


def test_planted_swap_file_links_are_replaced_not_followed(tmp_path) -> None:
    folder = tmp_path / "rank00000"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = folder / "subgroup00000.swp"
    os.symlink(victim, link)
    stale = folder / "subgroup00001.swp"
    stale.write_bytes(b"left by an earlier run")
    preallocate({str(link): 8192, str(stale): 4096})
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(link) and os.path.getsize(link) == 8192
    assert os.path.getsize(stale) == 4096 and stale.read_bytes() == b"\0" * 4096
    assert oct(os.stat(link).st_mode & 0o777) == oct(0o600)


def test_planted_lock_link_or_folder_link_is_refused(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    folder = tmp_path / "swap" / "nvmeswap" / "rank00000"
    folder.mkdir(parents=True)
    os.symlink(victim, folder / LOCK)
    with pytest.raises(OSError, match=r"owner\.lock.*symbolic link") as info:
        claim(str(folder), 0)
    assert info.value.errno == errno.ELOOP
    assert f"(to {str(victim)!r})" in str(info.value)  # the link's target is named
    assert victim.read_bytes() == b"precious"
    # a FIFO (or anything but a regular file) as the claim file
    os.unlink(folder / LOCK)
    os.mkfifo(folder / LOCK)
    with pytest.raises(OSError, match=r"not a regular file"):
        claim(str(folder), 0)
    # the rank folder itself, or the nvmeswap folder above it, planted as a link elsewhere
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "swap" / "nvmeswap" / "rank00001"
    os.symlink(elsewhere, linked)
    with pytest.raises(OSError, match=r"rank00001.*symbolic link"):
        claim(str(linked), 1)
    base = tmp_path / "other"
    base.mkdir()
    os.symlink(elsewhere, base / "nvmeswap")
    with pytest.raises(OSError, match=r"other/nvmeswap'.*symbolic link"):
        claim(str(base / "nvmeswap" / "rank00000"), 0)
    assert os.listdir(elsewhere) == []


def test_cleanup_removes_only_its_own_files(tmp_path) -> None:
    folder = tmp_path / "rank00000"
    folder.mkdir()
    own = ["subgroup00000.swp", "subgroup00012.swp", "subgroup123456.swp", LOCK]
    theirs = ["notes.txt", "subgroup0.swp", "subgroup00000.swp.bak", "owner.lock~"]
    for name in own + theirs:
        (folder / name).write_text(name)
    (folder / "subgroup00001.swp").mkdir()  # a folder with an own name: not ours, kept
    assert [n for n in own + theirs if is_own_file(n)] == own
    remove_folder(str(folder))
    assert sorted(os.listdir(folder)) == sorted([*theirs, "subgroup00001.swp"])
    for name in theirs:
        assert (folder / name).read_text() == name
    # only nvmeswap's files left: the folder goes too
    for name in os.listdir(folder):
        p = folder / name
        p.rmdir() if p.is_dir() else p.unlink()
    (folder / "subgroup00000.swp").write_text("x")
    remove_folder(str(folder))
    assert not folder.exists()
    remove_folder(str(folder))  # absent: nothing to do
