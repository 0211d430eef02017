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
        # not a number: named, with the accepted value (was a bare ValueError from float("x"))
        *(
            (
                lambda c, v=v: c["zero_optimization"]["offload_optimizer"].update(ratio=v),
                r"zero_optimization\.offload_optimizer\.ratio = .* accepted value is the JSON number 1\.0",
            )
            for v in ("x", "1.0", True, None, [1])
        ),
        *(
            (
                lambda c, v=v: c["zero_optimization"].update(stage=v),
                r"zero_optimization\.stage must be the JSON integer 3; got",
            )
            for v in ("three", "3", 3.0, True)
        ),
        # bounds that keep RAM, threads and requests sane (documented in the README)
        (lambda c: c.update(nvmeswap={"buffer_count": 17}), r"buffer_count: .*<= 16"),
        (lambda c: c.update(nvmeswap={"io_threads": 33}), r"io_threads: .*<= 32"),
        (lambda c: c.update(nvmeswap={"block_size": 1 << 40}), r"block_size: .*<= 268435456"),
        (lambda c: c.update(nvmeswap={"min_swap_numel": 2**48 + 1}), r"min_swap_numel: .*<= 281474976710656"),
        (lambda c: c.update(nvmeswap={"prefetch_bytes": 2**48 + 1}), r"prefetch_bytes: .*<= 281474976710656"),
        (lambda c: c.update(nvmeswap={"prefetch_bytes": -1}), r"prefetch_bytes: .*>= 0"),
        (lambda c: c.update(nvmeswap={"prefetch_bytes": 1.5}), r"prefetch_bytes: .*a JSON integer"),
        # three state tensors per element do not fit the swap files (was a RuntimeError at the first step)
        (
            lambda c: c.update(optimizer={"type": "AdamW", "params": {"amsgrad": True}}),
            r"optimizer\.params\.amsgrad is True with nvmeswap: .*set amsgrad to false",
        ),
        (lambda c: c.update(nvmeswap={"io_threads": True}), r"io_threads: .*a JSON integer"),
        (lambda c: c.update(nvmeswap={"keep_master_in_ram": "no"}), r"keep_master_in_ram: .*true or false"),
        (lambda c: c.update(nvmeswap={"folder": ""}), r"folder: .*non-empty JSON string"),
        (lambda c: c.update(nvmeswap={"bufer_count": 4}), "did you mean 'buffer_count'"),
        (lambda c: c.update(nvmeswap={"buffer_count": 1}), "buffer_count"),
        (lambda c: c.update(nvmeswap={"block_size": 5000}), "block_size"),
        (lambda c: c.update(nvmeswap={"io_engine": "libaio"}), "io_engine: .*'detect', 'native' or 'python'"),
        (
            lambda c: c.update(nvmeswap={"fused_adam": "yes please"}),
            'fused_adam: .*true, false or "when_supported"',
        ),
        (lambda c: c.update(nvmeswap={"fused_adam": None}), 'fused_adam: .*true, false or "when_supported"'),
        # the two overlaps are alternatives; a speculative step needs the master on disk
        (
            lambda c: c.update(nvmeswap={"step_in_backward": True, "prefetch_bytes": 1 << 30}),
            "step_in_backward and prefetch_bytes .* choose one",
        ),
        (
            lambda c: c.update(nvmeswap={"step_in_backward": True, "keep_master_in_ram": True}),
            "step_in_backward cannot be combined with keep_master_in_ram.*set keep_master_in_ram to false",
        ),
        (lambda c: c.update(nvmeswap={"step_in_backward": "yes"}), r"step_in_backward: .*true or false"),
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


@pytest.mark.parametrize(("key", "word"), [("io_engine", "detect"), ("fused_adam", "when_supported")])
def test_absent_key_new_word_and_auto_alias_are_the_same(key: str, word: str) -> None:
    built = []
    for section in ({}, {key: word}, {key: "auto"}):
        cfg = _cfg()
        cfg["nvmeswap"] = section
        (plugin,) = split_plugin_sections(cfg, {"nvmeswap": NvmeSwapPlugin})
        assert isinstance(plugin, NvmeSwapPlugin)
        built.append(plugin.cfg)
    assert built[0] == built[1] == built[2] == NvmeSwapConfig()
    assert getattr(built[2], key) == word  # "auto" is stored as the new word


def test_fused_adam_choice_is_the_same_for_absent_new_word_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from nvmeswap import adam
    from nvmeswap.plugin import _fused_choice

    loads: list[int] = []
    monkeypatch.setattr(adam, "load_distributed", lambda: loads.append(1) or True)
    param = torch.nn.Parameter(torch.zeros(2))

    class Zero:  # the ZeRO-3 optimizer around the torch one
        def __init__(self, opt: torch.optim.Optimizer) -> None:
            self.optimizer = opt

    adamw, sgd = Zero(torch.optim.AdamW([param])), Zero(torch.optim.SGD([param], lr=0.1))
    for cfg in (
        NvmeSwapConfig(),
        NvmeSwapConfig(fused_adam="when_supported"),
        NvmeSwapConfig(fused_adam="auto"),
    ):  # type: ignore[arg-type]
        loads.clear()
        assert _fused_choice(cfg, adamw) is True and loads == [1]  # the kernel is built
        loads.clear()
        assert _fused_choice(cfg, sgd) is True and loads == []  # unfused per step, no error
    assert _fused_choice(NvmeSwapConfig(fused_adam=False), adamw) is False
    with pytest.raises(
        ConfigError, match=r'fused_adam is true but .*SGD.*set it to false or "when_supported"'
    ):
        _fused_choice(NvmeSwapConfig(fused_adam=True), sgd)
