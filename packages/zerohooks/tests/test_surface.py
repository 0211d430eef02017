"""The DeepSpeed surface (zerohooks.adapter.surface.SEAMS, SURFACE their union): every name a seam declares
exists in the installed DeepSpeed, an engine missing one is refused naming all that are missing,
and the seams are declared by the adapter (naming no plugin) or by the plugin that owns one."""

from __future__ import annotations

import functools
import importlib
import inspect
import pathlib
import re

import pytest

from zerohooks import DeepSpeedInternalMissing, surface


def _assigned(cls: type, name: str) -> bool:
    """Whether a class of ``cls``'s MRO assigns ``self.<name>`` (instance attributes live there)."""
    private = name.startswith("_") and "__" in name[1:] and not name.endswith("__")
    short = "__" + name.split("__", 1)[1] if private else name
    pattern = re.compile(
        rf"self\.{re.escape(short)}\s*(:[^=]+)?=(?!=)|self\.__dict__\[['\"]{re.escape(short)}['\"]\]\s*="
    )
    for base in cls.__mro__:
        try:
            if pattern.search(inspect.getsource(base)):
                return True
        except (OSError, TypeError):
            continue
    return False


@functools.cache
def _deepspeed_sources() -> str:
    import deepspeed

    root = pathlib.Path(deepspeed.__file__).parent
    return "\n".join(f.read_text(errors="replace") for f in sorted((root / "runtime").rglob("*.py")))


def _set_on_parameters(name: str) -> bool:
    """Whether DeepSpeed's runtime sets (or names, for ``setattr``) the parameter attribute ``name``."""
    pattern = re.compile(rf"\.{re.escape(name)}\s*=(?!=)|['\"]{re.escape(name)}['\"]")
    return bool(pattern.search(_deepspeed_sources()))


def _exists(item: surface.Internal) -> bool:
    if item.owner == surface.PARAM:
        return _set_on_parameters(item.name)
    try:
        module = importlib.import_module(item.owner)
        return hasattr(module, item.name)
    except ImportError:
        pass
    path, _, cls_name = item.owner.rpartition(".")
    cls = getattr(importlib.import_module(path), cls_name)
    return hasattr(cls, item.name) or _assigned(cls, item.name)


def _declared_by_plugins() -> tuple[surface.Internal, ...]:
    """Every seam, the plugins' own included (their declarations run when the module is imported;
    nvmeswap's store is the adapter's seam ``optimizer_state_store`` now)."""
    return surface.surface()


@pytest.mark.parametrize("item", _declared_by_plugins(), ids=lambda i: f"{i.user}:{i.qualname}")
def test_every_name_on_the_list_exists_in_the_installed_deepspeed(item: surface.Internal) -> None:
    assert _exists(item), f"{item.owner}.{item.name} ({item.user}) is not in the installed DeepSpeed"


def test_the_list_is_well_formed() -> None:
    assert {i.user for i in surface.SURFACE} == set(surface.SEAMS)
    assert set(surface.CORE_SEAMS) <= set(surface.SEAMS)
    for name, seam in surface.SEAMS.items():
        assert seam and all(i.user == name for i in seam), name
        # the core names no plugin: its seams are mechanisms, not users
        assert not any(p in name for p in ("accumdtype", "autocastzero", "mixedlayers", "loco", "nvmeswap"))
    assert all(i.how in surface.HOWS for i in surface.SURFACE)
    assert all(i.stages and i.stages <= {0, 1, 2, 3} for i in surface.SURFACE)
    keys = [(i.owner, i.name, i.user, i.stages) for i in surface.surface()]
    assert len(keys) == len(set(keys)), "an entry is listed twice"


def test_a_plugin_declares_its_own_seam() -> None:
    """A third-party plugin declares the DeepSpeed names it touches; the adapter then checks them."""
    mine = surface.make_entries(
        "thirdparty.counter", surface.ENGINE, (0,), write="no_such_attribute_anywhere"
    )
    surface.declare_seam("thirdparty.counter", mine)
    try:
        _check_declared_seam(mine)
    finally:
        surface._DECLARED.pop("thirdparty.counter", None)


def _check_declared_seam(mine: list[surface.Internal]) -> None:
    surface.declare_seam("thirdparty.counter", mine)  # imported twice: the same declaration

    class Plugin:
        name = "thirdparty"
        deepspeed_seams = ("thirdparty.counter",)

    class Engine:  # has every core name of ZeRO 0
        pass

    for item in surface.needed(0, []):
        if item.owner == surface.ENGINE:
            setattr(Engine, item.name, None)
    surface.check(Engine(), 0, [])
    with pytest.raises(
        DeepSpeedInternalMissing, match=r"Engine\.no_such_attribute_anywhere.*used by thirdparty\.counter"
    ):
        surface.check(Engine(), 0, surface.seams_of([Plugin]))
    with pytest.raises(ValueError, match="already declared with other names"):
        surface.declare_seam(
            "thirdparty.counter", surface.make_entries("thirdparty.counter", surface.ENGINE, (0,), read="x")
        )
    with pytest.raises(ValueError, match="is the adapter's own"):
        surface.declare_seam("forward", ())

    class Unknown:
        name = "unknown"
        deepspeed_seams = ("no_such_seam",)

    with pytest.raises(ValueError, match=r"declares the unknown seam 'no_such_seam'; known: \["):
        surface.seams_of([Unknown])


def test_an_engine_missing_names_is_refused_naming_all_of_them() -> None:
    class Engine:  # stands for a DeepSpeedEngine of a release that renamed two methods
        pass

    for item in surface.needed(0, ["forward", "loss_scaling"]):
        if item.owner == surface.ENGINE and item.name not in (
            "_take_model_step",
            "torch_autocast_z0_gradscaler",
        ):
            setattr(Engine, item.name, None)
    with pytest.raises(DeepSpeedInternalMissing) as e:
        surface.check(Engine(), 0, ["forward", "loss_scaling"])
    assert "needs Engine._take_model_step, Engine.torch_autocast_z0_gradscaler, which DeepSpeed" in str(
        e.value
    )
    assert "used by engine, loss_scaling;" in str(e.value)
    Engine._take_model_step = None  # type: ignore[attr-defined]
    surface.check(Engine(), 0, [])  # the ZeRO 0 scaler slot is the loss_scaling seam's only
