"""The zerohooks plugin: LoCo owns the gradient collective of a DeepSpeed ZeRO engine."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

import zerohooks
from loco import comm, groups, ops
from loco.config import LocoConfig
from loco.state import LocoState, after_step, begin_call, load_state_dict, reset_errors, state_dict
from zerohooks import (
    ConfigError,
    GradientReducer,
    ParameterGatherer,
    PluginConfig,
    ReduceBucket,
    SetupContext,
    StepContext,
    ZeroPlugin,
    next_loss_scale,
)
from zerohooks.adapter import seams
from zerohooks.dsconfig import read_settings
from zerohooks.registry import HookRegistry

__all__ = ["LocoGatherer", "LocoPlugin", "LocoReducer", "param_key"]


def param_key(param: Any, index: int, names: dict[int, str]) -> str:
    """Error-buffer key of a ZeRO-3 parameter: its name in the model (stable across steps, engines
    and runs), else DeepSpeed's ``ds_id`` (a per-process counter), else its place in the bucket."""
    name = names.get(id(param))
    if name is not None:
        return f"p:{name}"
    ds_id = getattr(param, "ds_id", None)
    return f"p{ds_id}" if ds_id is not None else f"t{index}"


class LocoReducer(GradientReducer):
    """Owner of the gradient collective: quantized all-to-all reduction with error feedback.

    ``topology(group)`` gives the :class:`~loco.comm.Topology` to use for a process group and
    ``window()`` the current reduction window (one backward pass: ``StepContext.micro_step``, which
    counts backward passes however the engine is driven).
    """

    def __init__(
        self,
        state: LocoState,
        exact_below: int | None,
        topology: Callable[[Any], comm.Topology],
        window: Callable[[], int],
    ) -> None:
        self.state = state
        self.exact_below = exact_below
        self.topology = topology
        self.window = window
        self.names: dict[int, str] = {}
        """id(parameter) -> its name in the model, for the ZeRO-3 keys (set by the plugin)."""

    def _threshold(self, world: int) -> int:
        return world * self.state.group_size if self.exact_below is None else self.exact_below

    def reduce(self, bucket: ReduceBucket) -> list[torch.Tensor] | None:
        state = self.state
        topo = self.topology(bucket.group)
        index = begin_call(state, self.window())
        small = self._threshold(topo.world)
        if bucket.op == "all_reduce":
            (flat,) = bucket.tensors
            divisor = float(bucket.world_size) if bucket.average else 1.0
            if topo.world == 1 or flat.numel() < small:
                comm.exact_all_reduce(state, topo, flat, divisor)
            elif not (
                bucket.owners
                and comm.quantized_reduce_to_owners(state, topo, flat, bucket.owners, f"o{index}", divisor)
            ):
                comm.quantized_all_reduce(state, topo, flat, f"w{index}", divisor)
            return None
        tensors = list(bucket.tensors)
        divisor = float(bucket.world_size)
        if len(bucket.params) == len(tensors):
            keys = [param_key(p, i, self.names) for i, p in enumerate(bucket.params)]
        else:
            keys = [f"w{index}.t{i}" for i in range(len(tensors))]
        out: list[torch.Tensor | None] = [None] * len(tensors)
        exact = [i for i, t in enumerate(tensors) if topo.world == 1 or t.numel() < small]
        quant = [i for i in range(len(tensors)) if i not in set(exact)]
        if exact:
            parts = comm.exact_reduce_scatter(state, topo, [tensors[i] for i in exact], divisor)
            for i, part in zip(exact, parts, strict=True):
                out[i] = part
        if quant:
            parts = comm.quantized_reduce_scatter(
                state, topo, [tensors[i] for i in quant], [keys[i] for i in quant], divisor
            )
            for i, part in zip(quant, parts, strict=True):
                out[i] = part
        return [t for t in out if t is not None]


class LocoGatherer(ParameterGatherer):
    """Owner of DeepSpeed's parameter all-gathers: two-level (:func:`loco.comm.all_gather`) on
    a group with a two-level topology (the whole world, an MoE expert-data-parallel group spread
    over nodes); any other group (tensor or pipeline parallelism) is gathered flat, as DeepSpeed
    would.  ``two_level(group)`` gives the group's two-level topology or None."""

    def __init__(self, state: LocoState, two_level: Callable[[Any], comm.Topology | None]) -> None:
        self.state = state
        self.two_level = two_level

    @override
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> Callable[[], None]:
        two = self.two_level(group)
        topo = two if two is not None else comm.flat_topology(group)
        nbytes = input.numel() * input.element_size()
        hops, finish = comm.begin_all_gather(topo, output, input, "loco parameter all_gather")
        for hop, copies in hops.items():
            self.state.stats.parameters(hop, copies * nbytes)
        return finish


def _node_size(config: LocoConfig, world: int) -> int:
    if config.node_size is not None:
        return config.node_size
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(var)
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return world


