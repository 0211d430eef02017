"""Routing of DeepSpeed's parameter all-gathers to the engine's :class:`ParameterGatherer`.

Every parameter all-gather of DeepSpeed 0.19.8's ZeRO 1-3 goes through one method of one object,
``deepspeed.comm.comm.cdb.all_gather_into_tensor`` (the process's communication backend): ZeRO
1/2's ``all_gather_dp_groups`` after the step and ZeRO 3's ``allgather_fn`` in forward and
backward.  A route is a (process group -> gatherer) entry; the backend method is shadowed on the
``cdb`` instance while at least one route exists, and calls on a group without a route go to
DeepSpeed's method unchanged.  Several engines may route the same group: the newest route serves
it (every gatherer returns exactly what DeepSpeed's all-gather would, so only whose counters see
the bytes differs), and removing a route hands the group back to the previous one.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerohooks.errors import DeepSpeedInternalMissing
from zerohooks.hookspec import ParameterGatherer

__all__ = ["RouteHandle", "route"]

_routes: dict[Any, list[tuple[int, ParameterGatherer]]] = {}
_backend: Any = None
_ids = iter(range(1 << 62))


class _Handle:
    """What an ``async_op=True`` caller gets: ``wait()`` completes the gather (once).

    Finish steps run in issue order, whatever order the caller waits in: waiting on a handle
    first finishes every older unfinished one.  A finish step may itself be a collective (loco's
    within-node hop), and DeepSpeed does not wait in the same order on every rank (ZeRO 3 waits
    the handles of a module's parameters in the order of a ``set``, which follows memory
    addresses), so finishing in wait order could pair different gathers on different ranks.
    The issue order is the same on every rank."""

    __slots__ = ("finish",)

    def __init__(self, finish: Callable[[], None] | None) -> None:
        self.finish = finish
        if finish is not None:
            _unfinished.append(self)

    def wait(self, timeout: Any = None) -> bool:
        while self.finish is not None:
            oldest = _unfinished.popleft()
            finish, oldest.finish = oldest.finish, None
            if finish is not None:
                finish()
        return True

    def is_completed(self) -> bool:
        return self.finish is None


_unfinished: collections.deque[_Handle] = collections.deque()
"""Handles whose finish step has not run, oldest first."""


class RouteHandle:
    """Removes the routes of one engine (kept by the attachment, removed on detach)."""

    def __init__(self, groups: list[Any], ident: int) -> None:
        self.groups = groups
        self.ident = ident

    def remove(self) -> None:
        for g in self.groups:
            stack = _routes.get(g, [])
            stack[:] = [e for e in stack if e[0] != self.ident]
            if not stack:
                _routes.pop(g, None)
        if not _routes:
            _restore()


def _cdb() -> Any:
    try:
        from deepspeed.comm import comm as ds_comm
    except ImportError as e:  # pragma: no cover - DeepSpeed is a dependency
        raise DeepSpeedInternalMissing(f"deepspeed.comm.comm cannot be imported: {e}") from e
    backend = getattr(ds_comm, "cdb", None)
    if backend is None or not callable(getattr(backend, "all_gather_into_tensor", None)):
        raise DeepSpeedInternalMissing(
            "deepspeed.comm.comm.cdb.all_gather_into_tensor (the backend's parameter all-gather) is missing; "
            "the parameter-gather owner supports DeepSpeed 0.19.x"
        )
    return backend


def _install(backend: Any) -> None:
    global _backend
    if _backend is backend:
        return
    if _backend is not None:
        # the process made a new backend (DeepSpeed re-initialised): the old routes' groups are gone
        _restore()
    original = backend.all_gather_into_tensor

    def all_gather_into_tensor(
        output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        key = group if group is not None else dist.group.WORLD
        stack = _routes.get(key)
        if not stack:
            return original(
                output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op
            )
        finish = stack[-1][1].all_gather(output_tensor, input_tensor, key)
        handle = _Handle(finish)
        if async_op:
            return handle
        handle.wait()
        return None

    backend.all_gather_into_tensor = all_gather_into_tensor
    _backend = backend


def _restore() -> None:
    global _backend
    if _backend is not None:
        _backend.__dict__.pop("all_gather_into_tensor", None)
    _backend = None
    _routes.clear()


def route(groups: list[Any], gatherer: ParameterGatherer) -> RouteHandle:
    """Send the parameter all-gathers on ``groups`` (None: the default group) to ``gatherer``."""
    backend = _cdb()
    _install(backend)
    keys: list[Any] = []
    for g in groups:
        key = g if g is not None else dist.group.WORLD
        if all(key is not k for k in keys):
            keys.append(key)
    ident = next(_ids)
    for key in keys:
        _routes.setdefault(key, []).append((ident, gatherer))
    return RouteHandle(keys, ident)


def install(att: Any, groups: list[Any]) -> None:
    """Route ``groups`` to the registry's gatherer, if one is registered, until ``att`` detaches."""
    gatherer = att.registry.gatherer.owner
    if gatherer is not None and groups:
        att.keep_handle(route(groups, gatherer))
