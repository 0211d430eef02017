"""LoCo's algorithm state and the pure functions that read and change it.

:class:`LocoState` holds everything LoCo remembers between collectives (as torch's PowerSGD
keeps a ``PowerSGDState``): the error buffers, the step counters, the loss scale they are
expressed in, the rollback copies of an fp16 step, the byte counters.  Nothing is stored on the
parameters.  The functions below are the only code that changes it.

Error-buffer keys (strings, so checkpoints are portable across processes):

* ZeRO 3 (``reduce_scatter`` buckets carry their parameters): ``"p:<name>.<level>"``, one
  buffer per parameter (its name in ``engine.module``), whatever bucket it travels in;
* ZeRO 0/1/2 (``all_reduce`` buckets, flat tensors without parameters): ``"w<i>.<level>"``, the
  i-th collective call of the current reduction window (one backward pass: DeepSpeed reduces the
  same buckets, in the same order, with the same sizes, in every backward of a static graph).
  A buffer whose size does not match its call any more (a dynamic graph) is reset, with a warning;
* ``level`` 0 is the sender's error (full tensor), 1 the intra-node partial sums' error of the
  two-level path, 2 the error of the reduced chunk re-quantized for the all-gather (all-reduce).
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from loco.config import LocoConfig

__all__ = [
    "CommStats",
    "ErrorBuffer",
    "LocoState",
    "after_step",
    "begin_call",
    "crossing_bytes",
    "error_buffer",
    "load_state_dict",
    "rescale_errors",
    "reset_errors",
    "state_dict",
    "workspace",
]

STATE_FORMAT = 1
_ERROR_DTYPES = {"int8": torch.int8, "bf16": torch.bfloat16, "fp32": torch.float32}


class ErrorBuffer:
    """One error buffer: ``data`` (int8 codes, bf16 or fp32 values) and, for int8, ``scale``."""

    __slots__ = ("data", "scale")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        self.data = data
        self.scale = scale

    def clone(self) -> ErrorBuffer:
        return ErrorBuffer(self.data.clone(), self.scale.clone())

    def to(self, device: torch.device) -> ErrorBuffer:
        return ErrorBuffer(self.data.to(device), self.scale.to(device))

    def values(self, group_size: int) -> torch.Tensor:
        """The error as float32 values (for tests and inspection)."""
        if self.data.dtype == torch.int8:
            return (self.data.float().view(-1, group_size) * self.scale.view(-1, 1)).reshape(-1)
        return self.data.float()


class CommStats:
    """Bytes this rank hands to collectives and sends to other ranks, per optimizer step.

    Per step, a dict of: ``elements`` (gradient elements reduced), ``wire_bytes`` (bytes this rank
    sends to other ranks: ``(P-1)/P`` of an all-to-all input over P ranks, ``P-1`` times its
    all-gather input, ``2(P-1)/P`` of an exact all-reduce), ``handed_bytes`` (input bytes given to
    loco's own collectives: codes, scales and padding, or the exact path's tensors),
    ``bf16_wire_bytes`` / ``bf16_handed_bytes`` (the same for a bf16 all-reduce, or reduce-scatter
    on ZeRO 3, of the same elements: the baseline), and ``wire:<collective>`` per collective
    (``all_to_all`` within a node or flat, ``all_to_all_inter`` between nodes, ``all_gather``
    flat, or ``all_gather_inter`` and ``all_gather_intra`` two-level, ``exact``).  When loco owns
    DeepSpeed's parameter all-gathers (``parameter_gather``), their bytes are counted apart, as
    ``params:<hop>`` (``params:all_gather_inter``, ...), and not in ``wire_bytes``: they are the
    model's weights, not gradients.

    ``sink``, when set (the plugin sets it to ``zerohooks.attachment(engine).counters``), receives
    the same wire bytes through ``sink.add_wire(collective, format, nbytes)``, split by format
    (``"int4 codes"`` or ``"int8 codes"``, ``"float32 scales"``, or the exact path's dtype), so
    zerohooks' counters show what loco really sends.
    """

    __slots__ = ("current", "history", "sink")

    def __init__(self, maxlen: int = 100_000) -> None:
        self.current: dict[str, int] = {}
        self.history: collections.deque[dict[str, int]] = collections.deque(maxlen=maxlen)
        self.sink: Any = None

    def add(self, key: str, value: float) -> None:
        self.current[key] = self.current.get(key, 0) + round(value)

    def collective(
        self,
        name: str,
        handed: int,
        wire: float,
        parts: Mapping[str, float] | None = None,
        op: str | None = None,
    ) -> None:
        """Count one collective call: ``handed`` input bytes, ``wire`` bytes sent to others.

        ``parts`` splits ``wire`` by format for the sink (default: all of it as ``"uint8"``), and
        ``op`` names the torch collective that ran (default ``name``)."""
        self.add("handed_bytes", handed)
        self.add("wire_bytes", wire)
        self.add(f"wire:{name}", wire)
        if self.sink is not None:
            for fmt, nbytes in (parts or {"uint8": wire}).items():
                self.sink.add_wire(op or name, fmt, round(nbytes))

    def parameters(self, hop: str, wire: float) -> None:
        """Count ``wire`` bytes this rank sent in one hop of a parameter all-gather."""
        self.add(f"params:{hop}", wire)

    def reduced(self, numel: int, op: str, world: int) -> None:
        """Count ``numel`` gradient elements and what bf16 would have cost for them."""
        self.add("elements", numel)
        self.add("bf16_handed_bytes", 2 * numel)
        factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
        self.add("bf16_wire_bytes", factor * 2 * numel)

    def end_step(self) -> None:
        self.history.append(self.current)
        self.current = {}

    def last_step(self) -> dict[str, int]:
        return dict(self.history[-1]) if self.history else {}


def crossing_bytes(step: Mapping[str, float], nodes: int, node_size: int) -> float:
    """Of one rank's counters for one step (an entry of :attr:`CommStats.history`), the gradient
    bytes it sent to ranks on other nodes (ranks node-major, ``nodes`` x ``node_size``).

    All of the two-level cross-node hops (``wire:all_to_all_inter``, ``wire:all_gather_inter``);
    of a flat all-to-all, which sends to each of the W-1 other ranks directly, the
    (N-1)L/(W-1) that go to other nodes; of a ring (loco's flat all-gather, and the exact path,
    an all-reduce on ZeRO 0-2) N/W, the share of the ring's W edges that join two nodes.  The
    parameter all-gathers (``params:``) are not included."""
    world = nodes * node_size
    if world < 2 or nodes < 2:
        return 0.0
    ring = nodes / world
    total = step.get("wire:all_to_all_inter", 0) + step.get("wire:all_gather_inter", 0)
    if "wire:all_to_all_inter" not in step:
        total += (nodes - 1) * node_size / (world - 1) * step.get("wire:all_to_all", 0)
    return total + ring * (step.get("wire:all_gather", 0) + step.get("wire:exact", 0))


class LocoState:
    """Everything LoCo keeps between collectives; changed only by this module's functions."""

    __slots__ = (
        "beta",
        "bits",
        "buffers",
        "call_index",
        "error_dtype",
        "error_feedback",
        "group_size",
        "keep_snapshots",
        "loss_scale",
        "on_skip",
        "reset_T",
        "resets",
        "snapshots",
        "stats",
        "steps",
        "use_kernels",
        "warned",
        "window",
        "workspaces",
    )

    def __init__(self, config: LocoConfig) -> None:
        self.bits: int = config.bits
        self.beta: float = config.err_beta
        self.group_size: int = config.group_size
        self.error_dtype: torch.dtype = _ERROR_DTYPES[config.error_dtype]
        self.error_feedback: bool = config.error_feedback
        self.reset_T: int = config.reset_T
        self.on_skip: str = config.on_skip
        self.use_kernels: bool = config.kernels == "compiled"
        self.buffers: dict[str, ErrorBuffer] = {}
        self.keep_snapshots = False
        """Keep each buffer's value from before the step (fp16 with ``on_skip="restore"``)."""
        self.snapshots: dict[str, ErrorBuffer | None] = {}
        self.window: int | None = None
        self.call_index = 0
        self.loss_scale: float | None = None
        """Loss scale the buffers are expressed in (fp16); None when there is none."""
        self.steps = 0
        """Optimizer steps seen (``engine.global_steps`` after the last step)."""
        self.resets = 0
        """How many times the buffers were cleared by ``reset_T``."""
        self.stats = CommStats()
        self.workspaces: dict[str, torch.Tensor] = {}
        self.warned: set[str] = set()


def begin_call(state: LocoState, window: int) -> int:
    """Index of this collective call within reduction window ``window`` (a backward pass)."""
    if window != state.window:
        state.window = window
        state.call_index = 0
    index = state.call_index
    state.call_index += 1
    return index


def error_buffer(state: LocoState, key: str, numel: int, device: torch.device) -> ErrorBuffer | None:
    """The error buffer ``key`` of ``numel`` elements on ``device`` (zeros when new); None without
    error feedback.  Kernels update it in place; with ``keep_snapshots`` its value before the
    first update of the step is kept for :func:`after_step`."""
    if not state.error_feedback:
        return None
    buf = state.buffers.get(key)
    if buf is not None and buf.data.numel() != numel:
        if key not in state.warned:
            state.warned.add(key)
            warnings.warn(
                f"loco: error buffer {key!r} held {buf.data.numel()} elements but this call reduces "
                f"{numel}: the gradient buckets changed (dynamic graph?); the buffer is reset",
                RuntimeWarning,
                stacklevel=3,
            )
        buf = None
    if buf is not None and buf.data.device != device:
        buf = buf.to(device)
        state.buffers[key] = buf
    if state.keep_snapshots and key not in state.snapshots:
        state.snapshots[key] = buf.clone() if buf is not None else None
    if buf is None:
        n_scale = numel // state.group_size if state.error_dtype == torch.int8 else 0
        buf = ErrorBuffer(
            torch.zeros(numel, dtype=state.error_dtype, device=device),
            torch.zeros(n_scale, dtype=torch.float32, device=device),
        )
        state.buffers[key] = buf
    return buf


def reset_errors(state: LocoState) -> None:
    """Forget every error buffer (they come back as zeros)."""
    state.buffers.clear()
    state.snapshots.clear()


def rescale_errors(state: LocoState, factor: float) -> None:
    """Multiply every error by ``factor`` (exact for the powers of two of fp16 loss scaling)."""
    for buf in state.buffers.values():
        if buf.data.dtype == torch.int8:
            buf.scale.mul_(factor)
        else:
            buf.data.mul_(factor)


def after_step(state: LocoState, skipped: bool, loss_scale: float | None, global_step: int) -> None:
    """End of an optimizer step (``global_step``: ``engine.global_steps`` after it).

    A skipped step (fp16 overflow) sent values that were thrown away, so the errors it produced
    are rolled back (``on_skip="restore"``) or cleared (``"reset"``).  Then the buffers are
    rescaled to a new loss scale, and cleared when ``global_step`` is a multiple of ``reset_T``.
    """
    if skipped:
        if state.on_skip == "restore" and state.keep_snapshots:
            for key, old in state.snapshots.items():
                if old is None:
                    state.buffers.pop(key, None)
                else:
                    state.buffers[key] = old
        else:
            state.buffers.clear()
    state.snapshots.clear()
    if loss_scale is not None and state.loss_scale is not None and loss_scale != state.loss_scale:
        rescale_errors(state, loss_scale / state.loss_scale)
    state.loss_scale = loss_scale
    state.steps = global_step
    if state.reset_T > 0 and global_step > 0 and global_step % state.reset_T == 0:
        reset_errors(state)
        state.resets += 1
    state.stats.end_step()


def workspace(state: LocoState, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """A byte buffer of at least ``nbytes`` reused across calls on CPU (fresh on accelerators,
    whose caching allocators make that cheap and stream-safe); returns exactly ``nbytes``."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf = state.workspaces.get(name)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        state.workspaces[name] = buf
    return buf[:nbytes]


def state_dict(state: LocoState) -> dict[str, Any]:
    """What a checkpoint keeps: the buffers (on CPU), the loss scale and the step counter."""
    return {
        "format": STATE_FORMAT,
        "bits": state.bits,
        "group_size": state.group_size,
        "error_dtype": str(state.error_dtype),
        "buffers": {k: (b.data.cpu(), b.scale.cpu()) for k, b in state.buffers.items()},
        "loss_scale": state.loss_scale,
        "steps": state.steps,
        "resets": state.resets,
    }


def load_state_dict(state: LocoState, sd: dict[str, Any]) -> None:
    """Restore :func:`state_dict` output; buffers move to their device on first use."""
    if sd.get("format") != STATE_FORMAT:
        raise ValueError(f"not a loco state (format {sd.get('format')!r}, expected {STATE_FORMAT})")
    saved = (sd["group_size"], sd["error_dtype"])
    if saved != (state.group_size, str(state.error_dtype)):
        raise ValueError(
            f"the checkpoint's loco error buffers use group_size={saved[0]}, error_dtype={saved[1]}, "
            f"but this run uses group_size={state.group_size}, error_dtype={state.error_dtype}; "
            "use the same settings (or start the error buffers afresh with reset_T)"
        )
    state.buffers = {k: ErrorBuffer(d, s) for k, (d, s) in sd["buffers"].items()}
    state.snapshots.clear()
    state.loss_scale = sd["loss_scale"]
    state.steps = sd["steps"]
    state.resets = sd.get("resets", 0)
    state.window = None
