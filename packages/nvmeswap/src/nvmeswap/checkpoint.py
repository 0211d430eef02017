"""Checkpoints of a swapped optimizer, streamed: the state on disk never passes through RAM whole.

DeepSpeed saves and loads the ZeRO-3 optimizer in its CPU-offload format (the fp32 flat groups and
the torch optimizer's state dict) through its own code, which needs every sub-group's master and
moments as tensors at once: 12 bytes a parameter, 24 GB for a 2 B-parameter model, more than the
RAM that made swapping necessary.  Instead:

* save: after the outstanding writes are done, each swapped sub-group's master and moment tensors
  become views of a private, read-only memory map of its swap file (:func:`mapped`), so
  ``torch.save`` copies the file's pages (page cache, which the kernel may drop at any time) into
  the checkpoint; no anonymous memory is allocated, and the tensors go back to holding nothing.
  The checkpoint's format is DeepSpeed's own (``zero_to_fp32`` consolidates it); each sub-group's
  tensors are views of one storage holding its swap file (header included).
* load: DeepSpeed's ``torch.load`` of the optimizer file is made with ``mmap=True`` (the
  checkpoint's pages are mapped, not read into RAM; asked for with
  :func:`zerohooks.adapter.seams.read_checkpoints_mapped`, which keeps the weights-only read); the
  moments are the mapped saved tensors torch's ``load_state_dict`` keeps.  DeepSpeed's own restore
  (every saved master copied into its fp32 partition, then every fp32 partition into its 16-bit
  one) is shown the swapped sub-groups' masters and saved masters empty, so it passes them by and
  touches none of the mapped masters; then, one sub-group at a time, the saved master becomes the
  sub-group's master, its 16-bit partition is written from it, and
  :func:`nvmeswap.swapper.swap_out` copies master and moments into a swap buffer and writes the
  swap file (new checksum and generation); the copy done, the pages of the checkpoint that held
  the sub-group are dropped from the process (:func:`drop_pages`: ``madvise(MADV_DONTNEED)`` on
  the private mapping; clean file pages, read again from the file if anything touches them), so
  at most one sub-group's pages of the mapped checkpoint are in the process's memory at a time.
  ``load_optimizer_states=False`` goes the same way, each sub-group read from its swap file (its
  moments kept) instead of its moments taken from the checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections.abc import Callable
from typing import Any

import torch

from nvmeswap import swapper
from nvmeswap.swapper import SwapState
from zerohooks.adapter import statestore, unistate

__all__ = ["drop_pages", "mapped", "streamed_load", "streamed_refresh", "streamed_save"]

_MADV_DONTNEED = 4
"""Linux's ``MADV_DONTNEED`` (the same number on every Linux architecture)."""
_libc: Any = None


def file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's file-backed mappings (``/proc/self/maps``)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return out


def _inside(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether ``t``'s bytes lie in one file-backed mapping (only such pages may be dropped:
    dropping anonymous memory would zero it)."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    return t.numel() > 0 and any(a <= lo and hi <= b for a, b in ranges)


def drop_pages(t: torch.Tensor) -> int:
    """Drop from the process the whole pages inside ``t``'s bytes, which must be a view of a
    read-only private file mapping (a checkpoint loaded with ``mmap=True``): they are clean file
    pages, read again from the file if touched later, so nothing is lost.  Returns the bytes
    dropped (0 where ``madvise`` is not available)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start or _libc.madvise(ctypes.c_void_p(start), end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start


def streamed_refresh(state: SwapState, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (DeepSpeed's refresh of every fp32 master from the 16-bit weights: a
    module-only load, ``refresh_fp32_params``) done one swapped sub-group at a time through the
    swap buffers (read, refreshed, written back), never with the whole state in RAM; with the
    masters kept in RAM, DeepSpeed's own."""

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        if state.keep_master:
            return original(*args, **kwargs)
        if state.resident:
            raise RuntimeError(
                f"nvmeswap: fp32 masters refreshed while sub-groups {sorted(state.resident)} are stepped"
            )
        opt = state.optimizer
        for i in range(len(statestore.sub_group_numels(opt))):
            if i not in state.groups:
                statestore.master_from_bit16(opt, i)
                continue
            swapper.swap_in(state, i)  # reads the next sub-group ahead meanwhile
            try:
                statestore.master_from_bit16(opt, i)
            finally:
                swapper.swap_out(state, i)
        return None

    return run


def mapped(state: SwapState, g: swapper.SubGroup) -> dict[str, torch.Tensor]:
    """``g``'s master (unless kept in RAM) and moments as views of a private memory map of its
    swap file (read-only use: a write would copy the page, never reach the file)."""
    whole = torch.from_file(g.path, shared=False, size=state.file_bytes(g), dtype=torch.uint8)
    base = g.region * state.region_bytes(g)  # the live region (step_in_backward keeps two)
    out = {}
    for name, off in swapper.segments(state, g, g.keys):
        out[name] = whole[base + off : base + off + g.numel * 4].view(torch.float32)
    return out


def _empty_all(state: SwapState) -> None:
    for i in state.order:
        g = state.groups[i]
        if not state.keep_master:
            statestore.set_master(g.master, swapper.EMPTY)
        for t in swapper.state_tensors(state, g).values():
            t.data = swapper.EMPTY


