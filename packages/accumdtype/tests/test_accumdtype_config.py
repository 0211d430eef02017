"""The config section, the lossy-combination refusal and the per-stage plan (no ranks needed)."""

from __future__ import annotations

import copy
from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
from _accum_common import ds_config, make_model

import zerohooks
from accumdtype import AccumDtypeConfig, AccumDtypePlugin, grad_accum, make_plan
from accumdtype.config import apply_plan, lossless
from zerohooks import ConfigError
from zerohooks.config import split_plugin_sections
from zerohooks.dsconfig import setup_context

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _plan(stage: int, model: str, offload: bool = False, **section: Any) -> Any:
    cfg = ds_config(stage, model, offload)
    cfg.update(section.pop("ds", {}))
    return make_plan(AccumDtypeConfig(**section), setup_context(cfg))


def _edited(stage: int, model: str, offload: bool = False, **section: Any) -> dict[str, Any]:
    cfg = ds_config(stage, model, offload)
    cfg.update(section.pop("ds", {}))
    plugin = AccumDtypePlugin(AccumDtypeConfig(**section))
    plugin.edit_deepspeed_config(cfg)
    return cfg


def test_defaults_are_fp32_accumulation_and_matching_reduction() -> None:
    cfg = AccumDtypeConfig()
    assert (cfg.dtype, cfg.reduce_dtype, cfg.allow_lossy) == ("fp32", "inherit", False)
    plan = _plan(2, "bf16")
    assert (plan.accum_dtype, plan.reduce_dtype, plan.deepspeed_comm_dtype) == (FP32, FP32, BF16)
    assert plan.set_comm_dtype  # DeepSpeed would reduce a bf16 model's gradients in bf16
    assert _edited(2, "bf16")["communication_data_type"] == "fp32"
    assert "communication_data_type" not in _edited(2, "fp32")


def test_every_field_has_a_docstring() -> None:
    import ast
    import inspect

    import accumdtype.config as mod

    tree = ast.parse(inspect.getsource(mod))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AccumDtypeConfig")
    body = cls.body
    documented = {
        body[i].target.id  # type: ignore[attr-defined]
        for i in range(len(body) - 1)
        if isinstance(body[i], ast.AnnAssign)
        and isinstance(body[i + 1], ast.Expr)
        and isinstance(body[i + 1].value, ast.Constant)  # type: ignore[attr-defined]
    }
    assert set(AccumDtypeConfig.model_fields) <= documented  # every field (class variables may be too)


@pytest.mark.parametrize(
    ("given", "expected"), [("float32", "fp32"), ("bfloat16", "bf16"), ("half", "fp16"), ("FP32", "fp32")]
)
def test_dtype_aliases(given: str, expected: str) -> None:
    assert AccumDtypeConfig(dtype=given).dtype == expected  # type: ignore[arg-type]
    assert AccumDtypeConfig(reduce_dtype=given).reduce_dtype == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("ds", [{}, {"communication_data_type": "fp32"}, {"communication_data_type": "bf16"}])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_reduce_dtype_absent_inherit_and_auto_are_the_same(stage: int, ds: dict[str, Any]) -> None:
    plugins = {"accumdtype": AccumDtypePlugin}
    plans, edited = [], []
    for section in ({}, {"reduce_dtype": "inherit"}, {"reduce_dtype": "auto"}):
        section = {**section, "allow_lossy": True}  # communication_data_type bf16 is lossy
        (built,) = split_plugin_sections({"accumdtype": dict(section)}, plugins)
        assert isinstance(built, AccumDtypePlugin)
        assert built.cfg == AccumDtypeConfig(allow_lossy=True)  # "auto" is stored as "inherit"
        assert built.cfg.reduce_dtype == "inherit"
        plans.append(_plan(stage, "bf16", ds=copy.deepcopy(ds), **section))
        edited.append(_edited(stage, "bf16", ds=copy.deepcopy(ds), **section))
    assert plans[0] == plans[1] == plans[2]
    assert edited[0] == edited[1] == edited[2]


