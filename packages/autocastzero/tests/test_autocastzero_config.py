"""The config section, the conflicts refused when the config is read, and the safe-module choice.

Conflicts go through ``zerohooks.initialize`` itself: the error must come before DeepSpeed
builds anything (no process group is needed to reach it).
"""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import zerohooks
from autocastzero import DEFAULT_SAFE_MODULES, AutocastZeroConfig, AutocastZeroPlugin, safe_parameters
from autocastzero.select import nothing_safe_message, warn_if_nothing_safe
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
    assert cfg.safe_classes()[:4] == (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    assert "transformers.pytorch_utils.Conv1D" in cfg.lower_precision_safe_modules
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
        # scales with which no step can train: refused naming the key and the accepted range
        *(
            ({"dtype": "float16", "loss_scale": bad}, "autocastzero.loss_scale: .*must be 0 .*from 2**-24")
            for bad in (float("inf"), 1e300, float("nan"), -1.0, 1e-30, "inf")
        ),
        *(
            ({"dtype": "float16", "min_loss_scale": bad}, "autocastzero.min_loss_scale: .*from 2**-24")
            for bad in (float("inf"), 0.0, 1e300)
        ),
        ({"dtype": "float16", "initial_scale_power": 33}, "autocastzero.initial_scale_power: .*32"),
        # step counts: at most 2**31 - 1 (issue #33: no integer field without an upper bound)
        ({"dtype": "float16", "loss_scale_window": 2**31}, "autocastzero.loss_scale_window: .*<= 2147483647"),
        ({"dtype": "float16", "hysteresis": 10**30}, "autocastzero.hysteresis: .*<= 2147483647"),
        ({"dtype": "float16", "initial_scale_power": 4, "min_loss_scale": 32}, "above the first loss scale"),
        ({"dtype": "float16", "loss_scale": 128, "hysteresis": 3}, "keys hysteresis would be ignored"),
    ],
)
def test_bad_section_is_refused(section: dict[str, Any], needle: str) -> None:
    with pytest.raises(
        ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("**", r"\*\*")
    ):
        _init(ds_config(1, sections={"autocastzero": section}))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"bf16": {"enabled": True}}, 'remove the "bf16" section'),
        # issue #33: a bare boolean (which DeepSpeed fails on with a TypeError) is the same conflict
        ({"bf16": True}, r'"bf16" is enabled \(a bare true\): .*remove the "bf16" section'),
        ({"bfloat16": True}, r'"bfloat16" is enabled \(a bare true\): .*remove the "bfloat16" section'),
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


def test_transformers_classes_are_never_imported_by_autocastzero() -> None:
    # in a fresh interpreter: the default section, the defaults listed explicitly, and the class
    # lookup leave transformers unimported (a model holding its Conv1D would have imported it)
    code = (
        "import sys\n"
        "from autocastzero import DEFAULT_SAFE_MODULES, AutocastZeroConfig\n"
        "for cfg in (AutocastZeroConfig(), AutocastZeroConfig(lower_precision_safe_modules=DEFAULT_SAFE_MODULES)):\n"
        "    assert len(cfg.safe_classes()) == 4, cfg.safe_classes()\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'transformers']\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_an_imported_only_class_is_found_once_its_module_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    # a stand-in for transformers.pytorch_utils, so the rule is tested without transformers
    class Conv1D(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 3))
            self.bias = nn.Parameter(torch.zeros(3))

    if "transformers.pytorch_utils" not in sys.modules:
        assert nn.Module not in AutocastZeroConfig().safe_classes()
    fake = types.ModuleType("transformers.pytorch_utils")
    fake.Conv1D = Conv1D  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", fake)
    assert AutocastZeroConfig().safe_classes()[4:] == (Conv1D,)
    model = nn.Sequential(Conv1D(), nn.LayerNorm(3))
    assert _names(model) == {"0.weight", "0.bias"}
    assert _names(model, lower_precision_safe_modules=["torch.nn.Linear"]) == set()


