"""The hook contracts of zerohooks, one per phase of a ZeRO training step.

Every hook a plugin may register is described here, once, with the moment it fires, what it
receives and what it may return.  The DeepSpeed adapter (:mod:`zerohooks.adapter`) is the only
code that fires them; plugins only implement them.

Two kinds of hooks exist:

*transforms* (``prepare_model``, ``prepare_parameters``, ``micro_step_grad``, ``reduce_dtype``,
``reduce_tensor``, ``before_step``, ``after_step``, ``gather_dtype``) compose: every registered callback runs, in ascending
``order`` and then by name, each one receiving what the previous one returned;

*owners* (the gradient collective, :class:`GradientReducer`; the parameter all-gather,
:class:`ParameterGatherer`) have at most one owner per engine.  Registering a second owner is
an error that names both.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "AfterStepHook",
    "BeforeStepHook",
    "GatherDtypeHook",
    "GradientReducer",
    "MicroStepGradHook",
    "ParameterGatherer",
    "PrepareModelHook",
    "PrepareParametersHook",
    "ReduceBucket",
    "ReduceDtypeHook",
    "ReduceTensorHook",
    "SetupContext",
    "StateProvider",
    "StepContext",
    "next_loss_scale",
]


@dataclasses.dataclass(frozen=True)
class SetupContext:
    """What a plugin knows while the engine is being built: DeepSpeed's part of the config, read
    once (:func:`zerohooks.dsconfig.setup_context`), and the process group."""

    config: dict[str, Any]
    """The DeepSpeed config as DeepSpeed will see it (plugin sections removed). Do not mutate."""
    zero_stage: int
    """ZeRO stage from ``zero_optimization.stage`` (0 when absent)."""
    train_dtype: torch.dtype
    """Model dtype DeepSpeed trains in: bfloat16, float16 or float32."""
    offload_optimizer: str | None
    """``"cpu"``, ``"nvme"`` or None, from ``zero_optimization.offload_optimizer.device``."""
    world_size: int
    """Size of the default process group (1 when torch.distributed is not initialised)."""
    rank: int
    """Rank in the default process group."""
    offload_param: str | None = None
    """``"cpu"``, ``"nvme"`` or None, from ``zero_optimization.offload_param.device``."""
    grad_accum_dtype: Any = None
    """``data_types.grad_accum_dtype`` as written (DeepSpeed accepts ``"fp32"``, ``"bf16"``, ...), or None."""
    communication_data_type: Any = None
    """``communication_data_type`` as written, or None (DeepSpeed reduces in the model dtype)."""
    buffer_dtype: Any = None
    """``data_types.buffer_dtype`` as written, or None."""
    deepspeed_autocast: tuple[str, ...] = ()
    """DeepSpeed's own mixed-precision sections that are enabled: ``"torch_autocast"``, ``"amp"``."""


