"""One plugin object serves one engine at a time: a second engine is refused until the first is
detached (a shared plugin would mix the two engines' state without a word)."""

from __future__ import annotations

import pytest

import zerohooks
from zerohooks import PluginConfig, PluginInUseError, ZeroPlugin
from zerohooks.dsconfig import setup_context
from zerohooks.registry import HookRegistry
from zerohooks.testing import distributed
from zerohooks.testing.recording import RecordingPlugin
from zerohooks.testing.toy import ds_config, make_model, train


class _Plain(ZeroPlugin):
    """A plugin overriding attach and close without calling super()."""

    name = "plain"

    def __init__(self) -> None:
        super().__init__(PluginConfig())
        self.attached: list[HookRegistry] = []
        self.closed = 0

    def attach(self, registry: HookRegistry, ctx: zerohooks.SetupContext) -> None:
        self.attached.append(registry)

    def close(self) -> None:
        self.closed += 1
        raise OSError("a close that fails")


def test_binding_rules_without_an_engine() -> None:
    ctx = setup_context(ds_config(1))
    plugin = _Plain()
    first = HookRegistry()
    plugin.attach(first, ctx)
    # the registry of an initialize that failed before DeepSpeed built the engine binds nothing
    second = HookRegistry()
    plugin.attach(second, ctx)
    second.seal()  # now it serves the engine of `second`
    assert plugin.in_use
    plugin.attach(second, ctx)  # the same engine again: fine
    for attempt in (
        lambda: setattr(plugin, "peers", ("x",)),
        lambda: plugin.edit_deepspeed_config({}),
        lambda: plugin.attach(HookRegistry(), ctx),
    ):
        with pytest.raises(PluginInUseError, match=r"'plain' plugin object .*_Plain at 0x"):
            attempt()
    assert len(plugin.attached) == 3  # the refused attach never reached the plugin
    with pytest.raises(OSError, match="a close that fails"):
        plugin.close()
    assert not plugin.in_use  # released although its own close failed
    plugin.peers = ("x",)
    plugin.attach(HookRegistry(), ctx)


class _Base(ZeroPlugin):
    """A plugin reading ``self.deepspeed`` in its edit, with a read-only ``cfg`` property (the
    shape of plugins written before ``ZeroPlugin`` set ``cfg`` itself)."""

    name = "base"

    @property
    def cfg(self) -> PluginConfig:  # type: ignore[override]
        return self.config

    def edit_deepspeed_config(self, ds_config: dict) -> None:  # type: ignore[type-arg]
        ds_config.setdefault("seen", []).append(("base", self.deepspeed.zero_stage))


class _Derived(_Base):
    name = "derived"

    def edit_deepspeed_config(self, ds_config: dict) -> None:  # type: ignore[type-arg]
        super().edit_deepspeed_config(ds_config)
        ds_config["seen"].append(("derived", self.deepspeed.zero_stage))  # still inside the edit


def test_subclass_calling_super_and_a_cfg_property() -> None:
    plugin = _Derived()
    assert plugin.cfg is plugin.config
    cfg = ds_config(2)
    plugin.edit_deepspeed_config(cfg)
    assert cfg["seen"] == [("base", 2), ("derived", 2)]
    with pytest.raises(RuntimeError, match="only available inside edit_deepspeed_config"):
        plugin.deepspeed  # noqa: B018


@pytest.mark.multirank
@distributed(world_size=2)
def test_a_plugin_object_serves_one_engine_at_a_time() -> None:
    def build(plugin: ZeroPlugin, model=None, **extra):  # type: ignore[no-untyped-def]
        model = make_model() if model is None else model
        cfg = ds_config(2, **extra)
        return zerohooks.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, plugins=[plugin]
        )[0]

    plugin = RecordingPlugin()
    engine = build(plugin)
    losses = train(engine, 1, 2)
    other = make_model()
    with pytest.raises(
        PluginInUseError,
        match=r"the 'recording' plugin object .*RecordingPlugin at 0x[0-9a-f]+ is already in use by another "
        r"engine.*Build a new plugin object for each engine .*zerohooks\.detach",
    ):
        build(plugin, other)
    att = zerohooks.attachment(engine)
    assert att is not None and att.plugins == [plugin]
    losses += train(engine, 1, 2, first=1)
    # the refused attempt changed nothing: the engine trains as one that never saw it
    assert losses == train(build(RecordingPlugin()), 2, 2)

    # detached, the plugin is released and serves a new engine
    zerohooks.detach(engine)
    assert not plugin.in_use
    again = build(plugin, other)
    att = zerohooks.attachment(again)
    assert att is not None and att.plugins == [plugin] and plugin.in_use
    train(again, 1, 2)

    # an initialize that DeepSpeed refuses (after the plugin attached) leaves the plugin free
    fresh = RecordingPlugin()
    with pytest.raises(Exception, match="train_batch_size"):
        build(fresh, train_batch_size=15)
    assert not fresh.in_use
    train(build(fresh), 1, 2)

    # so does one the adapter refuses after sealing the registry: a stage plugin with the
    # BF16_Optimizer that DeepSpeed builds for bf16 + ZeRO 1 + grad_accum_dtype fp32
    refused = RecordingPlugin()
    model = make_model()
    cfg = ds_config(1, "bf16", data_types={"grad_accum_dtype": "fp32"})
    with pytest.raises(zerohooks.ConfigError, match=r"need DeepSpeed's ZeRO 1 optimizer .*BF16_Optimizer"):
        zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg, plugins=[refused])
    assert not refused.in_use
    train(build(refused), 1, 2)


def test_the_guarded_methods_are_named_and_nothing_else_is_wrapped() -> None:
    def attach(self: ZeroPlugin, registry: HookRegistry, ctx: zerohooks.SetupContext) -> None:
        pass

    def engine_ready(self: ZeroPlugin, engine: object, registry: HookRegistry) -> None:
        pass

    cls = type("_Guarded", (ZeroPlugin,), {"name": "guarded", "attach": attach, "engine_ready": engine_ready})
    assert ZeroPlugin.GUARDED == ("edit_deepspeed_config", "attach", "close")
    assert cls.attach is not attach and cls.attach.__wrapped__ is attach  # type: ignore[attr-defined]
    assert cls.attach.__name__ == "attach"
    assert cls.engine_ready is engine_ready  # not guarded: left as written
    sub = type("_Sub", (cls,), {})  # inherits the wrapped method: not wrapped twice
    assert sub.attach is cls.attach