def _settle(state: SwapState, what: str) -> None:
    """No sub-group is being stepped, and every swap write has landed (before a checkpoint)."""
    if state.resident:
        raise RuntimeError(
            f"nvmeswap: checkpoint {what} while sub-groups {sorted(state.resident)} are stepped"
        )
    swapper.drop_prefetched(state)  # a load rewrites the files: nothing read before it is kept
    swapper.flush(state)


def streamed_save(state: SwapState, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (DeepSpeed's ``_save_zero_checkpoint``) run with every swapped sub-group's
    tensors mapped from its swap file."""

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        _settle(state, "saved")
        try:
            for i in state.order:
                g = state.groups[i]
                if g.checksum is None:
                    continue
                views = mapped(state, g)
                if "master" in views:
                    statestore.set_master(g.master, views.pop("master"))
                for key, t in swapper.state_tensors(state, g).items():
                    t.data = views[key]
            return original(*args, **kwargs)
        finally:
            _empty_all(state)

    return save


def _own_the_rest(opt: Any) -> None:
    """Copy into RAM what the load left as views of the mapped file: the moments of sub-groups
    kept in RAM, small optimizer state (Adam's step counts) and tensor hyper-parameters.  One of
    them alive would keep the whole file mapped, and every page read from it in the process's
    memory, until the engine goes.  (The fp32 masters are not among them: DeepSpeed copies the
    saved ones into its own, and a swapped sub-group's are empty by now.)"""
    inner = opt.optimizer
    for entries in [*inner.state.values(), *inner.param_groups]:
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.numel() and key != "params":
                value.data = value.data.clone()


def streamed_load(state: SwapState, engine: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (DeepSpeed's ``_load_zero_checkpoint``) with the checkpoint mapped and the
    swapped sub-groups written back to their swap files one at a time."""
    opt = engine.optimizer

    def make_rigid_load(rigid: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(rigid_load, rigid)

    def rigid_load(rigid: Callable[..., Any], state_dict: Any, load_optimizer_states: bool = True) -> Any:
        if state.keep_master and not load_optimizer_states:  # masters in RAM, moments left as they are
            return rigid(state_dict, load_optimizer_states)
        # DeepSpeed's own loops copy every saved master into its fp32 partition, then every fp32
        # partition into its 16-bit one: for a mapped checkpoint that touches all the saved masters
        # (4 bytes a parameter) before the first sub-group is written back.  It is shown the
        # swapped sub-groups' masters and saved masters empty, so both loops pass them by, and each
        # is restored here, one sub-group at a time, its checkpoint pages dropped once written.
        saved = state_dict["fp32_flat_groups"]
        hidden = not state.keep_master
        if hidden:
            state_dict["fp32_flat_groups"] = [
                swapper.EMPTY if i in state.groups else t for i, t in enumerate(saved)
            ]
        try:
            out = rigid(state_dict, load_optimizer_states)
            files = file_mappings()
            for i in state.order:
                _write_back(i, saved[i] if hidden else None, load_optimizer_states, files)
            swapper.flush(state)
            _own_the_rest(opt)
            return out
        except BaseException:
            _empty_all(state)
            raise
        finally:
            state_dict["fp32_flat_groups"] = saved

    def _write_back(
        i: int, saved: torch.Tensor | None, with_moments: bool, files: list[tuple[int, int]]
    ) -> None:
        """Sub-group ``i`` through a swap buffer to its file: its master from ``saved`` (unless
        kept in RAM), its moments the loaded ones (``with_moments``) or its own; its 16-bit
        partition from the master; then the checkpoint's pages that held it dropped."""
        g = state.groups[i]
        held: list[torch.Tensor] = []
        if with_moments:
            # the moments loaded (g.keys is not known yet on an engine that never stepped)
            # (``.data``: aliases of the mapped storage, which swap_out empties the tensors of)
            loaded = opt.optimizer.state.get(g.master, {})
            held += [v.data for v in loaded.values() if isinstance(v, torch.Tensor) and v.numel() == g.numel]
        else:
            swapper.swap_in(state, i)  # the moments stay as they are (reads the next one ahead)
        if saved is not None:
            held.append(saved.data)
            if with_moments:  # the saved tensor itself becomes the master until it is written
                statestore.set_master(g.master, saved.data)
            else:
                g.master.data.copy_(saved.data)
            statestore.bit16_from_master(opt, i)
        swapper.swap_out(state, i)  # copied into the buffer: the mapped pages are done
        for t in held:
            if _inside(t, files):
                state.pages_dropped += drop_pages(t)

    def take_universal(i: int, fp32: torch.Tensor) -> bool:
        """A universal load's sub-group ``i`` (built one sub-group at a time by
        :mod:`zerohooks.adapter.unistate`, its moments already where a regular load puts them): a
        swapped one is written to its swap file as a regular load writes it; the others are left
        to DeepSpeed's tensors."""
        if i not in state.groups:
            return False
        if state.keep_master:  # the master stays in RAM; only the moments go to the file
            state.groups[i].master.data.copy_(fp32)
            statestore.bit16_from_master(opt, i)
        _write_back(i, None if state.keep_master else fp32, True, [])
        return True

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        _settle(state, "loaded")
        with (
            statestore.rigid_load_replaced(opt, make_rigid_load),
            unistate.universal_load_replaced(opt, engine, take_universal),
        ):
            try:
                return original(*args, **kwargs)
            finally:
                swapper.flush(state)

    return load
