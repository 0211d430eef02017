"""The swapper: moves each sub-group's fp32 master partition and optimizer moments between RAM
buffers and its swap file around the sub-group's optimizer step, and builds its fp32 gradient
from the 16-bit gradient partition DeepSpeed keeps in memory (no gradient ever touches disk).

DeepSpeed runs as plain CPU offload (``config.rewrite_offload``); the plugin replaces the
per-sub-group hooks of its step (``_prepare_sub_group`` / ``_release_sub_group``) for swapped
sub-groups with :func:`swap_in` / :func:`swap_out`.  Between steps a swapped sub-group's master
tensor and moment tensors keep their identity (the optimizer's state is keyed by them) but hold
no storage (``tensor.data`` is an empty tensor); while it is stepped they are views of one of
``buffer_count`` aligned RAM buffers, each with its own I/O engine so that the next sub-group is
read ahead while the current one is stepped and the previous one is written.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch

from nvmeswap import io
from nvmeswap.memory import meminfo
from nvmeswap.swapfile import (
    HEADER,
    SwapCorruptionError,
    decode_header,
    encode_header,
    preallocate,
    remove_folder,
    segment_bytes,
)
from zerohooks.adapter import statestore

__all__ = ["Slot", "SubGroup", "SwapState", "build_gradient", "flush", "swap_in", "swap_out"]

EMPTY = torch.empty(0, dtype=torch.float32)


class SubGroup:
    """One swapped sub-group of one rank."""

    __slots__ = (
        "checksum",
        "generation",
        "index",
        "keys",
        "master",
        "numel",
        "path",
        "region",
        "slot",
        "staged",
        "writer",
    )

    def __init__(self, index: int, numel: int, path: str, master: torch.Tensor) -> None:
        self.index = index
        self.numel = numel
        self.path = path
        self.master = master
        """DeepSpeed's fp32 partition tensor of the sub-group (identity kept, storage swapped)."""
        self.keys: tuple[str, ...] = ()
        """Optimizer-state entries swapped with it (known after the first step)."""
        self.checksum: int | None = None
        """Checksum of the last write (None before the first)."""
        self.generation = 0
        self.slot: Slot | None = None
        """The buffer holding it now (resident or being read), None when only on disk."""
        self.writer: Any = None
        """The I/O engine of its last write (waited for before the file is read again)."""
        self.region = 0
        """The region of its file holding its live state (0, or 1 with ``step_in_backward``)."""
        self.staged: tuple[int, int, tuple[str, ...]] | None = None
        """(checksum, generation, keys) of a speculative step written to the other region, not
        yet committed (:mod:`nvmeswap.early`)."""


class Slot:
    """An aligned RAM buffer with its own I/O engine."""

    __slots__ = ("buffer", "engine", "owner", "ready", "released")

    def __init__(self, nbytes: int, engine: Any) -> None:
        self.buffer = io.aligned_empty(nbytes)
        self.engine = engine
        self.owner: SubGroup | None = None
        """The sub-group being read into, or stepped in, the buffer (None: free, maybe writing)."""
        self.ready = False
        """True when the buffer holds ``owner``'s verified data."""
        self.released = 0
        """Clock of its last release: the free buffer released longest ago is reused first."""