class StepContext:
    """Where training is when a step-time hook fires: a live view of the engine's counters.

    The micro-step position is counted by the adapter from the engine's ``backward`` and ``step``
    calls, not read from ``engine.micro_steps``: DeepSpeed increments that in ``engine.step()``,
    which accelerate (hence Hugging Face Trainer) calls only at accumulation boundaries, after
    ``engine.set_gradient_accumulation_boundary(...)``.  Both ways of driving the engine give the
    same :attr:`micro_step` and :attr:`window_micro_step` here.
    """

    __slots__ = ("_micro", "_pending", "_window", "engine", "zero_stage")

    def __init__(self, engine: Any, zero_stage: int) -> None:
        self.engine = engine
        """The DeepSpeedEngine."""
        self.zero_stage = zero_stage
        """ZeRO stage of the engine."""
        self._micro = int(getattr(engine, "micro_steps", 0) or 0)
        self._pending = False  # a backward pass ended and no step()/backward has counted it yet
        self._window = 0  # backward passes since the last optimizer step

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (``engine.global_steps``)."""
        return int(self.engine.global_steps)

    @property
    def micro_step(self) -> int:
        """Backward passes taken so far, counted as DeepSpeed's documented loop counts
        ``engine.micro_steps`` (one ``backward`` + ``step`` per micro-batch): during the k-th
        backward pass (from 0) it is k, and it becomes k + 1 at the following ``step()`` or
        ``backward``, whichever comes first."""
        return self._micro

    @property
    def window_micro_step(self) -> int:
        """Backward passes taken since the last optimizer step: 0 at an accumulation boundary
        (after the optimizer step), ``k`` after the k-th backward pass of an unfinished window."""
        return self._window

    @property
    def in_window(self) -> bool:
        """True between the micro-steps of an accumulation window (not at a boundary)."""
        return self._window != 0

    # -- fed by the adapter ------------------------------------------------------------------
    def _commit(self) -> None:
        if self._pending:
            self._pending = False
            self._micro += 1

    def begin_backward(self) -> None:
        """Adapter: a backward pass starts (``engine.backward`` or DeepSpeed's backward prologue;
        a second call in the same pass does nothing)."""
        self._commit()

    def end_backward(self) -> None:
        """Adapter: DeepSpeed's backward epilogue (the end of a backward pass) returned."""
        self._pending = True
        self._window += 1

    def end_engine_step(self) -> None:
        """Adapter: ``engine.step()`` returned (at a boundary or not)."""
        self._commit()

    def optimizer_stepped(self) -> None:
        """Adapter: the optimizer step of a boundary ran (or was skipped on overflow)."""
        self._window = 0

    def restore(self, micro_step: int, window_micro_step: int) -> None:
        """Set the position (checkpoint load); the saved run was between two micro-steps."""
        self._micro = int(micro_step)
        self._pending = False
        self._window = int(window_micro_step)

    @property
    def is_boundary(self) -> bool:
        """True while the current micro-step ends a gradient-accumulation window."""
        return bool(self.engine.is_gradient_accumulation_boundary())

    @property
    def next_loss_scale(self) -> float | None:
        """The scale the next loss will be multiplied by (fp16 loss scaling; 1.0 under bf16/fp32
        ZeRO optimizers), None when the engine's optimizer has none.

        Plugins that keep state in loss-scaled units (error-feedback buffers) read it after a
        step to rescale.  A loss scaler whose ``cur_scale`` lags behind its update (as
        autocastzero's does, so that a step's gradients are unscaled by the scale they were
        made with) exposes the upcoming value as ``next_scale``, which takes precedence."""
        return next_loss_scale(self.engine)


@dataclasses.dataclass
class ReduceBucket:
    """One call of the gradient collective, as handed to :class:`GradientReducer`.

    ``op == "all_reduce"`` (ZeRO 0, 1 and 2): ``tensors`` holds one flat tensor in the
    communication dtype; on return it must hold, in place, the sum over the group (divided by
    ``world_size`` when ``average`` is True).  DeepSpeed's ZeRO 2 reduces each slice to the rank
    that owns it; an owner may all-reduce instead, since every rank then holds what it needs.

    ``op == "reduce_scatter"`` (ZeRO 3): ``tensors`` holds one full gradient per parameter in
    ``params``; the reducer returns, per tensor, this rank's chunk of the result: elements
    ``[r*c, min((r+1)*c, numel))`` of the flattened tensor with ``c = ceil(numel / world_size)``.
    """

    op: Literal["all_reduce", "reduce_scatter"]
    """Which collective DeepSpeed would have issued."""
    tensors: list[torch.Tensor]
    """The tensors to reduce, already in ``dtype``."""
    params: Sequence[nn.Parameter]
    """Parameters whose gradients are in the bucket (empty when DeepSpeed does not say)."""
    dtype: torch.dtype
    """Communication dtype chosen by DeepSpeed and the ``reduce_dtype`` hooks."""
    group: Any
    """The torch.distributed process group to reduce over."""
    world_size: int
    """Size of ``group``."""
    average: bool
    """Divide the sum by ``world_size`` (False when DeepSpeed already pre-divided the inputs)."""
    owners: Sequence[tuple[int, int]] = ()
    """``all_reduce`` only, may be empty: ``(numel, rank)`` per consecutive segment of
    ``tensors[0]`` (covering it), the one rank of ``group`` that uses that segment's result
    (ZeRO 1/2 keep the reduced gradients of their own partition only).  A reducer may then leave
    the other ranks' segments as they were on this rank; one that ignores ``owners`` all-reduces,
    which is always correct.  Empty: every rank uses every element."""


