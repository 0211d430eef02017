"""The hook registry: ordered transforms, single-owner collectives, removable handles.

Callbacks are kept in lists while plugins register, and frozen into tuples by :meth:`seal` so
the hot path (a per-parameter hook fires thousands of times per step) is a plain loop over a
tuple.  Removing a handle re-freezes the tuple.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from zerohooks.hookspec import (
    AfterStepHook,
    BeforeStepHook,
    GatherDtypeHook,
    GradientReducer,
    MicroStepGradHook,
    ParameterGatherer,
    PrepareModelHook,
    PrepareParametersHook,
    ReduceDtypeHook,
    ReduceTensorHook,
    StateProvider,
)

__all__ = ["FIRST", "LAST", "HookRegistry", "OwnerConflictError", "RemovableHandle"]

FIRST = -1000
"""``order=`` of a transform that must run before every other plugin's (ties: by name)."""
LAST = 1000
"""``order=`` of a transform that must run after every other plugin's (ties: by name)."""

T = TypeVar("T")
_ids = itertools.count()


class OwnerConflictError(RuntimeError):
    """A second owner was registered for a single-owner hook."""


class RemovableHandle:
    """Undoes one registration.  ``remove()`` is idempotent; usable as a context manager."""

    __slots__ = ("_remove", "name")

    def __init__(self, remove: Callable[[], None], name: str) -> None:
        self._remove: Callable[[], None] | None = remove
        self.name = name

    def remove(self) -> None:
        """Unregister; a second call does nothing."""
        if self._remove is not None:
            fn, self._remove = self._remove, None
            fn()

    @property
    def active(self) -> bool:
        """True until :meth:`remove` has run."""
        return self._remove is not None

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"RemovableHandle({self.name!r}, active={self.active})"


@dataclasses.dataclass(frozen=True)
class _Entry(Generic[T]):
    order: int
    name: str
    seq: int
    fn: T


class _HookList(Generic[T]):
    """Callbacks of one transform hook, sorted by (order, name, registration)."""

    __slots__ = ("_entries", "frozen", "hook")

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self._entries: list[_Entry[T]] = []
        self.frozen: tuple[T, ...] = ()

    def add(self, fn: T, order: int, name: str) -> RemovableHandle:
        entry = _Entry(order, name, next(_ids), fn)
        self._entries.append(entry)
        self._refreeze()

        def remove() -> None:
            self._entries.remove(entry)
            self._refreeze()

        return RemovableHandle(remove, f"{self.hook}:{name}")

    def _refreeze(self) -> None:
        self._entries.sort(key=lambda e: (e.order, e.name, e.seq))
        self.frozen = tuple(e.fn for e in self._entries)

    def names(self) -> list[str]:
        return [e.name for e in self._entries]


class _Owner(Generic[T]):
    __slots__ = ("hook", "name", "owner")

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.owner: T | None = None
        self.name: str | None = None

    def set(self, owner: T, name: str) -> RemovableHandle:
        if self.owner is not None:
            raise OwnerConflictError(
                f"{self.hook} already has an owner, {self.name!r}; {name!r} cannot also own it. "
                f"Only one plugin may own {self.hook}: disable one of {self.name!r} and {name!r}."
            )
        self.owner, self.name = owner, name

        def remove() -> None:
            if self.owner is owner:
                self.owner, self.name = None, None

        return RemovableHandle(remove, f"{self.hook}:{name}")


