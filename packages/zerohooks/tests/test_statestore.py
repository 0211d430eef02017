"""The optimizer-state store's build-time deferral replaces DeepSpeed's ZeRO-3 class methods only
while the context is open, and puts DeepSpeed's own back however it ends (the engine-level
take-overs are checked by nvmeswap's tests: detach restores a working engine, bit for bit)."""

from __future__ import annotations

import pytest

from zerohooks.adapter import statestore

_METHODS = ("_create_momentum_buffer", "initialize_optimizer_states")


def _own() -> dict[str, object]:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as cls

    return {n: cls.__dict__[n] for n in _METHODS}


def test_deferral_replaces_the_build_methods_only_inside_the_context() -> None:
    before = _own()
    with statestore.deferred_state(1, keep_master=False):
        inside = _own()
        assert all(inside[n] is not before[n] for n in _METHODS)
    assert _own() == before


def test_deferral_is_undone_when_the_build_fails() -> None:
    before = _own()
    with pytest.raises(RuntimeError, match="build failed"), statestore.deferred_state(1, keep_master=True):
        raise RuntimeError("build failed")
    assert _own() == before
