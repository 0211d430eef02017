"""The error-feedback algorithm (telescoping, the update rule), its state (keys, reset_T, loss
scale, skipped steps, checkpoints) and the config section, in one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _loco_common import fresh_seed, gradient_like, kernels

import zerohooks
from loco import LocoConfig, LocoPlugin, ops, reference
from loco.state import (
    LocoState,
    after_step,
    begin_call,
    error_buffer,
    load_state_dict,
    state_dict,
)
from zerohooks import ConfigError
from zerohooks.config import split_plugin_sections

README = Path(__file__).resolve().parents[1] / "README.md"


def _send(
    g: torch.Tensor, e: torch.Tensor, es: torch.Tensor, beta: float, group: int, native: bool
) -> torch.Tensor:
    """One quantize_ef call on a single row; returns deQ of what was sent (float64)."""
    n = g.numel()
    cpad = reference.padded_row_len(n, group)
    q, s = torch.zeros(1, cpad // 2, dtype=torch.uint8), torch.zeros(1, cpad // group)
    ops.quantize_ef(g, e, es, beta, 4, group, n, q, s, use_kernels=native)
    return reference.decode(q, s, 4, group)[0, :n].double()


@pytest.mark.parametrize("native", [True, False])
def test_telescoping_with_beta_zero(native: bool) -> None:
    """beta = 0: sum of transmitted values + final error == sum of the true gradients."""
    assert kernels() or not native
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, group, steps = 5000, 128, 40
    e = torch.zeros(reference.padded_row_len(n, group))  # fp32 storage: exact up to float32 rounding
    sent = torch.zeros(n, dtype=torch.float64)
    true = torch.zeros(n, dtype=torch.float64)
    scale = 0.0
    for _ in range(steps):
        g = gradient_like(n, torch.float32, gen)
        scale = max(scale, float(g.abs().max()))
        sent += _send(g, e, torch.empty(0), 0.0, group, native)
        true += g.double()
    gap = (sent + e[:n].double() - true).abs().max().item()
    # each step rounds x = g + e and e = x - deQ once in float32: a few ulps of the largest |x|
    assert gap <= steps * 4 * 2**-24 * scale, f"seed={seed}: gap {gap}"
    # without error feedback the transmitted sum drifts by up to half a step per element per call
    plain = torch.zeros(n, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        plain += _send(
            gradient_like(n, torch.float32, gen),
            torch.empty(0, dtype=torch.int8),
            torch.empty(0),
            0.0,
            group,
            native,
        )
    assert (plain - true).abs().max().item() > 1000 * gap


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("error_dtype", ["int8", "fp32"])
def test_error_update_rule(native: bool, error_dtype: str) -> None:
    """e <- beta * e + (1 - beta) * (x - deQ(Q(x))), x = g + e, stored int8 with group scales."""
    assert kernels() or not native
    gen = torch.Generator().manual_seed(fresh_seed())
    n, group, beta = 1024, 128, 0.8
    e = torch.zeros(n, dtype=torch.int8 if error_dtype == "int8" else torch.float32)
    es = torch.zeros(n // group) if error_dtype == "int8" else torch.empty(0)
    for _ in range(5):
        g = gradient_like(n, torch.bfloat16, gen)
        prev = (
            (e.float().view(-1, group) * es.view(-1, 1)).reshape(-1) if error_dtype == "int8" else e.clone()
        )
        x = g.float() + prev
        sent = _send(g, e, es, beta, group, native).float()
        want = beta * prev + (1 - beta) * (x - sent)
        got = (e.float().view(-1, group) * es.view(-1, 1)).reshape(-1) if error_dtype == "int8" else e
        # int8 storage: half a step of the 8-bit quantizer of each group of the new error
        tol = want.view(-1, group).abs().amax(1, keepdim=True).expand(-1, group).reshape(-1) / 127 / 2
        bound = tol * 1.001 + 1e-30 if error_dtype == "int8" else 1e-6 * want.abs().max()
        assert torch.all((got - want).abs() <= bound)


def _state(**cfg) -> LocoState:
    return LocoState(LocoConfig(**cfg))


def test_reset_T_counts_optimizer_steps() -> None:
    st = _state(reset_T=3)
    for step in range(1, 8):
        error_buffer(st, "p1.0", 256, torch.device("cpu")).data.fill_(5)
        after_step(st, False, None, step)
        assert bool(st.buffers) == (step % 3 != 0), step
    assert st.resets == 2 and st.steps == 7
    st = _state(reset_T=0)
    error_buffer(st, "p1.0", 256, torch.device("cpu"))
    after_step(st, False, None, 1024)
    assert st.buffers and st.resets == 0


def test_loss_scale_change_rescales_and_skip_restores() -> None:
    st = _state(error_dtype="int8")
    st.keep_snapshots = True
    st.loss_scale = 256.0
    cpu = torch.device("cpu")
    buf = error_buffer(st, "p1.0", 128, cpu)
    buf.data.fill_(10)
    buf.scale.fill_(0.5)
    after_step(st, False, 512.0, 1)  # scale grew: errors (in scaled units) double
    assert float(st.buffers["p1.0"].scale[0]) == 1.0 and st.loss_scale == 512.0
    before = st.buffers["p1.0"].clone()
    # an overflowing step: the buffer is written, a new one created, then the step is skipped
    buf = error_buffer(st, "p1.0", 128, cpu)
    buf.data.fill_(-99)
    error_buffer(st, "p2.0", 128, cpu).data.fill_(7)
    after_step(st, True, 256.0, 2)  # skipped: back off the scale
    assert set(st.buffers) == {"p1.0"}
    assert torch.equal(st.buffers["p1.0"].data, before.data)
    assert float(st.buffers["p1.0"].scale[0]) == 0.5  # restored, then rescaled to the new scale
    st2 = _state(on_skip="reset")
    error_buffer(st2, "p1.0", 128, cpu)
    after_step(st2, True, None, 1)
    assert not st2.buffers


def test_keys_windows_and_size_changes() -> None:
    st = _state()
    assert [begin_call(st, 5) for _ in range(3)] == [0, 1, 2]
    assert begin_call(st, 6) == 0  # next backward pass: the same calls, the same keys
    cpu = torch.device("cpu")
    a = error_buffer(st, "w0.0", 256, cpu)
    assert error_buffer(st, "w0.0", 256, cpu) is a
    with pytest.warns(RuntimeWarning, match="buckets changed"):
        b = error_buffer(st, "w0.0", 512, cpu)
    assert b.data.numel() == 512
    assert error_buffer(_state(error_feedback=False), "w0.0", 256, cpu) is None


def test_state_dict_round_trip() -> None:
    st = _state(error_dtype="bf16")
    error_buffer(st, "p3.0", 256, torch.device("cpu")).data.normal_()
    after_step(st, False, 4.0, 10)
    sd = state_dict(st)
    st2 = _state(error_dtype="bf16")
    load_state_dict(st2, sd)
    assert torch.equal(st2.buffers["p3.0"].data, st.buffers["p3.0"].data)
    assert (st2.loss_scale, st2.steps) == (4.0, 10)
    with pytest.raises(ValueError, match=r"group_size=128, error_dtype=torch\.bfloat16"):
        load_state_dict(_state(error_dtype="int8"), sd)


def test_config_defaults_validation_and_entry_point() -> None:
    cfg = LocoConfig()
    assert (cfg.bits, cfg.err_beta, cfg.reset_T, cfg.group_size, cfg.error_dtype) == (
        4,
        0.8,
        1024,
        128,
        "int8",
    )
    assert zerohooks.available_plugins()["loco"] is LocoPlugin
    (plugin,) = split_plugin_sections({"loco": {"bits": 8, "err_beta": 0.5}})
    assert isinstance(plugin, LocoPlugin) and plugin.cfg.bits == 8
    with pytest.raises(ConfigError, match=r"loco\.bits"):
        split_plugin_sections({"loco": {"bits": 3}})
    with pytest.raises(ConfigError, match=r"loco\.err_bta: unknown key \(did you mean 'err_beta'\?\)"):
        split_plugin_sections({"loco": {"err_bta": 0.5}})
    with pytest.raises(ConfigError, match=r"loco\.err_beta"):
        split_plugin_sections({"loco": {"err_beta": 1.5}})
    with pytest.raises(ConfigError, match=r"loco\.group_size"):
        split_plugin_sections({"loco": {"group_size": 100}})
    with pytest.raises(ConfigError, match="zero_quantized_gradients"):
        LocoPlugin().edit_deepspeed_config(
            {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}
        )


@pytest.mark.parametrize(("key", "word"), [("hierarchy", "detect"), ("kernels", "compiled")])
def test_absent_key_new_word_and_auto_alias_resolve_the_same(key: str, word: str) -> None:
    from loco.plugin import _two_level_wanted

    built = []
    for section in ({}, {key: word}, {key: "auto"}):
        (plugin,) = split_plugin_sections({"loco": section})
        assert isinstance(plugin, LocoPlugin)
        built.append(plugin)
    assert built[0].cfg == built[1].cfg == built[2].cfg == LocoConfig()
    assert getattr(built[2].cfg, key) == word  # "auto" is stored as the new word
    assert LocoConfig(**{key: "auto"}) == LocoConfig()
    if key == "kernels":
        assert all(p.state.use_kernels for p in built)
        assert not LocoState(LocoConfig(kernels="reference")).use_kernels
    else:  # world, node -> two-level?
        cases = {(4, 2): True, (8, 4): True, (2, 2): False, (4, 4): False, (6, 4): False}
        for (world, node), two in cases.items():
            assert [_two_level_wanted(p.cfg, world, node) for p in built] == [two] * 3
            assert not _two_level_wanted(LocoConfig(hierarchy="flat"), world, node)


@pytest.mark.parametrize(
    ("key", "words"),
    [("hierarchy", "'detect', 'flat' or 'two_level'"), ("kernels", "'compiled' or 'reference'")],
)
def test_bad_value_lists_the_accepted_words(key: str, words: str) -> None:
    with pytest.raises(ConfigError, match=rf"loco\.{key}: .*{words}.*got 'automatic'"):
        split_plugin_sections({"loco": {key: "automatic"}})


def test_readme_documents_every_option_with_its_default() -> None:
    text = README.read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| `([^`]*)` \|", text, re.M)}
    for name, field in LocoConfig.model_fields.items():
        assert field.description, f"LocoConfig.{name} has no docstring"
        assert name in rows, f"README.md does not document {name}"
        default = field.default
        shown = (
            "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        )
        shown = f'"{default}"' if isinstance(default, str) else shown
        assert rows[name] == shown, f"README.md shows {name} = {rows[name]}, the default is {shown}"