class PrepareModelHook(Protocol):
    """Transform the model before DeepSpeed wraps it (casts, wrappers, module hooks).

    Fires once, in ``zerohooks.initialize``, before ``deepspeed.initialize``.  Returns the model
    to hand on (the same object, or a replacement); returning None keeps the model.
    """

    def __call__(self, model: nn.Module, ctx: SetupContext) -> nn.Module | None: ...


class PrepareParametersHook(Protocol):
    """Transform the ``model_parameters`` handed to ``deepspeed.initialize`` (e.g. split groups).

    Fires once, in ``zerohooks.initialize``, after the ``prepare_model`` hooks and before
    ``deepspeed.initialize``, on ``model_parameters`` when it was given.  Receives the parameters
    as the caller gave them or as the previous hook returned them (an iterable of tensors or of
    param-group dicts; a generator may be consumed once) and the prepared model; returns what
    to hand on (None keeps the input, which is then only safe when it was not consumed).  When
    ``optimizer`` is an optimizer object, it also fires on a list of that optimizer's
    ``param_groups``, and the result replaces them in place.
    """

    def __call__(self, model_parameters: Any, model: nn.Module, ctx: SetupContext) -> Any: ...


class MicroStepGradHook(Protocol):
    """See a parameter's gradient for one micro-step, before DeepSpeed takes it over.

    Fires once per parameter per backward pass, when autograd has accumulated ``param.grad``
    and before DeepSpeed buckets, reduces or accumulates it.  A hook may read ``param.grad``,
    accumulate it elsewhere and set ``param.grad`` to a tensor of the same shape (for example
    zeros, to take over accumulation).  Returns nothing.
    """

    def __call__(self, param: nn.Parameter, ctx: StepContext) -> None: ...


class ReduceDtypeHook(Protocol):
    """Choose the dtype a parameter's gradient is reduced in.

    Fires when DeepSpeed asks which communication dtype to use for ``param`` (each micro-step on
    ZeRO 2/3, at the boundary on ZeRO 1).  Receives DeepSpeed's choice (or the previous hook's)
    and returns the dtype to use.  ZeRO 0 reduces one dtype for the whole model.
    """

    def __call__(self, param: nn.Parameter, dtype: torch.dtype) -> torch.dtype: ...


class GatherDtypeHook(Protocol):
    """Choose the dtype a ZeRO-3 parameter is all-gathered in.

    Fires once per parameter when the adapter attaches to a ZeRO-3 engine.  Receives the dtype
    of the parameter's partition (or the previous hook's choice) and returns the dtype its
    partitions travel in when DeepSpeed all-gathers the full parameter; the gathered parameter
    is cast back to the partition dtype afterwards, so only communication precision changes.
    Not fired on ZeRO 0-2 (parameters are not gathered there).
    """

    def __call__(self, param: nn.Parameter, dtype: torch.dtype) -> torch.dtype: ...


class ReduceTensorHook(Protocol):
    """Choose the tensor reduced for a parameter.

    Fires when DeepSpeed picks the tensor it reduces for ``param`` (ZeRO 1 and 2: the gradient
    or its accumulation buffer; ZeRO 3: ``param.grad``).  Receives DeepSpeed's choice (or the
    previous hook's, possibly None when there is no gradient) and returns the tensor to reduce.
    """

    def __call__(self, param: nn.Parameter, tensor: torch.Tensor | None) -> torch.Tensor | None: ...


class BeforeStepHook(Protocol):
    """Fires at a gradient-accumulation boundary right before the optimizer step.

    Gradients are reduced (and partitioned) at this point; master parameters are not updated yet.
    """

    def __call__(self, ctx: StepContext) -> None: ...


class AfterStepHook(Protocol):
    """Fires right after the optimizer step, with ``skipped`` True when DeepSpeed skipped it.

    ``ctx.global_step`` already counts this step (DeepSpeed counts skipped steps too).

    A step is skipped on fp16 overflow (the loss scale backs off); state that assumed the step
    happened (error feedback, accumulation buffers) must be rolled back or rescaled here.
    """

    def __call__(self, ctx: StepContext, skipped: bool) -> None: ...


