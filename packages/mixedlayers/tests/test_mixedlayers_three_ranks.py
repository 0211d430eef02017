"""ZeRO 3 on 3 ranks: padded partitions and non-persistent parameters (the partitioned path).

On 2 ranks every parameter of the toy model splits evenly and is small enough for ZeRO 3 to
keep gathered (persistent); here ``stage3_param_persistence_threshold`` is 0 and the world size
3 leaves fc2.bias (8 elements) padded, so :func:`mixedlayers.zero3.restore_zero3` rebuilds the
fp32 partitions of the partitioned, padded case.  Same checks as the 2-rank scenarios.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _mixed_common import KEPT, three_rank_scenario

from zerohooks.testing import run_distributed

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("checkpoints3"))
    return run_distributed(three_rank_scenario, 3, args=(tmp,), timeout=900)


def test_zero3_three_ranks(three_ranks: list[dict[str, Any]]) -> None:
    for res in three_ranks:
        for when in ("dtypes_init", "dtypes_trained", "dtypes_loaded"):
            assert {n: d for n, d in res[when].items() if d == "float32"}.keys() == set(KEPT), when
        assert all(res["masters_init_exact"].values())
        for n in KEPT:
            g, r = torch.as_tensor(res["grads"][n]), torch.as_tensor(res["ref_grads"][n])
            err = (g - r).abs().max().item() / r.abs().max().item()
            assert err < 2e-6, f"{n}: relative error {err:.2e}"
        assert all(res["masters_loaded_equal"].values())
        uninterrupted, resumed = res["resumed_losses"]
        assert resumed == uninterrupted
        assert (torch.tensor(res["losses"]) - torch.tensor(res["fp32_losses"])).abs().max() < 3e-2
