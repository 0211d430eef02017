"""Training run for test_two_nodes.py: started by torchrun on each emulated node (or on one
machine for the reference), trains a small MLP a few steps with ZeRO 0, fp32 compute, three ways
in turn, and writes what it saw to ``--out`` (rank 0):

* ``ds``: DeepSpeed alone, gradients all-reduced in bf16 (``communication_data_type``);
* ``loco2``: loco, ``hierarchy: detect`` (two-level when torchrun says there is more than one
  node; ``--node-size`` forces the layout where there is one machine);
* ``loco1``: loco, ``hierarchy: flat``.

For each: every rank's losses, loco's per-step stats (``plugin.stats``) and topology, and (rank 0,
between barriers around the training steps) the counters of this node's link interface
(``/sys/class/net/$GLOO_SOCKET_IFNAME/statistics``, read inside the namespace).  A calibration
phase first measures what known transfers cost on the link: a cross-node all-to-all (direct
sends), a world all-gather and all-reduce (gloo's rings), so the test can turn loco's counters
into bytes on the link and measure the TCP/IP + gloo framing overhead.

``--die-at S``: at step S of ``loco2`` every rank writes ``<marker-dir>/rank<r>``; then the ranks
of node 1 sleep (the test kills them) while node 0's go into the step's collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WIDTH, DEPTH, FEATURES, CLASSES, BATCH = 256, 3, 64, 16, 4


def _link() -> tuple[int, int]:
    """(bytes, frames) through this node's link interface so far, both directions (tx + rx);
    (0, 0) on one machine."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return 0, 0
    base = Path("/sys/class/net") / ifname / "statistics"

    def read(name: str) -> int:
        return int((base / name).read_text())

    return read("tx_bytes") + read("rx_bytes"), read("tx_packets") + read("rx_packets")


def _measured(fn: Any, frames: list[int] | None = None) -> int:
    """Bytes that crossed between the nodes while ``fn()`` ran on every rank (rank 0's reading of
    its node's interface, tx + rx: with 2 nodes every crossing byte passes it once); the number
    of Ethernet frames is appended to ``frames``.

    Ranks leave a barrier at different times, so each reading sits between two barriers: no rank
    starts ``fn`` before rank 0 has read, and none starts what follows before it reads again.
    The window holds ``fn`` and two barriers (``calibration.empty`` measures those)."""
    dist.barrier()
    b0, f0 = _link()
    dist.barrier()
    fn()
    dist.barrier()
    b1, f1 = _link()
    dist.barrier()
    if frames is not None:
        frames.append(f1 - f0)
    return b1 - b0


def _make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(FEATURES, WIDTH), nn.GELU()]
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _config(loco: dict[str, Any] | None) -> dict[str, Any]:
    from zerohooks.testing.toy import ds_config

    cfg = ds_config(0, gas=1, lr=1e-3, train_micro_batch_size_per_gpu=BATCH, communication_data_type="bf16")
    if loco is not None:
        cfg["loco"] = loco
    return cfg


