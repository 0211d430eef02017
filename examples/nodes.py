"""The demo across emulated nodes: ``train_gpt.py --nodes N --link-rate R``.

With ``--nodes`` above 1 the demo's ranks run as N nodes on this machine, each node a network
namespace with its own torchrun (``zerohooks.testing.nodes.EmulatedNodes``), the nodes joined by
one link shaped with ``tc`` to ``--link-rate``.  Every byte between two nodes crosses that link,
so a run that sends fewer bytes between the nodes (loco) shows it in its step time.  torchrun
tells each rank how many ranks its node has (``LOCAL_WORLD_SIZE``), which is how loco finds the
two-level layout by itself.

Every run of ``--runs`` goes over the same link, one after another in the same launch.  Each
node's first rank reads its link interface's transmit counter
(``/sys/class/net/$GLOO_SOCKET_IFNAME/statistics/tx_bytes``, what ``ip -s link`` shows) before
and after the run's training steps, between barriers; the sum over the nodes is what crossed the
link, each byte counted once.  The report gets a table of step time and link bytes per run.

Needs Linux, root and iproute2 (``ip``, ``tc``); the ranks run on CPU (gloo), since GPUs on one
machine would reach each other without the link.  The module imports nothing heavy at import
time: ``train_gpt.py`` parses its options with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

DEFAULT_RATE = "1gbit"
RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
BYTE_UNITS = {"bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}  # tc: bytes per second
DELAY = re.compile(r"^\d+(?:\.\d+)?(?:us|ms|s)$")
MAX_NODES = 250  # EmulatedNodes' addresses: 10.77.0.0/24
FAILED_GRACE_S = 30
"""After one node's ranks failed, how long the others get to fail on their own before they are
killed (they usually fail at once: their peers' sockets closed)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("emulated nodes (Linux, root, iproute2)")
    g.add_argument(
        "--nodes",
        metavar="N",
        type=int,
        default=1,
        help="run the ranks as N emulated nodes on this machine (network namespaces, one torchrun "
        "each), all traffic between nodes over one shaped link; 1: no emulation",
    )
    g.add_argument(
        "--nproc-per-node",
        metavar="K",
        type=int,
        default=None,
        help="ranks per node with --nodes (default: --nproc / --nodes, else 2)",
    )
    g.add_argument(
        "--link-rate",
        metavar="RATE",
        default=None,
        help=f"rate of each node's link with --nodes, in tc's units (100mbit, 1gbit, 50mbps = bytes/s) "
        f"or 'none' for an unshaped link (default: {DEFAULT_RATE} with --nodes)",
    )
    g.add_argument(
        "--link-delay",
        metavar="DELAY",
        default=None,
        help="one-way delay added to each node's link with --nodes (e.g. 1ms; needs sch_netem)",
    )


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate (``"100mbit"``; ``"12.5mbps"`` is bytes per second)."""
    m = RATE.match(rate.strip())
    if m is None:
        raise ValueError(rate)
    value, unit = float(m.group(1)), m.group(2).lower()
    return value * (RATE_UNITS.get(unit) or BYTE_UNITS[unit])


def check_args(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """Validate the node options and settle them: ``args.nproc_per_node`` and ``args.nproc``
    (nodes x ranks per node) and ``args.link_rate`` (``None`` for an unshaped link)."""
    nodes = args.nodes
    if nodes < 1 or nodes > MAX_NODES:
        error(f"--nodes {nodes}: expected 1 (no emulation) to {MAX_NODES} emulated nodes")
    if nodes == 1:
        for opt, value in (("--link-rate", args.link_rate), ("--link-delay", args.link_delay)):
            if value is not None:
                error(f"{opt} {value} shapes the link between emulated nodes: it needs --nodes 2 or more")
        if args.nproc_per_node is not None:
            error("--nproc-per-node needs --nodes 2 or more; on one machine use --nproc")
        return
    ppn = args.nproc_per_node
    if ppn is not None and ppn < 1:
        error(f"--nproc-per-node {ppn}: expected at least 1")
    if args.nproc is not None:
        if args.nproc % nodes:
            error(
                f"--nproc {args.nproc} is not divisible by --nodes {nodes}: every node runs the same "
                f"number of ranks; give --nproc a multiple of {nodes}, or --nproc-per-node"
            )
        if ppn is not None and ppn * nodes != args.nproc:
            error(
                f"--nproc {args.nproc} but --nodes {nodes} x --nproc-per-node {ppn} = {ppn * nodes} "
                "ranks; give one of --nproc and --nproc-per-node"
            )
        ppn = args.nproc // nodes
    args.nproc_per_node = ppn or 2
    args.nproc = nodes * args.nproc_per_node
    rate = DEFAULT_RATE if args.link_rate is None else args.link_rate.strip()
    if rate.lower() in ("none", "unlimited"):
        args.link_rate = None
    else:
        try:
            bits = rate_bits(rate)
        except ValueError:
            bits = 0.0
        if bits <= 0:
            units = ", ".join([*RATE_UNITS, *BYTE_UNITS])
            error(
                f"--link-rate {rate!r}: expected a positive number and one of tc's units ({units}), "
                "e.g. 100mbit or 1gbit, or 'none' for an unshaped link"
            )
        args.link_rate = rate
    if args.link_delay is not None and not DELAY.match(args.link_delay):
        error(f"--link-delay {args.link_delay!r}: expected a number and us, ms or s, e.g. 1ms")


def describe(args: argparse.Namespace) -> str:
    delay = f", {args.link_delay} delay" if args.link_delay else ""
    return (
        f"{args.nodes} emulated nodes x {args.nproc_per_node} CPU rank(s), gloo, "
        f"link {args.link_rate or 'unshaped'}{delay}"
    )


def unavailable(args: argparse.Namespace) -> str | None:
    """Why the emulated nodes cannot be made here (a message for the user), else None."""
    from zerohooks.testing.nodes import available

    reason = available(rate=args.link_rate is not None, delay=args.link_delay is not None)
    if reason is None:
        return None
    return (
        f"error: --nodes {args.nodes} runs the ranks in emulated nodes (Linux network namespaces "
        f"joined by a tc-shaped veth link), which cannot be made here: {reason}.\n"
        "Run the command as root on Linux with iproute2 installed (`ip` and `tc`), e.g. "
        "`sudo python examples/train_gpt.py --nodes 2 ...`, or leave out --nodes, --link-rate "
        "and --link-delay to run every rank on this machine without a link in between."
    )


def rank_env(args: argparse.Namespace, env: dict[str, str]) -> None:
    """The ranks' environment on emulated nodes: CPU only, DeepSpeed's node size per node."""
    env["CUDA_VISIBLE_DEVICES"] = ""  # GPUs on one machine would talk past the link
    env["DS_ACCELERATOR"] = "cpu"
    env["LOCAL_SIZE"] = str(args.nproc_per_node)  # DeepSpeed's CPU accelerator; torchrun sets the rest
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))


def run(args: argparse.Namespace, script: str, env: dict[str, str]) -> int:
    """Launch ``script`` on the emulated nodes, stream node 0's output here, wait for every node;
    the exit status (the first failing node's, else 0).  The namespaces are gone on return."""
    from zerohooks.testing.nodes import EmulatedNodes

    logs = Path(args.out) / "node-logs"
    with EmulatedNodes(args.nodes, args.link_rate, args.link_delay, log_dir=logs) as emu:
        before = emu.link_bytes()
        job = emu.launch([script], args.nproc_per_node, env=env)
        codes = _follow(job)
        crossed = (emu.link_bytes() - before).total
    failed = [i for i, c in enumerate(codes) if c != 0]
    for i in failed:
        if i > 0:  # node 0's output was shown as it came
            tail = job[i].output()[-4000:]
            print(f"--- node {i} (exit status {codes[i]}), end of its log ---\n{tail}", file=sys.stderr)
    print(
        f"train_gpt: {crossed / 2**20:.1f} MiB crossed the link between the nodes in all (start-up, "
        f"every run, evaluations); node logs: {logs}",
        flush=True,
    )
    return codes[failed[0]] if failed else 0


def _follow(job: Any) -> list[int]:
    """Copy node 0's log to stdout as it grows until every node's launcher has exited; once one
    failed, the others get FAILED_GRACE_S seconds before they are killed."""
    out = sys.stdout.buffer
    failed_at: float | None = None
    with open(job[0].log, "rb") as log:
        while True:
            chunk = log.read()
            if chunk:
                out.write(chunk)
                out.flush()
            codes = job.poll()
            if all(c is not None for c in codes):
                rest = log.read()
                out.write(rest)
                out.flush()
                return [int(c) for c in codes]
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILED_GRACE_S:
                print(f"train_gpt: stopping the other nodes {FAILED_GRACE_S} s after one failed", flush=True)
                with contextlib.suppress(TimeoutError):
                    job.wait(timeout=0)  # kills what still runs
                return [1 if c is None else int(c) for c in job.poll()]
            time.sleep(0.2)


# ---------------------------------------------------------------------------- in the ranks


def link_tx() -> int:
    """Bytes this node has sent on its link so far when this rank is its node's first (local rank 0)
    on an emulated node, else 0: summed over the ranks, the bytes that crossed the link."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or os.environ.get("LOCAL_RANK", "0") != "0":
        return 0
    return int(Path("/sys/class/net", ifname, "statistics", "tx_bytes").read_text())


class LinkMeter:
    """Link bytes during a run's training steps: :meth:`start` before, :meth:`stop` after, both
    called by every rank (each reading sits between barriers, so no rank's traffic of the run
    falls outside the window)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = 0

    def _read(self) -> int:
        import torch.distributed as dist

        dist.barrier()
        value = link_tx()
        dist.barrier()
        return value

    def start(self) -> None:
        if self.enabled:
            self.t0 = self._read()

    def stop(self) -> int | None:
        """This rank's share of the bytes that crossed the link since :meth:`start` (None on one
        machine)."""
        return self._read() - self.t0 if self.enabled else None