class HookRegistry:
    """All hooks of one engine.  Plugins register here; the adapter fires what is registered."""

    def __init__(self) -> None:
        self.prepare_model: _HookList[PrepareModelHook] = _HookList("prepare_model")
        self.micro_step_grad: _HookList[MicroStepGradHook] = _HookList("micro_step_grad")
        self.prepare_parameters: _HookList[PrepareParametersHook] = _HookList("prepare_parameters")
        self.reduce_dtype: _HookList[ReduceDtypeHook] = _HookList("reduce_dtype")
        self.reduce_tensor: _HookList[ReduceTensorHook] = _HookList("reduce_tensor")
        self.before_step: _HookList[BeforeStepHook] = _HookList("before_step")
        self.after_step: _HookList[AfterStepHook] = _HookList("after_step")
        self.reducer: _Owner[GradientReducer] = _Owner("the gradient collective")
        self.gatherer: _Owner[ParameterGatherer] = _Owner("the parameter all-gather")
        self.gather_dtype: _HookList[GatherDtypeHook] = _HookList("gather_dtype")
        self.states: dict[str, StateProvider] = {}
        self._sealed = False

    # -- registration -------------------------------------------------------------------------
    def _add(
        self, hooks: _HookList[T], fn: T, order: int, name: str, before: str | None = None
    ) -> RemovableHandle:
        """Add ``fn`` to a transform; ``before``: the moment after which it is refused."""
        if before is not None and self._sealed:
            raise RuntimeError(f"{hooks.hook} hooks must be registered before {before}")
        return hooks.add(fn, order, name)

    def register_prepare_model(self, fn: PrepareModelHook, *, name: str, order: int = 0) -> RemovableHandle:
        """Register a :class:`~zerohooks.hookspec.PrepareModelHook` (before the engine is built)."""
        return self._add(self.prepare_model, fn, order, name, before="the engine is built")

    def register_prepare_parameters(
        self, fn: PrepareParametersHook, *, name: str, order: int = 0
    ) -> RemovableHandle:
        """Register a :class:`~zerohooks.hookspec.PrepareParametersHook` (before the engine is built)."""
        return self._add(self.prepare_parameters, fn, order, name, before="the engine is built")

    def register_micro_step_grad(
        self, fn: MicroStepGradHook, *, name: str, order: int = 0
    ) -> RemovableHandle:
        """Register a :class:`~zerohooks.hookspec.MicroStepGradHook`."""
        return self._add(self.micro_step_grad, fn, order, name)

    def register_reduce_dtype(self, fn: ReduceDtypeHook, *, name: str, order: int = 0) -> RemovableHandle:
        """Register a :class:`~zerohooks.hookspec.ReduceDtypeHook`."""
        return self._add(self.reduce_dtype, fn, order, name)

    def register_reduce_tensor(self, fn: ReduceTensorHook, *, name: str, order: int = 0) -> RemovableHandle:
        """Register a :class:`~zerohooks.hookspec.ReduceTensorHook`."""
        return self._add(self.reduce_tensor, fn, order, name)

    def register_before_step(self, fn: BeforeStepHook, *, name: str, order: int = 0) -> RemovableHandle:
        """Register a :class:`~zerohooks.hookspec.BeforeStepHook`."""
        return self._add(self.before_step, fn, order, name)

    def register_after_step(self, fn: AfterStepHook, *, name: str, order: int = 0) -> RemovableHandle:
        """Register a :class:`~zerohooks.hookspec.AfterStepHook`."""
        return self._add(self.after_step, fn, order, name)

    def register_gather_dtype(self, fn: GatherDtypeHook, *, name: str, order: int = 0) -> RemovableHandle:
        """Register a :class:`~zerohooks.hookspec.GatherDtypeHook` (ZeRO 3 only; read at attach)."""
        return self._add(self.gather_dtype, fn, order, name, before="the engine is attached")

    def register_reducer(self, reducer: GradientReducer, *, name: str) -> RemovableHandle:
        """Own the gradient collective; a second owner raises :class:`OwnerConflictError`."""
        return self.reducer.set(reducer, name)

    def register_gatherer(self, gatherer: ParameterGatherer, *, name: str) -> RemovableHandle:
        """Own the parameter all-gathers (ZeRO 1-3); a second owner raises :class:`OwnerConflictError`."""
        return self.gatherer.set(gatherer, name)

    def register_state(self, provider: StateProvider, *, name: str) -> RemovableHandle:
        """Save ``provider``'s state with checkpoints under ``name`` (unique per engine)."""
        if name in self.states:
            raise ValueError(f"plugin state {name!r} is already registered; state names must be unique")
        self.states[name] = provider

        def remove() -> None:
            if self.states.get(name) is provider:
                del self.states[name]

        return RemovableHandle(remove, f"state:{name}")

    # -- firing helpers used by the adapter ----------------------------------------------------
    def seal(self) -> None:
        """Mark the registry as attached to an engine (model preparation is over)."""
        self._sealed = True

    @property
    def sealed(self) -> bool:
        """True once the registry is attached to an engine (see :meth:`seal`)."""
        return self._sealed

    def _transforms(self) -> tuple[_HookList[Any], ...]:
        return (
            self.prepare_model,
            self.micro_step_grad,
            self.reduce_dtype,
            self.reduce_tensor,
            self.before_step,
            self.after_step,
            self.gather_dtype,
            self.prepare_parameters,
        )

    def run_prepare_model(self, model: Any, ctx: Any) -> Any:
        """Apply the ``prepare_model`` transforms in order."""
        for fn in self.prepare_model.frozen:
            out = fn(model, ctx)
            if out is not None:
                model = out
        return model

    def run_prepare_parameters(self, model_parameters: Any, model: Any, ctx: Any) -> Any:
        """Apply the ``prepare_parameters`` transforms in order."""
        for fn in self.prepare_parameters.frozen:
            out = fn(model_parameters, model, ctx)
            if out is not None:
                model_parameters = out
        return model_parameters

    def summary(self) -> dict[str, list[str]]:
        """Names registered per hook, in firing order (for logs and tests)."""
        out = {hl.hook: hl.names() for hl in self._transforms()}
        out["reducer"] = [self.reducer.name] if self.reducer.name else []
        out["gatherer"] = [self.gatherer.name] if self.gatherer.name else []
        out["state"] = sorted(self.states)
        return out
