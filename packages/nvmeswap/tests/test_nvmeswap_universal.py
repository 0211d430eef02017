"""Universal checkpoints (``ds_to_universal``, then ``"checkpoint": {"load_universal": true}``)
with nvmeswap: its checkpoints are DeepSpeed's own format, so DeepSpeed's converter takes them,
and a universal load writes each swapped sub-group to its swap file, one sub-group at a time
(:mod:`zerohooks.adapter.unistate`).

Oracles: the uninterrupted run (resumed on the same 2 ranks, every loss equal) and DeepSpeed's
own CPU offload loading the same universal folder (equal too: nvmeswap's numerics are its).  The
model's three sub-groups a rank are all swapped; with the masters kept in RAM
(``keep_master_in_ram``) only the moments go through the files.  A sub-group left unwritten (its
swap file holding the fresh engine's state) or written from another sub-group's partitions moves
the losses after the first resumed step.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch.distributed as dist
from _nvme_common import _build, _oracle_config, config, train

from zerohooks.adapter.universal import to_universal
from zerohooks.testing import run_distributed

SAVED, RESUMED = 2, 2


def _universal(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**cfg, "checkpoint": {"load_universal": True}}


def _run(tmp: str) -> dict[str, Any]:
    import zerohooks

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for mode, section in (("files", {}), ("ram", {"keep_master_in_ram": True})):
        saved = os.path.join(tmp, mode, "ckpt")
        engine = _build(config(os.path.join(tmp, mode, "a"), nvmeswap=section))
        train(engine, SAVED)
        engine.save_checkpoint(saved, tag="t")
        continued = train(engine, RESUMED, first=SAVED)
        swapped = len(zerohooks.attachment(engine).plugins[0].state.groups)  # type: ignore[union-attr]
        zerohooks.detach(engine)
        if rank == 0:
            to_universal(saved, "t")
        dist.barrier()
        engine = _build(_universal(config(os.path.join(tmp, mode, "b"), nvmeswap=section)))
        engine.load_checkpoint(os.path.join(saved, "universal"))
        resumed = train(engine, RESUMED, first=SAVED)
        zerohooks.detach(engine)
        oracle = _build(_universal(_oracle_config(os.path.join(tmp, mode, "c"))))
        oracle.load_checkpoint(os.path.join(saved, "universal"))
        out[mode] = {
            "continued": continued,
            "resumed": resumed,
            "oracle": train(oracle, RESUMED, first=SAVED),
            "swapped": swapped,
        }
    return out


@pytest.mark.multirank
def test_universal_load_resumes_the_uninterrupted_run(tmp_path: Any) -> None:
    for rank in run_distributed(_run, 2, args=(str(tmp_path),), timeout=600):
        for mode, run in rank.items():
            assert run["swapped"] >= 2, (mode, run["swapped"])  # several swapped sub-groups
            assert run["resumed"] == run["continued"], (mode, run)
            assert run["oracle"] == run["continued"], (mode, run)
