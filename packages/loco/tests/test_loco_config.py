"""The ``"loco"`` section's bounds and the DeepSpeed settings loco refuses, raised by
``zerohooks.initialize`` before DeepSpeed builds anything, naming the key, the value and what is
accepted."""

from __future__ import annotations

from typing import Any

import pytest

import zerohooks
from loco import LocoConfig
from zerohooks import ConfigError
from zerohooks.testing.toy import ds_config, make_model


def _init(cfg: dict[str, Any]) -> None:
    model = make_model()
    zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        # issue #33: reset_T = 10**30 was accepted silently
        ({"reset_T": 10**30}, r"loco\.reset_T: .*got 1000000000000000000000000000000.*<= 2147483647"),
        ({"reset_T": 2**31}, r"loco\.reset_T: .*\(>= 0, <= 2147483647\)"),
        ({"exact_below": 2**48 + 1}, r"loco\.exact_below: .*<= 281474976710656"),
        ({"node_size": 2**16 + 1}, r"loco\.node_size: .*<= 65536"),
    ],
)
def test_values_past_a_bound_are_refused(section: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _init(ds_config(1, sections={"loco": section}))


def test_bounds_themselves_are_accepted() -> None:
    cfg = LocoConfig.model_validate({"reset_T": 2**31 - 1, "exact_below": 2**48, "node_size": 2**16})
    assert (cfg.reset_T, cfg.exact_below, cfg.node_size) == (2**31 - 1, 2**48, 2**16)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {"gradient_predivide_factor": 2.0},
            r"^gradient_predivide_factor is 2\.0: loco owns .*remove gradient_predivide_factor",
        ),
        ({"gradient_predivide_factor": 4}, r"^gradient_predivide_factor is 4: .*accepted value is 1\.0"),
        ({"prescale_gradients": True}, r"^prescale_gradients is True: loco owns .*remove prescale_gradients"),
    ],
)
def test_deepspeed_averaging_settings_are_refused_before_deepspeed(
    stage: int, extra: dict[str, Any], needle: str
) -> None:
    """Issue #33: on ZeRO 2/3 these were DeepSpeed's assertion once the model was built, on ZeRO
    0/1 the adapter's refusal after DeepSpeed built the engine (or, for prescale_gradients,
    nothing: loco's average ignored it)."""
    with pytest.raises(ConfigError, match=needle):
        _init(ds_config(stage, sections={"loco": {}}, **extra))


def test_deepspeed_defaults_pass() -> None:
    from loco import LocoPlugin

    for extra in (
        {"gradient_predivide_factor": 1.0},
        {"gradient_predivide_factor": 1},
        {"prescale_gradients": False},
    ):
        LocoPlugin(LocoConfig()).edit_deepspeed_config({**ds_config(2), **extra})


_PLAIN = (
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor != 1.0 is not yet supported"),
    ({"prescale_gradients": True}, "pre-scale gradients is not yet supported"),
)


def _plain_deepspeed() -> list[list[str]]:
    import deepspeed

    out = []
    for extra, _ in _PLAIN:
        row = []
        for init in (deepspeed.initialize, zerohooks.initialize):
            model = make_model()
            try:
                init(model=model, model_parameters=model.parameters(), config={**ds_config(3), **extra})
                row.append("built")
            except Exception as e:
                row.append(f"{type(e).__name__}: {e}")
        out.append(row)
    return out


@pytest.mark.multirank
def test_plain_deepspeed_refuses_them_on_zero3_in_its_own_words() -> None:
    """Without loco, DeepSpeed's own assertion stays (zerohooks.initialize is deepspeed.initialize)."""
    from zerohooks.testing import run_distributed

    rows = run_distributed(_plain_deepspeed, 1, timeout=300)[0]
    for (plain, ours), (_, words) in zip(rows, _PLAIN, strict=True):
        assert plain == ours and plain.startswith("AssertionError") and words in plain, plain


def _sequence_parallel_by_mpu() -> list[str]:
    """loco on ZeRO 2 and 3 with DeepSpeed's Ulysses mpu but without the config key (what
    DeepSpeed reads sequence parallelism from): each build's outcome."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(2)
    out = []
    for stage in (2, 3):
        model = make_model()
        try:
            zerohooks.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=ds_config(stage, "bf16", sections={"loco": {}}),
                mpu=parallel_state_sp,
            )
            out.append("built")
        except ConfigError as e:
            out.append(str(e))
    return out


@pytest.mark.multirank
def test_sequence_parallel_mpu_without_the_key_is_refused_on_zero2_and_zero3() -> None:
    """``sequence_parallel_size`` is refused before DeepSpeed builds; an engine made sequence
    parallel by its mpu alone is refused once built, on ZeRO 2 and 3 alike (loco averages over
    the whole data-parallel group and does not span DeepSpeed's sequence-parallel groups)."""
    from zerohooks.testing import run_distributed

    for outcome in run_distributed(_sequence_parallel_by_mpu, 2, timeout=300):
        assert len(outcome) == 2
        for message in outcome:
            assert "'loco' owns the gradient collective" in message, outcome
            assert "sequence parallelism" in message, outcome
