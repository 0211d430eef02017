"""The "mixedlayers" section, module selection, group splitting and the boundary casts.

No ranks are started here: configs are read through zerohooks' own section parser (what
``zerohooks.initialize`` does), selection and casts run on plain torch modules.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mixedlayers import MixedLayersConfig, MixedLayersPlugin, MixedState, select_modules, split_param_groups
from mixedlayers.casting import explain_dtype_errors, install_boundary_hooks
from mixedlayers.config import add_sharers, check_deepspeed_config, outermost
from mixedlayers.state import keep_fp32, restore_fp32, shadow_module_to
from zerohooks import ConfigError
from zerohooks.config import split_plugin_sections
from zerohooks.dsconfig import setup_context
from zerohooks.testing.toy import TinyNet, ds_config, make_model


def _section(section: Any) -> MixedLayersConfig:
    cfg = {"mixedlayers": section}
    (plugin,) = split_plugin_sections(cfg, {"mixedlayers": MixedLayersPlugin})
    assert isinstance(plugin.config, MixedLayersConfig)
    return plugin.config


class MyNorm(nn.LayerNorm):
    """A LayerNorm subclass: selected by "torch.nn.LayerNorm" too."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = MyNorm(8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


# -- the section ---------------------------------------------------------------------------------
def test_defaults_and_single_string() -> None:
    cfg = _section({"fp32_modules": "head"})
    assert cfg.fp32_modules == ("head",)
    assert cfg.fp32_module_types == ()
    assert cfg.cast_inputs is True and cfg.output_dtype == "input" and cfg.keep_buffers is True


def test_empty_selection_is_an_error() -> None:
    with pytest.raises(ConfigError, match="select at least one module"):
        _section({})


def test_unknown_key_names_the_close_key() -> None:
    with pytest.raises(
        ConfigError, match=r"mixedlayers\.fp32_module: unknown key \(did you mean 'fp32_modules'\?\)"
    ):
        _section({"fp32_module": ["head"]})


def test_bad_output_dtype() -> None:
    with pytest.raises(ConfigError, match=r"mixedlayers\.output_dtype"):
        _section({"fp32_modules": ["head"], "output_dtype": "fp64"})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.pop("bf16"), 'enable DeepSpeed\'s "bf16" or "fp16"'),
        (lambda c: c["zero_optimization"].update(offload_param={"device": "cpu"}), "offload_param"),
        (
            lambda c: c["zero_optimization"].update(stage=3, offload_optimizer={"device": "nvme"}),
            '"nvme"',
        ),
        (lambda c: c.update(data_types={"grad_accum_dtype": "bf16"}), "grad_accum_dtype"),
        (lambda c: c.update(data_types={"buffer_dtype": "bf16"}), "buffer_dtype"),
        (lambda c: c.update(torch_autocast={"enabled": True}), "torch_autocast"),
    ],
)
def test_deepspeed_settings_refused(edit: Any, match: str) -> None:
    cfg = ds_config(3, "bf16")
    edit(cfg)
    with pytest.raises(ConfigError, match=match):
        check_deepspeed_config(setup_context(cfg))


@pytest.mark.parametrize(
    ("stage", "dtype", "offload", "by_config"),
    [
        (0, "bf16", False, False),
        (1, "bf16", False, False),
        (1, "bf16", True, True),
        (1, "fp16", False, True),
        (2, "bf16", False, True),
        (3, "fp16", False, True),
    ],
)
def test_fp32_accumulation_through_deepspeed_config(
    stage: int, dtype: str, offload: bool, by_config: bool
) -> None:
    """DeepSpeed's grad_accum_dtype is set except where it would swap in BF16_Optimizer (bf16
    ZeRO 1 without offload: the plugin switches the accumulation on per instance instead)."""
    plugin = MixedLayersPlugin(_section({"fp32_modules": ["head"]}))
    cfg = ds_config(stage, dtype, offload, data_types={"grad_accum_dtype": "fp32"} if stage else {})
    plugin.edit_deepspeed_config(cfg)
    assert cfg.get("data_types", {}).get("grad_accum_dtype") == ("fp32" if by_config else None)


