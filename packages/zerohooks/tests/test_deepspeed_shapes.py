"""DeepSpeed settings that DeepSpeed 0.19.8 refuses only once it builds (issue #33), refused by
``zerohooks.initialize`` before anything is built when a plugin is on, naming the key and the
fix; without a plugin DeepSpeed keeps its own error (``zerohooks.initialize`` is
``deepspeed.initialize`` there).

* ``"bf16": true`` / ``"fp16": false`` (a bare boolean for a section DeepSpeed reads as an
  object): DeepSpeed's ``TypeError ... must be a mapping``.
* an optimizer DeepSpeed has not tested with ZeRO (torch's SGD, as an object or as
  ``optimizer.type``) without ``"zero_allow_untested_optimizer": true``: DeepSpeed's assertion.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zerohooks
from zerohooks import ConfigError
from zerohooks.adapter.dsrules import check_zero_optimizer
from zerohooks.dsconfig import setup_context
from zerohooks.testing import run_distributed
from zerohooks.testing.recording import RecordingPlugin
from zerohooks.testing.toy import ds_config, make_model

PLUGIN: dict[str, Any] = {}
"""No plugin section: the plugin that is on is zerohooks' own RecordingPlugin, passed as an
object (these tests run where only zerohooks is installed)."""


def _init(cfg: dict[str, Any], optimizer: Any = None) -> None:
    model = make_model()
    kwargs: dict[str, Any] = {"optimizer": optimizer} if optimizer is not None else {}
    zerohooks.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, plugins=[RecordingPlugin()], **kwargs
    )


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("bf16", True, '"bf16": {"enabled": true}'),
        ("bf16", False, '"bf16": {"enabled": false}'),
        ("fp16", True, '"fp16": {"enabled": true}'),
        ("fp16", False, '"fp16": {"enabled": false}'),
        ("fp16", None, '"fp16": {"enabled": true} (or false), or remove the key'),
        ("bfloat16", True, '"bfloat16": {"enabled": true}'),
        ("bf16", 1, '"bf16": {"enabled": true} (or false), or remove the key'),
    ],
)
def test_bare_precision_value_is_refused_naming_key_and_fix(key: str, value: Any, fix: str) -> None:
    cfg = ds_config(1, sections=PLUGIN)
    cfg[key] = value
    with pytest.raises(ConfigError, match=f'^"{key}": .*as a JSON object.*must be a mapping') as info:
        _init(cfg)
    assert str(info.value).endswith(f"write {fix}")


def test_shapes_deepspeed_reads_pass() -> None:
    # "bf16": null is DeepSpeed's "absent" (it then reads "bfloat16"); "bfloat16" is not read
    # at all when "bf16" is there
    for extra in ({"bf16": None}, {"bf16": {"enabled": True}, "bfloat16": True}, {"fp16": {}}):
        ctx = setup_context({**ds_config(1), **extra})
        assert ctx.train_dtype == (torch.bfloat16 if extra.get("bf16") else torch.float32)


def _plain_bare_bf16() -> list[str]:
    """Without a plugin, both functions raise DeepSpeed's own error for "bf16": true."""
    import deepspeed

    out = []
    for init in (deepspeed.initialize, zerohooks.initialize):
        model = make_model()
        try:
            init(model=model, model_parameters=model.parameters(), config={**ds_config(1), "bf16": True})
            out.append("built")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.multirank
def test_without_a_plugin_deepspeed_keeps_its_own_error() -> None:
    plain, ours = run_distributed(_plain_bare_bf16, 1, timeout=300)[0]
    assert plain == ours and plain.startswith("TypeError") and "must be a mapping" in plain


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_untested_optimizer_object_is_refused_before_deepspeed(stage: int) -> None:
    with pytest.raises(ConfigError) as info:
        _init(ds_config(stage, sections=PLUGIN), optimizer=_sgd())
    message = str(info.value)
    assert "(torch.optim.sgd.SGD)" in message and f"zero_optimization.stage {stage}" in message
    assert 'set "zero_allow_untested_optimizer": true' in message and '"AdamW"' in message


def test_untested_optimizer_type_is_refused_before_deepspeed() -> None:
    cfg = ds_config(2, sections=PLUGIN, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with pytest.raises(ConfigError, match=r'optimizer\.type "SGD" \(torch\.optim\.SGD\) is not an optimizer'):
        _init(cfg)


def test_optimizers_deepspeed_takes_pass() -> None:
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    check_zero_optimizer({}, adamw, 3)
    check_zero_optimizer({}, _sgd(), 0)  # ZeRO 0 takes any optimizer
    check_zero_optimizer({"zero_allow_untested_optimizer": True}, _sgd(), 3)
    for name in ("Adam", "adamw", "Adagrad", "Lion", "Lamb", "sgd", "NoSuchOptimizer"):
        check_zero_optimizer({"optimizer": {"type": name}}, None, 2)  # DeepSpeed's names, or its error
    check_zero_optimizer({"optimizer": {"type": "SGD"}}, lambda params: None, 2)  # a callable: DeepSpeed's
