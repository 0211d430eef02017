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