# -- selection -----------------------------------------------------------------------------------
def test_globs_and_types_select_subclasses() -> None:
    net = Net()
    got = select_modules(
        net, _section({"fp32_modules": ["head"], "fp32_module_types": ["torch.nn.LayerNorm"]})
    )
    assert list(got) == ["blocks.0.norm", "blocks.1.norm", "head"]
    bare = select_modules(net, _section({"fp32_module_types": ["LayerNorm"]}))
    assert list(bare) == ["blocks.0.norm", "blocks.1.norm"]
    glob = select_modules(net, _section({"fp32_modules": ["blocks.*"]}))
    assert "blocks.0" in glob and "blocks.1.proj" in glob
    assert list(outermost(glob)) == ["blocks.0", "blocks.1"]


def test_glob_matching_nothing_lists_close_names() -> None:
    with pytest.raises(
        ConfigError,
        match=r'"blocks\.\*\.nrom" matches no module of Net; close module names: .*blocks\.0\.norm',
    ):
        select_modules(Net(), _section({"fp32_modules": ["blocks.*.nrom"]}))


def test_type_matching_nothing_lists_close_classes() -> None:
    with pytest.raises(ConfigError, match=r'"torch.nn.RMSNorm" matches no module of Net; .*LayerNorm'):
        select_modules(Net(), _section({"fp32_module_types": ["torch.nn.RMSNorm"]}))
    with pytest.raises(ConfigError, match="cannot import"):
        select_modules(Net(), _section({"fp32_module_types": ["torch.nn.NoSuchNorm"]}))
    with pytest.raises(ConfigError, match=r"not a torch\.nn\.Module subclass"):
        select_modules(Net(), _section({"fp32_module_types": ["torch.float32"]}))


