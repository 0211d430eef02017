"""Config errors are raised when the config is read, naming what is wrong and what is accepted."""

from __future__ import annotations

import copy
from typing import Any

import pydantic
import pytest

from nvmeswap import NvmeSwapConfig, NvmeSwapPlugin
from zerohooks import ConfigError
from zerohooks.config import split_plugin_sections


def _cfg(**offload: Any) -> dict[str, Any]:
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", **offload},
        },
        "nvmeswap": {},
    }


def _edit(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    plugins = split_plugin_sections(cfg, {"nvmeswap": NvmeSwapPlugin})
    for p in plugins:
        p.edit_deepspeed_config(cfg)
    return cfg


def test_nvme_offload_becomes_cpu_offload_owned_by_nvmeswap() -> None:
    out = _edit(_cfg(pipeline_read=True, buffer_count=8))
    off = out["zero_optimization"]["offload_optimizer"]
    assert off == {"device": "cpu", "nvme_path": "/tmp/x"} and "nvmeswap" not in out


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["zero_optimization"].update(stage=2), "needs ZeRO stage 3"),
        (lambda c: c["zero_optimization"]["offload_optimizer"].update(device="cpu"), 'device = "nvme"'),
        (lambda c: c["zero_optimization"].pop("offload_optimizer"), 'device = "nvme"'),
        (lambda c: c["zero_optimization"]["offload_optimizer"].pop("nvme_path"), "folder for its swap files"),
        (lambda c: c["zero_optimization"].update(offload_param={"device": "nvme"}), "offload_param"),
        (lambda c: c["zero_optimization"]["offload_optimizer"].update(ratio=0.5), "partial offload"),
        (lambda c: c.update(nvmeswap={"bufer_count": 4}), "did you mean 'buffer_count'"),
        (lambda c: c.update(nvmeswap={"buffer_count": 1}), "buffer_count"),
        (lambda c: c.update(nvmeswap={"block_size": 5000}), "block_size"),
        (lambda c: c.update(nvmeswap={"io_engine": "libaio"}), "io_engine"),
        (lambda c: c.update(nvmeswap={"fused_adam": "yes please"}), "fused_adam"),
    ],
)
def test_bad_config_is_a_clear_error(mutate: Any, message: str) -> None:
    cfg = _cfg()
    mutate(cfg)
    with pytest.raises(ConfigError, match=message):
        _edit(cfg)


def test_folder_option_overrides_nvme_path() -> None:
    cfg = _cfg()
    cfg["zero_optimization"]["offload_optimizer"].pop("nvme_path")
    cfg["nvmeswap"] = {"folder": "/tmp/y"}
    plugins = split_plugin_sections(cfg, {"nvmeswap": NvmeSwapPlugin})
    plugins[0].edit_deepspeed_config(cfg)
    assert plugins[0].base_folder == "/tmp/y"  # type: ignore[attr-defined]


def test_config_is_frozen_and_documented() -> None:
    cfg = NvmeSwapConfig()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.buffer_count = 5  # type: ignore[misc]
    assert all(f.description for f in NvmeSwapConfig.model_fields.values())
