"""Two-level topologies for process groups smaller than the world (MoE expert-data-parallel groups).

DeepSpeed reduces the gradients of MoE experts over the expert-data-parallel group: the ranks
holding the same expert, e.g. ranks 0, 2, 4, 6 of 8 with ``ep_size`` 2.  When the world is laid
out in nodes of ``node_size`` consecutive ranks, such a group may span several nodes with several
of its ranks on each (0, 2 on node 0 and 4, 6 on node 1 with nodes of 4): loco then reduces it as
it reduces the world, within each node first and across nodes second, so the slow link carries
1/L of the bytes instead of all of them.

:func:`node_layout` says how a group sits on the nodes; :func:`two_level_subgroups` creates the
node groups and cross-node groups of every such group.  Creating a process group is collective
over the default group (every rank creates every group, in the same order), so every rank must
call it with the same groups: the union of every rank's groups, gathered first
(:func:`gather_group_ranks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from loco.comm import Topology, make_two_level

__all__ = [
    "by_node",
    "flat_costs_link",
    "gather_group_ranks",
    "node_layout",
    "two_level_possible",
    "two_level_subgroups",
]


def by_node(ranks: Sequence[int], node_size: int) -> list[list[int]]:
    """``ranks`` (global) split by the node of ``node_size`` consecutive ranks each is on, node by
    node, each node's ascending."""
    if node_size < 1:
        raise ValueError(f"node_size must be at least 1, not {node_size}")
    nodes: dict[int, list[int]] = {}
    for r in sorted(ranks):
        nodes.setdefault(r // node_size, []).append(r)
    return [nodes[n] for n in sorted(nodes)]


def node_layout(ranks: Sequence[int], node_size: int) -> tuple[int, int] | None:
    """``(nodes, ranks per node)`` of a group of global ``ranks`` on nodes of ``node_size``
    consecutive ranks, when every node it touches holds the same number of its ranks; None when
    the nodes hold different numbers (such a group can only be reduced flat)."""
    nodes = by_node(ranks, node_size)
    counts = {len(node) for node in nodes}
    if len(counts) != 1:
        return None
    return len(nodes), counts.pop()


def two_level_possible(ranks: Sequence[int], node_size: int) -> bool:
    """Whether a group spans at least 2 nodes with the same number (at least 2) of its ranks on
    each: the case where reducing within the node first saves bytes on the link.  A group on one
    node, or with one rank per node, is one hop whichever way it is reduced."""
    layout = node_layout(ranks, node_size)
    return layout is not None and layout[0] > 1 and layout[1] > 1


def flat_costs_link(ranks: Sequence[int], node_size: int) -> bool:
    """Whether reducing ``ranks`` flat sends more over the link than two-level would: the group
    spans several nodes with several of its ranks on one of them (evenly or not)."""
    return node_layout(ranks, node_size) is None or two_level_possible(ranks, node_size)


def gather_group_ranks(mine: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    """Every rank's groups (global ranks, sorted), gathered over the default group: the same
    sorted list on every rank.  Collective."""
    own = sorted({tuple(sorted(g)) for g in mine})
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own)
    return sorted({tuple(g) for theirs in everyone for g in theirs})


def two_level_subgroups(
    groups: Sequence[Sequence[int]],
    node_size: int,
    own: Mapping[tuple[int, ...], Any],
    point_to_point: bool = True,
) -> dict[tuple[int, ...], Topology]:
    """The two-level :class:`~loco.comm.Topology` of each group of ``own`` (sorted global ranks
    -> this rank's process group of them) that :func:`two_level_possible` allows.

    Collective over the default group: every rank passes the same ``groups`` (see
    :func:`gather_group_ranks`) and creates, for each group that can be two-level, in the order
    given, its node groups (its ranks on each node, node by node) and then its cross-node groups
    (its ranks of the same place on their node, one per node).  A group's rank ``r = n * L + l``
    (its ranks sorted, as a process group numbers them) is the ``l``-th of its ranks on its
    ``n``-th node, as :mod:`loco.comm` expects."""
    me = dist.get_rank()
    out: dict[tuple[int, ...], Topology] = {}
    for ranks in groups:
        ranks = tuple(sorted(ranks))
        if not two_level_possible(ranks, node_size):
            continue
        topo = make_two_level(by_node(ranks, node_size), own.get(ranks), point_to_point)
        if topo is not None:
            if ranks not in own:
                raise ValueError(
                    f"loco: rank {me} is in group {list(ranks)} but holds no process group of it"
                )
            out[ranks] = topo
    return out
