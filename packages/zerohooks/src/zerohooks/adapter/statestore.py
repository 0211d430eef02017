"""ZeRO 3's fp32 optimizer state, held elsewhere by a plugin: the seam ``optimizer_state_store``.

A plugin that keeps the fp32 masters and moments of some sub-groups out of RAM (nvmeswap) asks
here instead of naming DeepSpeed's ZeRO-3 internals:

* where the state lies: each sub-group's size (:func:`sub_group_numels`), its fp32 master
  (:func:`master`), where a parameter's gradient lies in its sub-group (:func:`position`,
  :func:`positions`), the fp32 gradient partitions DeepSpeed keeps per parameter
  (:func:`gradient_partitions`), a sub-group's optimizer param group (:func:`param_group`);
* the fp32 master's storage swapped for another tensor, its gradient set (:func:`set_master`,
  :func:`set_master_grad`): the master keeps its identity (the inner optimizer's param groups and
  state are keyed by it), only what it holds changes;
* the gradient norm DeepSpeed records at the accumulation boundary, recorded for a gradient the
  plugin takes over (:func:`record_gradient_norm`);
* a sub-group stepped before DeepSpeed's step (nvmeswap's ``step_in_backward``): DeepSpeed's own
  unscale-and-step of it (:func:`unscale_and_step`), its 16-bit partition written from the
  master (:func:`bit16_from_master`), the factor DeepSpeed's unscale-and-clip gives for a norm
  (:func:`unscale_factor`) and the norm of the step it is running (:func:`scaled_norm`);
* the checkpoint load of the optimizer's state dict replaced while a load runs
  (:func:`rigid_load_replaced`), put back when it ends;
* the plugin's store in DeepSpeed's place, per optimizer instance: a held sub-group's boundary
  hand-off, prepare and release (:func:`take_over_sub_groups`), its step
  (:func:`take_over_step`), DeepSpeed's fp32 get/set APIs on it (:func:`guard_state_access`),
  the engine's checkpoint save/load and the masters' refresh (:func:`stream_checkpoints`): each
  method replaced is recorded on the engine's :class:`~zerohooks.adapter.base.Attachment` and
  put back by detach;
* while DeepSpeed builds the optimizer, no fp32 master or gradient buffer for the sub-groups the
  plugin will hold (:func:`deferred_state`, :func:`materialise`): two methods of DeepSpeed's
  ZeRO-3 class replaced for the build only, recorded and put back when it ends.

The storage swaps are the plugin's, which puts DeepSpeed's own tensors back when it closes.  The
names are those of the seam ``optimizer_state_store`` of :data:`zerohooks.adapter.surface.SEAMS`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zerohooks.adapter import surface
from zerohooks.adapter.base import Attachment

__all__ = [
    "SEAM",
    "bit16_from_master",
    "check",
    "deferred_state",
    "gradient_partitions",
    "guard_state_access",
    "master",
    "materialise",
    "param_group",
    "position",
    "positions",
    "record_gradient_norm",
    "rigid_load_replaced",
    "scaled_norm",
    "set_master",
    "set_master_grad",
    "stream_checkpoints",
    "sub_group_numels",
    "take_over_step",
    "take_over_sub_groups",
    "unscale_and_step",
    "unscale_factor",
]

SEAM = "optimizer_state_store"
"""The seam's name (a plugin's ``deepspeed_seams``)."""

_GRAD_PARTITIONS = surface.ZERO3_PRIVATE + "param_id_to_grad_partition"
_RIGID = "_rigid_load_state_dict"
_OPT = "DeepSpeedZeroOptimizer_Stage3"


def check(opt: Any) -> None:
    """Raise :class:`zerohooks.DeepSpeedInternalMissing` now when ``opt`` (a ZeRO-3 optimizer)
    lacks a name this seam touches."""
    surface.check_object(opt, surface.ZERO3, 3, SEAM)


def sub_group_numels(opt: Any) -> list[int]:
    """The number of elements of each sub-group's partition on this rank."""
    return [int(n) for n in opt.fp16_partitioned_groups_flat_numel]


def master(opt: Any, sub_group: int) -> torch.Tensor:
    """Sub-group ``sub_group``'s fp32 master partition (DeepSpeed's own tensor)."""
    out: torch.Tensor = opt.fp32_partitioned_groups_flat[sub_group]
    return out