class SwapState:
    """Everything the swapper knows about one engine."""

    __slots__ = (
        "algorithm",
        "buffer_count",
        "bytes_read",
        "bytes_written",
        "capacity",
        "clock",
        "folder",
        "fused",
        "fused_steps",
        "grad_partitions",
        "grad_positions",
        "grad_scales",
        "groups",
        "io_wait",
        "keep_master",
        "make_engine",
        "needs_sync",
        "optimizer",
        "order",
        "overrides",
        "pages_dropped",
        "pending_grads",
        "pool",
        "prefetch_hits",
        "prefetch_slots",
        "prefetched",
        "recorded",
        "regions",
        "resident",
        "scratch",
        "slots",
        "state_slots",
    )

    def __init__(
        self,
        optimizer: Any,
        folder: str,
        sub_groups: list[int],
        keep_master: bool,
        buffer_count: int,
        make_engine: Any,
        algorithm: int,
        state_slots: int = 2,
        prefetch_bytes: int = 0,
        regions: int = 1,
    ) -> None:
        self.optimizer = optimizer
        self.folder = folder
        self.keep_master = keep_master
        self.algorithm = algorithm
        self.state_slots = state_slots
        self.regions = regions
        """Regions per swap file: 2 with ``step_in_backward`` (the live state and a speculative step)."""
        numels = statestore.sub_group_numels(optimizer)
        self.groups: dict[int, SubGroup] = {
            i: SubGroup(
                i,
                numels[i],
                os.path.join(folder, f"subgroup{i:05d}.swp"),
                statestore.master(optimizer, i),
            )
            for i in sub_groups
        }
        self.order = list(sub_groups)
        biggest = max((g.numel for g in self.groups.values()), default=0)
        self.capacity = HEADER + (state_slots + (0 if keep_master else 1)) * segment_bytes(biggest)
        self.make_engine = make_engine
        self.buffer_count = min(buffer_count, max(len(sub_groups), 1))
        self.prefetch_slots = _prefetch_slots(prefetch_bytes, self.capacity, len(sub_groups))
        """Extra buffers for sub-groups read ahead while backward runs (``prefetch_bytes``)."""
        self.pool = self.buffer_count + self.prefetch_slots
        """Buffers between steps (a checkpoint's load may add some for a while)."""
        _check_buffer_memory(self.pool, self.capacity, biggest, self.prefetch_slots)
        self.slots = [Slot(self.capacity, make_engine()) for _ in range(self.pool)]
        self.clock = 0
        self.scratch = EMPTY
        """The fp32 gradient of the sub-group being stepped (one buffer, reused; made on first use,
        never when every step is fused)."""
        self.pending_grads: dict[int, dict[int, torch.Tensor]] = {}
        """sub-group -> {offset: 16-bit gradient partition} recorded at the accumulation boundary."""
        self.recorded: dict[int, int] = {}
        """sub-group -> elements of its gradient recorded this window (all: its gradient is final)."""
        self.prefetched: set[int] = set()
        """Sub-groups read ahead during backward, holding a buffer until their step (not resident)."""
        self.prefetch_hits = 0
        """Sub-groups the step found read ahead (counted when swapped in)."""
        self.pages_dropped = 0
        """Bytes of mapped checkpoint pages dropped after their sub-group was written back."""
        self.overrides: dict[int, torch.Tensor] = {}
        """sub-group -> fp32 gradient written through DeepSpeed's set-gradient APIs."""
        self.grad_partitions: dict[int, torch.Tensor] = statestore.gradient_partitions(optimizer)
        self.grad_positions = statestore.positions(optimizer)
        self.resident: set[int] = set()
        self.fused: set[int] = set()
        """Sub-groups whose step this window is the fused Adam kernel (decided when swapped in)."""
        self.fused_steps = 0
        """Sub-group steps taken by the fused kernel so far."""
        self.grad_scales: dict[int, float] = {}
        """sub-group -> DeepSpeed's unscale-and-clip factor, for the fused step."""
        self.needs_sync = False
        """A recorded gradient was copied from an accelerator asynchronously: synchronise first."""
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_wait = 0.0
        """Seconds spent waiting for reads and writes to finish (the step blocked on the disk)."""

    def region_bytes(self, g: SubGroup) -> int:
        return HEADER + (self.state_slots + (0 if self.keep_master else 1)) * segment_bytes(g.numel)

    def file_bytes(self, g: SubGroup) -> int:
        return self.regions * self.region_bytes(g)


