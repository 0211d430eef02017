"""The config section, the conflicts refused when the config is read, and the safe-module choice.

Conflicts go through ``zerohooks.initialize`` itself: the error must come before DeepSpeed
builds anything (no process group is needed to reach it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerohooks
from autocastzero import AutocastZeroConfig, AutocastZeroPlugin, safe_parameters
from zerohooks import ConfigError
from zerohooks.testing.toy import ds_config, make_model


def _init(cfg: dict[str, Any]) -> None:
    model = make_model()
    zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def test_plugin_is_found_by_entry_point() -> None:
    assert zerohooks.available_plugins()["autocastzero"] is AutocastZeroPlugin


def test_defaults_and_aliases() -> None:
    cfg = AutocastZeroConfig.model_validate({"dtype": "bf16"})
    assert cfg.torch_dtype == torch.bfloat16
    assert cfg.safe_classes() == (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    assert AutocastZeroConfig.model_validate({"dtype": "fp16"}).torch_dtype == torch.float16


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"dtype": "float8"}, "autocastzero.dtype"),
        ({"dtyp": "bfloat16"}, "did you mean 'dtype'"),
        ({"lower_precision_safe_modules": ["torch.nn.Linearr"]}, "is not a torch.nn.Module subclass"),
        ({"lower_precision_safe_modules": ["nosuchpkg.Linear"]}, "cannot import module 'nosuchpkg'"),
        ({"dtype": "bfloat16", "initial_scale_power": 8}, "only apply to dtype float16"),
        ({"dtype": "float16", "loss_scale_window": 0}, "autocastzero.loss_scale_window"),
    ],
)
def test_bad_section_is_refused(section: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _init(ds_config(1, sections={"autocastzero": section}))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"bf16": {"enabled": True}}, 'remove the "bf16" section'),
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, 'remove the "torch_autocast" section'),
        ({"communication_data_type": "bf16"}, 'remove "communication_data_type"'),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
        (
            {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            "zero_optimization.zero_quantized_weights",
        ),
    ],
)
def test_conflicting_deepspeed_settings_are_refused(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _init(ds_config(1, sections={"autocastzero": {}}, **extra))


def test_deepspeed_fp16_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match='remove the "fp16" section'):
        _init(ds_config(1, "fp16", sections={"autocastzero": {}}))


def test_fp16_with_offload_is_refused() -> None:
    with pytest.raises(ConfigError, match="offload_optimizer"):
        _init(ds_config(2, offload=True, sections={"autocastzero": {"dtype": "float16"}}))


class MyLinear(nn.Linear):
    pass


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = MyLinear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 6)
        self.emb = nn.Embedding(6, 4)
        self.gate = nn.Parameter(torch.ones(4))


def _names(model: nn.Module, **section: Any) -> set[str]:
    return set(safe_parameters(model, AutocastZeroConfig.model_validate(section)).values())


def test_subclasses_count_unlike_deepspeed() -> None:
    from deepspeed.runtime.torch_autocast import LOWER_PRECISION_SAFE_MODULES

    model = Block()
    exact = {n for n, m in model.named_modules() if m.__class__ in LOWER_PRECISION_SAFE_MODULES}
    assert exact == {"head"}  # DeepSpeed's own rule misses the subclass
    assert _names(model) == {"proj.weight", "proj.bias", "head.weight", "head.bias"}


def test_globs_add_and_fp32_names_remove() -> None:
    model = Block()
    assert _names(model, lower_precision_safe_names=["norm"], fp32_names=["head"]) == {
        "proj.weight",
        "proj.bias",
        "norm.weight",
        "norm.bias",
    }
    # a module's own parameters only: the root's "gate" follows the root, which is not safe
    assert "gate" not in _names(model, lower_precision_safe_names=["n*"])
    assert _names(model, lower_precision_safe_modules=[]) == set()


def test_tied_weight_is_safe_only_if_every_holder_is() -> None:
    model = Block()
    model.head.weight = model.emb.weight  # (6, 4) in both
    assert "head.weight" not in _names(model) and "emb.weight" not in _names(model)


def test_unmatched_glob_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"lower_precision_safe_names: \['blocks\.\*'\] match no module"):
        _names(Block(), lower_precision_safe_names=["blocks.*"])
