"""Two nodes on one machine: loco across a real (virtual) network link.

Two emulated nodes (network namespaces joined by a veth pair, zerohooks.testing.nodes) of two
ranks each run tests/integration/_two_nodes_train.py under torchrun: ZeRO 0, fp32 compute, a
small MLP trained a few steps as plain DeepSpeed (bf16 gradient all-reduce), loco with
``hierarchy: detect`` and loco flat.  Checked:

* loco finds the node layout from torchrun (``LOCAL_WORLD_SIZE``): two-level, 2 nodes of 2, and
  the ranks of each loco node group really share a network namespace;
* every rank's losses are bit-for-bit those of the same run with 4 ranks on one machine (loco
  given ``node_size: 2`` there): the reduction order does not depend on the transport;
* the bytes that crossed the link during each step match what the counters (zerohooks' for
  DeepSpeed, ``plugin.stats`` for loco) say crossed the node boundary, within the TCP/IP and
  gloo framing measured by the run's calibration transfers, and two-level's inter-node hop
  carries 1/L of flat's inter-node all-to-all bytes;
* when node 1 dies mid-step (link cut, then its processes killed; or only killed), node 0's
  ranks fail within ZEROHOOKS_COLLECTIVE_TIMEOUT plus the census, naming node 1's ranks, and no
  namespace is left behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from zerohooks.testing.nodes import EmulatedNodes, available

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "_two_nodes_train.py")
NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
STEPS = 3
LIMIT = 10
"""ZEROHOOKS_COLLECTIVE_TIMEOUT of the runs, seconds."""
PER_FRAME = 160
"""Bytes on the link beyond the payload, at most, per Ethernet frame that crossed: each frame's
Ethernet + IP + TCP headers (66 bytes with TCP timestamps), header-only ACK frames, gloo's
per-message framing.  Measured here: 95-105 bytes per frame for the steps and for the
calibration transfers alike (1-5% of the payload at these sizes: small messages pay more)."""


def _skip_unless_available() -> None:
    reason = available()
    if reason is not None:
        pytest.skip(reason)


def _env() -> dict[str, str]:
    return {"ZEROHOOKS_COLLECTIVE_TIMEOUT": str(LIMIT), "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


def _ours() -> set[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {
        line.split()[0] for line in done.stdout.splitlines() if line.startswith(f"zhnodes-{os.getpid()}-")
    }


def _die(
    tmp: Path, args: list[str], cut_link: bool, die_at: int, timeout: float = 200
) -> tuple[str, float, list[str]]:
    """Launch the script on 2 emulated nodes; once every rank reached step ``die_at`` kill node 1.
    Returns node 0's output, the seconds from the kill to node 0's exit, and the namespaces."""
    markers = tmp / "markers"
    markers.mkdir()
    argv = [SCRIPT, *args, "--die-at", str(die_at), "--marker-dir", str(markers)]
    with EmulatedNodes(NODES) as nodes:
        names = nodes.namespaces
        job = nodes.launch(argv, LOCAL, env=_env())
        deadline = time.monotonic() + timeout
        while len(list(markers.iterdir())) < WORLD:
            codes = job.poll()
            assert all(c is None for c in codes), f"exited early {codes}:\n{job.output(0)[-4000:]}"
            assert time.monotonic() < deadline, f"no rank reached step {die_at}:\n{job.output(0)[-4000:]}"
            time.sleep(0.2)
        time.sleep(1.0)  # node 0 is inside the step's collectives by now
        nodes.kill_node(1, cut_link=cut_link)
        killed = time.monotonic()
        job[0].popen.wait(timeout=LIMIT + 60)
        waited = time.monotonic() - killed
        out = job.output(0)
    return out, waited, names


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two-node run (whose last phase loses node 1, the link cut first) and the one-machine
    reference; both JSON results, node 0's output and the timings."""
    _skip_unless_available()
    tmp = tmp_path_factory.mktemp("two_nodes")
    t0 = time.monotonic()
    args = ["--out", str(tmp / "two.json"), "--steps", str(STEPS), "--calibrate", "65536"]
    out, waited, names = _die(tmp, args, cut_link=True, die_at=2)
    t1 = time.monotonic()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD)]
    one = subprocess.run(
        [*launcher, SCRIPT, "--out", str(tmp / "one.json"), "--steps", str(STEPS), "--node-size", str(LOCAL)],
        env={**os.environ, **_env()},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-5000:]
    print(f"two nodes: {t1 - t0:.0f} s, one machine: {time.monotonic() - t1:.0f} s", file=sys.stderr)
    return {
        "two": json.loads((tmp / "two.json").read_text()),
        "one": json.loads((tmp / "one.json").read_text()),
        "node0": out,
        "waited": waited,
        "namespaces": names,
    }


def test_loco_takes_the_node_layout_from_torchrun(runs: dict[str, Any]) -> None:
    two = runs["two"]
    ranks = two["ranks"]
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    for r in ranks:
        assert (r["group_rank"], r["local_rank"], r["local_world_size"]) == (*divmod(r["rank"], LOCAL), LOCAL)
    # loco's nodes are the namespaces: ranks 0-1 share one, 2-3 another
    assert ranks[0]["netns"] == ranks[1]["netns"] != ranks[2]["netns"] == ranks[3]["netns"]
    assert "node_size" not in two["loco2"]["config"]
    assert two["loco2"]["topology"] == [{"nodes": NODES, "node_size": LOCAL}] * WORLD
    assert two["loco1"]["topology"] == [None] * WORLD
    for r in range(WORLD):
        assert all(step["wire:all_to_all_inter"] > 0 for step in two["loco2"]["stats"][r])
        assert all("wire:all_to_all_inter" not in step for step in two["loco1"]["stats"][r])