def test_bad_reduce_dtype_lists_the_accepted_words() -> None:
    with pytest.raises(
        ConfigError, match=r"accumdtype\.reduce_dtype: .*'inherit', 'fp32', 'bf16' or 'fp16'"
    ) as err:
        split_plugin_sections({"accumdtype": {"reduce_dtype": "deepspeed"}}, {"accumdtype": AccumDtypePlugin})
    assert "got 'deepspeed'" in str(err.value)


def test_lossy_reduction_names_the_fix() -> None:
    with pytest.raises(ConfigError, match='set communication_data_type to "fp32" or remove it'):
        _plan(2, "bf16", ds={"communication_data_type": "bf16"})
    with pytest.raises(ConfigError, match='use reduce_dtype "fp32" or leave the key out'):
        _plan(2, "bf16", reduce_dtype="bf16")


def test_section_errors_name_the_key() -> None:
    plugins = {"accumdtype": AccumDtypePlugin}
    with pytest.raises(ConfigError, match=r"accumdtype\.dtyp: unknown key \(did you mean 'dtype'\?\)"):
        split_plugin_sections({"accumdtype": {"dtyp": "fp32"}}, plugins)
    with pytest.raises(ConfigError, match=r"accumdtype\.dtype: .*got 'int8'"):
        split_plugin_sections({"accumdtype": {"dtype": "int8"}}, plugins)
    (built,) = split_plugin_sections({"accumdtype": {"dtype": "bfloat16"}}, plugins)
    assert isinstance(built, AccumDtypePlugin) and built.cfg.dtype == "bf16"


def test_entry_point_loads_the_plugin() -> None:
    (ep,) = [ep for ep in entry_points(group="zerohooks.plugins") if ep.name == "accumdtype"]
    assert ep.load() is AccumDtypePlugin and AccumDtypePlugin.name == "accumdtype"


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        (BF16, FP32, True),
        (FP16, FP32, True),
        (BF16, BF16, True),
        (FP32, BF16, False),
        (BF16, FP16, False),
        (FP16, BF16, False),
    ],
)
def test_lossless(src: torch.dtype, dst: torch.dtype, ok: bool) -> None:
    assert lossless(src, dst) is ok


@pytest.mark.parametrize(
    ("stage", "model", "section", "ds", "fragment"),
    [
        (2, "fp32", {"dtype": "bf16"}, {}, "accumulating fp32 gradients in bf16"),
        (0, "fp16", {"dtype": "bf16"}, {}, "accumulating fp16 gradients in bf16"),
        (3, "bf16", {"reduce_dtype": "bf16"}, {}, "reducing fp32-accumulated gradients in bf16"),
        (1, "bf16", {}, {"communication_data_type": "bf16"}, "set by communication_data_type"),
    ],
)
def test_lossy_combinations_are_refused(
    stage: int, model: str, section: dict[str, Any], ds: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError, match="allow_lossy") as err:
        _plan(stage, model, ds=ds, **section)
    assert fragment in str(err.value)
    plan = _plan(stage, model, ds=ds, allow_lossy=True, **section)  # explicitly allowed: runs
    assert plan.accum_dtype == {"bf16": BF16, "fp32": FP32}[section.get("dtype", "fp32")]


def test_lossy_refused_before_deepspeed_is_called() -> None:
    model = make_model()
    with pytest.raises(ConfigError, match=r"accumdtype refuses.*fp32 gradients in bf16.*allow_lossy"):
        zerohooks.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=ds_config(2, "fp32", accum={"dtype": "bf16"}),
        )


