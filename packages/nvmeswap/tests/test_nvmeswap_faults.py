"""Faults on 2 gloo ranks: a disk without room (for the ranks together), a rank killed mid-step then
resumed, two engines given one swap folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from _nvme_common import config, make_model, swap_files, train

from zerohooks.testing import MultiRankError, run_distributed

pytestmark = pytest.mark.multirank
HERE = os.path.dirname(os.path.abspath(__file__))


def _initialize(folder: str, fsize_limit: int | None = None) -> str:
    """Build an nvmeswap engine with its swap folder in ``folder``; the error text if it fails."""
    import resource
    import signal

    import zerohooks

    if fsize_limit is not None:  # the process may not grow files past this size
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    model = make_model()
    try:
        zerohooks.initialize(
            model=model, model_parameters=model.parameters(), config=config(folder, nvmeswap={})
        )
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _check_space_error(text: str, folder: str) -> None:
    assert "SwapSpaceError" in text, text
    assert folder in text and "bytes needed" in text and "bytes free" in text, text
    # both ranks' files are counted: each rank's 7 MiB alone would fit
    assert "2 rank(s) [0, 1]" in text and "rank 0: " in text and "rank 1: " in text, text


def test_disk_full_fails_at_start_on_a_small_tmpfs(tmp_path, native_engine: bool) -> None:
    """A 10 MiB tmpfs mounted in a user namespace (no root needed) for 2 x 7 MiB of swap files: room
    for one rank's files, not for both; every rank fails at start, naming the total."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    mnt = tmp_path / "small"
    mnt.mkdir()
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=10m nvmeswap-test {mnt}"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.decode().strip()}")
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {HERE!r})
            from zerohooks.testing import run_distributed
            from test_nvmeswap_faults import _initialize
            if __name__ == "__main__":
                for text in run_distributed(_initialize, 2, args=({str(mnt)!r},), timeout=600):
                    print("RESULT", text)
            """
        )
    )
    proc = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=10m nvmeswap-test {mnt} && exec {sys.executable} {script}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and len(results) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in results:
        _check_space_error(line, str(mnt))


def test_file_size_limit_fails_at_start(tmp_path, native_engine: bool) -> None:
    """RLIMIT_FSIZE of 1 MiB: preallocation fails at once, naming the file, not a step later."""
    results = run_distributed(_initialize, 2, args=(str(tmp_path / "lim"), 1 << 20), timeout=600)
    for text in results:
        assert "SwapSpaceError" in text and "cannot preallocate" in text and ".swp" in text, text


def _train_then_die(folder: str, ckpt: str) -> None:
    import signal

    import zerohooks

    rank = int(os.environ["RANK"])
    model = make_model()
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=config(f"{folder}{rank}", nvmeswap={})
    )
    train(engine, 2)
    engine.save_checkpoint(ckpt, tag="s2")
    train(engine, 1, first=2)

    def die(e: Any) -> None:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of step 4, files being swapped

    train(engine, 1, first=3, before_step=die)


def _resume(folder: str, ckpt: str) -> dict[str, Any]:
    import zerohooks

    rank = int(os.environ["RANK"])
    stale = swap_files(f"{folder}{rank}")
    model = make_model()
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=config(f"{folder}{rank}", nvmeswap={})
    )
    engine.load_checkpoint(ckpt, tag="s2")
    losses = train(engine, 2, first=2)
    zerohooks.detach(engine)
    return {"stale": stale, "losses": losses, "left": swap_files(f"{folder}{rank}")}


def test_killed_rank_then_resume(tmp_path, two_ranks: list[dict[str, Any]]) -> None:
    folder, ckpt = str(tmp_path / "swap"), str(tmp_path / "ckpt")
    with pytest.raises(MultiRankError):  # rank 1 died; rank 0 dies with it or fails in gloo
        run_distributed(_train_then_die, 2, args=(folder, ckpt), timeout=600)
    resumed = run_distributed(_resume, 2, args=(folder, ckpt), timeout=600)
    for r, ref in zip(resumed, two_ranks, strict=True):
        assert r["losses"] == ref["checkpoint"]["uninterrupted"][4:]  # nothing lost
        assert r["left"] == []
    assert resumed[1]["stale"], "the killed rank should have left its swap files behind"


def _train_and_exit(folder: str) -> list[str]:
    """Train and return without detaching: the swap files exist while the rank runs."""
    import zerohooks

    rank = int(os.environ["RANK"])
    # a user's file in the rank's swap folder, and a link planted where a swap file will be
    mine = os.path.join(f"{folder}{rank}", "nvmeswap", f"rank{rank:05d}")
    os.makedirs(mine)
    with open(os.path.join(mine, "notes.txt"), "w") as f:
        f.write("keep me")
    victim = os.path.join(f"{folder}{rank}", "victim")
    with open(victim, "w") as f:
        f.write("precious")
    os.symlink(victim, os.path.join(mine, "subgroup00000.swp"))
    model = make_model()
    engine, *_ = zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=config(f"{folder}{rank}", nvmeswap={})
    )
    train(engine, 1)
    assert not any(os.path.islink(p) for p in swap_files(f"{folder}{rank}"))
    return swap_files(f"{folder}{rank}")


def test_clean_exit_removes_swap_files(tmp_path) -> None:
    """Only nvmeswap's own files go: a user's file in the swap folder survives, with the folder;
    a link planted at a swap file's name is replaced by the swap file, its target untouched."""
    folder = str(tmp_path / "exit")
    during = run_distributed(_train_and_exit, 2, args=(folder,), timeout=600)
    assert all(during)  # the files existed while training
    for rank in range(2):
        assert swap_files(f"{folder}{rank}") == []  # gone once the rank's interpreter exited
        mine = os.path.join(f"{folder}{rank}", "nvmeswap", f"rank{rank:05d}")
        assert os.listdir(mine) == ["notes.txt"]
        with open(os.path.join(mine, "notes.txt")) as f:
            assert f.read() == "keep me"
        with open(os.path.join(f"{folder}{rank}", "victim")) as f:
            assert f.read() == "precious"


