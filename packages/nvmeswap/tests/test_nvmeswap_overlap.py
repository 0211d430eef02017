"""nvmeswap's overlap of the optimizer with backward on 2 gloo ranks, ZeRO 3, two micro-steps a
step: read-ahead (``prefetch_bytes``) and speculative steps during backward (``step_in_backward``).

The oracles: the same run with ``prefetch_bytes: 0`` (today's nvmeswap, itself bit-identical to
DeepSpeed's own CPU offload, test_nvmeswap_training.py) and DeepSpeed's CPU offload.  Every
interruption (a checkpoint saved or loaded, a detach, while sub-groups are read ahead; an
fp16 step the loss scaler skips; an exception raised in backward) runs the same sequence with
the read-ahead (or the steps during backward) on and off: losses and state must be equal bit for
bit, and the read-ahead (or a speculative step) must have been under way at the interruption (else
the test proves nothing).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _nvme_common import (
    _build,
    _oracle_config,
    _state,
    config,
    masters,
    moments,
    params16,
    train,
    two_rank_results,
)

from zerohooks.testing import run_distributed

pytestmark = pytest.mark.multirank

ALL = 1 << 30
"""``prefetch_bytes`` holding every sub-group of the test model (a few MB each)."""
BUCKET = 100_000
"""``reduce_bucket_size``: DeepSpeed reduces (and so finalises) gradients during backward, in
buckets of this many elements, not all at its end (the default bucket holds the whole model)."""


def _config(path: str, section: dict[str, Any], **kw: Any) -> dict[str, Any]:
    cfg = config(path, nvmeswap=section, **kw)
    cfg["zero_optimization"]["reduce_bucket_size"] = BUCKET
    return cfg


def _at_boundary(note: Any, action: Any) -> Any:
    """A ``_run`` probe that, at the step boundary (the last backward done, the step not yet
    run: sub-groups are read ahead), records ``note(engine)`` then does ``action(engine)``."""

    def probe(engine: Any, boundary: bool) -> None:
        if boundary:
            note(engine)
            action(engine)

    return probe


def _run(engine: Any, steps: int, first: int = 0, probe: Any = None) -> list[float]:
    """``_nvme_common.train``'s batches, two micro-steps a step; ``probe(engine, boundary)`` after
    each backward."""
    return train(engine, steps, first=first, probe=probe)


def _local(engine: Any) -> list[torch.Tensor]:
    """This rank's fp32 partitions and moments, read from the optimizer (no collective)."""
    opt = engine.optimizer
    out = []
    for t in opt.fp32_partitioned_groups_flat:
        out.append(t.detach().clone())
        st = opt.optimizer.state.get(t, {})
        out += [st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq") if k in st]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _prefetched(engine: Any) -> int:
    st = _state(engine)
    return len(st.prefetched) if st is not None else -1


def _early(engine: Any) -> Any:
    import zerohooks

    att = zerohooks.attachment(engine)
    return next(p for p in att.plugins if p.name == "nvmeswap").early if att is not None else None


def _stepped_early(engine: Any) -> int:
    """Sub-groups stepped so far in this window's backward (the thread's queue drained first)."""
    from nvmeswap import early

    es = _early(engine)
    if es is None:
        return len(_state(engine).prefetched) if _state(engine) is not None else -1
    early.drain(es)
    return 0 if es.decided else len(es.touched)


MODES = {"prefetch": {"prefetch_bytes": ALL}, "step": {"step_in_backward": True}}
"""The two overlaps, each tested against the run with neither."""


def scenario_equal(tmp: str) -> dict[str, Any]:
    """Read-ahead of every sub-group, of one, and none: the same losses, weights, masters and
    moments as DeepSpeed's CPU offload, and the same bytes moved."""
    import zerohooks

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    ref_cfg = _oracle_config(f"{tmp}/eq_oracle{rank}")
    ref_cfg["zero_optimization"]["reduce_bucket_size"] = BUCKET
    ref = _build(ref_cfg, plugins=False)
    out["oracle"] = _run(ref, 4)
    oracle = (params16(ref), masters(ref), moments(ref))
    off = _build(_config(f"{tmp}/eq_off{rank}", {}))
    capacity = _state(off).capacity
    out["numels"] = [g.numel for g in _state(off).groups.values()]
    try:
        _build(_config(f"{tmp}/eq_small{rank}", {"prefetch_bytes": capacity - 1}))
        out["small_error"] = ""
    except zerohooks.ConfigError as e:
        out["small_error"] = str(e)
    out["capacity"] = capacity
    engines = {"off": off}
    engines["all"] = _build(_config(f"{tmp}/eq_all{rank}", {"prefetch_bytes": ALL}))
    engines["one"] = _build(_config(f"{tmp}/eq_one{rank}", {"prefetch_bytes": capacity}))
    engines["step"] = _build(_config(f"{tmp}/eq_step{rank}", MODES["step"]))
    out["step_file_bytes"] = [
        _state(engines["step"]).file_bytes(g) for g in _state(engines["step"]).groups.values()
    ]
    out["off_file_bytes"] = [capacity_of(off, g) for g in _state(off).groups.values()]
    for name, eng in engines.items():
        st = _state(eng)
        seen: list[tuple[bool, int]] = []
        out[f"{name}_losses"] = _run(
            eng, 4, probe=lambda e, b, seen=seen: seen.append((b, _stepped_early(e)))
        )
        out[f"{name}_probes"] = seen
        out[f"{name}_slots"] = (st.prefetch_slots, len(st.slots), st.buffer_count)
        out[f"{name}_hits"] = st.prefetch_hits
        out[f"{name}_bytes"] = (st.bytes_read, st.bytes_written)
        es = _early(eng)
        out[f"{name}_early"] = (es.steps, es.undone) if es is not None else None
        out[f"{name}_equal"] = [
            _same(x, y) for x, y in zip(oracle, (params16(eng), masters(eng), moments(eng)), strict=True)
        ]
        zerohooks.detach(eng)
    return out


def capacity_of(engine: Any, g: Any) -> int:
    return int(_state(engine).file_bytes(g))


def _sequence(tmp: str, name: str, mode: str | None) -> dict[str, Any]:
    """One interruption, with an overlap ``mode`` of :data:`MODES` or none: what it returns must be
    the same."""
    import zerohooks

    rank = int(os.environ["RANK"])
    section = MODES[mode] if mode else {}
    tag = f"{name}_{mode or 'off'}"
    folder, ckpt = f"{tmp}/{tag}{rank}", f"{tmp}/{tag}_ckpt"
    kw: dict[str, Any] = {}
    if name == "overflow":
        kw["dtype"] = "fp16"
    cfg = _config(folder, section, **kw)
    if name == "overflow":  # 2**32 overflows fp16 gradients: the first steps are skipped
        cfg["fp16"].update(initial_scale_power=32, hysteresis=1)
    eng = _build(cfg)
    out: dict[str, Any] = {"at_interruption": -1}

    def note(e: Any) -> None:
        out["at_interruption"] = _stepped_early(e)

    if name == "save_mid":  # saved between the last backward and the step
        out["losses"] = _run(eng, 2)

        save = _at_boundary(note, lambda e: e.save_checkpoint(ckpt, tag="mid"))
        out["losses"] += _run(eng, 1, first=2, probe=save)
        out["losses"] += _run(eng, 1, first=3)
        out["state"] = _local_after_detach(eng)
        again = _build(_config(f"{folder}_again", section, **kw))
        again.load_checkpoint(ckpt, tag="mid")
        # each sub-group's pages of the mapped checkpoint were dropped once it was written back
        st = _state(again)
        out["dropped"] = (st.pages_dropped, sum(3 * 4 * g.numel for g in st.groups.values()), len(st.groups))
        out["resumed"] = _run(again, 2, first=2)
        out["resumed_state"] = _local_after_detach(again)
    elif name == "load_mid":  # an older checkpoint loaded while the newer state is read ahead
        out["losses"] = _run(eng, 2)
        eng.save_checkpoint(ckpt, tag="s2")
        out["losses"] += _run(eng, 1, first=2)

        def load(e: Any) -> None:
            e.load_checkpoint(ckpt, tag="s2")
            out["after_load"] = _stepped_early(e)

        out["losses"] += _run(eng, 1, first=3, probe=_at_boundary(note, load))
        out["losses"] += _run(eng, 1, first=4)
        out["state"] = _local_after_detach(eng)
    elif name == "detach_mid":  # detached between the last backward and the step
        out["losses"] = _run(eng, 2)

        out["losses"] += _run(eng, 1, first=2, probe=_at_boundary(note, zerohooks.detach))
        out["losses"] += _run(eng, 1, first=3)
        out["state"] = _local(eng)
    elif name == "overflow":  # fp16 steps skipped by the loss scaler after the read-ahead began
        seen: list[tuple[bool, int, int]] = []

        def probe(e: Any, boundary: bool) -> None:
            seen.append((boundary, _stepped_early(e), e.skipped_steps))
            if boundary and e.skipped_steps == 0:  # the first steps overflow
                note(e)

        out["losses"] = _run(eng, OVERFLOW_STEPS, probe=probe)
        out["probes"] = seen
        out["skipped"] = eng.skipped_steps
        out["state"] = _local_after_detach(eng)
    elif name == "exception":  # backward raises at the last micro-step, part of the way through
        out["losses"] = _run(eng, 2)
        x = torch.randn(4, 600, generator=torch.Generator().manual_seed(7 + rank)).to(torch.bfloat16)
        eng.backward((eng(x).float() - x.float()).pow(2).mean())  # a non-boundary micro-step first
        eng.step()
        x2 = x.clone().requires_grad_(True)  # its gradient comes last: the first layer's after

        def boom(_: torch.Tensor) -> None:
            note(eng)
            raise RuntimeError("boom in backward")

        x2.register_hook(boom)
        try:
            eng.backward((eng(x2).float() - x.float()).pow(2).mean())
            out["raised"] = ""
        except RuntimeError as e:
            out["raised"] = str(e)
        out["state"] = _local_after_detach(eng)
    return out


def _local_after_detach(engine: Any) -> list[torch.Tensor]:
    import zerohooks

    zerohooks.detach(engine)  # every sub-group back in RAM, read and verified
    return _local(engine)


OVERFLOW_STEPS = 12
"""fp16 steps from a loss scale of 2**32: the first ones overflow and are skipped."""
INTERRUPTIONS = ("save_mid", "load_mid", "detach_mid", "overflow", "exception")


def scenario_interruptions(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in INTERRUPTIONS:
        off = _sequence(tmp, name, None)
        for mode in MODES:
            on = _sequence(tmp, name, mode)
            out[f"{name}/{mode}"] = {
                "on": {k: v for k, v in on.items() if "state" not in k},
                "off": {k: v for k, v in off.items() if "state" not in k},
                "state_equal": {k: _same(on[k], off[k]) for k in on if "state" in k},
            }
    return out


CLIPS = {"clips": 1e-3, "never_clips": 1e6, "unfused": 0.0}
"""``gradient_clipping`` per case of :func:`scenario_clip` (``unfused``: none, torch's AdamW step
through DeepSpeed's own unscale and step instead of the fused kernel)."""


def scenario_clip(tmp: str) -> dict[str, Any]:
    """Steps during backward where DeepSpeed's factor is not the assumed one (clipping that clips:
    every speculative step undone), where clipping is on but does not clip (all taken), and on
    the unfused step: losses and state equal the run without them."""
    import zerohooks

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    for case, clip in CLIPS.items():
        runs = {}
        for mode in ("off", "step"):
            section: dict[str, Any] = dict(MODES["step"]) if mode == "step" else {}
            if case == "unfused":
                section["fused_adam"] = False
            cfg = _config(f"{tmp}/clip_{case}_{mode}{rank}", section)
            cfg["gradient_clipping"] = clip
            eng = _build(cfg)
            losses = _run(eng, 3)
            es = _early(eng)
            runs[mode] = (losses, (params16(eng), masters(eng), moments(eng)))
            out[f"{case}_{mode}_early"] = (es.steps, es.undone, es.paused) if es is not None else None
            out[f"{case}_{mode}_fused"] = _state(eng).fused_steps
            zerohooks.detach(eng)
        out[f"{case}_losses"] = (runs["step"][0], runs["off"][0])
        out[f"{case}_equal"] = [_same(x, y) for x, y in zip(runs["step"][1], runs["off"][1], strict=True)]
    return out


def _scenarios(tmp: str) -> dict[str, Any]:
    return {
        "equal": scenario_equal(tmp),
        "clip": scenario_clip(tmp),
        "interruptions": scenario_interruptions(tmp),
    }


@pytest.fixture(scope="module")
def overlap(
    tmp_path_factory: pytest.TempPathFactory, native_engine: bool, fused_kernel: bool
) -> list[dict[str, Any]]:
    return two_rank_results(tmp_path_factory, "overlap", _scenarios)


@pytest.mark.parametrize("name", ["all", "one", "step"])
def test_read_ahead_is_bit_identical(overlap: list[dict[str, Any]], name: str) -> None:
    """Losses, 16-bit weights, masters and moments equal DeepSpeed's CPU offload and the run
    without read-ahead (or without steps during backward) bit for bit; the same bytes are read
    and written (nothing read twice)."""
    for r in overlap:
        t = r["equal"]
        assert t[f"{name}_losses"] == t["off_losses"] == t["oracle"]
        assert t[f"{name}_equal"] == [True, True, True] and t["off_equal"] == [True, True, True]
        assert t[f"{name}_bytes"] == t["off_bytes"]


def test_read_ahead_only_at_the_boundary_and_within_budget(overlap: list[dict[str, Any]]) -> None:
    """Sub-groups are read ahead in the boundary micro-step's backward only (gradient
    accumulation: none after the first micro-step), at most as many as ``prefetch_bytes`` holds,
    and each is found by its step; without ``prefetch_bytes`` nothing is read ahead."""
    for r in overlap:
        t = r["equal"]
        groups = len(t["numels"])
        assert groups >= 2
        assert t["all_slots"] == (groups, t["all_slots"][2] + groups, t["all_slots"][2])
        assert t["one_slots"][0] == 1 and t["off_slots"][0] == 0
        for name, most in (("all", groups), ("one", 1)):
            probes = t[f"{name}_probes"]
            assert [n for b, n in probes if not b] == [0] * 4
            # the last sub-group's gradient is final before backward ends: read ahead at once
            assert all(1 <= n <= most for b, n in probes if b), probes
            assert t[f"{name}_hits"] == sum(n for b, n in probes if b)
        assert t["off_hits"] == 0 and all(n == 0 for _, n in t["off_probes"])


def test_steps_during_backward_are_taken_by_the_step(overlap: list[dict[str, Any]]) -> None:
    """``step_in_backward``: every step after the first finds sub-groups already stepped during the
    boundary backward (none in the first micro-step of a window) and takes them all, none undone;
    each swap file holds two regions."""
    for r in overlap:
        t = r["equal"]
        groups = len(t["numels"])
        probes = t["step_probes"]
        assert [n for b, n in probes if not b] == [0] * 4
        assert all(1 <= n <= groups for b, n in probes if b), probes
        steps, undone = t["step_early"]
        assert steps == sum(n for b, n in probes if b) and undone == 0
        assert t["step_file_bytes"] == [2 * b for b in t["off_file_bytes"]]
        assert t["off_early"] is None


@pytest.mark.parametrize("case", list(CLIPS))
def test_steps_during_backward_taken_or_undone_by_the_factor(
    overlap: list[dict[str, Any]], case: str
) -> None:
    """Clipping that clips makes DeepSpeed's factor differ from the assumed one: every speculative
    step is undone and the step runs as without them; clipping that does not clip, and the
    unfused step, take them all.  Losses and state are those of the run without them, bit for bit."""
    for r in overlap:
        t = r["clip"]
        step_losses, off_losses = t[f"{case}_losses"]
        assert step_losses == off_losses and len(step_losses) == 6
        assert t[f"{case}_equal"] == [True, True, True]
        steps, undone, paused = t[f"{case}_step_early"]
        groups = len(r["equal"]["numels"])
        if case == "clips":  # undone, paused one window (the backoff), undone again
            assert (steps, undone, paused) == (0, 2 * groups, 1)
        else:
            assert (steps, undone, paused) == (3 * groups, 0, 0)
        assert (t[f"{case}_off_fused"] == 0) == (case == "unfused")


def test_prefetch_bytes_below_one_buffer_is_refused(overlap: list[dict[str, Any]]) -> None:
    for r in overlap:
        t = r["equal"]
        msg = t["small_error"]
        assert (
            "nvmeswap.prefetch_bytes" in msg and str(t["capacity"] - 1) in msg and str(t["capacity"]) in msg
        )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", INTERRUPTIONS)
def test_interruption_with_read_ahead(overlap: list[dict[str, Any]], name: str, mode: str) -> None:
    """The interruption came while sub-groups were read ahead (or stepped during backward and not
    yet taken by the step), and the run (losses, and the state each rank holds, read back and
    verified at detach) is the run with neither."""
    for r in overlap:
        t = r["interruptions"][f"{name}/{mode}"]
        on, off = t["on"], t["off"]
        assert on["at_interruption"] >= 1 and off["at_interruption"] == 0
        assert on["losses"] == off["losses"] and on["losses"]
        assert t["state_equal"] and all(t["state_equal"].values()), t["state_equal"]
        if name == "save_mid":  # a fresh engine resumes from the checkpoint saved mid-window
            assert on["resumed"] == off["resumed"] == on["losses"][4:8]
            dropped, state_bytes, groups = on["dropped"]
            assert state_bytes - 3 * groups * 8192 <= dropped <= state_bytes
        if name == "load_mid":  # nothing read before the load survives it
            assert on["after_load"] == 0
        if name == "overflow":
            assert on["skipped"] == off["skipped"] >= 1
            assert on["skipped"] < OVERFLOW_STEPS  # some steps were taken too
            # read ahead before a step that was skipped, and dropped with it: nothing is held
            # at the next micro-step (none is a boundary: two micro-steps a step)
            probes = on["probes"]
            assert any(
                b and n >= 1 and probes[k + 1][2] > skipped for k, (b, n, skipped) in enumerate(probes[:-1])
            )
            assert all(n == 0 for b, n, _ in probes if not b)
        if name == "exception":
            assert on["raised"] == off["raised"] == "boom in backward"


def _train_then_die(folder: str, ckpt: str, mode: str) -> None:
    """Rank 1 is killed after the last backward of step 4, with sub-groups read ahead or stepped
    during backward (their count written next to its folder first)."""
    import signal

    rank = int(os.environ["RANK"])
    engine = _build(_config(f"{folder}{rank}", MODES[mode]))
    _run(engine, 2)
    engine.save_checkpoint(ckpt, tag="s2")
    _run(engine, 1, first=2)

    def die(e: Any, boundary: bool) -> None:
        if boundary and rank == 1:
            with open(f"{folder}{rank}.prefetched", "w") as f:
                f.write(str(_stepped_early(e)))
            os.kill(os.getpid(), signal.SIGKILL)

    _run(engine, 1, first=3, probe=die)


def _resume(folder: str, ckpt: str, mode: str) -> dict[str, Any]:
    import zerohooks

    rank = int(os.environ["RANK"])
    engine = _build(_config(f"{folder}{rank}", MODES[mode]))
    engine.load_checkpoint(ckpt, tag="s2")
    losses = _run(engine, 2, first=2)
    zerohooks.detach(engine)
    return {"losses": losses}


@pytest.mark.parametrize("mode", list(MODES))
def test_killed_rank_with_read_ahead_then_resume(
    tmp_path: Any, overlap: list[dict[str, Any]], mode: str
) -> None:
    """A rank killed while sub-groups were read ahead (or stepped during backward) leaves nothing
    that a resume from the last checkpoint trusts: the resumed steps equal the uninterrupted run
    with neither."""
    from zerohooks.testing import MultiRankError

    folder, ckpt = str(tmp_path / "swap"), str(tmp_path / "ckpt")
    with pytest.raises(MultiRankError):  # rank 1 died; rank 0 dies with it or fails in gloo
        run_distributed(_train_then_die, 2, args=(folder, ckpt, mode), timeout=600)
    with open(f"{folder}1.prefetched") as f:
        assert int(f.read()) >= 1
    resumed = run_distributed(_resume, 2, args=(folder, ckpt, mode), timeout=600)
    for r, ref in zip(resumed, overlap, strict=True):
        assert r["losses"] == ref["equal"]["off_losses"][4:8]
