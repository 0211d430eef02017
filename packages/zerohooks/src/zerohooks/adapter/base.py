"""The attachment of a registry to one DeepSpeed engine: per-instance patches that can be undone."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from zerohooks import stepwatch
from zerohooks.adapter.compat import require_attr
from zerohooks.counters import CommCounters
from zerohooks.errors import ConfigError
from zerohooks.hookspec import ReduceBucket, SetupContext, StepContext
from zerohooks.plugin import ZeroPlugin
from zerohooks.registry import HookRegistry

__all__ = ["Attachment", "attachment", "bind_by_name", "step_context"]

_MISSING = object()
_attachments: weakref.WeakKeyDictionary[Any, Attachment] = weakref.WeakKeyDictionary()


def attachment(engine: Any) -> Attachment | None:
    """The :class:`Attachment` of ``engine``, or None when zerohooks did not build it."""
    return _attachments.get(engine)


def step_context(engine: Any) -> StepContext:
    """The live :class:`StepContext` of an engine zerohooks is attached to (micro-step position,
    window position, global step); ValueError for an engine zerohooks did not build."""
    att = _attachments.get(engine)
    if att is None:
        raise ValueError("this engine has no zerohooks attachment (was it built by zerohooks.initialize?)")
    return att.step_ctx


def bind_by_name(original: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """A function binding a call's ``(*args, **kwargs)`` to ``original``'s parameters by name,
    defaults applied: the wrappers read DeepSpeed's private signatures by name, never by position
    (the signature is read once, when the wrapper is made)."""
    signature = inspect.signature(original)

    def bind(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    return bind


class Attachment:
    """Everything zerohooks changed on one engine, and the means to change it back.

    Only instance attributes are touched (a bound method shadowed on the object, an attribute
    set on it), each recorded here and undone by :meth:`detach`; the adapter modifies no
    DeepSpeed class or module.  The one object shared by the process it changes is DeepSpeed's
    communication backend instance: its ``all_gather_into_tensor`` is shadowed while an attached
    engine routes parameter all-gathers to a gatherer (:mod:`zerohooks.adapter.gather`; groups
    without a route reach DeepSpeed's method unchanged), and removed with the last route.
    """

    def __init__(
        self, engine: Any, registry: HookRegistry, setup: SetupContext, plugins: list[ZeroPlugin]
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.setup = setup
        self.plugins = plugins
        self.counters = CommCounters()
        self.step_ctx = StepContext(engine, setup.zero_stage)
        self._patches: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []
        self.attached = False
        self.inert: str | None = None
        """Why nothing is installed on this engine (no plugin, and the adapter did not fit it), or None."""
        self.map_checkpoint_reads = False
        """Read DeepSpeed's checkpoint files memory-mapped (:func:`.seams.read_checkpoints_mapped`)."""
        self.bucket_buffers_fitted = False
        """ZeRO 1/2: the adapter allocates the IPG buffers of the buckets that need less than
        ``reduce_bucket_size`` or are staged in their own dtype (``zero12._fit_bucket_buffers``)."""
        self.staged_buckets: set[torch.dtype] = set()
        """ZeRO 1/2: the communication dtypes whose buckets stage gradients in that dtype rather
        than the model's (:func:`.seams.stage_buckets_in_own_dtype`)."""

    # -- patching ------------------------------------------------------------------------------
    def patch(self, obj: Any, name: str, make: Callable[[Any], Any], what: str | None = None) -> None:
        """Shadow ``obj.name`` with ``make(original)`` on this instance only."""
        original = require_attr(obj, name, what)
        previous = obj.__dict__.get(name, _MISSING)
        self._patches.append((obj, name, previous))
        wrapper = make(original)
        if callable(original) and callable(wrapper):
            # keep the original's name, docstring and signature (frameworks inspect them, e.g.
            # transformers looks for save_checkpoint's exclude_frozen_parameters)
            functools.update_wrapper(wrapper, original)
        setattr(obj, name, wrapper)

    def keep_handle(self, handle: Any) -> None:
        """Remember a torch hook handle to remove on detach."""
        self._handles.append(handle)

    def detach(self) -> None:
        """Undo every patch and hook, newest first, and close the plugins; a plugin that refuses
        (:meth:`ZeroPlugin.check_detach` raises) leaves everything as it was."""
        for p in self.plugins:
            p.check_detach()
        for h in reversed(self._handles):
            h.remove()
        self._handles.clear()
        for obj, name, previous in reversed(self._patches):
            if previous is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = previous
        self._patches.clear()
        for p in self.plugins:
            p.close()
        _attachments.pop(self.engine, None)
        self.attached = False

    # -- shared pieces used by the stage adapters ------------------------------------------------
    def comm_dtype(self, param: Any, dtype: torch.dtype) -> torch.dtype:
        """Apply the ``reduce_dtype`` transforms."""
        for fn in self.registry.reduce_dtype.frozen:
            dtype = fn(param, dtype)
        return dtype

    def patch_comm_dtype(self, opt: Any, tag: str) -> bool:
        """Route ``opt.get_param_comm_dtype`` (ZeRO 1-3) through the ``reduce_dtype`` transforms.

        Installs nothing and returns False when no ``reduce_dtype`` hook is registered."""
        if not self.registry.reduce_dtype.frozen:
            return False

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def get_param_comm_dtype(param: Any) -> torch.dtype:
                return self.comm_dtype(param, original(param))

            return get_param_comm_dtype

        self.patch(opt, "get_param_comm_dtype", make, tag)
        return True

    def reduce_tensor(self, param: Any, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Apply the ``reduce_tensor`` transforms."""
        for fn in self.registry.reduce_tensor.frozen:
            tensor = fn(param, tensor)
        return tensor

    def fire_micro_step_grad(self, param: Any) -> None:
        ctx = self.step_ctx
        for fn in self.registry.micro_step_grad.frozen:
            fn(param, ctx)

    def owner_all_reduce(
        self,
        flat: torch.Tensor,
        group: Any,
        average: bool,
        params: Any = (),
        collective: str = "all_reduce",
        owners: Any = (),
    ) -> None:
        """Hand one flat tensor to the owning reducer (in place), in place of DeepSpeed's
        ``collective`` (counted on the wire as that collective if the owner reports nothing);
        ``owners``: see :attr:`ReduceBucket.owners`."""
        reducer = self.registry.reducer.owner
        assert reducer is not None
        world = torch.distributed.get_world_size(group=group)
        reports = self.counters.wire_reports
        bucket = ReduceBucket(
            "all_reduce", [flat], list(params), flat.dtype, group, world, average, tuple(owners)
        )
        reducer.reduce(bucket)
        if self.counters.wire_reports == reports:
            self.counters.add_default_wire(collective, flat.dtype, flat.numel() * flat.element_size(), world)

    def check_default_averaging(self, predivide: float) -> None:
        """An owner of the collective supports DeepSpeed's default averaging only."""
        if self.registry.reducer.owner is not None and predivide != 1.0:
            raise ConfigError(
                f"gradient_predivide_factor={predivide} is not supported when {self.registry.reducer.name!r} "
                "owns the gradient collective; remove gradient_predivide_factor (default 1.0)"
            )

    def check_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """An owner of the collective does not span DeepSpeed's sequence-parallel groups: refused
        on every ZeRO stage once the engine says it is sequence parallel (an mpu without the
        config key reaches here)."""
        if self.registry.reducer.owner is not None and sequence_parallel_size > 1:
            raise ConfigError(
                f"{self.registry.reducer.name!r} owns the gradient collective, which does not support "
                "sequence parallelism"
            )

    # -- engine-level patches (every stage) -------------------------------------------------------
    def _make_destroy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``engine.destroy()`` detaches first: the plugins release what they hold (swap files
        and their folder's lock, buffers, I/O threads) and every patch goes, including the
        registration that would keep the engine alive, then DeepSpeed's own ``destroy`` runs."""

        def destroy(*args: Any, **kwargs: Any) -> Any:
            if self.attached or self._patches:
                self.detach()
            return original(*args, **kwargs)

        return destroy

    def install_engine_patches(self) -> None:
        reg = self.registry
        ctx = self.step_ctx
        counters = self.counters
        engine = self.engine

        def make_step(original: Callable[..., Any]) -> Callable[..., Any]:
            def _take_model_step(*args: Any, **kwargs: Any) -> Any:
                for fn in reg.before_step.frozen:
                    fn(ctx)
                skipped_before = engine.skipped_steps
                out = original(*args, **kwargs)
                ctx.optimizer_stepped()
                skipped = engine.skipped_steps != skipped_before
                for after in reg.after_step.frozen:
                    after(ctx, skipped)
                counters.end_step()
                return out

            return _take_model_step

        self.patch(engine, "_take_model_step", make_step, "DeepSpeedEngine")

        def make_begin(original: Callable[..., Any]) -> Callable[..., Any]:
            def begin(*args: Any, **kwargs: Any) -> Any:
                ctx.begin_backward()
                return original(*args, **kwargs)

            return begin

        def make_watched(what: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def watched(*args: Any, **kwargs: Any) -> Any:
                with stepwatch.in_step(what):
                    return original(*args, **kwargs)

            return watched

        def make_backward(original: Callable[..., Any]) -> Callable[..., Any]:
            return make_watched("DeepSpeedEngine.backward", make_begin(original))

        def make_end(original: Callable[..., Any]) -> Callable[..., Any]:
            def end(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                ctx.end_backward()
                return out

            return end

        def make_engine_step(original: Callable[..., Any]) -> Callable[..., Any]:
            def step(*args: Any, **kwargs: Any) -> Any:
                with stepwatch.in_step("DeepSpeedEngine.step"):
                    out = original(*args, **kwargs)
                ctx.end_engine_step()
                return out

            return step

        # The micro-step position (StepContext) is counted here, whichever way the engine is
        # driven: step() every micro-step, or only at boundaries (accelerate, HF Trainer), with
        # engine.backward(loss) or a direct loss.backward().  A backward pass begins at
        # engine.backward or at DeepSpeed's once-per-backward prologue (fired from the forward
        # output's hook), whichever comes first (beginning twice counts once), and ends after
        # DeepSpeed's epilogue, which runs the boundary reduction of ZeRO 0/1.
        # the engine calls that run collectives are watched for a stalled peer (stepwatch)
        self.patch(engine, "forward", lambda f: make_watched("DeepSpeedEngine.forward", f), "DeepSpeedEngine")
        self.patch(engine, "backward", make_backward, "DeepSpeedEngine")
        self.patch(engine, "_backward_prologue", make_begin, "DeepSpeedEngine")
        self.patch(engine, "_backward_epilogue", make_end, "DeepSpeedEngine")
        self.patch(engine, "step", make_engine_step, "DeepSpeedEngine")
        require_attr(engine, "skipped_steps", "DeepSpeedEngine")
        if callable(getattr(engine, "destroy", None)):
            self.patch(engine, "destroy", self._make_destroy, "DeepSpeedEngine")

        from zerohooks.adapter.checkpoint import install_checkpoint_patches

        install_checkpoint_patches(self)
        # saving and loading run collectives too (DeepSpeed's barriers, our agreements): a rank
        # frozen in a save is named like one frozen in a step (outermost: around our own wrappers)
        for name in ("save_checkpoint", "load_checkpoint"):
            self.patch(
                engine, name, functools.partial(make_watched, f"DeepSpeedEngine.{name}"), "DeepSpeedEngine"
            )
        stepwatch.start(skip=("/deepspeed/comm/",))  # DeepSpeed's comm wrappers: not where a rank waits

    def register(self) -> None:
        _attachments[self.engine] = self
        self.attached = True
