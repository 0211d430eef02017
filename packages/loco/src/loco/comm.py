"""Quantized reduce-scatter and all-reduce through all-to-all, flat or two-level.

W ranks, N nodes of L ranks (flat: N = 1, L = W); rank r = n * L + l owns chunk r of every
tensor: elements ``[r*c, (r+1)*c)``, ``c = ceil(numel / W)`` (ZeRO 3's partitioning), or a
whole number of quantization groups per chunk for the flat all-reduce buckets of ZeRO 0/1/2.
Each chunk is padded to whole groups of G elements; each group travels as G codes of ``bits``
bits and one fp32 scale.

reduce-scatter (ZeRO 3), per bucket of tensors:

1. every rank quantizes each tensor with its error buffer (``quantize_ef``, level 0), straight
   into the send buffer, row ``l'`` holding the chunks ``n'*L + l'`` for every node ``n'``;
2. all-to-all within the node (flat: over all ranks);
3. two-level only: each rank sums the L rows it received for its N chunks, adds its level-1 error
   and requantizes (``dequant_reduce_requant``) into a second send buffer, then all-to-all
   across nodes among the ranks of the same local index;
4. each rank sums the rows it received and divides by W (``dequant_reduce``): its chunk.

all-reduce (ZeRO 0/1/2): steps 1-3, then the owner of each chunk sums, adds its level-2 error,
requantizes the reduced chunk, and an all-gather gives every rank every chunk, which each rank
decodes into the bucket in place: all ranks end with the same values.

reduce to owners (ZeRO 1/2, :func:`quantized_reduce_to_owners`): DeepSpeed all-reduces buckets
of gradient slices but each rank keeps only the slices of its partition, so the slices are
arranged one row per owning rank and reduce-scattered (steps 1-4): each owner gets its slices
and nothing is all-gathered.

all-gather (:func:`all_gather`: the all-reduce's last hop, and DeepSpeed's parameter all-gathers
when loco owns them), two-level: first among the ranks of the same local index, one per node, so
each chunk crosses to every other node once, then within the node.  Per node, (N-1)/N of the
gathered bytes come in over the link, against (W-1)/W for a ring over all ranks (2/3 of it on
2 nodes x 2).  Lossless: the result is the flat all-gather's, bit for bit.

Bytes a rank sends per element of a bucket (4 bits, G = 128, fp32 scales: 0.53 bytes per element
per hop): reduce-scatter ``(W-1)/W * 0.53`` flat, ``(L-1)/L * 0.53 + (N-1)/(N*L) * 0.53``
two-level; all-reduce adds ``(W-1)/W * 0.53`` for the all-gather.  A bf16 ring all-reduce sends
``2 (W-1)/W * 2`` bytes per element: 4-bit LoCo sends 0.266 of that (0.25 + 2/G).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from loco import ops, p2p
from loco.reference import padded_row_len
from loco.state import LocoState, error_buffer, workspace
from zerohooks import watchdog

__all__ = [
    "Topology",
    "all_gather",
    "begin_all_gather",
    "exact_all_reduce",
    "exact_reduce_scatter",
    "flat_topology",
    "make_two_level",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "quantized_reduce_to_owners",
    "two_level_topology",
]


@dataclasses.dataclass(frozen=True)
class Topology:
    """How the ranks of ``group`` are arranged: ``nodes`` x ``node_size``, node-major."""

    group: Any
    world: int
    rank: int
    nodes: int
    node_size: int
    intra: Any
    """Process group of this rank's node (the whole group when flat)."""
    inter: Any
    """Process group of the ranks with this rank's local index, one per node (None when flat)."""
    point_to_point: bool = True
    """On gloo, issue all-to-alls and the cross-node all-gather hop as sends and receives
    (:mod:`loco.p2p`); False keeps gloo's collectives (the config's ``gloo_exchange``)."""

    @property
    def two_level(self) -> bool:
        return self.nodes > 1