class Conv1DLike(nn.Module):
    """A linear layer autocastzero does not know: a model built of these has no safe module."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _unknown_layers() -> nn.Module:
    return nn.Sequential(Conv1DLike(8, 16), nn.LayerNorm(16), Conv1DLike(16, 8))


def test_warning_when_no_parameter_is_safe() -> None:
    model = _unknown_layers()
    cfg = AutocastZeroConfig()
    safe = safe_parameters(model, cfg)
    assert safe == {}
    with pytest.warns(RuntimeWarning) as record:
        warn_if_nothing_safe(model, cfg, safe, stage=2)
    (w,) = record
    text = str(w.message)
    assert "no parameter of the model is lower-precision safe" in text
    # the largest parameter-holding classes, largest first, and the key to set
    cls = f"{Conv1DLike.__module__}.{Conv1DLike.__qualname__}"
    assert text.index(f"{cls} (89% of the parameters, 2 modules)") < text.index(
        "torch.nn.modules.normalization.LayerNorm (11% of the parameters, 1 module)"
    )
    assert '"lower_precision_safe_modules"' in text and "lower_precision_safe_names" in text


def test_no_warning_when_something_is_safe_or_nothing_is_asked() -> None:
    model = _unknown_layers()
    named = AutocastZeroConfig(lower_precision_safe_names=["0"])
    sections: list[tuple[AutocastZeroConfig, int]] = [
        (named, 2),  # the first layer is safe by name
        (AutocastZeroConfig(lower_precision_safe_modules=[f"{__name__}.Conv1DLike"]), 2),
        (AutocastZeroConfig(lower_precision_safe_modules=[]), 2),  # explicitly none
        (AutocastZeroConfig(low_precision_reduce=False), 1),  # fp32 reduction asked for
        (AutocastZeroConfig(low_precision_reduce=False, low_precision_gather=False), 3),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cfg, stage in sections:
            warn_if_nothing_safe(model, cfg, safe_parameters(model, cfg), stage)
    # ZeRO 3 gathers in 16 bits even without 16-bit reduction: still worth a warning
    cfg = AutocastZeroConfig(low_precision_reduce=False)
    assert "gathered in float32" in str(nothing_safe_message(model, cfg, {}, 3))


def _tiny_gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    from _acz_common import tiny_gpt2

    model: nn.Module = tiny_gpt2()
    return model


def test_hugging_face_gpt2_conv1d_layers_are_safe() -> None:
    model = _tiny_gpt2()
    from transformers.pytorch_utils import Conv1D

    cfg = AutocastZeroConfig()
    assert Conv1D in cfg.safe_classes()
    safe = safe_parameters(model, cfg)
    conv = {
        f"{n}.{p}"
        for n, m in model.named_modules()
        if isinstance(m, Conv1D)
        for p, _ in m.named_parameters(recurse=False)
    }
    assert len(conv) == 2 * 4 * 2  # c_attn, c_proj, mlp.c_fc, mlp.c_proj per block; weight, bias
    assert set(safe.values()) == conv  # embeddings, norms and the tied lm_head stay fp32
    numel = {id(p): p.numel() for p in model.parameters()}
    assert sum(numel[k] for k in safe) > sum(numel.values()) // 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_nothing_safe(model, cfg, safe, stage=3)


def test_hugging_face_gpt2_without_conv1d_warns_naming_it() -> None:
    model = _tiny_gpt2()
    cfg = AutocastZeroConfig(
        lower_precision_safe_modules=[m for m in DEFAULT_SAFE_MODULES if "Conv1D" not in m]
    )
    with pytest.warns(
        RuntimeWarning, match=r"transformers\.pytorch_utils\.Conv1D \(\d+% of the parameters, 8 modules\)"
    ):
        warn_if_nothing_safe(model, cfg, safe_parameters(model, cfg), stage=2)


def test_largest_and_smallest_scales_are_accepted() -> None:
    for section in (
        {"dtype": "float16", "loss_scale": 2.0**32},
        {"dtype": "float16", "loss_scale": 2.0**-24},
        {"dtype": "float16", "initial_scale_power": 32, "min_loss_scale": 2.0**32},
        {"dtype": "float16", "loss_scale": 0, "min_loss_scale": 2.0**-24},
    ):
        AutocastZeroConfig.model_validate(section)


def test_stuck_run_is_reported_once_per_run() -> None:
    from autocastzero.scaling import STUCK_STEPS, ScaleState, load, save, stuck_message, update

    state = ScaleState(2.0**16, dynamic=False)
    seen = []
    for run in range(2):
        for i in range(STUCK_STEPS + 5):
            update(state, True)
            seen.append((run, i, stuck_message(state)))
        update(state, False)  # a step that trains ends the run
        assert stuck_message(state) is None and state.skipped_run == 0
    reported = [(run, i) for run, i, m in seen if m is not None]
    assert reported == [(0, STUCK_STEPS - 1), (1, STUCK_STEPS - 1)]
    text = next(m for *_, m in seen if m is not None)
    assert "static loss_scale 65536" in text and "use a smaller loss_scale, or 0 for dynamic scaling" in text
    # a checkpoint written before these counters existed still loads
    old = {k: v for k, v in save(state).items() if k not in ("skipped_run", "stuck_run")}
    load(state, old)
    assert state.skipped_run == state.stuck_run == 0
