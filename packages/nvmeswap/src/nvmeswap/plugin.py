"""The nvmeswap zerohooks plugin: wires :mod:`nvmeswap.swapper` into DeepSpeed's ZeRO-3 step.

Design: DeepSpeed's own NVMe path builds its libaio-based swapper when the engine is built, so
replacing only its I/O calls would still need libaio.  nvmeswap instead tells DeepSpeed to offload
the optimizer to the CPU (``config.rewrite_offload``) and takes the swapping over: right after
the engine is built every swapped sub-group's fp32 master goes to its swap file and its RAM is
freed; in each step the sub-group's prepare reads it back (read ahead of time) and builds its fp32
gradient from the 16-bit partition, and its release writes it out.  The gradient itself is never
written: at the accumulation boundary only the gradient norm is recorded (as DeepSpeed does) and
where the 16-bit partition lies.  Every DeepSpeed method taken over is the adapter's
optimizer-state store's (:mod:`zerohooks.adapter.statestore`), which records it and puts it back
at detach.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from typing_extensions import override

import zerohooks
from nvmeswap import adam, checkpoint, early, fused, io, memory, swapper
from nvmeswap.config import NvmeSwapConfig, rewrite_offload
from nvmeswap.folder import FolderClaim, prepare
from nvmeswap.memory import NotEnoughMemoryError
from nvmeswap.swapfile import SwapCorruptionError
from nvmeswap.swapper import SwapState
from zerohooks import ConfigError, PluginConfig, SetupContext, StepContext, ZeroPlugin
from zerohooks.adapter import seams, statestore
from zerohooks.registry import HookRegistry

__all__ = ["NvmeSwapPlugin"]


class NvmeSwapPlugin(ZeroPlugin):
    """ZeRO-3 optimizer state on NVMe without gradient I/O, on nvmeswap's own I/O engine."""

    name = "nvmeswap"
    deepspeed_seams = (statestore.SEAM,)
    """The seams this plugin uses: the adapter's optimizer-state store (:mod:`zerohooks.adapter.statestore`)."""
    distribution = "zerohooks-nvmeswap"
    Config = NvmeSwapConfig
    cfg: NvmeSwapConfig
    native = (io.EXTENSION, adam.EXTENSION)

    def __init__(self, config: PluginConfig | None = None) -> None:
        super().__init__(config)
        self.base_folder: str | None = None
        self.state: SwapState | None = None
        self._claim: FolderClaim | None = None
        self._atexit: Callable[[], None] | None = None
        self.early: early.EarlyState | None = None
        self._forward_hook: Any = None

    @override
    def edit_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        self.base_folder = rewrite_offload(ds_config, self.cfg)

    @override
    def building(self) -> contextlib.AbstractContextManager[None]:
        # no fp32 master or gradient buffer is made for a swapped sub-group while DeepSpeed builds
        # the engine (it would need 8 bytes a parameter of RAM at once): see
        # zerohooks.adapter.statestore.deferred_state
        return statestore.deferred_state(self.cfg.min_swap_numel, self.cfg.keep_master_in_ram)

    @override
    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        if self.base_folder is None:
            raise RuntimeError("nvmeswap: attach() before edit_deepspeed_config() (use zerohooks.initialize)")
        registry.register_after_step(self._after_step, name=self.name)

    def _after_step(self, ctx: StepContext, skipped: bool) -> None:
        if self.early is not None:
            early.end_window(self.early)  # a skipped step undoes what was stepped during backward
        if self.state is not None:
            swapper.end_step(self.state)

    @override
    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        att = zerohooks.attachment(engine)
        assert att is not None and self.base_folder is not None
        opt = engine.optimizer
        statestore.check(opt)
        cfg = self.cfg
        fuse = _fused_choice(cfg, opt)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        folder = os.path.join(self.base_folder, "nvmeswap", f"rank{rank:05d}")
        numels = statestore.sub_group_numels(opt)
        chosen = [i for i in range(len(numels)) if numels[i] >= max(cfg.min_swap_numel, 1)]
        native = cfg.io_engine != "python"
        if native:
            mod = io.load_native_distributed()
            if mod is None and cfg.io_engine == "native":
                raise ConfigError(
                    f'nvmeswap.io_engine is "native" but the C++ I/O engine could not be built: {io.build_error()}'
                )
            native = mod is not None

        def make_engine() -> Any:
            return io.engine(cfg.io_threads, cfg.block_size, native=native)

        state = SwapState(
            opt,
            folder,
            chosen,
            keep_master=cfg.keep_master_in_ram,
            buffer_count=cfg.buffer_count,
            make_engine=make_engine,
            algorithm=1 if native else 2,
            prefetch_bytes=cfg.prefetch_bytes,
            regions=2 if cfg.step_in_backward else 1,
        )
        # the folder is this engine's, and every rank's files fit on their disks: checked with
        # every rank before any file is touched (all ranks fail together otherwise)
        self._claim = prepare(folder, rank, {g.path: state.file_bytes(g) for g in state.groups.values()})
        self.state = state
        es = self.early = early.EarlyState(state, fuse) if cfg.step_in_backward else None
        _install(att, opt, state, fuse, es)
        if es is not None:  # a forward with no step after the boundary backward undoes its steps
            self._forward_hook = engine.module.register_forward_pre_hook(lambda *_: early.abandon(es))
        try:
            swapper.initialise(state)
        except BaseException:
            # preallocation failed part way (full disk, file-size limit): no swap file is left behind
            swapper.remove_folder(folder)
            self.state = None
            self._release_folder()
            raise
        ref = weakref.ref(self)

        def cleanup() -> None:  # a clean interpreter exit removes the swap files
            plugin = ref()
            if plugin is not None and plugin.state is not None:
                swapper.remove_folder(plugin.state.folder)

        self._atexit = cleanup
        atexit.register(cleanup)

    @override
    def check_detach(self) -> None:
        """Detaching brings every swapped sub-group back into RAM (DeepSpeed's optimizer holds its
        state there): refused, before anything changes, when that is more than this process can
        take now (the machine's available memory, or its memory cgroup's headroom)."""
        state = self.state
        if state is None:
            return
        need, avail = swapper.restore_bytes(state), memory.available_bytes()
        if avail is not None and need > avail:
            raise NotEnoughMemoryError(
                f"nvmeswap: detaching brings the swapped optimizer state back into RAM, {need} bytes "
                f"({len(state.groups)} sub-groups: fp32 {'moments' if state.keep_master else 'master and moments'}), "
                f"more than the {avail} this process can take now (MemAvailable, or its memory cgroup's "
                "limit less its use); nothing was changed and nvmeswap stays attached. To leave nvmeswap, "
                "save a checkpoint (streamed from the swap files) and load it into an engine built without "
                "it on a machine with the RAM, or keep training with it"
            )

    @override
    def close(self) -> None:
        es, self.early = self.early, None
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if es is not None:
            early.close(es)  # what was stepped during backward and not taken is undone first
        state, self.state = self.state, None
        if state is not None:
            try:
                swapper.close(state, restore=True)
            except (SwapCorruptionError, io.SwapIOError) as e:
                warnings.warn(
                    f"nvmeswap: the optimizer state could not be brought back into RAM on detach ({e}); "
                    f"this engine cannot train further; the swap files are kept in {state.folder}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._release_folder()
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None

    def _release_folder(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.release()


def _fused_choice(cfg: NvmeSwapConfig, opt: Any) -> bool:
    """Whether to install the fused Adam step (``fused_adam``), building its kernel (rank 0 first)."""
    if cfg.fused_adam is False:
        return False
    why = fused.refusal(opt.optimizer, opt)
    if cfg.fused_adam is True:
        if why is not None:
            raise ConfigError(f'nvmeswap.fused_adam is true but {why}; set it to false or "when_supported"')
        if not adam.load_distributed():
            warnings.warn(
                f"nvmeswap.fused_adam: the C++ kernel is not available ({adam.build_error()}); "
                "the same step runs as torch operations, one parameter at a time",
                RuntimeWarning,
                stacklevel=2,
            )
    elif why is None:
        adam.load_distributed()  # the fallback warns by itself
    return True


def _install(att: Any, opt: Any, state: SwapState, fuse: bool, es: early.EarlyState | None) -> None:
    """nvmeswap's swapper in the place of DeepSpeed's ZeRO-3 NVMe path, through the adapter's
    optimizer-state store (:mod:`zerohooks.adapter.statestore`; undone by ``zerohooks.detach``);
    ``fuse``: step swapped sub-groups with the fused Adam kernel whenever the optimizer allows it;
    ``es``: sub-groups are stepped during backward (``step_in_backward``), DeepSpeed's step takes
    those steps or has them undone."""
    groups = state.groups

    def took(i: int) -> bool:  # stepped during backward, taken by this step
        return es is not None and early.stepped(es, i)

    def undo_early() -> None:  # before anything reads or replaces the state between backward and step
        if es is not None:
            early.abandon(es)

    def holds(i: int) -> bool:
        return i in groups

    def take_gradient(param: Any, i: int, offset: int, grad_buffer: torch.Tensor) -> None:
        # On a GPU, DeepSpeed hands over a temporary device copy of the gradient partition it
        # keeps in (pinned) CPU memory: record the persistent CPU partition instead, so no
        # device memory is held until the step and the CPU step reads it where it lies.
        persistent = state.grad_partitions.get(param.ds_id)
        if persistent is not None and persistent.device != grad_buffer.device:
            grad_buffer = persistent.narrow(0, 0, grad_buffer.numel())
            state.needs_sync = True
        swapper.record_gradient(state, i, offset, grad_buffer)
        if es is not None and state.recorded.get(i) == groups[i].numel:
            early.submit(es, i)

    def prepare(i: int) -> None:
        if es is not None:
            early.settle(es, commit=True)  # DeepSpeed's step has begun: take or undo what backward stepped
            if took(i):
                return
        swapper.swap_in(state, i)
        if fused.usable(fuse, opt):
            state.fused.add(i)  # the gradient is read by the fused step itself
            swapper.sync_gradients(state)
        else:
            statestore.set_master_grad(groups[i].master, swapper.build_gradient(state, i))

    def release(i: int) -> None:
        if took(i):
            return
        statestore.set_master_grad(groups[i].master, None)
        swapper.swap_out(state, i)

    statestore.take_over_sub_groups(
        att,
        opt,
        holds,
        take_gradient=take_gradient,
        prepare=prepare,
        release=release,
        bit16_done=took if es is not None else None,
    )
    if fuse or es is not None:

        def step(i: int, group: dict[str, Any]) -> None:
            scale = state.grad_scales.pop(i)
            if not took(i):
                fused.step(state, i, opt.optimizer, group, scale)

        statestore.take_over_step(
            att,
            opt,
            lambda i: i in state.fused or took(i),
            note_scale=state.grad_scales.__setitem__,
            step=step,
        )

    # DeepSpeed's get/set APIs (safe_get_full_fp32_param, safe_set_full_grad, ...) read the
    # sub-group's tensors directly under CPU offload: bring them in first, write them back after.
    def gradient(i: int) -> torch.Tensor:
        undo_early()
        if i not in state.overrides:  # the first access: the gradient as the step would see it
            numel = groups[i].numel
            state.overrides[i] = swapper.build_gradient(state, i, torch.empty(numel, dtype=torch.float32))
        return state.overrides[i]

    @contextlib.contextmanager
    def reading(i: int) -> Iterator[bool]:
        undo_early()
        if i in state.resident:
            yield False
            return
        swapper.swap_in(state, i, prefetch=False)
        try:
            yield True
        finally:
            swapper.swap_out(state, i, write=False)

    @contextlib.contextmanager
    def writing(i: int) -> Iterator[None]:
        undo_early()
        swapper.swap_in(state, i, prefetch=False)
        try:
            yield
        finally:
            swapper.swap_out(state, i)

    statestore.guard_state_access(att, opt, holds, gradient=gradient, reading=reading, writing=writing)
    _install_checkpoint(att, opt, state, undo_early)


def _install_checkpoint(att: Any, opt: Any, state: SwapState, undo_early: Callable[[], None]) -> None:
    """Checkpoints in DeepSpeed's CPU-offload format, streamed from and to the swap files
    (:mod:`nvmeswap.checkpoint`); refreshing the masters from the 16-bit weights (a module-only
    load) goes through the swap buffers one sub-group at a time."""
    engine = att.engine
    seams.read_checkpoints_mapped(att)  # the optimizer file (12 bytes a parameter) is mapped, not read

    # load_checkpoint(load_module_only=True / load_optimizer_states=False) refreshes the fp32
    # masters from the loaded 16-bit weights instead (refresh_fp32_params goes through it too)
    # a checkpoint between the boundary backward and the step sees the state before the step:
    # what backward stepped is undone first (step_in_backward)
    def undoing(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def build(original: Any) -> Any:
            inner = make(original)

            @functools.wraps(inner)
            def run(*args: Any, **kwargs: Any) -> Any:
                undo_early()
                return inner(*args, **kwargs)

            return run

        return build

    statestore.stream_checkpoints(
        att,
        save=undoing(lambda f: checkpoint.streamed_save(state, f)),
        load=undoing(lambda f: checkpoint.streamed_load(state, engine, f)),
        refresh_masters=undoing(lambda f: checkpoint.streamed_refresh(state, f)),
    )