def flat_topology(group: Any, point_to_point: bool = True) -> Topology:
    world = dist.get_world_size(group=group)
    return Topology(group, world, dist.get_rank(group=group), 1, world, group, None, point_to_point)


def two_level_topology(node_size: int, point_to_point: bool = True) -> Topology:
    """Topology of the default group with nodes of ``node_size`` ranks.  Collective: every rank
    creates every node group and every cross-node group, in the same order."""
    world = dist.get_world_size()
    if node_size < 1 or world % node_size:
        raise ValueError(f"loco: node_size {node_size} does not divide the world size {world}")
    if world // node_size == 1:
        return flat_topology(dist.group.WORLD, point_to_point)
    on_node = [list(range(n, n + node_size)) for n in range(0, world, node_size)]
    topo = make_two_level(on_node, dist.group.WORLD, point_to_point)
    assert topo is not None  # every rank is in the world
    return topo


def make_two_level(
    on_node: Sequence[Sequence[int]], group: Any, point_to_point: bool = True
) -> Topology | None:
    """The two-level topology of ``group``, whose global ranks are ``on_node`` (node by node, the
    same number on each, ascending): ``group``'s rank ``n * L + l`` is the ``l``-th of its ranks
    on its ``n``-th node.  Collective over the default group: every rank creates the node groups
    (node by node) and then the cross-node groups (one per place on a node), in that order, and
    gets the topology when it is in ``group`` (None otherwise)."""
    me = dist.get_rank()
    intra = inter = None
    for members in on_node:
        g = dist.new_group(list(members))
        if me in members:
            intra = g
    for local in range(len(on_node[0])):
        members = [node[local] for node in on_node]
        g = dist.new_group(members)
        if me in members:
            inter = g
    ranks = [r for node in on_node for r in node]
    if me not in ranks:
        return None
    return Topology(
        group, len(ranks), ranks.index(me), len(on_node), len(on_node[0]), intra, inter, point_to_point
    )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One tensor in a bucket: chunk sizes and where its codes/scales sit in the rows."""

    numel: int
    chunk: int  # elements per chunk (c)
    cpad: int  # c padded to whole groups
    q_off: int  # byte offset of its codes in a row of the first send buffer
    s_off: int  # float offset of its scales in the scale part of that row
    q2_off: int  # same in the second (inter-node) send buffer
    s2_off: int


def _plan(
    numels: Sequence[int], chunks: Sequence[int], nodes: int, bits: int, G: int
) -> tuple[list[_Plan], int, int]:
    """Layout of a bucket; returns the plans, the bytes of codes per row of the first send buffer
    (N chunks per tensor) and of the second (1 chunk per tensor)."""
    plans = []
    q = s = q2 = s2 = 0
    for n, c in zip(numels, chunks, strict=True):
        cpad = padded_row_len(c, G)
        plans.append(_Plan(n, c, cpad, q, s, q2, s2))
        q += nodes * cpad * bits // 8
        s += nodes * cpad // G
        q2 += cpad * bits // 8
        s2 += cpad // G
    return plans, q, q2


def _rows(buf: torch.Tensor, rows: int, q_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A byte buffer of ``rows`` rows split into its code part [rows, q_bytes] (uint8) and its
    scale part [rows, groups] (float32 view)."""
    grid = buf.view(rows, -1)
    return grid[:, :q_bytes], grid[:, q_bytes:].view(torch.float32)


def _codes(state: LocoState) -> str:
    """The wire format name of the codes (two 4-bit codes per byte, or one 8-bit code)."""
    return f"int{state.bits} codes"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _a2a(
    state: LocoState,
    topo: Topology,
    name: str,
    out: torch.Tensor,
    inp: torch.Tensor,
    group: Any,
    size: int,
    q_bytes: int,
) -> None:
    """All-to-all of ``size`` rows of ``q_bytes`` code bytes then fp32 scales, counted."""
    watchdog.run(f"loco {name}", group, lambda: _all_to_all(topo, out, inp, group))
    row = inp.numel() // size
    parts = {_codes(state): (size - 1) * q_bytes, "float32 scales": (size - 1) * (row - q_bytes)}
    state.stats.collective(name, inp.numel(), (size - 1) * row, parts)


