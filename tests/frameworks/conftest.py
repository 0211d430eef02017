"""One 2-rank launch per framework for all the scenarios of this folder.

Starting ranks (spawned processes importing torch, DeepSpeed and transformers) costs far more on
CPU than the tiny-GPT-2 scenarios, so each framework's scenarios run in one launch (a session
fixture, started only when a test needs it) and the test modules assert on what they measured.
A scenario that raises is reported by its own tests (with the rank's traceback); the others
still run.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from zerohooks.testing import run_distributed

TIMEOUT = 900


def _launch(target: str, tmp: str) -> list[dict[str, Any]]:
    import importlib

    module = importlib.import_module(f"_{target}_scenarios")
    return run_distributed(getattr(module, f"all_{target}_scenarios"), 2, args=(tmp,), timeout=TIMEOUT)


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of the Hugging Face Trainer scenarios."""
    return _launch("trainer", str(tmp_path_factory.mktemp("trainer")))


@pytest.fixture(scope="session")
def accelerate_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of the accelerate scenarios."""
    return _launch("accelerate", str(tmp_path_factory.mktemp("accelerate")))


@pytest.fixture(scope="session")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of the Lightning scenarios."""
    return _launch("lightning", str(tmp_path_factory.mktemp("lightning")))


def scenario(runs: list[dict[str, Any]], name: str) -> list[Any]:
    """Each rank's result of scenario ``name``; fails the test with the rank's traceback if it raised."""
    out = []
    for rank, results in enumerate(runs):
        got = results[name]
        if "error" in got:
            pytest.fail(f"scenario {name!r} raised on rank {rank}:\n{got['error']}", pytrace=False)
        out.append(got["ok"])
    return out
