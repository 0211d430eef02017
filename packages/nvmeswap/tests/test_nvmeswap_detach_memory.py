"""Detaching brings the swapped state back into RAM: refused, with nothing changed, when this
process cannot take it (issue 37).  The limit is real: the rank runs in a cgroup-v1 memory cgroup
whose limit is 1 MiB less than what the detach needs; the oracle for "nothing changed" is DeepSpeed's CPU
offload of the same run, equal bit for bit after training on and detaching once there is room."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _nvme_common import _build, _oracle_config, config, masters, moments, swap_files, train

from nvmeswap.memory import cgroup_headroom
from zerohooks.testing import run_distributed

MIB = 1 << 20


def _own_memory_cgroup() -> Path | None:
    """This process's cgroup-v1 memory cgroup, if a child cgroup can be made in it."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = Path("/sys/fs/cgroup/memory", rel.strip("/"))
            return path if os.access(path, os.W_OK) else None
    return None


def test_headroom_reads_v1_and_v2_and_counts_file_pages_free(tmp_path: Path) -> None:
    """The cgroup's limit less its use plus its file pages (reclaimable), v1 or v2; no limit: None."""
    v1 = tmp_path / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{100 * MIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{90 * MIB}\n")
    (v1 / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {3 * MIB}\ntotal_active_file {2 * MIB}\n")
    (tmp_path / "cg1").write_text("5:memory:/job\n0::/\n")
    assert cgroup_headroom(str(tmp_path / "cg1"), str(tmp_path)) == 15 * MIB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_headroom(str(tmp_path / "cg1"), str(tmp_path)) is None

    v2 = tmp_path / "user.slice"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{64 * MIB}\n")
    (v2 / "memory.current").write_text(f"{60 * MIB}\n")
    (v2 / "memory.stat").write_text(f"anon {50 * MIB}\nfile {MIB}\n")
    (tmp_path / "cg2").write_text("0::/user.slice\n")
    assert cgroup_headroom(str(tmp_path / "cg2"), str(tmp_path)) == 5 * MIB
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_headroom(str(tmp_path / "cg2"), str(tmp_path)) is None


def _detach_in_a_small_cgroup(tmp: str, parent: str) -> dict[str, Any]:
    import torch

    import zerohooks
    from nvmeswap import NotEnoughMemoryError, swapper

    folder = f"{tmp}/swap"
    eng = _build(config(folder, nvmeswap={}))
    train(eng, 1)
    state = zerohooks.attachment(eng).plugins[0].state
    need = swapper.restore_bytes(state)
    files_before = swap_files(folder)
    child = Path(parent, f"nvmeswap_detach_{os.getpid()}")
    child.mkdir()
    error = ""
    try:
        # less than the need by 1 MiB: refused, with room left for Python meanwhile
        (child / "memory.limit_in_bytes").write_text(str(need - MIB))
        (child / "cgroup.procs").write_text(str(os.getpid()))  # new charges go to the child
        try:
            zerohooks.detach(eng)
        except NotEnoughMemoryError as e:
            error = str(e)
    finally:
        Path(parent, "cgroup.procs").write_text(str(os.getpid()))
        child.rmdir()
    out: dict[str, Any] = {
        "need": need,
        "error": error,
        "still_attached": zerohooks.attachment(eng) is not None,
        "files_kept": swap_files(folder) == files_before and bool(files_before),
    }
    out["losses"] = train(eng, 1, first=1)
    if zerohooks.attachment(eng) is not None:  # (not refused: the assertions below say so)
        zerohooks.detach(eng)  # there is room now
    ours = masters(eng) + moments(eng)
    oracle = _build(_oracle_config(f"{tmp}/oracle"), plugins=False)
    out["oracle_losses"] = train(oracle, 2)[2:]
    out["equal"] = all(
        torch.equal(a, b) for a, b in zip(ours, masters(oracle) + moments(oracle), strict=True)
    )
    return out


@pytest.mark.multirank
def test_detach_without_the_memory_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    parent = _own_memory_cgroup()
    if parent is None:
        pytest.skip("no writable cgroup-v1 memory controller here (a limit is what this test needs)")
    try:
        (r,) = run_distributed(_detach_in_a_small_cgroup, 1, args=(str(tmp_path), str(parent)), timeout=600)
    finally:  # a rank killed inside the small cgroup leaves it behind, empty
        for left in parent.glob("nvmeswap_detach_*"):
            left.rmdir()
    assert r["need"] > 4 * MIB
    assert r["error"], "detach was not refused under a limit below what it needs"
    assert str(r["need"]) in r["error"] and "nothing was changed" in r["error"], r["error"]
    assert r["still_attached"] and r["files_kept"]
    # it trained on as if nothing had happened, then detached: DeepSpeed's CPU offload's state
    assert r["losses"] == r["oracle_losses"]
    assert r["equal"]
