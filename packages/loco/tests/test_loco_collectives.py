"""The quantized collectives on real gloo ranks: within the quantization bound of the exact
average (flat and two-level), telescoping through the whole collective, kernels == reference,
and the bytes on the wire."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from _loco_common import DTYPES, gradient_like, group_bound, kernels
from _loco_common import gathered as _gather

from loco import LocoConfig, comm, groups
from loco.state import LocoState
from zerohooks.testing import distributed

G = 128


@pytest.fixture(scope="module", autouse=True)
def _build() -> None:
    kernels()  # in the parent process, before the ranks start


def _inputs(n: int, dtype: str, seed: int, group: object = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed * 7919 + dist.get_rank())
    mine = gradient_like(n, DTYPES[dtype], gen)
    return mine, _gather(mine, group)


def _check_bounds(topo: comm.Topology, seed: int) -> None:
    """First call (zero errors): |result - exact average| <= the quantization steps of each hop."""
    W, r = topo.world, topo.rank
    levels_rs = 2 if topo.two_level else 1
    for dtype in ("fp32", "bf16", "fp16"):
        for n in (G * W * 8, 100_003, 3000):
            mine, every = _inputs(n, dtype, seed, topo.group)
            exact = torch.stack([t.double() for t in every]).sum(0) / W
            rounding = exact.abs() * (2**-8 if dtype == "bf16" else 2**-11 if dtype == "fp16" else 2**-23)
            # all-reduce: chunks of whole groups; one more requantization before the all-gather
            state = LocoState(LocoConfig())
            flat = mine.clone()
            comm.quantized_all_reduce(state, topo, flat, "b", float(W))
            chunk = math.ceil(n / (W * G)) * G
            bound = (levels_rs + 1) * 1.1 * group_bound(every, G, chunk, 7).double() / W
            err = (flat.double() - exact).abs()
            assert torch.all(err <= bound + rounding + 1e-30), (topo, dtype, n, float((err - bound).max()))
            assert torch.equal(torch.stack(_gather(flat, topo.group)), flat.expand(W, -1)), "ranks disagree"
            # reduce-scatter: ZeRO 3 chunks
            state = LocoState(LocoConfig())
            (part,) = comm.quantized_reduce_scatter(state, topo, [mine], ["p0"], float(W))
            c = math.ceil(n / W)
            lo, hi = min(r * c, n), min((r + 1) * c, n)
            bound = levels_rs * 1.1 * group_bound(every, G, c, 7).double()[lo:hi] / W
            err = (part.double() - exact[lo:hi]).abs()
            assert part.dtype == mine.dtype and part.numel() == hi - lo
            assert torch.all(err <= bound + rounding[lo:hi] + 1e-30), (topo, dtype, n)


def _rows(t: torch.Tensor, owners: list[tuple[int, int]], W: int) -> torch.Tensor:
    """``t``'s segments arranged one row per owner, padded with zeros to the longest row."""
    counts = [sum(n for n, o in owners if o == k) for k in range(W)]
    rows = torch.zeros(W, max(counts), dtype=t.dtype)
    filled, off = [0] * W, 0
    for n, o in owners:
        rows[o, filled[o] : filled[o] + n] = t[off : off + n]
        filled[o] += n
        off += n
    return rows


