"""The DeepSpeed adapter: attaches a sealed registry to an engine, per instance, undoably."""

from __future__ import annotations

from typing import Any

from zerohooks.adapter.base import Attachment, attachment_of, step_context
from zerohooks.hookspec import SetupContext
from zerohooks.plugin import ZeroPlugin
from zerohooks.registry import HookRegistry

__all__ = ["Attachment", "attach", "attachment_of", "detach", "step_context"]


def attach(engine: Any, registry: HookRegistry, setup: SetupContext, plugins: list[ZeroPlugin]) -> Attachment:
    """Attach ``registry`` to ``engine``; the stage is read from the engine."""
    if attachment_of(engine) is not None:
        raise RuntimeError("this engine already has zerohooks attached; detach it first")
    registry.seal()
    att = Attachment(engine, registry, setup, plugins)
    try:
        att.install_engine_patches()
        stage = setup.zero_stage
        if stage == 0:
            from zerohooks.adapter import zero0 as mod
        elif stage in (1, 2):
            from zerohooks.adapter import zero12 as mod  # type: ignore[no-redef]
        else:
            from zerohooks.adapter import zero3 as mod  # type: ignore[no-redef]
        mod.install(att)
    except BaseException:
        att.detach()
        raise
    att.register()
    return att


def detach(engine: Any) -> None:
    """Undo everything zerohooks did to ``engine``: it behaves as DeepSpeed built it."""
    att = attachment_of(engine)
    if att is None:
        raise ValueError("this engine has no zerohooks attachment")
    att.detach()