def _send_receive(
    state: LocoState,
    topo: Topology,
    tensors: Sequence[torch.Tensor],
    keys: Sequence[str],
    chunks: Sequence[int],
) -> tuple[list[_Plan], torch.Tensor, torch.Tensor]:
    """Steps 1-3: returns the plans and the (codes, scales) rows each rank received last
    (sources x row), whose columns for tensor i are at ``q2_off``/``s2_off`` when two-level and at
    ``q_off``/``s_off`` (N = 1 chunk) when flat."""
    G, bits, beta = state.group_size, state.bits, state.beta
    N, L = topo.nodes, topo.node_size
    device = tensors[0].device
    plans, q_bytes, q2_bytes = _plan([t.numel() for t in tensors], chunks, N, bits, G)
    row = q_bytes + 4 * sum(N * p.cpad // G for p in plans)
    send = workspace(state, "send1", L * row, device)
    send_q, send_s = _rows(send, L, q_bytes)
    for t, key, p in zip(tensors, keys, plans, strict=True):
        e = error_buffer(state, f"{key}.0", topo.world * p.cpad, device)
        qb, ng = p.cpad * bits // 8, p.cpad // G
        # chunk r = n' * L + l' goes to row l', block n' of this tensor's columns
        q3 = send_q[:, p.q_off : p.q_off + N * qb].view(L, N, qb).transpose(0, 1)
        s3 = send_s[:, p.s_off : p.s_off + N * ng].view(L, N, ng).transpose(0, 1)
        ops.quantize_ef(
            t.reshape(-1),
            e.data if e else _EMPTY_I8.to(device),
            e.scale if e else _EMPTY_F32.to(device),
            beta,
            bits,
            G,
            p.chunk,
            q3,
            s3,
            use_kernels=state.use_kernels,
        )
    recv = workspace(state, "recv1", L * row, device)
    _a2a(state, topo, "all_to_all", recv, send, topo.intra, L, q_bytes)
    recv_q, recv_s = _rows(recv, L, q_bytes)
    if not topo.two_level:
        return plans, recv_q, recv_s
    row2 = q2_bytes + 4 * sum(p.cpad // G for p in plans)
    send2 = workspace(state, "send2", N * row2, device)
    send2_q, send2_s = _rows(send2, N, q2_bytes)
    for key, p in zip(keys, plans, strict=True):
        qb, ng = p.cpad * bits // 8, p.cpad // G
        e = error_buffer(state, f"{key}.1", N * p.cpad, device)
        ops.dequant_reduce_requant(
            recv_q[:, p.q_off : p.q_off + N * qb],
            recv_s[:, p.s_off : p.s_off + N * ng],
            e.data if e else _EMPTY_I8.to(device),
            e.scale if e else _EMPTY_F32.to(device),
            beta,
            bits,
            G,
            send2_q[:, p.q2_off : p.q2_off + qb],
            send2_s[:, p.s2_off : p.s2_off + ng],
            use_kernels=state.use_kernels,
        )
    recv2 = workspace(state, "recv2", N * row2, device)
    _a2a(state, topo, "all_to_all_inter", recv2, send2, topo.inter, N, q2_bytes)
    q2, s2 = _rows(recv2, N, q2_bytes)
    return plans, q2, s2


# torch 2.13 renamed all_gather_into_tensor (the old name warns); older torch has only that one
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_to_all(topo: Topology, out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Issue an equal-split all-to-all: point to point on gloo (see :mod:`loco.p2p`)."""
    if topo.point_to_point and p2p.preferred(group, inp):
        return p2p.all_to_all_single(out, inp, group)
    return dist.all_to_all_single(out, inp, group=group, async_op=True)


def _gather_across(topo: Topology, out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Issue the all-gather among one rank per node: point to point on gloo."""
    if topo.point_to_point and p2p.preferred(group, inp):
        return p2p.all_gather(out, inp, group)
    return _all_gather(out, inp, group=group, async_op=True)


_EMPTY_I8 = torch.empty(0, dtype=torch.int8)
_EMPTY_F32 = torch.empty(0, dtype=torch.float32)


def _columns(
    q: torch.Tensor, s: torch.Tensor, p: _Plan, bits: int, G: int, two_level: bool
) -> tuple[Any, Any]:
    q_off, s_off = (p.q2_off, p.s2_off) if two_level else (p.q_off, p.s_off)
    return q[:, q_off : q_off + p.cpad * bits // 8], s[:, s_off : s_off + p.cpad // G]


def _scatter_parts(
    state: LocoState, topo: Topology, tensors: Sequence[torch.Tensor], keys: Sequence[str], divisor: float
) -> list[torch.Tensor]:
    W, r = topo.world, topo.rank
    chunks = [math.ceil(t.numel() / W) for t in tensors]
    plans, q, s = _send_receive(state, topo, tensors, keys, chunks)
    out = []
    for t, p in zip(tensors, plans, strict=True):
        part = torch.empty(max(0, min(p.chunk, p.numel - r * p.chunk)), dtype=t.dtype, device=t.device)
        qc, sc = _columns(q, s, p, state.bits, state.group_size, topo.two_level)
        ops.dequant_reduce(qc, sc, state.bits, state.group_size, divisor, part, use_kernels=state.use_kernels)
        out.append(part)
    return out


def quantized_reduce_scatter(
    state: LocoState, topo: Topology, tensors: Sequence[torch.Tensor], keys: Sequence[str], divisor: float
) -> list[torch.Tensor]:
    """This rank's chunk (ZeRO 3 partitioning) of each tensor's sum over ranks, / ``divisor``."""
    out = _scatter_parts(state, topo, tensors, keys, divisor)
    for t in tensors:
        state.stats.reduced(t.numel(), "reduce_scatter", topo.world)
    return out


OWNER_PADDING = 1.25
""":func:`quantized_reduce_to_owners` runs when the owners' rows, padded to the largest, hold at
most this many times the bucket's elements (ZeRO 1/2's partitions split a bucket evenly when it
holds the whole model, but a bucket smaller than the model may belong mostly to one rank)."""


def quantized_reduce_to_owners(
    state: LocoState,
    topo: Topology,
    flat: torch.Tensor,
    owners: Sequence[tuple[int, int]],
    key: str,
    divisor: float,
) -> bool:
    """Reduce each segment of ``flat`` (``owners``: ``(numel, rank)`` per consecutive segment)
    to the rank that uses it, in place on that rank, / ``divisor``; the other segments keep this
    rank's values.  The segments are gathered into one row per owner, padded to the longest, and
    reduce-scattered (steps 1-4): no all-gather.  Returns False, doing nothing, when the padding
    would exceed :data:`OWNER_PADDING`."""
    W, r = topo.world, topo.rank
    counts = [0] * W
    for n, rank in owners:
        counts[rank] += n
    c = max(counts)
    if c == 0 or W * c > OWNER_PADDING * flat.numel():
        return False
    rows = torch.zeros(W, c, dtype=flat.dtype, device=flat.device)
    filled = [0] * W
    off = 0
    for n, rank in owners:
        rows[rank, filled[rank] : filled[rank] + n] = flat[off : off + n]
        filled[rank] += n
        off += n
    (mine,) = _scatter_parts(state, topo, [rows.view(-1)], [key], divisor)
    off = pos = 0
    for n, rank in owners:
        if rank == r:
            flat[off : off + n] = mine[pos : pos + n]
            pos += n
        off += n
    state.stats.reduced(flat.numel(), "all_reduce", W)  # the baseline: DeepSpeed all-reduces it
    return True


def quantized_all_reduce(
    state: LocoState, topo: Topology, flat: torch.Tensor, key: str, divisor: float
) -> None:
    """Sum of ``flat`` over ranks / ``divisor``, in place, the same on every rank."""
    G, bits, W = state.group_size, state.bits, topo.world
    n, device = flat.numel(), flat.device
    chunk = math.ceil(n / (W * G)) * G  # whole groups, so the decoded chunks are the bucket itself
    plans, q, s = _send_receive(state, topo, [flat], [key], [chunk])
    (p,) = plans
    qb, ng = p.cpad * bits // 8, p.cpad // G
    # the owner of each chunk sums it, adds its error and requantizes it for the all-gather
    mine = workspace(state, "gather_in", qb + 4 * ng, device)
    mine_q, mine_s = _rows(mine, 1, qb)
    e = error_buffer(state, f"{key}.2", p.cpad, device)
    qc, sc = _columns(q, s, p, bits, G, topo.two_level)
    ops.dequant_reduce_requant(
        qc,
        sc,
        e.data if e else _EMPTY_I8.to(device),
        e.scale if e else _EMPTY_F32.to(device),
        state.beta,
        bits,
        G,
        mine_q,
        mine_s,
        use_kernels=state.use_kernels,
    )
    gathered = workspace(state, "gather_out", W * mine.numel(), device)
    for name, peers in all_gather(topo, gathered, mine, "loco all_gather").items():
        handed = mine.numel() * (topo.nodes if name == "all_gather_intra" else 1)
        parts = {_codes(state): peers * qb, "float32 scales": peers * 4 * ng}
        state.stats.collective(name, handed, peers * mine.numel(), parts, op="all_gather")
    all_q, all_s = _rows(gathered, W, qb)
    # rank r's row is chunk r: as one row of W * chunk elements it decodes to the whole bucket
    codes = workspace(state, "codes", W * qb, device).view(1, W * qb)
    codes.view(W, qb).copy_(all_q)
    scales = workspace(state, "scales", 4 * W * ng, device).view(torch.float32).view(1, W * ng)
    scales.view(W, ng).copy_(all_s)
    out = flat if flat.is_contiguous() else torch.empty_like(flat, memory_format=torch.contiguous_format)
    ops.dequant_reduce(codes, scales, bits, G, divisor, out.view(-1), use_kernels=state.use_kernels)
    if out is not flat:
        flat.copy_(out)
    state.stats.reduced(n, "all_reduce", W)


def _used_on_this_stream(*tensors: torch.Tensor) -> None:
    """Tell CUDA's caching allocator that ``tensors`` (made when the all-gather was issued) were
    last used on the stream current now.  DeepSpeed's ZeRO 3 issues parameter all-gathers on its
    all-gather stream and waits for them on the compute stream; a buffer allocated on the first
    and freed after work queued on the second could otherwise be handed to the first stream's
    next allocation while that work still reads it.  DeepSpeed's own all-gather handles record
    the parameters on the waiting stream the same way.  Nothing to do off CUDA."""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def begin_all_gather(
    topo: Topology, out: torch.Tensor, inp: torch.Tensor, what: str
) -> tuple[dict[str, int], Callable[[], None]]:
    """Issue the all-gather ``out`` (``W * inp.numel()`` elements) <- every rank's ``inp``, in
    rank order: flat, one all-gather over the group; two-level, across nodes then within the node
    (see the module docstring).  Returns, per hop (``all_gather``, or ``all_gather_inter`` and
    ``all_gather_intra``), how many copies of ``inp``'s bytes this rank sends, and ``finish``,
    which completes ``out``: the first hop runs in the background until it is called."""
    W, N, L = topo.world, topo.nodes, topo.node_size
    if out.numel() != W * inp.numel():
        raise ValueError(f"loco all_gather: output has {out.numel()} elements, expected {W} x {inp.numel()}")
    src = inp.reshape(-1).contiguous()
    m = src.numel()
    if not topo.two_level:
        dst = out if out.is_contiguous() else torch.empty(W * m, dtype=out.dtype, device=out.device)
        flat = watchdog.begin(
            what, topo.group, lambda: _all_gather(dst.view(-1), src, group=topo.group, async_op=True)
        )

        def finish_flat() -> None:
            flat.wait()
            if dst is not out:
                out.copy_(dst.view(out.shape))
            _used_on_this_stream(src, dst)

        return {"all_gather": W - 1}, finish_flat
    across = torch.empty(N * m, dtype=src.dtype, device=src.device)
    first = watchdog.begin(
        f"{what} across nodes", topo.inter, lambda: _gather_across(topo, across, src, topo.inter)
    )

    def finish() -> None:
        first.wait()
        # row l' of `within` holds, for every node n', the chunk of rank n' * L + l'
        within = torch.empty(L * N * m, dtype=src.dtype, device=src.device)
        watchdog.run(
            f"{what} within the node",
            topo.intra,
            lambda: _all_gather(within, across, group=topo.intra, async_op=True),
        )
        ordered = within.view(L, N, m).transpose(0, 1)
        if out.is_contiguous():
            out.view(N, L, m).copy_(ordered)
        else:
            out.copy_(ordered.reshape(out.shape))
        _used_on_this_stream(src, across)

    return {"all_gather_inter": N - 1, "all_gather_intra": (L - 1) * N}, finish


def all_gather(topo: Topology, out: torch.Tensor, inp: torch.Tensor, what: str) -> dict[str, int]:
    """:func:`begin_all_gather`, completed before returning; returns the copies sent per hop."""
    hops, finish = begin_all_gather(topo, out, inp, what)
    finish()
    return hops


def exact_reduce_scatter(
    state: LocoState, topo: Topology, tensors: Sequence[torch.Tensor], divisor: float
) -> list[torch.Tensor]:
    """Unquantized reduce-scatter (small tensors): all-to-all in the tensors' dtype, fp32 sums."""
    W, r = topo.world, topo.rank
    dtype, device = tensors[0].dtype, tensors[0].device
    chunks = [math.ceil(t.numel() / W) for t in tensors]
    width = sum(chunks)
    send = torch.zeros(W, width, dtype=dtype, device=device)
    off = 0
    for t, c in zip(tensors, chunks, strict=True):
        flat = t.reshape(-1)
        padded = torch.nn.functional.pad(flat, (0, W * c - flat.numel()))
        send[:, off : off + c] = padded.view(W, c)
        off += c
    recv = torch.empty_like(send)
    watchdog.run(
        "loco exact all_to_all",
        topo.group,
        lambda: _all_to_all(topo, recv, send, topo.group),
    )
    wire = (W - 1) * width * send.element_size()
    parts = {_dtype_name(dtype): wire}
    state.stats.collective("exact", send.numel() * send.element_size(), wire, parts, op="all_to_all")
    total = recv.float().sum(dim=0)
    if divisor != 1:
        total = total / divisor
    out, off = [], 0
    for t, c in zip(tensors, chunks, strict=True):
        length = max(0, min(c, t.numel() - r * c))
        out.append(total[off : off + length].to(dtype))
        off += c
        state.stats.reduced(t.numel(), "reduce_scatter", W)
    return out


def exact_all_reduce(state: LocoState, topo: Topology, flat: torch.Tensor, divisor: float) -> None:
    """Unquantized all-reduce (small buckets) in the bucket's dtype, as DeepSpeed does it."""
    W = topo.world
    watchdog.run(
        "loco exact all_reduce", topo.group, lambda: dist.all_reduce(flat, group=topo.group, async_op=True)
    )
    if divisor != 1:
        flat.div_(divisor)
    nbytes = flat.numel() * flat.element_size()
    wire = 2 * (W - 1) / W * nbytes
    state.stats.collective("exact", nbytes, wire, {_dtype_name(flat.dtype): wire}, op="all_reduce")
    state.stats.reduced(flat.numel(), "all_reduce", W)
