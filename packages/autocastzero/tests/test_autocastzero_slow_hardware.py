"""autocastzero warns once when bfloat16 autocast is emulated on this CPU (no native bf16)."""

from __future__ import annotations

import warnings

import pytest
import torch

import zerohooks.adapter.compat
from autocastzero import plugin


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "_slow_warned", False)


def test_emulated_bf16_warns_once_with_the_reason_and_the_alternative(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(zerohooks.adapter.compat, "native_bf16", lambda cuda=False: False)
    with pytest.warns(RuntimeWarning, match=r"no native bf16.*AVX512-BF16/AMX.*slower than fp32.*fp32"):
        assert plugin.warn_if_slow_here("cpu", torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plugin.warn_if_slow_here("cpu", torch.bfloat16)  # once per process


@pytest.mark.parametrize(
    ("native", "device", "dtype"),
    [(True, "cpu", torch.bfloat16), (False, "cpu", torch.float16), (False, "cuda", torch.bfloat16)],
)
def test_no_warning_where_it_is_not_slow(
    monkeypatch: pytest.MonkeyPatch, native: bool, device: str, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(zerohooks.adapter.compat, "native_bf16", lambda cuda=False: native)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not plugin.warn_if_slow_here(device, dtype)