@pytest.mark.parametrize(
    ("stage", "model", "offload", "mechanism", "grad_accum_dtype"),
    [
        (0, "bf16", False, "own", None),  # DeepSpeed raises NotImplementedError without ZeRO
        (1, "bf16", False, "deepspeed_flag", None),  # DeepSpeed would swap in BF16_Optimizer
        (1, "bf16", True, "deepspeed", "fp32"),
        (1, "fp16", False, "deepspeed", "fp32"),
        (2, "bf16", False, "deepspeed", "fp32"),
        (2, "bf16", True, "deepspeed", "fp32"),
        (3, "bf16", False, "deepspeed", "fp32"),
        (3, "fp16", True, "deepspeed", "fp32"),
        (2, "fp32", False, "none", None),
        (0, "fp32", False, "none", None),
    ],
)
def test_plan_per_stage(
    stage: int, model: str, offload: bool, mechanism: str, grad_accum_dtype: str | None
) -> None:
    plan = _plan(stage, model, offload)
    assert plan.mechanism == mechanism
    cfg = _edited(stage, model, offload)
    assert (cfg.get("data_types") or {}).get("grad_accum_dtype") == grad_accum_dtype
    assert not plan.wide_ipg_buffer  # one rank here: a power of two
    assert plan.set_comm_dtype == (model != "fp32")
    assert cfg.get("communication_data_type") == (None if model == "fp32" else "fp32")


@pytest.mark.parametrize("world", [2, 3, 4, 6])
def test_zero2_stages_in_fp32_only_for_world_sizes_not_powers_of_two(
    monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert _plan(2, "bf16").wide_ipg_buffer == (world in (3, 6))
    assert not _plan(2, "fp32").wide_ipg_buffer and not _plan(3, "bf16").wide_ipg_buffer
    assert not _plan(2, "bf16", reduce_dtype="bf16", dtype="bf16").wide_ipg_buffer


def test_deepspeed_keys_that_agree_or_conflict() -> None:
    with pytest.raises(ConfigError, match=r'grad_accum_dtype="bf16" conflicts with accumdtype\.dtype="fp32"'):
        _plan(2, "bf16", ds={"data_types": {"grad_accum_dtype": "bf16"}})
    with pytest.raises(ConfigError, match='communication_data_type="fp16" conflicts'):
        _plan(2, "bf16", reduce_dtype="fp32", ds={"communication_data_type": "fp16"})
    # the same value as accumdtype: removed where DeepSpeed must not see it, kept elsewhere
    same = {"data_types": {"grad_accum_dtype": "fp32", "param_dtype": "bf16"}}
    assert _edited(0, "bf16", ds=copy.deepcopy(same))["data_types"] == {"param_dtype": "bf16"}
    assert _edited(1, "bf16", ds=copy.deepcopy(same))["data_types"] == {"param_dtype": "bf16"}
    assert _edited(2, "bf16", ds=copy.deepcopy(same))["data_types"]["grad_accum_dtype"] == "fp32"
    assert "data_types" not in _edited(0, "bf16", ds={"data_types": {"grad_accum_dtype": "float32"}})
    # an explicit fp32 communication dtype is honoured by reduce_dtype "inherit": no hook needed
    plan = _plan(2, "bf16", ds={"communication_data_type": "fp32"})
    assert plan.reduce_dtype == FP32 and not plan.set_comm_dtype


def test_apply_plan_only_sets_the_two_deepspeed_keys() -> None:
    cfg = ds_config(3, "bf16")
    before = copy.deepcopy(cfg)
    apply_plan(_plan(3, "bf16"), cfg)
    assert cfg.pop("data_types") == {"grad_accum_dtype": "fp32"}
    assert cfg.pop("communication_data_type") == "fp32" and cfg == before


def test_accessors_need_accumdtype() -> None:
    class NotAnEngine:
        pass

    with pytest.raises(ValueError, match="no accumdtype attached"):
        grad_accum(NotAnEngine(), torch.nn.Parameter(torch.zeros(1)))


def test_missing_deepspeed_internal_is_named() -> None:
    from accumdtype.access import check_internals

    class Stage3Like:
        def _get_param_partition_rank(self, param: Any) -> int:
            return 0

    with pytest.raises(
        zerohooks.DeepSpeedInternalMissing, match=r"Stage3Like\._DeepSpeedZeroOptimizer_Stage3__param_id"
    ):
        check_internals(Stage3Like(), 3)
    check_internals(Stage3Like(), 0)  # ZeRO 0 reads no DeepSpeed internal
