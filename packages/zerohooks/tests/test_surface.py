"""The DeepSpeed surface list (zerohooks.surface.SURFACE): every name on it exists in the installed
DeepSpeed, and an engine missing one is refused naming all that are missing."""

from __future__ import annotations

import importlib
import inspect
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


def _exists(item: surface.Internal) -> bool:
    try:
        module = importlib.import_module(item.owner)
        return hasattr(module, item.name)
    except ImportError:
        pass
    path, _, cls_name = item.owner.rpartition(".")
    cls = getattr(importlib.import_module(path), cls_name)
    return hasattr(cls, item.name) or _assigned(cls, item.name)


@pytest.mark.parametrize("item", surface.SURFACE, ids=lambda i: f"{i.user}:{i.qualname}")
def test_every_name_on_the_list_exists_in_the_installed_deepspeed(item: surface.Internal) -> None:
    assert _exists(item), f"{item.owner}.{item.name} ({item.user}) is not in the installed DeepSpeed"


def test_the_list_is_well_formed() -> None:
    users = {i.user for i in surface.SURFACE}
    assert users == {"zerohooks", "accumdtype", "autocastzero", "mixedlayers", "nvmeswap"}
    assert all(i.stages and i.stages <= {0, 1, 2, 3} for i in surface.SURFACE)
    keys = [(i.owner, i.name, i.user, i.stages) for i in surface.SURFACE]
    assert len(keys) == len(set(keys)), "an entry is listed twice"


def test_an_engine_missing_names_is_refused_naming_all_of_them() -> None:
    class Engine:  # stands for a DeepSpeedEngine of a release that renamed two methods
        pass

    for item in surface.needed(0, ["autocastzero"]):
        if item.owner == surface.ENGINE and item.name not in (
            "_take_model_step",
            "torch_autocast_z0_gradscaler",
        ):
            setattr(Engine, item.name, None)
    with pytest.raises(DeepSpeedInternalMissing) as e:
        surface.check(Engine(), 0, ["autocastzero"])
    assert "needs Engine._take_model_step, Engine.torch_autocast_z0_gradscaler, which DeepSpeed" in str(
        e.value
    )
    assert "used by zerohooks, autocastzero;" in str(e.value)
    Engine._take_model_step = None  # type: ignore[attr-defined]
    surface.check(Engine(), 0, [])  # the ZeRO 0 scaler slot is autocastzero's only