class StateProvider(Protocol):
    """Plugin state saved by ``engine.save_checkpoint`` and restored by ``load_checkpoint``.

    Each rank saves its own state (one file per rank in the checkpoint tag folder), so state may
    be rank-local (error-feedback buffers, partitions of accumulation buffers).

    Optional: ``load_universal(self) -> None``, called instead of :meth:`load_state_dict` after
    DeepSpeed loaded a universal checkpoint (``ds_to_universal`` output, possibly on another
    number of ranks), which holds no plugin state.  A provider without it makes such a load fail
    with ``CheckpointStateError``; a plugin that cannot resume from a universal checkpoint should
    refuse ``checkpoint.load_universal`` at ``initialize``
    (:func:`zerohooks.dsconfig.refuse_universal_load`).
    """

    def state_dict(self) -> dict[str, Any]:
        """Return the state to save, as plain data: dicts (string or integer keys), lists,
        tuples, strings, numbers, booleans, None and tensors (dtypes and the like as strings).
        It is read back with ``torch.load(..., weights_only=True)``; anything else is refused
        when saving (``ValueError``) and when loading."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on the same rank of an identical run."""
        ...


class GradientReducer(abc.ABC):
    """Owner of the gradient collective.

    At most one per engine.  Without an owner DeepSpeed's own collectives run unchanged.  The
    adapter casts to the communication dtype and hands the result back to DeepSpeed; the
    reducer only moves and averages data.

    The adapter counts the bytes handed to :meth:`reduce` (``CommCounters.add``).  An owner that
    sends something else than it was handed (compressed codes, scales) reports what this rank
    really sends with ``zerohooks.attachment(engine).counters.add_wire(collective, format,
    nbytes)`` during the call; a call it reports nothing for is counted as DeepSpeed's own
    collective would be (ring model, ``counters.ring_wire_bytes``).
    """

    @abc.abstractmethod
    def reduce(self, bucket: ReduceBucket) -> list[torch.Tensor] | None:
        """Reduce one bucket (see :class:`ReduceBucket` for the two shapes of call).

        ``all_reduce``: reduce ``bucket.tensors[0]`` in place and return None.
        ``reduce_scatter``: return this rank's chunk of the result for each tensor.
        """


class ParameterGatherer(abc.ABC):
    """Owner of the parameter all-gathers of a ZeRO 1-3 engine.  At most one per engine.

    DeepSpeed all-gathers parameters over the data-parallel group: on ZeRO 1/2 the updated 16-bit
    (or fp32) partitions after every optimizer step, on ZeRO 3 every parameter before its forward
    (and backward) use.  With an owner, each such ``all_gather_into_tensor`` on one of the
    engine's data-parallel groups calls :meth:`all_gather` instead; other groups (hpZ's secondary
    partition, expert groups) and other engines keep DeepSpeed's collective.

    The result must be exactly DeepSpeed's (a lossless re-routing, such as a two-level
    all-gather over nodes): the gathered values are the model's weights.
    """

    @abc.abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> Callable[[], None] | None:
        """Fill ``output`` (``world_size * input.numel()`` elements, flat) with every rank's
        ``input``, in the rank order of ``group``.

        Return None when ``output`` is complete on return, or a callable that completes it: the
        adapter calls it once, when DeepSpeed waits on the collective's handle (ZeRO 3 issues
        its gathers ahead of use and waits later, so the transfer overlaps compute), or at once
        for a synchronous call.  Finish steps run in the order the gathers were issued, the same
        on every rank (waiting on one first finishes the older ones), so a finish step may run
        collectives of its own.

        Every ``all_gather_into_tensor`` DeepSpeed issues on a routed group comes here, not only
        the parameters' (ZeRO 3's partitioned-buffer and fp32-state gathers use the same groups).
        """


def next_loss_scale(engine: Any) -> float | None:
    """The scale the engine's next loss will be multiplied by (see
    :attr:`zerohooks.StepContext.next_loss_scale`): a loss scaler's ``next_scale`` when it has
    one, else the ZeRO optimizer's ``cur_scale`` / ``loss_scale``; None when it has neither."""
    opt = getattr(engine, "optimizer", None)
    upcoming = getattr(getattr(opt, "loss_scaler", None), "next_scale", None)
    if isinstance(upcoming, (int, float)):
        return float(upcoming)
    for name in ("cur_scale", "loss_scale"):
        try:
            value = getattr(opt, name, None)
        except Exception:  # some optimizers raise from the property outside fp16 mode
            value = None
        if isinstance(value, (int, float)):
            return float(value)
    return None