# -- parameters, groups, casts -------------------------------------------------------------------
def _prepared(net: nn.Module, section: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> MixedState:
    cfg = _section(section)
    state = MixedState(cfg, dtype)
    selected = select_modules(net, cfg)
    keep_fp32(state, net, selected, cfg.keep_buffers)
    state.boundaries = outermost(selected)
    install_boundary_hooks(state)
    return state


def test_split_param_groups_keeps_hyperparameters_and_puts_16bit_first() -> None:
    net = Net()
    state = _prepared(net, {"fp32_modules": ["head"], "fp32_module_types": ["torch.nn.LayerNorm"]})
    groups = [
        {"params": [*net.head.parameters(), *net.embed.parameters()], "lr": 0.1},
        {"params": list(net.blocks.parameters()), "weight_decay": 0.0},
    ]
    out = split_param_groups(state, groups)
    kinds = [
        ({state.is_fp32(p) for p in g["params"]}, {k: v for k, v in g.items() if k != "params"}) for g in out
    ]
    assert kinds == [
        ({False}, {"lr": 0.1}),
        ({False}, {"weight_decay": 0.0}),
        ({True}, {"lr": 0.1}),
        ({True}, {"weight_decay": 0.0}),
    ]
    assert sum(len(g["params"]) for g in out) == len(list(net.parameters()))
    flat = split_param_groups(state, net.parameters())
    assert [len(g["params"]) for g in flat] == [6, 6]
    with pytest.raises(TypeError, match="param-group dicts"):
        split_param_groups(state, [("name", net.head.weight)])


def test_deepspeed_style_cast_is_undone_exactly() -> None:
    """The engine casts every parameter then calls module.to(device): the kept ones come back."""
    net = make_model()
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    state = _prepared(net, {"fp32_modules": ["fc2", "norm"]})
    remover = shadow_module_to(state, net)
    for p in net.parameters():  # what DeepSpeedEngine._cast_module_mixed_precision does
        p.data = p.data.to(torch.bfloat16)
    net.to("cpu")
    assert "to" not in net.__dict__
    for n, p in net.named_parameters():
        if n.startswith(("fc2", "norm")):
            assert p.dtype == torch.float32 and torch.equal(p, initial[n])
        else:
            assert p.dtype == torch.bfloat16
    remover.remove()
    assert restore_fp32(state) == 0


def test_boundary_casts_forward_and_backward() -> None:
    """Against the same model with the casts written by hand (fp32 gradients for kept params)."""
    torch.manual_seed(0)
    net = Net()
    state = _prepared(net, {"fp32_modules": ["head"], "fp32_module_types": ["LayerNorm"]})
    for p in net.parameters():
        if not state.is_fp32(p):
            p.data = p.data.to(torch.bfloat16)
    for b in net.buffers():
        b.data = b.data.to(torch.bfloat16)
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    out = net(x)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()

    ref = Net()
    ref.load_state_dict({k: v.float() for k, v in net.state_dict().items()})
    h = nn.functional.linear(x, ref.embed.weight.bfloat16(), ref.embed.bias.bfloat16())
    for b in ref.blocks:
        h = nn.functional.linear(h, b.proj.weight.bfloat16(), b.proj.bias.bfloat16())
        h = b.norm(h.float()).to(torch.bfloat16) * b.scale.bfloat16()
    r = ref.head(h.float()).to(torch.bfloat16)
    r.float().square().sum().backward()
    assert torch.equal(out, r)
    for (n, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        if state.is_fp32(p):
            assert p.grad is not None and p.grad.dtype == torch.float32, n
            assert torch.equal(p.grad, q.grad), n
    state.release()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())


@pytest.mark.parametrize(
    ("output_dtype", "expected"),
    [("input", torch.float16), ("train", torch.bfloat16), ("fp32", torch.float32)],
)
def test_output_dtype(output_dtype: str, expected: torch.dtype) -> None:
    net = nn.Sequential(nn.Linear(4, 4))
    _prepared(net, {"fp32_modules": ["0"], "output_dtype": output_dtype})
    assert net(torch.randn(2, 4, dtype=torch.float16)).dtype == expected


def test_embedding_output_goes_to_training_dtype() -> None:
    net = TinyNet()
    _prepared(net, {"fp32_modules": ["emb"]}, torch.float16)
    assert net.emb(torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float16
    assert net.emb.weight.dtype == torch.float32


def test_buffers_kept_and_inputs_left_alone_when_asked() -> None:
    net = Net().to(torch.bfloat16)
    _prepared(net, {"fp32_modules": ["blocks.0"], "cast_inputs": False})
    assert net.blocks[0].scale.dtype == torch.float32 and net.blocks[1].scale.dtype == torch.bfloat16
    with pytest.raises(RuntimeError):  # bf16 input reaches the fp32 Linear unconverted
        net(torch.randn(2, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"fp32_modules": ["blocks.0"], "cast_inputs": False}, "cast_inputs: false"),
        ({"fp32_modules": ["embed"], "output_dtype": "fp32"}, 'output_dtype: "fp32"'),
    ],
)
def test_dtype_error_in_forward_names_the_setting(section: dict[str, Any], named: str) -> None:
    net = Net().to(torch.bfloat16)
    state = _prepared(net, section)
    explain_dtype_errors(state, net)
    with pytest.raises(RuntimeError) as info:
        net(torch.randn(2, 4, dtype=torch.bfloat16))
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and named in notes[0] and repr(section["fp32_modules"][0]) in notes[0], notes


def test_default_settings_add_no_note() -> None:
    net = Net().to(torch.bfloat16)
    state = _prepared(net, {"fp32_modules": ["blocks.0"]})
    explain_dtype_errors(state, net)
    with pytest.raises(RuntimeError) as info:
        net(torch.randn(2, 5, dtype=torch.bfloat16))  # a shape error, not ours to explain
    assert not getattr(info.value, "__notes__", [])


def test_tied_weight_owners_are_kept_together() -> None:
    """Keeping a head whose weight is the embedding's keeps the embedding too, with its casts."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(self.emb(t)))

    net = Tied()
    cfg = _section({"fp32_modules": ["head"]})
    selected = add_sharers(net, select_modules(net, cfg))
    assert list(selected) == ["emb", "head"]
    state = MixedState(cfg, torch.bfloat16)
    keep_fp32(state, net, selected, True)
    state.boundaries = outermost(selected)
    install_boundary_hooks(state)
    net.mid.to(torch.bfloat16)
    out = net(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.bfloat16 and net.emb.weight.dtype == torch.float32
