"""The universal-checkpoint row of the compatibility matrix: save on 2 ranks, convert with
DeepSpeed's own ``ds_to_universal``, resume with ``"checkpoint": {"load_universal": true}`` on 2
ranks (inside the matrix's one 2-rank launch) and on 1 rank (a launch of its own, the changed
world size the feature is for).

Every run trains :data:`SAVED` steps, saves (tag ``t``), and goes on for :data:`RESUMED` steps:
the uninterrupted run.  Rank 0 then converts the checkpoint, and a fresh engine on the same ranks
loads the universal checkpoint and trains the same :data:`RESUMED` steps.  The 1-rank launch loads
the same universal folders.
"""

from __future__ import annotations

import os
from typing import Any

SAVED, RESUMED = 2, 2
TAG = "t"


def folder(tmp: str, column: str, stage: int) -> str:
    """Where the run of ``column`` on ZeRO ``stage`` saves (the same folder on every rank)."""
    return os.path.join(tmp, "universal", f"{column}-{stage}")


def resume(make: Any, saved: str) -> dict[str, Any]:
    """A fresh engine (``make()``, configured with ``load_universal``) loads the universal
    checkpoint converted from ``saved`` and trains :data:`RESUMED` steps: its losses, and the
    warnings the load gave."""
    import warnings

    import zerohooks
    from zerohooks.testing.toy import train

    engine, gas = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, _client = engine.load_checkpoint(os.path.join(saved, "universal"))
    assert path is not None, f"nothing loaded from {saved}/universal"
    losses = train(engine, RESUMED, gas, first=SAVED)
    if zerohooks.attachment(engine) is not None:
        zerohooks.detach(engine)
    return {"losses": losses, "warnings": [str(w.message) for w in caught]}


def save_convert_resume(engine: Any, make: Any, saved: str, gas: int) -> dict[str, Any]:
    """The 2-rank part: ``engine`` (already trained :data:`SAVED` steps) saves and goes on
    (uninterrupted), rank 0 converts, a fresh engine from ``make()`` resumes."""
    import torch.distributed as dist

    from zerohooks.adapter.universal import to_universal
    from zerohooks.testing.toy import train

    engine.save_checkpoint(saved, tag=TAG)
    continued = train(engine, RESUMED, gas, first=SAVED)
    if int(os.environ["RANK"]) == 0:
        to_universal(saved, TAG)
    dist.barrier()
    return {"continued": continued, **resume(make, saved)}


def _dist(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def check_cell(
    found: list[dict[str, Any]], one_rank: dict[str, list[float]], column: str, cell: Any, gas: int
) -> None:
    """Judge ``column``'s universal cell (its :data:`SAVED`-step runs in ``found``, the 2-rank
    launch's findings, and ``one_rank``, the 1-rank resumes) against plain DeepSpeed's own
    universal load (column ``none``); ``gas`` micro-steps a step."""
    import json

    first, row = gas, "universal"  # the losses of the first resumed step
    for stage in cell.stages:
        key = json.dumps([column, stage, row])
        for i, rank in enumerate(found):
            ds_run, run = (rank["trained"][json.dumps([col, stage, row])] for col in ("none", column))
            assert ds_run["losses"] == ds_run["continued"], (stage, ds_run)
            lost = [w for w in run["warnings"] if "loco" in w and "error-feedback" in w]
            assert len(lost) == (i == 0 and column in ("loco", "all")), (column, stage, run["warnings"])
            if cell.tolerance == 0:
                assert run["losses"] == run["continued"], (column, stage, run)
                continue
            # loco: error feedback restarted; the weights were carried (first step identical)
            assert run["losses"][:first] == run["continued"][:first], (column, stage, run)
            assert _dist(run["losses"], run["continued"]) <= cell.tolerance, (column, stage, run)
            tol = 2 * _dist(run["continued"], ds_run["continued"]) + 1e-3
            assert _dist(run["losses"], ds_run["losses"]) <= tol, (column, stage, run, ds_run, tol)
        runs = found[0]["trained"]
        continued, ds = runs[key]["continued"], runs[json.dumps(["none", stage, row])]["continued"]
        one, ds_one = one_rank[json.dumps([column, stage])], one_rank[json.dumps(["none", stage])]
        assert one[:first] == continued[:first], (column, stage, one, continued)
        assert _dist(one[first:], continued[first:]) > 0, (column, stage, "1 rank trained as 2")
        tol = 2 * _dist(continued, ds) + 1e-3
        assert _dist(one, ds_one) <= tol, (column, stage, one, ds_one, tol)