def _calibrate(nbytes: int) -> dict[str, Any]:
    """Known transfers of ``nbytes`` per rank and destination, each measured on the link: the
    bytes all ranks together send to other nodes by the transfer's algorithm (``crossing``), and
    the bytes and frames that crossed (``link``, ``frames``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // local
    out: dict[str, Any] = {}

    def measure(name: str, crossing: float, fn: Any) -> None:
        frames: list[int] = []
        out[name] = {"crossing": round(crossing), "link": _measured(fn, frames), "frames": frames[0]}

    # one row to the rank of the same local index on every other node (loco's inter-node hop)
    groups = [dist.new_group(list(range(i, world, local))) for i in range(local)]  # every rank, in order
    send = torch.ones(nodes * nbytes, dtype=torch.uint8)
    recv = torch.empty_like(send)
    mine = groups[rank % local]
    measure(
        "inter_all_to_all",
        world * (nodes - 1) * nbytes,
        lambda: dist.all_to_all_single(recv, send, group=mine),
    )
    # every rank sends a row straight to every other rank, (nodes - 1) * local of them remote
    send_w = torch.ones(world * nbytes, dtype=torch.uint8)
    recv_w = torch.empty_like(send_w)
    measure(
        "all_to_all", world * (nodes - 1) * local * nbytes, lambda: dist.all_to_all_single(recv_w, send_w)
    )
    # gloo's ring over ranks 0..W-1: `nodes` of its W edges cross, each carrying (W-1) chunks
    chunk = torch.ones(nbytes, dtype=torch.uint8)
    gathered = torch.empty(world * nbytes, dtype=torch.uint8)
    measure("all_gather", nodes * (world - 1) * nbytes, lambda: dist.all_gather_into_tensor(gathered, chunk))
    flat = torch.ones(nbytes // 2, dtype=torch.bfloat16)  # ring: 2 (W-1)/W of it on each edge
    measure("all_reduce", nodes * 2 * (world - 1) / world * nbytes, lambda: dist.all_reduce(flat))
    measure("empty", 0, lambda: None)
    return out


def _train(
    name: str, loco: dict[str, Any] | None, steps: int, die_at: int | None = None, marker_dir: str = ""
) -> dict[str, Any]:
    """Train ``steps`` measured steps (after one warm-up step); with ``die_at``, stop node 1 at that
    step (see the module docstring) and let node 0's ranks fail in it."""
    import zerohooks

    rank = dist.get_rank()
    model = _make_model()
    engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=_config(loco))
    att = zerohooks.attachment(engine)
    plugin = next((p for p in att.plugins if p.name == "loco"), None) if att is not None else None
    losses: list[float] = []
    times: list[float] = []
    link: list[int] = []
    frames: list[int] = []

    def one(step: int) -> None:
        x, y = _batch(step, rank)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))

    one(0)  # warm-up step (first-call allocations), not measured
    for step in range(1, steps + 1):
        if step == die_at:
            _die(step, marker_dir, lambda step=step: one(step))
        link.append(_measured(lambda step=step: one(step), frames))
    topo = getattr(plugin, "_two_level", None) if plugin is not None else None
    result: dict[str, Any] = {
        "losses": losses,
        "link_bytes": link,
        "link_frames": frames,
        "step_s": times,
        "params": sum(p.numel() for p in model.parameters()),
        "stats": list(plugin.stats.history)[1:] if plugin is not None else None,
        "topology": None if topo is None else {"nodes": topo.nodes, "node_size": topo.node_size},
        "kernels": bool(plugin.kernels) if plugin is not None else None,
        "counters": list(att.counters.wire_history)[1:] if att is not None else None,
    }
    zerohooks.detach(engine)
    return result


def _die(step: int, marker_dir: str, one: Any) -> None:
    """Every rank marks that it reached ``step``; node 1's ranks then wait to be killed, node 0's
    run the step, whose collectives must fail within the watchdog's limit (reported on stderr)."""
    rank = dist.get_rank()
    Path(marker_dir, f"rank{rank}").write_text(str(os.getpid()))
    if int(os.environ.get("GROUP_RANK", "0")) == 1:
        time.sleep(600)  # the test kills this node
        return
    t0 = time.monotonic()
    try:
        one()
    except Exception as e:
        print(
            f"rank {rank}: step {step} failed after {time.monotonic() - t0:.1f} s with "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        raise
    raise AssertionError(f"rank {rank}: step {step} completed although node 1 is gone")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run")
    p.add_argument("--node-size", type=int, default=None, help="loco node_size for loco2 (one machine)")
    p.add_argument("--runs", default="ds,loco2,loco1")
    p.add_argument("--calibrate", type=int, default=0, help="bytes per rank of the calibration transfers")
    p.add_argument("--die-at", type=int, default=None, help="then a loco2 run in which node 1 stops here")
    p.add_argument("--marker-dir", default=".")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed

    import zerohooks

    zerohooks.skip_deepspeed_compiles()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    # where each rank really is: torchrun's view and the kernel's network namespace
    where = {
        "rank": rank,
        "group_rank": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "0")),
        "netns": os.readlink("/proc/self/ns/net"),
    }
    everywhere: list[Any] = [None] * world
    dist.all_gather_object(everywhere, where)
    out: dict[str, Any] = {"world": world, "ranks": everywhere}
    if args.calibrate:
        out["calibration"] = _calibrate(args.calibrate)
    base = {"kernels": os.environ.get("TWO_NODES_KERNELS", "reference")}
    two = {**base, "hierarchy": "detect"}
    if args.node_size:
        two["node_size"] = args.node_size
    configs = {"ds": None, "loco2": two, "loco1": {**base, "hierarchy": "flat"}}
    for name in [r for r in args.runs.split(",") if r]:
        mine = _train(name, configs[name], args.steps)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        out[name] = {
            "config": configs[name],
            **{k: [r[k] for r in every] for k in ("losses", "stats", "counters", "topology")},
            **{k: every[0][k] for k in ("link_bytes", "link_frames", "step_s", "params", "kernels")},
        }
    if rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if args.die_at is not None:
        _train("die", two, args.die_at, die_at=args.die_at, marker_dir=args.marker_dir)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
