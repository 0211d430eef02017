"""Registry semantics: ordering, single owners, removable handles."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerohooks import GradientReducer, HookRegistry, OwnerConflictError, ReduceBucket


class _Reducer(GradientReducer):
    def reduce(self, bucket: ReduceBucket) -> None:
        return None


def test_transforms_run_in_order_then_name() -> None:
    reg = HookRegistry()
    calls: list[str] = []

    def make(tag: str, dtype: torch.dtype):
        def hook(param, d):
            calls.append(tag)
            return dtype

        return hook

    reg.register_reduce_dtype(make("late", torch.float32), name="b", order=10)
    reg.register_reduce_dtype(make("early-b", torch.bfloat16), name="b", order=-5)
    reg.register_reduce_dtype(make("early-a", torch.float16), name="a", order=-5)
    result = torch.float64
    for fn in reg.reduce_dtype.frozen:
        result = fn(None, result)
    assert calls == ["early-a", "early-b", "late"]
    assert result == torch.float32  # the last transform's output wins
    assert reg.summary()["reduce_dtype"] == ["a", "b", "b"]


def test_handle_removes_and_is_idempotent_and_a_context_manager() -> None:
    reg = HookRegistry()
    h = reg.register_before_step(lambda ctx: None, name="x")
    assert len(reg.before_step.frozen) == 1 and h.active
    h.remove()
    h.remove()
    assert reg.before_step.frozen == () and not h.active
    with reg.register_after_step(lambda ctx, skipped: None, name="y"):
        assert len(reg.after_step.frozen) == 1
    assert reg.after_step.frozen == ()


def test_second_reducer_owner_is_an_error_naming_both() -> None:
    reg = HookRegistry()
    first = reg.register_reducer(_Reducer(), name="loco")
    with pytest.raises(OwnerConflictError, match=r"'loco'.*'autocastzero'"):
        reg.register_reducer(_Reducer(), name="autocastzero")
    first.remove()
    reg.register_reducer(_Reducer(), name="autocastzero")  # free again once removed
    assert reg.reducer.name == "autocastzero"


def test_state_names_are_unique() -> None:
    reg = HookRegistry()

    class S:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    h = reg.register_state(S(), name="p")
    with pytest.raises(ValueError, match="'p' is already registered"):
        reg.register_state(S(), name="p")
    h.remove()
    reg.register_state(S(), name="p")


def test_prepare_model_transforms_chain() -> None:
    reg = HookRegistry()
    m1, m2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    reg.register_prepare_model(lambda model, ctx: None, name="keeps", order=0)
    reg.register_prepare_model(lambda model, ctx: m2 if model is m1 else None, name="swaps", order=1)
    assert reg.run_prepare_model(m1, None) is m2


def test_prepare_parameters_transforms_chain() -> None:
    reg = HookRegistry()
    seen: list[Any] = []
    reg.register_prepare_parameters(
        lambda ps, model, ctx: seen.append(list(ps)) or None, name="reads", order=0
    )
    h = reg.register_prepare_parameters(lambda ps, model, ctx: [{"params": ps}], name="groups", order=1)
    assert reg.run_prepare_parameters([1, 2], None, None) == [{"params": [1, 2]}]
    assert seen == [[1, 2]]
    h.remove()
    assert reg.run_prepare_parameters([3], None, None) == [3]
    reg.seal()
    with pytest.raises(RuntimeError, match="before the engine is built"):
        reg.register_prepare_parameters(lambda ps, model, ctx: None, name="late")
