"""The IPG buffers on ZeRO 2 when mixedlayers splits the gradients over two buckets.

DeepSpeed gives every IPG bucket ``reduce_bucket_size`` elements (500 M by default): on an H100
the bucket of mixedlayers' fp32 modules, a few MB of LayerNorm and head gradients, took 1 GB of
GPU memory (benchmarks/RESULTS.md, GPU suite).  zerohooks now sizes each bucket's buffers to the
gradients that can be in it; training is bitwise the same as with DeepSpeed's sizes.
"""

from __future__ import annotations

from typing import Any

import pytest
from _mixed_common import KEPT, SMALL_BUCKET, bucket_scenario

from zerohooks.testing import run_distributed

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def buckets() -> list[dict[str, Any]]:
    return run_distributed(bucket_scenario, 2, timeout=600)


def test_buffers_are_sized_to_their_buckets(buckets: list[dict[str, Any]]) -> None:
    """Default ``reduce_bucket_size``: each bucket's buffers hold exactly its gradients (the fp32
    bucket's in fp32, mixedlayers' staging); 8: DeepSpeed's own size, 8 elements, every bucket."""
    for res in buckets:
        copies = 2 if res["overlap_comm"] else 1
        fp32 = sum(res["numel"][n] for n in KEPT)
        bf16 = sum(res["numel"].values()) - fp32
        assert res["fitted_reduce_bucket_size"] > bf16 + fp32
        assert res["fitted_buffers"] == {
            "bfloat16": [(bf16, "bfloat16")] * copies,
            "float32": [(fp32, "float32")] * copies,
        }
        # each buffer allocated once, in its final dtype and size (no model-dtype buffer for
        # the fp32 bucket first, then an fp32 one)
        for run in ("fitted", "deepspeed"):
            kept = sorted(b for bufs in res[f"{run}_buffers"].values() for b in bufs)
            assert res[f"{run}_allocated"] == kept, run
        assert res["deepspeed_reduce_bucket_size"] == SMALL_BUCKET
        assert res["deepspeed_buffers"] == {
            "bfloat16": [(SMALL_BUCKET, "bfloat16")] * copies,
            "float32": [(SMALL_BUCKET, "float32")] * copies,
        }


def test_training_is_bitwise_deepspeeds_sizes(buckets: list[dict[str, Any]]) -> None:
    for res in buckets:
        assert res["fitted_losses"] == res["deepspeed_losses"]
        assert res["fitted_masters"] == res["deepspeed_masters"]
    assert buckets[0]["fitted_masters"] == buckets[1]["fitted_masters"]