def _two_level_wanted(config: LocoConfig, world: int, node: int) -> bool:
    """``hierarchy`` resolved for ``world`` ranks in nodes of ``node``: ``two_level``, or
    ``detect`` with more than one whole node."""
    return config.hierarchy == "two_level" or (
        config.hierarchy == "detect" and world % node == 0 and world // node > 1
    )


class LocoPlugin(ZeroPlugin):
    """LoCo: 4-bit (or 8-bit) gradient communication with error feedback, ZeRO 0-3.

    :attr:`state` is the algorithm state (error buffers, counters); :attr:`stats` counts, per
    optimizer step, the bytes this rank hands to collectives and sends on the wire, next to
    what a bf16 reduction of the same gradients would cost.  The wire bytes are also reported to
    the engine's ``zerohooks.attachment(engine).counters`` (``last_step(wire=True)``), by
    collective and format (codes, scales, exact path's dtype).
    """

    name = "loco"
    distribution = "zerohooks-loco"
    Config = LocoConfig
    cfg: LocoConfig
    native = (ops.EXTENSIONS["cpu"], ops.EXTENSIONS["cuda"])
    deepspeed_seams = ("gradient_groups",)

    def __init__(self, config: PluginConfig | None = None) -> None:
        super().__init__(config)
        self.state = LocoState(self.cfg)
        self.engine: Any = None
        self._fp16 = False
        self._check_skippable = False
        self.kernels = False
        self._topologies: dict[Any, comm.Topology] = {}
        self._two_level: comm.Topology | None = None
        self._subgroups: dict[tuple[int, ...], comm.Topology] = {}
        """Two-level topologies of the MoE expert-data-parallel groups (sorted ranks -> topology)."""
        self._node = 0
        self._served = False
        self.reducer = LocoReducer(self.state, self.cfg.exact_below, self._topology, self._window)

    @property
    def stats(self) -> Any:
        """Per-step byte counters (:class:`loco.state.CommStats`)."""
        return self.state.stats

    # -- setup -----------------------------------------------------------------------------------
    def edit_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        # loco owns the gradient collective and averages as DeepSpeed does by default (sum, then
        # divide by the world size): DeepSpeed's other averaging settings would be ignored on ZeRO
        # 0/1 and are DeepSpeed's assertion on ZeRO 2/3 ("not yet supported ... with reduce
        # scatter"); refused here, before anything is built
        settings = read_settings(ds_config)
        factor = settings.gradient_predivide_factor
        if factor != 1.0:
            raise ConfigError(
                f"gradient_predivide_factor is {factor!r}: loco owns the gradient collective and averages "
                "as DeepSpeed does by default (sum, then divide by the world size), so a pre-division "
                "factor would be ignored (and DeepSpeed refuses it on ZeRO 2/3 with reduce_scatter); "
                "remove gradient_predivide_factor (the accepted value is 1.0, the default)"
            )
        if settings.prescale_gradients:
            raise ConfigError(
                f"prescale_gradients is {settings.prescale_gradients!r}: loco owns the gradient "
                "collective and averages as DeepSpeed does by default (sum, then divide by the world "
                "size), so pre-scaling would be ignored (and DeepSpeed refuses it on ZeRO 2/3 with "
                "reduce_scatter); remove prescale_gradients or set it to false"
            )
        if settings.ulysses_size not in (None, 1):
            raise ConfigError(
                f"sequence_parallel_size is {settings.ulysses_size!r}: loco owns the gradient "
                "collective and does not span DeepSpeed's sequence-parallel groups (Ulysses); remove "
                "sequence_parallel_size (or the loco section)"
            )
        if "zero_quantized_gradients" in settings.quantized:
            raise ConfigError(
                "loco owns the gradient collective and replaces ZeRO++'s quantized gradients: remove "
                "zero_optimization.zero_quantized_gradients (or the loco section)"
            )

    def attach(self, registry: HookRegistry, ctx: SetupContext) -> None:
        if self._served:
            # given to a new engine after the last one was detached: start afresh (error buffers,
            # counters, statistics), as a new plugin object would
            self.state = self.reducer.state = LocoState(self.cfg)
            self._topologies = {}
            self._two_level = None
            self._subgroups = {}
        self._served = True
        self._fp16 = ctx.train_dtype == torch.float16
        self.state.keep_snapshots = self._fp16 and self.cfg.on_skip == "restore"
        world = ctx.world_size
        node = _node_size(self.cfg, world)
        if self.cfg.hierarchy == "two_level" and (world % node or world // node < 2):
            raise ConfigError(
                f"loco.hierarchy is two_level but {world} ranks with node_size {node} make "
                f"{world / node:g} node(s); set node_size to the ranks per node (at least 2 nodes)"
            )
        if self.cfg.kernels == "compiled":
            self.kernels = ops.load_distributed("cpu")
            if _device_type() == "cuda":
                self.kernels = ops.load_distributed("cuda")
        registry.register_reducer(self.reducer, name=self.name)
        if (
            self.cfg.parameter_gather == "two_level"
            and ctx.zero_stage > 0
            and _two_level_wanted(self.cfg, world, node)
        ):
            registry.register_gatherer(LocoGatherer(self.state, self._two_level_of), name=self.name)
        registry.register_after_step(self._after_step, name=self.name)
        registry.register_state(self, name=self.name)

    def engine_ready(self, engine: Any, registry: HookRegistry) -> None:
        self.engine = engine
        self._check_skippable = True
        self.state.loss_scale = next_loss_scale(engine)
        self.reducer.names = {id(p): n for n, p in engine.module.named_parameters()}
        att = zerohooks.attachment(engine)
        # what loco really sends goes to zerohooks' counters too (their wire record)
        self.state.stats.sink = att.counters if att is not None else None
        if not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size()
        node = self._node = _node_size(self.cfg, world)
        if _two_level_wanted(self.cfg, world, node):
            p2p = self.cfg.gloo_exchange == "point_to_point"
            self._two_level = comm.two_level_topology(node, p2p)
            # the groups smaller than the world spread evenly over nodes (MoE's expert-data-parallel
            # groups, a data-parallel group beside pipeline parallelism) are reduced two-level too;
            # their node and cross-node groups are created by every rank (collective)
            own = {}
            for g in seams.gradient_groups(engine):
                ranks = tuple(sorted(dist.get_process_group_ranks(g)))
                if len(ranks) < world:
                    own[ranks] = g
            everyone = groups.gather_group_ranks(own)
            self._subgroups = groups.two_level_subgroups(everyone, node, own, p2p)

    def close(self) -> None:
        self.state.buffers.clear()
        self.state.workspaces.clear()
        self.reducer.names = {}
        self.state.stats.sink = None
        self.engine = None

    # -- hooks -----------------------------------------------------------------------------------
    def _window(self) -> int:
        if self.engine is None:
            return 0
        if self._check_skippable:
            # At the first collective every plugin's engine_ready has run, so a loss scaler another
            # plugin installed (autocastzero's fp16 scaling on fp32 parameters) is visible here.
            self._check_skippable = False
            if self.cfg.on_skip == "restore" and not self.state.keep_snapshots:
                self.state.keep_snapshots = seams.steps_may_be_skipped(self.engine)
        return zerohooks.step_context(self.engine).micro_step

    def _two_level_of(self, group: Any) -> comm.Topology | None:
        """``group``'s two-level topology: the world's, or an MoE expert-data-parallel group's
        spread over nodes (:mod:`loco.groups`); None when it is reduced flat."""
        two = self._two_level
        if two is None:
            return None
        group = group if group is not None else dist.group.WORLD
        if dist.get_world_size(group=group) == two.world:
            return two
        if not self._subgroups:  # no smaller group is two-level: no rank lookup per all-gather
            return None
        return self._subgroups.get(tuple(sorted(dist.get_process_group_ranks(group))))

    def _topology(self, group: Any) -> comm.Topology:
        group = group if group is not None else dist.group.WORLD
        topo = self._topologies.get(group)
        if topo is None:
            topo = self._two_level_of(group) or comm.flat_topology(
                group, self.cfg.gloo_exchange == "point_to_point"
            )
            ranks = dist.get_process_group_ranks(group)
            if (
                self._two_level is not None
                and not topo.two_level
                and groups.flat_costs_link(ranks, self._node)
                and "two_level" not in self.state.warned
            ):
                self.state.warned.add("two_level")
                warnings.warn(
                    f"loco: the gradient group of ranks {ranks} is reduced flat (one hop over the "
                    f"link): two-level reduction covers the world and the data-parallel and MoE "
                    f"expert groups known when the engine was built whose ranks are spread evenly "
                    f"over the nodes (node_size {self._node}), at least 2 on each",
                    RuntimeWarning,
                    stacklevel=2,
                )
            self._topologies[group] = topo
        return topo

    def _after_step(self, ctx: StepContext, skipped: bool) -> None:
        after_step(self.state, skipped, ctx.next_loss_scale, ctx.global_step)

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return state_dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_state_dict(self.state, state)

    def load_universal(self) -> None:
        """After a universal load (``ds_to_universal``): the error-feedback buffers restart at zero.
        They are per rank and shaped by the partitioning, and the converter does not copy them, so
        the resumed run loses the compression error they held (one warning, on rank 0)."""
        state = self.state
        reset_errors(state)
        state.window = None
        state.loss_scale = None  # taken from the next step; nothing to rescale
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn(
                "loco: loaded a universal checkpoint, which does not carry loco's error-feedback "
                "buffers (per rank and partition-shaped; ds_to_universal converts DeepSpeed's files "
                "only): they restart at zero, so the first steps' compression errors are not fed back; "
                "to resume bit for bit, load a regular checkpoint on the same number of ranks",
                RuntimeWarning,
                stacklevel=2,
            )


def _device_type() -> str:
    try:
        from deepspeed.accelerator import get_accelerator

        return str(get_accelerator().device_name())
    except Exception:
        return "cuda" if torch.cuda.is_available() else "cpu"
