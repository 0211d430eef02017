"""Optimizers other than Adam/AdamW with nvmeswap (issue #33), on 2 gloo ranks.

SGD is not an optimizer DeepSpeed has tested with ZeRO: without
``"zero_allow_untested_optimizer": true`` zerohooks.initialize refuses it before DeepSpeed builds
anything, naming the key and the fix (it was DeepSpeed's assertion once the model was built).
With the key, nvmeswap swaps its momentum buffer and steps it unfused, bit for bit DeepSpeed's
own CPU offload of the same SGD.
"""

from __future__ import annotations

from typing import Any

import pytest
from _nvme_common import scenario_sgd

from zerohooks.testing import run_distributed

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def sgd_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(scenario_sgd, 2, args=(str(tmp_path_factory.mktemp("sgd")),), timeout=600)


def test_sgd_without_the_key_is_refused_before_deepspeed_builds(sgd_ranks: list[dict[str, Any]]) -> None:
    for r in sgd_ranks:
        message = r["refusal"]
        assert message is not None, "SGD with nvmeswap was built without zero_allow_untested_optimizer"
        assert 'optimizer.type "SGD"' in message
        assert '"zero_allow_untested_optimizer": true' in message and '"AdamW"' in message
        assert r["refused_files"] == []  # refused before nvmeswap made a swap file


def test_sgd_with_the_key_equals_deepspeed_offload(sgd_ranks: list[dict[str, Any]]) -> None:
    for r in sgd_ranks:
        assert r["swapped"] > 0 and r["keys"] == ["momentum_buffer"]
        assert r["losses"] == r["oracle_losses"]
        assert r["equal"] == [True, True]  # 16-bit parameters, fp32 masters