def set_master(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Make the fp32 master ``tensor`` hold ``value``'s storage (an empty tensor: none)."""
    tensor.data = value


def master_from_bit16(opt: Any, sub_group: int) -> None:
    """Refresh sub-group ``sub_group``'s fp32 master from its 16-bit partition, in place (what
    DeepSpeed's ``_restore_from_bit16_weights`` does to every sub-group: the plugin calls it for
    one sub-group at a time, with the master in RAM)."""
    master(opt, sub_group).data.copy_(opt.fp16_partitioned_groups_flat[sub_group].data)


def bit16_from_master(opt: Any, sub_group: int) -> None:
    """Write sub-group ``sub_group``'s 16-bit partition from its fp32 master (in RAM), in place:
    the copy DeepSpeed's step makes after stepping the sub-group, made early by a plugin that steps
    it before DeepSpeed's step runs (the parameters' partitions are views of it)."""
    opt.fp16_partitioned_groups_flat[sub_group].data.copy_(master(opt, sub_group).data)


def unscale_factor(opt: Any, total_norm: Any) -> float:
    """The factor DeepSpeed's own unscale-and-clip multiplies a gradient by for ``total_norm`` (the
    loss-scaled global norm), rounded as it rounds it (run on a one-element stand-in)."""
    flat = opt.fp32_partitioned_groups_flat
    probe = torch.ones(1, dtype=torch.float32)
    probe.grad = torch.ones(1, dtype=torch.float32)
    saved, flat[0] = flat[0], probe
    try:
        type(opt).unscale_and_clip_grads(opt, 0, total_norm)
    finally:
        flat[0] = saved
    return float(probe.grad[0])


def scaled_norm(opt: Any) -> Any:
    """The loss-scaled global gradient norm of the step DeepSpeed is running (set before its
    sub-group loop): what its unscale-and-clip receives."""
    return opt._global_grad_norm * opt.loss_scale


def unscale_and_step(opt: Any, sub_group: int, total_norm: Any) -> None:
    """DeepSpeed's own unscale-and-clip for ``total_norm`` and its step of one sub-group whose
    master and fp32 gradient are ready, bypassing the plugin's replacements (a plugin stepping
    a sub-group ahead of DeepSpeed's step)."""
    type(opt).unscale_and_clip_grads(opt, sub_group, total_norm)
    type(opt)._optimizer_step(opt, sub_group)


def set_master_grad(tensor: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Give the fp32 master ``tensor`` the fp32 gradient DeepSpeed's step reads (None: none)."""
    tensor.grad = grad


def gradient_partitions(opt: Any) -> dict[int, torch.Tensor]:
    """DeepSpeed's fp32 gradient partition of each parameter (by ``ds_id``): its own dict, read it."""
    out: dict[int, torch.Tensor] = getattr(opt, _GRAD_PARTITIONS)
    return out


def positions(opt: Any) -> dict[int, Any]:
    """DeepSpeed's own map: parameter id -> (sub-group, offset, numel) of its gradient."""
    out: dict[int, Any] = opt.grad_position
    return out


def position(opt: Any, param: Any) -> tuple[int, int, int]:
    """``(sub_group, offset, numel)``: where ``param``'s gradient lies in its sub-group."""
    i, offset, numel = opt.grad_position[opt.get_param_id(param)]
    return int(i), int(offset), int(numel)


def param_group(opt: Any, sub_group: int) -> dict[str, Any]:
    """The inner optimizer's param group sub-group ``sub_group`` belongs to."""
    out: dict[str, Any] = opt.optimizer.param_groups[opt.sub_group_to_group_id[sub_group]]
    return out


def record_gradient_norm(opt: Any, param: Any, grad: torch.Tensor) -> None:
    """Record ``param``'s gradient norm for the step's clipping, as DeepSpeed does at the boundary
    for a gradient it offloads itself."""
    opt.norm_for_param_grads[opt.get_param_id(param)] = opt._constant_buffered_norm2(grad)


@contextlib.contextmanager
def rigid_load_replaced(opt: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the context, the ZeRO-3 optimizer's load of a checkpoint's state dict is
    ``make(original)`` (called as ``(state_dict, load_optimizer_states=True)``); DeepSpeed's own
    again afterwards, whatever happened."""
    had = _RIGID in vars(opt)
    previous = vars(opt).get(_RIGID)
    setattr(opt, _RIGID, make(getattr(opt, _RIGID)))
    try:
        yield
    finally:
        if had:
            setattr(opt, _RIGID, previous)
        else:
            delattr(opt, _RIGID)


# -- the plugin's store in DeepSpeed's place (per instance, undone by detach) ------------------
def take_over_sub_groups(
    att: Attachment,
    opt: Any,
    holds: Callable[[int], bool],
    *,
    take_gradient: Callable[[Any, int, int, torch.Tensor], None],
    prepare: Callable[[int], None],
    release: Callable[[int], None],
    bit16_done: Callable[[int], bool] | None = None,
) -> None:
    """For each sub-group ``holds`` accepts, the plugin holds the fp32 state: at the accumulation
    boundary DeepSpeed records the gradient norm and hands the 16-bit gradient partition to
    ``take_gradient(param, sub_group, offset, grad)`` instead of offloading it; before a
    sub-group's step ``prepare(sub_group)`` makes its master, moments and fp32 gradient (or what
    the step reads instead) ready, after it ``release(sub_group)`` puts them away.  Where
    ``bit16_done(sub_group)`` is true the plugin has already written the sub-group's 16-bit
    partition from its stepped master (:func:`bit16_from_master`): DeepSpeed's copy after the
    step only points the parameters at it again.  Every other sub-group goes DeepSpeed's own way."""

    def make_boundary(original: Callable[..., Any]) -> Callable[..., Any]:
        def at_boundary(param: Any, grad_buffer: torch.Tensor, fp32_grads: Any, fp32_offsets: Any) -> Any:
            i, offset, _ = position(opt, param)
            if not holds(i):
                return original(param, grad_buffer, fp32_grads, fp32_offsets)
            record_gradient_norm(opt, param, grad_buffer)
            take_gradient(param, i, offset, grad_buffer)
            return None

        return at_boundary

    def make_around(hook: Callable[[int], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def around(sub_group_id: int, timer_names: Any) -> Any:
                if not holds(sub_group_id):
                    return original(sub_group_id, timer_names)
                hook(sub_group_id)
                return None

            return around

        return make

    att.patch(opt, "_offload_grad_partition_at_boundary", make_boundary, _OPT)
    att.patch(opt, "_prepare_sub_group", make_around(prepare), _OPT)
    att.patch(opt, "_release_sub_group", make_around(release), _OPT)
    if bit16_done is None:
        return
    done = bit16_done

    def make_reassign(original: Callable[..., Any]) -> Callable[..., Any]:
        def reassign(sub_group_id: int) -> Any:
            if not done(sub_group_id):
                return original(sub_group_id)
            opt._unflatten_partitioned_parameters(sub_group_id)
            return None

        return reassign

    att.patch(opt, "_reassign_or_swap_out_partitioned_parameters", make_reassign, _OPT)


def take_over_step(
    att: Attachment,
    opt: Any,
    stepped: Callable[[int], bool],
    *,
    note_scale: Callable[[int, float], None],
    step: Callable[[int, dict[str, Any]], None],
) -> None:
    """The plugin steps each sub-group ``stepped`` accepts itself (a fused kernel reading the
    16-bit gradient, no fp32 gradient buffer): DeepSpeed's own unscale-and-clip runs on a
    one-element stand-in and ``note_scale(sub_group, factor)`` gets the factor it multiplies the
    gradient by, rounded as DeepSpeed rounds it; ``step(sub_group, param_group)`` then replaces
    DeepSpeed's step of the sub-group."""

    def make_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
        def unscale(sub_group_id: int, total_norm: Any) -> Any:
            if not stepped(sub_group_id):
                return original(sub_group_id, total_norm)
            flat = opt.fp32_partitioned_groups_flat
            probe = torch.ones(1, dtype=torch.float32)
            probe.grad = torch.ones(1, dtype=torch.float32)
            saved, flat[sub_group_id] = flat[sub_group_id], probe
            try:
                original(sub_group_id, total_norm)
            finally:
                flat[sub_group_id] = saved
            note_scale(sub_group_id, float(probe.grad[0]))
            return None

        return unscale

    def make_step(original: Callable[..., Any]) -> Callable[..., Any]:
        def optimizer_step(sub_group_id: int) -> Any:
            if not stepped(sub_group_id):
                return original(sub_group_id)
            step(sub_group_id, param_group(opt, sub_group_id))
            return None

        return optimizer_step

    att.patch(opt, "unscale_and_clip_grads", make_unscale, _OPT)
    att.patch(opt, "_optimizer_step", make_step, _OPT)


def guard_state_access(
    att: Attachment,
    opt: Any,
    holds: Callable[[int], bool],
    *,
    gradient: Callable[[int], torch.Tensor],
    reading: Callable[[int], contextlib.AbstractContextManager[bool]],
    writing: Callable[[int], contextlib.AbstractContextManager[Any]],
) -> None:
    """DeepSpeed's per-parameter fp32 get/set APIs (``safe_get_full_fp32_param``,
    ``safe_set_full_grad``, ...) on a sub-group ``holds`` accepts: a gradient read or written is
    ``gradient(sub_group)`` (the whole sub-group's fp32 gradient, kept by the plugin); a state
    read runs inside ``reading(sub_group)``, which says whether it brought the state in only for
    the read (the value is then copied out); a master or state write runs inside
    ``writing(sub_group)``."""

    def make_get_grad(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_grad(param: Any, release_swap_buffers: bool) -> Any:
            i, offset, numel = position(opt, param)
            if not holds(i):
                return original(param, release_swap_buffers)
            return gradient(i).narrow(0, offset, numel), i

        return get_grad

    def held(param: Any) -> int | None:
        """The sub-group of ``param`` when the store holds it (None: DeepSpeed's own)."""
        i: int = position(opt, param)[0]
        return i if holds(i) else None

    def make_get_state(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_state(param: Any, release_swap_buffers: bool, optim_state_key: Any = None) -> Any:
            i = held(param)
            if i is None:
                return original(param, release_swap_buffers, optim_state_key)
            with reading(i) as brought_in:
                out, gi = original(param, release_swap_buffers, optim_state_key)
                return (out.clone() if brought_in else out), gi  # copied before it is released

        return get_state

    def make_setter(original: Callable[..., Any]) -> Callable[..., Any]:
        def setter(value: Any, param: Any, optim_state_key: Any = None) -> Any:
            i = held(param)
            with contextlib.nullcontext() if i is None else writing(i):
                return original(value, param, optim_state_key)

        return setter

    att.patch(opt, "_get_fp32_grad_state_partition", make_get_grad, _OPT)
    att.patch(opt, "_get_fp32_opt_state_partition", make_get_state, _OPT)
    for name in ("set_full_hp_param", "set_local_hp_param"):
        att.patch(opt, name, make_setter, _OPT)


def stream_checkpoints(
    att: Attachment,
    *,
    save: Callable[[Callable[..., Any]], Callable[..., Any]],
    load: Callable[[Callable[..., Any]], Callable[..., Any]],
    refresh_masters: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """The engine's save and load of the ZeRO-3 optimizer state become ``save(original)`` and
    ``load(original)``, and the optimizer's refresh of its fp32 masters from the 16-bit weights (a
    module-only load, ``refresh_fp32_params``) ``refresh_masters(original)``."""
    engine = att.engine
    att.patch(engine, "_save_zero_checkpoint", save, "DeepSpeedEngine")
    att.patch(engine, "_load_zero_checkpoint", load, "DeepSpeedEngine")
    att.patch(engine.optimizer, "_restore_from_bit16_weights", refresh_masters, _OPT)


# -- while DeepSpeed builds the optimizer: no fp32 master or gradient buffer for a held sub-group --
DEFERRED = "_zerohooks_deferred_masters"
"""Attribute of the ZeRO-3 optimizer (ours): the sub-groups whose fp32 master was not kept."""
NO_GRADIENT = "_zerohooks_no_fp32_gradient"
"""Attribute of the ZeRO-3 optimizer (ours): the sub-groups given no fp32 gradient buffer."""

_BUILD_METHODS = ("_create_momentum_buffer", "initialize_optimizer_states")
_build_lock = threading.Lock()


class _ClassPatches:
    """Methods replaced on a class for a while, recorded so that :meth:`undo` puts each back."""

    def __init__(self) -> None:
        self._done: list[tuple[type, str, Any]] = []

    def patch(self, cls: type, name: str, make: Callable[[Any], Any]) -> None:
        original = cls.__dict__[name]
        self._done.append((cls, name, original))
        setattr(cls, name, make(original))

    def undo(self) -> None:
        while self._done:
            cls, name, original = self._done.pop()
            setattr(cls, name, original)


@contextlib.contextmanager
def deferred_state(min_numel: int, keep_master: bool) -> Iterator[None]:
    """Build the ZeRO-3 optimizer (CPU offload) without an fp32 gradient buffer, and without an
    fp32 master unless ``keep_master``, for each sub-group of at least ``min_numel`` elements: the
    ones a plugin holds itself, which would otherwise need 8 bytes a parameter of RAM at once.

    Each such sub-group keeps its fp32 master tensor (its identity: the optimizer's param groups
    and state are keyed by it) with no storage; the master is the 16-bit partition in fp32, so
    :func:`materialise` makes it again, bit for bit.  The sub-groups kept in RAM get their buffers
    as DeepSpeed gives them.  Two methods of DeepSpeed's ZeRO-3 class are replaced for the duration
    of the context only (recorded and put back at its end, whatever happened), and act only for
    calls from the thread that entered it; on a DeepSpeed without them, nothing is replaced and
    the optimizer is built as before (the masters exist at first)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as cls

    if not all(callable(cls.__dict__.get(n)) for n in _BUILD_METHODS):
        yield
        return
    thread = threading.get_ident()

    def mine(opt: Any) -> bool:
        return threading.get_ident() == thread and bool(getattr(opt, "offload_optimizer", False))

    def make_momentum(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_momentum_buffer(self: Any, num_elements: Any, i: int, ds_id: Any) -> Any:
            out = original(self, num_elements, i, ds_id)
            if mine(self) and int(num_elements) >= max(min_numel, 1) and not getattr(self, "use_muon", False):
                self.__dict__.setdefault(NO_GRADIENT, set()).add(i)
                if not keep_master:
                    fp32 = self.fp32_partitioned_groups_flat[i]
                    set_master(fp32, torch.empty(0, dtype=fp32.dtype, device=fp32.device))
                    self.__dict__.setdefault(DEFERRED, set()).add(i)
            return out

        return create_momentum_buffer

    def make_init_states(original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_optimizer_states(self: Any) -> Any:
            held = self.__dict__.get(NO_GRADIENT)
            if not held or not mine(self) or isinstance(self.optimizer, torch.optim.Adagrad):
                return original(self)
            # what DeepSpeed's CPU-offload path gives each sub-group (a zeroed fp32 gradient
            # buffer, pinned when asked) for those kept in RAM; none for the held ones
            for i, fp32 in enumerate(self.fp32_partitioned_groups_flat):
                if i in held:
                    set_master_grad(fp32, None)
                    continue
                buf = torch.zeros(int(self.fp16_partitioned_groups_flat_numel[i]), dtype=fp32.dtype)
                if getattr(self, "offload_optimizer_pin_memory", False):
                    from deepspeed.accelerator import get_accelerator

                    buf = get_accelerator().pin_memory(buf)
                set_master_grad(fp32, buf.to(self.subgroup_to_device[i]))
            return None

        return initialize_optimizer_states

    patches = _ClassPatches()
    with _build_lock:
        try:
            patches.patch(cls, "_create_momentum_buffer", make_momentum)
            patches.patch(cls, "initialize_optimizer_states", make_init_states)
            yield
        finally:
            patches.undo()


def materialise(opt: Any, sub_group: int) -> torch.Tensor | None:
    """Sub-group ``sub_group``'s fp32 master as DeepSpeed made it (the 16-bit partition in fp32)
    when :func:`deferred_state` did not keep it (once; None otherwise)."""
    deferred = opt.__dict__.get(DEFERRED, set())
    if sub_group not in deferred:
        return None
    deferred.discard(sub_group)
    out: torch.Tensor = opt.fp16_partitioned_groups_flat[sub_group].to(
        "cpu", dtype=master(opt, sub_group).dtype
    )
    return out
