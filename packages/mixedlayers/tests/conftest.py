"""One 2-rank launch for all the multi-rank scenarios of this folder.

Starting ranks (spawned processes importing torch and DeepSpeed) costs far more on CPU than the
scenarios themselves, so every 2-rank scenario runs in one launch, with DeepSpeed's CPU
accelerator told to accept fp16 (``fp16_on_cpu``; it changes nothing for bf16 and fp32).  Each
test module takes its part of the results and asserts on it.
"""

from __future__ import annotations

from typing import Any

import pytest
from _mixed_common import all_two_rank_scenarios

from zerohooks.testing import run_distributed


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of every 2-rank scenario (run once per test session)."""
    tmp = str(tmp_path_factory.mktemp("checkpoints"))
    return run_distributed(all_two_rank_scenarios, 2, args=(tmp,), timeout=1500, fp16_on_cpu=True)
