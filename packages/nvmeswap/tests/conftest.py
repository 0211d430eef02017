"""One 2-rank launch for all the multi-rank scenarios of this folder (starting ranks is the slow part)."""

from __future__ import annotations

from typing import Any

import pytest
from _nvme_common import all_two_rank_scenarios, two_rank_results


@pytest.fixture(scope="session")
def native_engine() -> bool:
    """Build the C++ I/O engine in the parent process, so the ranks load it without racing."""
    from nvmeswap import io

    return io.load_native() is not None


@pytest.fixture(scope="session")
def fused_kernel() -> bool:
    """Build the fused Adam kernel in the parent process (the ranks then load the cached build)."""
    from nvmeswap import adam

    return adam.supported()


@pytest.fixture(scope="session")
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory, native_engine: bool, fused_kernel: bool
) -> list[dict[str, Any]]:
    """Every rank's results of every 2-rank scenario (run once per test session)."""
    return two_rank_results(tmp_path_factory, "nvmeswap", all_two_rank_scenarios)