def _check_owners(topo: comm.Topology, seed: int) -> None:
    """ZeRO 1/2's reduce-to-owners: each rank's own segments within one reduce-scatter's bound of
    the exact average, the other segments untouched, no all-gather; too much padding refused."""
    W, r = topo.world, topo.rank
    gen = torch.Generator().manual_seed(seed)  # the same layout on every rank
    n = 30_011
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: 4 * W - 1].add(1).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    owners = [
        (length, int(o))
        for length, o in zip(lengths, torch.randint(0, W, (len(lengths),), generator=gen), strict=True)
    ]
    counts = [sum(k for k, o in owners if o == rank) for rank in range(W)]
    mine, every = _inputs(n, "fp32", seed, topo.group)
    state = LocoState(LocoConfig())
    flat = mine.clone()
    done = comm.quantized_reduce_to_owners(state, topo, flat, owners, "o", float(W))
    assert done == (W * max(counts) <= comm.OWNER_PADDING * n), (counts, n)
    if not done:
        assert torch.equal(flat, mine) and not state.stats.current
        owners = [(n // W + (k < n % W), k) for k in range(W)]  # balanced: must run
        assert comm.quantized_reduce_to_owners(state, topo, flat, owners, "o2", float(W))
    exact = torch.stack([t.double() for t in every]).sum(0) / W
    levels = 2 if topo.two_level else 1
    c = max(sum(k for k, o in owners if o == rank) for rank in range(W))
    perm = [_rows(t, owners, W).reshape(-1) for t in every]
    bound_rows = (levels * 1.1 * group_bound(perm, G, c, 7).double() / W).view(W, c)[r]
    off = pos = 0
    for length, o in owners:
        got, want = flat[off : off + length].double(), exact[off : off + length]
        if o == r:
            bound = bound_rows[pos : pos + length]
            assert torch.all((got - want).abs() <= bound + want.abs() * 2**-23 + 1e-30), (topo, off)
            pos += length
        else:
            assert torch.equal(flat[off : off + length], mine[off : off + length]), (topo, off)
        off += length
    stats = state.stats.current
    assert "wire:all_gather" not in stats and "wire:all_gather_inter" not in stats
    assert stats["bf16_wire_bytes"] == round(2 * (W - 1) / W * 2 * n)  # against DeepSpeed's all-reduce
    # too much padding (every segment to rank 0): refused, nothing sent, nothing changed
    state, flat = LocoState(LocoConfig()), mine.clone()
    assert not comm.quantized_reduce_to_owners(state, topo, flat, [(n, 0)], "o", float(W))
    assert torch.equal(flat, mine) and not state.stats.current


def _check_telescoping(topo: comm.Topology, seed: int) -> None:
    """beta = 0, fp32 errors: sum of results + every error buffer == sum of all true gradients."""
    W, N, L = topo.world, topo.nodes, topo.node_size
    n, steps = 10_000, 12
    state = LocoState(LocoConfig(err_beta=0.0, error_dtype="fp32"))
    total_out = torch.zeros(n, dtype=torch.float64)
    total_true = torch.zeros(n, dtype=torch.float64)
    scale = 0.0
    for t in range(steps):
        mine, every = _inputs(n, "fp32", seed + t, topo.group)
        flat = mine.clone()
        comm.quantized_all_reduce(state, topo, flat, "b", 1.0)
        total_out += flat.double()
        total_true += torch.stack([x.double() for x in every]).sum(0)
        scale = max(scale, float(torch.stack(every).abs().sum(0).max()))
    c = math.ceil(n / (W * G)) * G
    residue = torch.zeros(W * c, dtype=torch.float64)
    for e0 in _gather(state.buffers["b.0"].data, topo.group):  # senders: full layout
        residue += e0.double()
    for rank, e2 in enumerate(_gather(state.buffers["b.2"].data, topo.group)):  # owners: chunk `rank`
        residue[rank * c : (rank + 1) * c] += e2.double()
    if topo.two_level:  # rank (node, l) holds the node's error of chunks n' * L + l, block n'
        for rank, e1 in enumerate(_gather(state.buffers["b.1"].data, topo.group)):
            for block in range(N):
                k = block * L + rank % L
                residue[k * c : (k + 1) * c] += e1[block * c : (block + 1) * c].double()
    gap = (total_out + residue[:n] - total_true).abs().max().item()
    assert gap <= steps * W * 16 * 2**-24 * scale, (topo, gap, scale)


def _check_kernels_equal_reference(topo: comm.Topology, seed: int) -> None:
    mine, _ = _inputs(50_000, "bf16", seed, topo.group)
    results = []
    for use in (True, False):
        cfg = LocoConfig(kernels="compiled" if use else "reference")
        state = LocoState(cfg)
        flat = mine.clone()
        for _ in range(3):  # with error feedback across calls
            comm.quantized_all_reduce(state, topo, flat, "b", float(topo.world))
        parts = comm.quantized_reduce_scatter(
            state, topo, [mine, mine[:777]], ["p0", "p1"], float(topo.world)
        )
        results.append((flat, *parts, *(b.data for b in state.buffers.values())))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _check_bytes(topo: comm.Topology) -> None:
    W, N, L = topo.world, topo.nodes, topo.node_size
    n = G * W * 64
    state = LocoState(LocoConfig())
    comm.quantized_all_reduce(state, topo, torch.randn(n, dtype=torch.bfloat16), "b", float(W))
    stats = state.stats.current
    per_hop = n * (0.5 + 4 / G)  # codes + one fp32 scale per group
    intra = (L - 1) / L * per_hop
    inter = (N - 1) / N * per_hop / L if N > 1 else 0
    assert stats["wire:all_to_all"] == round(intra)
    if N > 1:  # the all-gather across nodes first (one copy per other node), then within the node
        assert stats["wire:all_gather_inter"] == round((N - 1) / W * per_hop)
        assert stats["wire:all_gather_intra"] == round((L - 1) * N / W * per_hop)
        assert "wire:all_gather" not in stats
    else:
        assert stats["wire:all_gather"] == round((W - 1) / W * per_hop)
    assert stats.get("wire:all_to_all_inter", 0) == round(inter)
    assert stats["bf16_wire_bytes"] == round(2 * (W - 1) / W * 2 * n)
    # 0.266 of bf16 flat or two-level (two-level sends as much in all, but only 1/L of it between nodes)
    assert abs(stats["wire_bytes"] / stats["bf16_wire_bytes"] - (0.25 + 2 / G)) < 1e-6


def _seed() -> int:
    t = torch.tensor([int(os.environ.get("LOCO_TEST_SEED", torch.randint(0, 2**30, (1,)).item()))])
    dist.broadcast(t, 0)
    return int(t)


@pytest.mark.multirank
@distributed(world_size=2)
def test_flat_collectives_on_2_ranks() -> None:
    topo = comm.flat_topology(dist.group.WORLD)
    seed = _seed()
    _check_bounds(topo, seed)
    _check_owners(topo, seed)
    _check_telescoping(topo, seed)
    _check_kernels_equal_reference(topo, seed)
    _check_bytes(topo)
    # error feedback: the mean of repeated results converges to the exact average, plain 4-bit not
    mine, every = _inputs(20_000, "fp32", seed)
    exact = torch.stack(every).double().sum(0) / 2
    means = []
    for ef in (True, False):
        state = LocoState(LocoConfig(err_beta=0.0, error_feedback=ef, error_dtype="fp32"))
        acc = torch.zeros_like(exact)
        for _ in range(32):
            flat = mine.clone()
            comm.quantized_all_reduce(state, topo, flat, "b", 2.0)
            acc += flat.double()
        means.append(float((acc / 32 - exact).abs().mean()))
    assert means[0] < 0.2 * means[1], means  # about 1/32 of the gap of plain 4-bit


@pytest.mark.multirank
@distributed(world_size=4)
def test_two_level_and_flat_collectives_on_4_ranks() -> None:
    seed = _seed()
    two = comm.two_level_topology(2)
    assert (two.nodes, two.node_size, two.two_level) == (2, 2, True)
    for topo in (two, comm.flat_topology(dist.group.WORLD)):
        _check_bounds(topo, seed)
        _check_owners(topo, seed)
        _check_telescoping(topo, seed)
        _check_kernels_equal_reference(topo, seed)
        _check_bytes(topo)


def test_node_layout_of_groups() -> None:
    """How a group sits on nodes of 4: even (two-level when >= 2 nodes with >= 2 ranks each),
    uneven (None), on one node, one rank per node."""
    assert groups.node_layout([0, 2, 4, 6], 4) == (2, 2)
    assert groups.two_level_possible([0, 2, 4, 6], 4)
    assert groups.node_layout([0, 1, 2, 4], 4) is None and not groups.two_level_possible([0, 1, 2, 4], 4)
    assert groups.node_layout([0, 1, 2, 3], 4) == (1, 4) and not groups.two_level_possible([0, 1, 2, 3], 4)
    assert groups.node_layout([0, 4, 8], 4) == (3, 1) and not groups.two_level_possible([0, 4, 8], 4)
    assert groups.node_layout(range(12), 4) == (3, 4) and groups.two_level_possible(range(12), 4)
    with pytest.raises(ValueError, match="node_size"):
        groups.node_layout([0, 1], 0)
    # the groups whose flat reduction sends more over the link than two-level would: warned of
    assert groups.flat_costs_link([0, 1, 2, 4], 4) and groups.flat_costs_link([0, 2, 4, 6], 4)
    assert not groups.flat_costs_link([0, 1, 2, 3], 4) and not groups.flat_costs_link([0, 4], 4)


@pytest.mark.multirank
@distributed(world_size=8, timeout=600)
def test_two_level_on_expert_groups_of_8_ranks() -> None:
    """MoE's expert-data-parallel groups (``ep_size`` 2 on 8 ranks in nodes of 4: ranks 0 2 | 4 6
    and 1 3 | 5 7, as DeepSpeed makes them) reduced two-level within their group, both groups at
    once: the bounds, telescoping, kernels and bytes of the world's two-level collectives hold,
    and the same checks pass flat on the same group.  A group with one rank per node or uneven
    nodes gets no topology."""
    seed = _seed()
    me = dist.get_rank()
    own = {}
    for first in (0, 1):  # every rank creates both groups, as DeepSpeed does
        ranks = tuple(range(first, 8, 2))
        group = dist.new_group(list(ranks))
        if me in ranks:
            own[ranks] = group
    everyone = groups.gather_group_ranks([*own, (me % 4, me % 4 + 4), (0, 1, 2, 4)])
    assert everyone == [(0, 1, 2, 4), (0, 2, 4, 6), (0, 4), (1, 3, 5, 7), (1, 5), (2, 6), (3, 7)]
    topos = groups.two_level_subgroups(everyone, 4, own)
    mine = tuple(range(me % 2, 8, 2))
    assert list(topos) == [mine]  # the uneven group and the one-per-node groups: none
    topo = topos[mine]
    assert (topo.world, topo.rank, topo.nodes, topo.node_size) == (4, mine.index(me), 2, 2)
    node = [r for r in mine if r // 4 == me // 4]
    assert dist.get_process_group_ranks(topo.intra) == node
    assert dist.get_process_group_ranks(topo.inter) == [r for r in mine if r % 4 == me % 4]
    for t in (topo, comm.flat_topology(topo.group)):
        _check_bounds(t, seed)
        _check_owners(t, seed)
        _check_telescoping(t, seed)
        _check_kernels_equal_reference(t, seed)
        _check_bytes(t)
