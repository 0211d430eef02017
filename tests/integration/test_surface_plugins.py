"""The seams the five plugins declare (``deepspeed_seams``): here, where every package is
installed (the tests(zerohooks) session has zerohooks alone)."""

from __future__ import annotations

from zerohooks.adapter import surface


def test_every_plugin_declares_known_seams() -> None:
    """Each plugin names the seams it uses; the adapter checks exactly those (and the core's)."""
    from accumdtype import AccumDtypePlugin
    from autocastzero import AutocastZeroPlugin
    from loco import LocoPlugin
    from mixedlayers import MixedLayersPlugin
    from nvmeswap import NvmeSwapPlugin

    plugins = [AccumDtypePlugin, AutocastZeroPlugin, LocoPlugin, MixedLayersPlugin, NvmeSwapPlugin]
    assert surface.seams_of([AutocastZeroPlugin]) == ["forward", "loss_scaling"]
    assert "optimizer_state_store" in surface.seams_of(plugins)
    needed = {i.user for i in surface.needed(3, surface.seams_of([MixedLayersPlugin]))}
    assert needed == {*surface.CORE_SEAMS, "stage_buckets", "separate_accumulation", "partition_retype"} - {
        "loss_scale_query",  # optional names only
        "stage_buckets",  # ZeRO 1/2 only
        "separate_accumulation",
    }