def _prefetch_slots(prefetch_bytes: int, capacity: int, count: int) -> int:
    """The buffers ``prefetch_bytes`` of RAM holds (at most one per swapped sub-group)."""
    if prefetch_bytes and prefetch_bytes < capacity:
        from zerohooks import ConfigError

        raise ConfigError(
            f"nvmeswap.prefetch_bytes = {prefetch_bytes} is less than one swap buffer ({capacity} bytes: the "
            "largest sub-group's master and moments); accepted: 0 (no read-ahead during backward) or at "
            f"least {capacity} (a multiple of it: one sub-group read ahead per {capacity} bytes)"
        )
    return min(prefetch_bytes // capacity, count)


def _check_buffer_memory(count: int, capacity: int, biggest: int, prefetch: int = 0) -> None:
    """The RAM buffers must fit: each holds a whole sub-group's master and moments (12 bytes an
    element), so DeepSpeed's default ``sub_group_size`` (1e9) would ask for 36 GB.  More than the
    machine's RAM is an error; more than is available now (other processes) a warning."""
    need = count * capacity
    extra = f", {prefetch} of them for nvmeswap.prefetch_bytes," if prefetch else ""
    what = (
        f"nvmeswap: {count} swap buffers{extra} of {capacity} bytes (the largest sub-group, {biggest} elements, "
        f"with its fp32 master and moments) need {need} bytes of RAM"
    )
    fix = "lower zero_optimization.sub_group_size (e.g. 50000000: 0.6 GB a buffer) or nvmeswap.buffer_count"
    if prefetch:
        fix += " or nvmeswap.prefetch_bytes"
    total, avail = meminfo("MemTotal"), meminfo("MemAvailable")
    if total is not None and need > total:
        from zerohooks import ConfigError

        raise ConfigError(f"{what}, more than this machine's {total}; {fix}")
    if avail is not None and need > avail:
        warnings.warn(f"{what}, more than the {avail} available now; {fix}", RuntimeWarning, stacklevel=3)


# -- layout ---------------------------------------------------------------------------------------
def segments(state: SwapState, g: SubGroup, keys: tuple[str, ...]) -> list[tuple[str, int]]:
    """(name, byte offset in the file) of each segment: ``"master"`` then the state keys."""
    names = ([] if state.keep_master else ["master"]) + list(keys)
    seg = segment_bytes(g.numel)
    return [(n, HEADER + k * seg) for k, n in enumerate(names)]


def _view(slot: Slot, offset: int, numel: int) -> torch.Tensor:
    return slot.buffer[offset : offset + numel * 4].view(torch.float32)


def state_tensors(state: SwapState, g: SubGroup) -> dict[str, torch.Tensor]:
    st = state.optimizer.optimizer.state.get(g.master, {})
    return {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and k in g.keys}


def _wait(state: SwapState, engine: Any) -> None:
    t0 = time.perf_counter()
    try:
        engine.wait()
    finally:
        state.io_wait += time.perf_counter() - t0


# -- buffers --------------------------------------------------------------------------------------
def _free_slot(state: SwapState, idle: bool = False) -> Slot | None:
    """The free buffer released longest ago (``idle``: only one with no I/O in flight)."""
    free = [s for s in state.slots if s.owner is None and not (idle and s.engine.pending())]
    return min(free, key=lambda s: s.released) if free else None


def _release_slot(state: SwapState, g: SubGroup) -> None:
    """``g``'s buffer is free again (reused once its I/O is done); ``g`` holds none."""
    slot = g.slot
    if slot is not None:
        state.clock += 1
        slot.owner, slot.ready, slot.released = None, False, state.clock
        g.slot = None


def _acquire(state: SwapState, g: SubGroup, slot: Slot | None = None) -> Slot:
    """A buffer for ``g`` (``slot``, else the free one released longest ago), once its last write
    is done."""
    slot = slot or _free_slot(state)
    if slot is None:
        raise RuntimeError("nvmeswap: every swap buffer is in use; raise nvmeswap.buffer_count")
    _wait(state, slot.engine)  # its previous write must be on disk before the buffer is reused
    slot.owner, slot.ready = g, False
    g.slot = slot
    return slot


def _read(state: SwapState, g: SubGroup, slot: Slot | None = None) -> None:
    """Start reading ``g`` into a buffer, ``slot`` if given (nothing to read before its first write)."""
    if g.slot is not None:
        return
    slot = _acquire(state, g, slot)
    if g.checksum is None:
        return
    if g.writer is not None and g.writer is not slot.engine:
        _wait(state, g.writer)  # engines do not order requests between them
    g.writer = None
    nbytes = HEADER + len(segments(state, g, g.keys)) * segment_bytes(g.numel)
    slot.engine.submit("r", slot.buffer[:nbytes], g.path, g.region * state.region_bytes(g))
    state.bytes_read += nbytes


def _hex(value: object) -> str:
    return f"{value:#018x}" if isinstance(value, int) else repr(value)


def _finish_read(state: SwapState, g: SubGroup) -> Slot:
    slot = g.slot
    assert slot is not None
    if slot.ready:
        return slot
    _wait(state, slot.engine)
    if g.checksum is not None:
        meta = decode_header(slot.buffer, g.path)
        nbytes = len(segments(state, g, g.keys)) * segment_bytes(g.numel)
        payload = slot.buffer[HEADER : HEADER + nbytes]
        got = io.checksum(payload, int(meta.get("algorithm", 0)))  # type: ignore[call-overload]
        if got != meta.get("checksum") or got != g.checksum or meta.get("generation") != g.generation:
            raise SwapCorruptionError(
                f"swap file {g.path!r} (sub-group {g.index}) is corrupted: checksum {got:#018x} of its "
                f"{nbytes} payload bytes, header says {_hex(meta.get('checksum'))}, last written "
                f"{g.checksum:#018x} (generation {meta.get('generation')} vs {g.generation}). "
                "Training stops rather than use it; resume from the last checkpoint."
            )
    slot.ready = True
    return slot


# -- the step -------------------------------------------------------------------------------------
def swap_in(state: SwapState, index: int, prefetch: bool = True) -> None:
    """Make sub-group ``index``'s master and moments resident (views of a buffer)."""
    g = state.groups[index]
    if index in state.resident:
        return
    if index in state.prefetched:
        state.prefetched.discard(index)
        state.prefetch_hits += 1
    _read(state, g)
    slot = _finish_read(state, g)
    segs = dict(segments(state, g, g.keys))
    if not state.keep_master:
        if g.checksum is None:  # first use: the master is still DeepSpeed's own tensor
            raise AssertionError("nvmeswap: sub-group swapped in before it was written")
        statestore.set_master(g.master, _view(slot, segs["master"], g.numel))
    for key, t in state_tensors(state, g).items():
        t.data = _view(slot, segs[key], g.numel)
    state.resident.add(index)
    if prefetch:
        k = state.order.index(index)
        if k + 1 < len(state.order):
            nxt = state.groups[state.order[k + 1]]
            if nxt.slot is None and _free_slot(state) is not None:
                _read(state, nxt)


def swap_out(state: SwapState, index: int, write: bool = True, staged: bool = False) -> None:
    """Write sub-group ``index`` back (asynchronously) and release its storage; ``staged``: to the
    region of its file that is not live, recorded in ``staged`` until committed or dropped."""
    g = state.groups[index]
    opt_state = state.optimizer.optimizer.state.get(g.master, {})
    keys = tuple(
        k
        for k, v in opt_state.items()
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.numel() == g.numel
    )
    if len(keys) > state.state_slots:
        raise RuntimeError(
            f"nvmeswap: the optimizer keeps {len(keys)} per-element state tensors {list(keys)} for sub-group "
            f"{index}, more than the {state.state_slots} the swap files were sized for (Adam/AdamW)"
        )
    slot = g.slot
    if slot is None:  # never swapped in (the first write, from DeepSpeed's own tensors)
        slot = _acquire(state, g)
        slot.ready = True
    if not staged:
        g.keys = keys
    segs = segments(state, g, keys)
    sources = ([] if state.keep_master else [g.master]) + [opt_state[k] for k in keys]
    for (_, off), t in zip(segs, sources, strict=True):
        dst = _view(slot, off, g.numel)
        if t.data_ptr() != dst.data_ptr():
            dst.copy_(t.detach().reshape(-1))
    nbytes = len(segs) * segment_bytes(g.numel)
    if write:
        generation = g.generation + 1
        checksum = io.checksum(slot.buffer[HEADER : HEADER + nbytes], state.algorithm)
        region = 1 - g.region if staged else g.region
        if staged:
            g.staged = (checksum, generation, keys)
        else:
            g.generation, g.checksum = generation, checksum
        encode_header(
            slot.buffer,
            {
                "sub_group": index,
                "numel": g.numel,
                "keys": list(keys),
                "master": not state.keep_master,
                "algorithm": state.algorithm,
                "checksum": checksum,
                "generation": generation,
            },
        )
        slot.engine.submit("w", slot.buffer[: HEADER + nbytes], g.path, region * state.region_bytes(g))
        g.writer = slot.engine
        state.bytes_written += HEADER + nbytes
    if not state.keep_master:
        statestore.set_master(g.master, EMPTY)
    for k in keys:
        opt_state[k].data = EMPTY
    state.resident.discard(index)
    _release_slot(state, g)


def flush(state: SwapState) -> None:
    """Wait for every outstanding read and write."""
    for s in state.slots:
        _wait(state, s.engine)


def initialise(state: SwapState) -> None:
    """Preallocate the files, then write every sub-group's master out and free its RAM."""
    os.makedirs(state.folder, exist_ok=True)
    preallocate({g.path: state.file_bytes(g) for g in state.groups.values()})
    for i in state.order:
        g = state.groups[i]
        statestore.set_master_grad(
            g.master, None
        )  # DeepSpeed's per-sub-group fp32 gradient buffer: not needed
        master = statestore.materialise(state.optimizer, i)  # not made while DeepSpeed built the engine
        if master is not None:
            statestore.set_master(g.master, master)
        swap_out(state, i)
    flush(state)


# -- read-ahead during backward --------------------------------------------------------------------
def prefetch(state: SwapState, index: int) -> bool:
    """Start reading sub-group ``index`` into a free buffer while backward still runs, if the
    ``prefetch_bytes`` budget has room and neither the buffer nor the sub-group's file has I/O
    in flight (backward never waits on the disk); True if the read was started.  The buffer
    stays the sub-group's until its step swaps it in (verified then) or :func:`drop_prefetched`."""
    g = state.groups[index]
    if len(state.prefetched) >= state.prefetch_slots:
        return False
    if g.writer is not None and g.writer.pending():
        return False
    # at most prefetch_slots of the buffers are held this way: buffer_count stay for the step
    return read_next(state, index)


def read_next(state: SwapState, index: int) -> bool:
    """Start reading sub-group ``index`` into a free buffer with no I/O in flight, if there is one
    and it is not in a buffer already (the next sub-group stepped during backward); True if
    started.  It counts as read ahead (``prefetched``) until its step swaps it in or
    :func:`drop_prefetched`."""
    g = state.groups[index]
    if g.slot is not None or g.checksum is None:
        return False
    slot = _free_slot(state, idle=True)
    if slot is None:
        return False
    _read(state, g, slot)
    state.prefetched.add(index)
    return True


def drop_prefetched(state: SwapState) -> None:
    """Forget the sub-groups read ahead and not stepped (a skipped step, a checkpoint, a load):
    their buffers are free again (reused once their reads are done), nothing is written."""
    for i in sorted(state.prefetched):
        _release_slot(state, state.groups[i])
    state.prefetched.clear()


# -- gradients ------------------------------------------------------------------------------------
def record_gradient(state: SwapState, index: int, offset: int, grad16: torch.Tensor) -> None:
    """At the boundary: remember where sub-group ``index``'s gradient lies (no copy, no I/O); when
    that completes the sub-group's gradient, read its state ahead (``prefetch_bytes``)."""
    if not state.pending_grads:
        # the first gradient of a new window: gradients read through DeepSpeed's APIs since the
        # last step (zeros then) are stale
        state.overrides.clear()
        state.recorded.clear()
    parts = state.pending_grads.setdefault(index, {})
    before = parts.get(offset)
    parts[offset] = grad16
    count = state.recorded.get(index, 0) + grad16.numel() - (0 if before is None else before.numel())
    state.recorded[index] = count
    if state.prefetch_slots and count == state.groups[index].numel:
        prefetch(state, index)


def build_gradient(state: SwapState, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 gradient of sub-group ``index``: an override set through DeepSpeed's APIs, or the
    16-bit partitions recorded at the boundary converted on the fly (what DeepSpeed would have
    converted, written and read back), in ``out`` when given."""
    g = state.groups[index]
    override = state.overrides.get(index)
    if override is not None:
        return override
    sync_gradients(state)
    if out is None:  # the step's gradient: the one reused buffer
        if state.scratch.numel() < g.numel:
            state.scratch = torch.empty(max(x.numel for x in state.groups.values()), dtype=torch.float32)
        out = state.scratch[: g.numel]
    parts = state.pending_grads.get(index, {})
    if sum(t.numel() for t in parts.values()) != g.numel:
        out.zero_()  # parameters unused in this window contribute zero
    for off, t in parts.items():
        out[off : off + t.numel()].copy_(t)
    return out


def sync_gradients(state: SwapState) -> None:
    """Wait for the asynchronous device-to-host copies of the recorded gradients (GPU runs)."""
    if state.needs_sync:
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            acc.synchronize()
        state.needs_sync = False


def end_step(state: SwapState) -> None:
    """After the optimizer step (or a skipped one): forget this window's gradients."""
    state.pending_grads.clear()
    state.recorded.clear()
    drop_prefetched(state)  # a skipped step stepped none of them
    state.overrides.clear()
    state.fused.clear()
    state.grad_scales.clear()


def close(state: SwapState, restore: bool) -> None:
    """Bring every sub-group back into RAM when ``restore`` (detaching leaves a working CPU-offload
    engine), then delete the swap files.

    If the restore fails (a read error, a corrupt file) the files are left where they are: they
    may hold the only copy of the sub-groups not yet brought back."""
    flush(state)
    if restore:
        _restore(state)
    remove_folder(state.folder)


def restore_bytes(state: SwapState) -> int:
    """The RAM :func:`close` with ``restore`` takes: every swapped sub-group's moments, and its
    master unless kept in RAM already (fp32)."""
    per = state.state_slots + (0 if state.keep_master else 1)
    return sum(per * 4 * g.numel for g in state.groups.values())


def _restore(state: SwapState) -> None:
    for i in state.order:
        g = state.groups[i]
        swap_in(state, i, prefetch=False)
        if not state.keep_master:
            statestore.set_master(g.master, g.master.data.clone())
        for t in state_tensors(state, g).values():
            t.data = t.data.clone()
        statestore.set_master_grad(g.master, torch.zeros(g.numel, dtype=torch.float32))
        state.resident.discard(i)
        slot = g.slot
        assert slot is not None
        slot.owner, slot.ready, g.slot = None, False, None