@pytest.mark.parametrize("name", ["ds", "loco2", "loco1"])
def test_losses_equal_one_machine(runs: dict[str, Any], name: str) -> None:
    # same ranks, same data, same reduction order (gloo's ring, loco's rank-ordered sums): the
    # transport (loopback or veth) cannot change a bit
    assert runs["two"][name]["losses"] == runs["one"][name]["losses"]
    assert runs["one"]["loco2"]["topology"] == [{"nodes": NODES, "node_size": LOCAL}] * WORLD


def test_calibration_confirms_the_link_model(runs: dict[str, Any]) -> None:
    """Direct sends for all-to-all, gloo's ring for all-gather and all-reduce: what each is
    expected to put on the link is there, plus framing."""
    cal = runs["two"]["calibration"]
    empty = cal["empty"]
    for name in ("inter_all_to_all", "all_to_all", "all_gather", "all_reduce"):
        c = cal[name]
        excess = c["link"] - empty["link"] - c["crossing"]
        assert 0 <= excess <= PER_FRAME * (c["frames"] - empty["frames"]), (name, c, empty)


def _crossing(run: dict[str, Any], step: int) -> float:
    """Bytes the counters say crossed between the nodes at ``step``, summed over ranks: for loco,
    ``loco.state.crossing_bytes`` of each rank's counters; for DeepSpeed's own bf16 all-reduce (a
    ring, as zerohooks counts it) N/W, the share of the ring's W edges that join two nodes."""
    from loco.state import crossing_bytes

    if run["stats"][0] is None:
        ring = NODES / WORLD
        return ring * sum(sum(run["counters"][r][step]["all_reduce"].values()) for r in range(WORLD))
    return sum(crossing_bytes(run["stats"][r][step], NODES, LOCAL) for r in range(WORLD))


@pytest.mark.parametrize("name", ["ds", "loco2", "loco1"])
def test_link_bytes_match_the_counters(runs: dict[str, Any], name: str) -> None:
    two = runs["two"]
    run, empty = two[name], two["calibration"]["empty"]
    for step in range(STEPS):
        expected = _crossing(run, step)
        excess = run["link_bytes"][step] - empty["link"] - expected
        frames = run["link_frames"][step] - empty["frames"]
        assert 0 <= excess <= PER_FRAME * frames, (name, step, run["link_bytes"][step], expected, frames)


def test_two_level_sends_one_over_l_of_flat_between_nodes(runs: dict[str, Any]) -> None:
    two = runs["two"]
    for r in range(WORLD):
        s2, s1 = two["loco2"]["stats"][r][0], two["loco1"]["stats"][r][0]
        flat_inter = (NODES - 1) * LOCAL / (WORLD - 1) * s1["wire:all_to_all"]
        assert s2["wire:all_to_all_inter"] == pytest.approx(flat_inter / LOCAL, rel=1e-3)
        # the all-gather of the reduced chunks: one copy to the other node, against the ring's
        assert s2["wire:all_gather_inter"] == pytest.approx((NODES - 1) / (WORLD - 1) * s1["wire:all_gather"])
    # on the link: what is left after the all-gather is the all-to-all
    empty = two["calibration"]["empty"]["link"]
    gather_two = sum(s[0]["wire:all_gather_inter"] for s in two["loco2"]["stats"])
    gather_flat = NODES / WORLD * sum(s[0]["wire:all_gather"] for s in two["loco1"]["stats"])
    assert gather_two / gather_flat == pytest.approx((NODES - 1) / NODES * WORLD / (WORLD - 1))
    a2a_two = sum(two["loco2"]["link_bytes"]) / STEPS - empty - gather_two
    a2a_flat = sum(two["loco1"]["link_bytes"]) / STEPS - empty - gather_flat
    assert a2a_two / a2a_flat == pytest.approx(1 / LOCAL, rel=0.1)


def _check_death(out: str, waited: float) -> None:
    assert "CollectiveTimeoutError" in out, out[-4000:]
    named = re.findall(r"Not responding: rank\(s\) \[([\d, ]+)\]", out)
    assert named, out[-4000:]
    assert all({int(r) for r in n.split(",")} <= {2, 3} for n in named), named
    assert re.search(r"rank [01]: zerohooks collective loco all_to_all_inter", out), out[-4000:]
    # the limit, the census (2.5 heartbeat intervals), the launcher's teardown
    assert waited < LIMIT + 30, waited


def test_node_death_is_named_within_the_limit(runs: dict[str, Any]) -> None:
    """Node 1 lost (link cut, then its processes killed): silence, so the limit applies."""
    _check_death(runs["node0"], runs["waited"])
    # silence, so the limit applies: loco's all-to-all waits inside backward, under the step
    # watch, which ends it once the other node's heartbeats have been silent for the limit
    assert "(no heartbeat for 10 s" in runs["node0"], runs["node0"][-4000:]
    assert not set(runs["namespaces"]) & _ours()


def test_killed_node_is_named(tmp_path: Path) -> None:
    """Node 1's processes killed, the link up: node 0's ranks see closed connections at once."""
    _skip_unless_available()
    args = ["--out", str(tmp_path / "unused.json"), "--runs", ""]
    out, waited, names = _die(tmp_path, args, cut_link=False, die_at=1)
    _check_death(out, waited)
    assert waited < LIMIT, waited
    assert not set(names) & _ours()
