"""Assertions on a plugin scenario's measurements, shared by the Trainer and accelerate tests.

Every expected number comes from the model (parameter counts by module class) and from the
world size: what a bf16 ring all-reduce of the same gradients would send, the bytes a dtype
takes, the elements of this rank's ZeRO-3 partition.
"""

from __future__ import annotations

import itertools
from typing import Any

from _frameworks_common import GAS, WORLD

BF16, FP32 = 2, 4


def check_attached(rank: dict[str, Any], plugin: str) -> None:
    assert rank["attached"], "zerohooks.attachment(engine) is None: enable() did not reach the framework"
    assert plugin in rank["plugins"], rank["plugins"]


def check_plain(rank: dict[str, Any]) -> None:
    """No plugin section: zerohooks attached, nothing enabled, DeepSpeed reduces bf16 gradients."""
    assert rank["attached"] and rank["plugins"] == []
    for step in rank["steps"]:  # ZeRO 2 hands every gradient over at each micro-step
        assert step == {"bfloat16": BF16 * rank["numel"] * GAS}, step


def check_loco(rank: dict[str, Any]) -> None:
    check_attached(rank, "loco")
    assert rank["reducer"] == "loco"
    assert rank["loco"], "loco counted no step"
    for stats in rank["loco"]:
        # the oracle: a bf16 ring all-reduce of every gradient element of every micro-step; loco
        # sends 0.266 of it per hop, and reduces a bucket to the ranks that keep its slices in
        # one hop (0.133) or all-reduces it in two (0.266) when the slices are too uneven
        bf16_ring = 2 * (WORLD - 1) / WORLD * BF16 * rank["numel"] * GAS
        ratio = stats["wire_bytes"] / bf16_ring
        high = 0.29 if "wire:all_gather" in stats else 0.18
        assert 0.125 <= ratio <= high, (
            f"loco sent {ratio:.4f}x the bytes of a bf16 all-reduce (expected 0.133-0.27; stats {stats})"
        )


def check_accumdtype(rank: dict[str, Any]) -> None:
    check_attached(rank, "accumdtype")
    assert "accum_dtype=torch.float32" in rank["plan"], rank["plan"]
    # between two micro-steps the accumulated gradient is fp32 (the model is bf16)
    assert rank["mid_window_dtypes"] and all(d == ["torch.float32"] for d in rank["mid_window_dtypes"])
    for step in rank["steps"]:  # reduced in fp32: twice the bytes of the bf16 model's gradients
        assert step == {"float32": FP32 * rank["numel"] * GAS}, step


def check_autocastzero(rank: dict[str, Any]) -> None:
    check_attached(rank, "autocastzero")
    safe, total = rank["safe_numel"], rank["numel"]
    assert 0 < safe < total
    for step in rank["steps"]:
        # Linear and GPT-2's Conv1D in bf16, the rest (embeddings, tied head, LayerNorm) in fp32
        assert step == {"bfloat16": BF16 * safe * GAS, "float32": FP32 * (total - safe) * GAS}, step


def check_mixedlayers(rank: dict[str, Any]) -> None:
    check_attached(rank, "mixedlayers")
    assert rank["ln_dtypes"] == ["torch.float32"], rank["ln_dtypes"]
    assert rank["other_dtypes"] == ["torch.bfloat16"], rank["other_dtypes"]
    kept, total = rank["ln_numel"], rank["numel"]
    for step in rank["steps"]:
        assert step == {"bfloat16": BF16 * (total - kept) * GAS, "float32": FP32 * kept * GAS}, step


def check_nvmeswap(rank: dict[str, Any]) -> None:
    check_attached(rank, "nvmeswap")
    part = rank["partition_numel"]
    assert part * WORLD >= rank["numel"]
    # the swap files (each rank's folder also holds owner.lock, its claim on the folder)
    files = {path: size for path, size in rank["files"][-1].items() if path.endswith(".swp")}
    assert files, f"no swap file under the nvme_path: {sorted(rank['files'][-1])}"
    # fp32 master + two Adam moments of this rank's partition, 4 KiB-aligned, plus a header page
    for size in files.values():
        assert 3 * FP32 * part <= size <= 3 * FP32 * part + 4 * 4096, (size, part)
    io = rank["io"]
    assert len(io) >= 2
    for (w0, r0), (w1, r1) in itertools.pairwise(io):
        # each optimizer step reads and writes the swapped state once: 12 bytes per element
        for moved in (w1 - w0, r1 - r0):
            assert 3 * FP32 * part <= moved <= 3 * FP32 * part + 4 * 4096 + 64 * 1024, (moved, part)


CHECKS = {
    "plain": check_plain,
    "loco": check_loco,
    "accumdtype": check_accumdtype,
    "autocastzero": check_autocastzero,
    "autocastzero_conv1d": check_autocastzero,
    "mixedlayers": check_mixedlayers,
    "nvmeswap": check_nvmeswap,
}