def test_a_shared_swap_folder_is_refused_naming_its_holder(two_ranks: list[dict[str, Any]]) -> None:
    """It used to be accepted, and the first engine then stopped on a "corrupted" swap file."""
    for rank, res in enumerate(two_ranks):
        r = res["shared_folder"]
        assert r["error"].startswith("SwapFolderInUseError: nvmeswap: the swap folder"), r["error"]
        assert f"nvmeswap/rank{rank:05d}' is in use by another engine (rank {rank}, pid " in r["error"]
        assert "(this process)" in r["error"] and "its own folder" in r["error"]
        assert r["losses"] == r["again"]  # the first engine trained on untouched; the folder was reused
        assert r["left"] == []


_HOLD = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.pwrite(fd, json.dumps({"host": "elsewhere", "pid": os.getpid(), "rank": 3, "since": "then"}).encode(), 0)
print("held", flush=True)
time.sleep(600)
"""


def test_folder_claim_is_exclusive_across_processes_and_dies_with_its_holder(tmp_path) -> None:
    """The claim protocol (flock on owner.lock) against a holder in another process, which is then
    killed: the kernel drops its lock, so a killed run leaves no stale claim."""
    from nvmeswap import SwapFolderInUseError
    from nvmeswap.folder import LOCK, claim

    folder = str(tmp_path / "rank00000")
    os.makedirs(folder)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, os.path.join(folder, LOCK)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(
            SwapFolderInUseError, match=rf"rank 3, pid {holder.pid} on host elsewhere, since then\)"
        ):
            claim(folder, 0)
    finally:
        holder.kill()
        holder.wait()
    mine = claim(folder, 0)  # the holder died: its claim went with it
    try:
        with pytest.raises(SwapFolderInUseError, match=r"rank 0, pid \d+ on host .*\(this process\)"):
            claim(folder, 1)  # a second engine of this process
    finally:
        mine.release()
    claim(folder, 1).release()
