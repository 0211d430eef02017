"""Several emulated nodes on one Linux machine: one network namespace per node, a shaped link.

A multi-node job needs more than one machine; this test bed gives each "node" its own network
namespace, so its ranks reach each other over loopback while every byte to another node crosses
a virtual Ethernet link that ``tc`` can slow down and that has byte counters of its own::

    from zerohooks.testing.nodes import EmulatedNodes, available

    reason = available()            # None, or why namespaces cannot be made here (skip the test)
    with EmulatedNodes(2, rate="100mbit") as nodes:
        job = nodes.launch(["train.py", "--steps", "3"], nproc_per_node=2)
        codes = job.wait(timeout=300)
        print(nodes.link_bytes().total, job.output(0))

Layout
    Node ``i`` is the namespace ``zhnodes-<pid>-<k>-n<i>`` (``pid`` of the creating process,
    ``k`` counting the sets it made) with loopback up and one interface ``zh<i>`` holding
    ``10.77.0.<i+1>/24``.  Two nodes are joined by a veth pair; more than two by a veth per node
    into a bridge that lives in a namespace of its own (``...-br``).  Nothing is created in the
    caller's namespace, so concurrent sets never collide.

Shaping
    ``rate`` (``"100mbit"``, ``"1gbit"``: tc's units) puts a token bucket (``tbf``) on each
    node's link interface, and on its bridge port for more than two nodes, so each node sends
    and receives at most ``rate``; ``delay`` (``"1ms"``) adds a ``netem`` delay to the same
    egress queues (one-way delay per hop).  ``None`` leaves the link unshaped.  Kernels without
    the ``sch_netem`` module (some VM kernels) cannot add delay: :class:`NodesError` says so.

Launching
    :meth:`EmulatedNodes.launch` starts ``python -m torch.distributed.run --nnodes N
    --node_rank i --nproc_per_node K --master_addr 10.77.0.1 ...`` inside each namespace with
    ``GLOO_SOCKET_IFNAME`` set to that node's interface; output goes to one log file per node.

Clean-up
    Every process in the namespaces is killed and the namespaces (hence their veths and bridge)
    are deleted when the ``with`` block ends, whatever ends it: normal exit, an exception,
    Ctrl-C, SIGTERM/SIGHUP (turned into ``SystemExit`` while the block runs) or interpreter exit.
    A creator killed with SIGKILL leaves its namespaces behind; the next :class:`EmulatedNodes`
    or :func:`available` call removes namespaces of this prefix whose creating pid is dead.

Requirements: Linux, root (CAP_SYS_ADMIN and CAP_NET_ADMIN), ``ip`` and, for shaping, ``tc``
(iproute2).  Progress lines go to stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

__all__ = [
    "PREFIX",
    "EmulatedNodes",
    "Job",
    "LinkBytes",
    "Node",
    "NodeProcess",
    "NodesError",
    "available",
    "sweep_stale",
]

PREFIX = "zhnodes"
"""Start of every namespace name this module creates (``zhnodes-<pid>-<k>-n<i>``)."""

SUBNET = "10.77.0"
"""Node ``i`` has the address ``10.77.0.<i+1>/24`` on its link interface."""

_NAME = re.compile(rf"^{PREFIX}-(\d+)-")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
_DELAY = re.compile(r"^\d+(?:\.\d+)?(?:us|ms|s)$")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTE_UNITS = {"bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_sets = 0
_sets_lock = threading.Lock()


class NodesError(RuntimeError):
    """A namespace, link or shaping step failed (the message holds the command and its error)."""


def _say(msg: str) -> None:
    print(f"[zerohooks.testing.nodes] {msg}", file=sys.stderr, flush=True)


def _run(args: Sequence[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run a command (``ip``, ``tc``, ...); :class:`NodesError` with its stderr when it fails."""
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NodesError(f"`{' '.join(args)}` could not run: {e}") from e
    if check and done.returncode != 0:
        raise NodesError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _veth(name: str, ns: str, peer: str, peer_ns: str) -> None:
    """A veth pair made straight inside the two namespaces (nothing in the caller's)."""
    _run(f"ip link add name {name} netns {ns} type veth peer name {peer} netns {peer_ns}".split())


def _rate_bits(rate: str | int) -> float:
    """Bits per second of a tc rate (``"100mbit"``, ``"12.5mbps"`` = bytes, or an int of bit/s)."""
    if isinstance(rate, int):
        return float(rate)
    m = _RATE.match(rate.strip())
    if m is None:
        raise ValueError(
            f"rate {rate!r}: expected a number and one of tc's units "
            f"({', '.join([*_RATE_UNITS, *_BYTE_UNITS])}), e.g. '100mbit'"
        )
    value, unit = float(m.group(1)), m.group(2).lower()
    return value * (_RATE_UNITS.get(unit) or _BYTE_UNITS[unit])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    done = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill_until_quiet(
    find: Callable[[], list[int]], rounds: int, pause: float, quiet_rounds: int = 1
) -> list[int]:
    """SIGKILL the pids ``find()`` returns (this process aside) until ``quiet_rounds`` calls in a
    row, ``pause`` seconds apart, return none, at most ``rounds`` calls; returns the pids killed."""
    killed: list[int] = []
    quiet = 0
    for _ in range(rounds):
        pids = [p for p in find() if p != os.getpid()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed += [p for p in pids if p not in killed]
        quiet = 0 if pids else quiet + 1
        if quiet >= quiet_rounds:
            break
        time.sleep(pause)
    return killed


def _kill_ns(ns: str, rounds: int = 50) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left; returns the pids killed."""
    return _kill_until_quiet(lambda: _ns_pids(ns), rounds, 0.05)


def _ns_inode(ns: str) -> int | None:
    """The inode of namespace ``ns`` (what ``/proc/<pid>/ns/net`` of its processes points to)."""
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return None


def _pids_in(inodes: set[int]) -> list[int]:
    """Every process whose network namespace is one of ``inodes`` (named or not)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                    found.append(int(entry))
    return found


def _kill_entering(inodes: set[int]) -> list[int]:
    """SIGKILL processes in the network namespaces ``inodes`` until two scans in a row (0.1 s
    apart) find none, at most 10 scans; returns the pids killed.

    After a namespace's name is deleted, a process can still enter it: ``ip netns exec`` opens
    the namespace, then joins it, so one started just before ``close`` may join after the kill
    by name found nothing, and live on in a namespace nobody can name."""
    return _kill_until_quiet(lambda: _pids_in(inodes), 10, 0.1, quiet_rounds=2)


def _delete_ns(ns: str) -> None:
    _kill_ns(ns)
    _run(["ip", "netns", "del", ns], check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces named ``zhnodes-<pid>-...`` whose creating process is gone (killed
    with SIGKILL before it could clean up), after killing what still runs in them."""
    swept = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        _delete_ns(ns)
        swept.append(ns)
    if swept:
        _say(f"removed {len(swept)} stale namespace(s) of dead creators: {', '.join(swept)}")
    return swept


_available: dict[tuple[bool, bool], str | None] = {}


def available(*, rate: bool = False, delay: bool = False) -> str | None:
    """``None`` when emulated nodes can be made here, else the reason (for ``pytest.skip``).

    Checks Linux, root, the ``ip`` command, then really makes a namespace with a veth pair;
    ``rate=True`` also needs ``tc`` with the ``tbf`` qdisc, ``delay=True`` the ``netem`` one.
    The answer is cached per process; stale namespaces of dead creators are swept first.
    """
    key = (rate, delay)
    if key not in _available:
        _available[key] = _probe(rate, delay)
    return _available[key]


def _probe(rate: bool, delay: bool) -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "no `ip` command: install iproute2"
    if (rate or delay) and shutil.which("tc") is None:
        return "no `tc` command: install iproute2"
    sweep_stale()
    ns = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["ip", "-n", ns, "link", "set", "p0", "up"])
        if rate:
            tbf = ["tbf", "rate", "1gbit", "burst", "64kb", "latency", "50ms"]
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "p0", "root", *tbf])
        if delay:
            netem = ["netem", "delay", "1ms"]
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "p0", "root", *netem])
    except NodesError as e:
        return f"cannot make emulated nodes here: {e}"
    finally:
        _delete_ns(ns)
    return None


@dataclasses.dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, link interface and address."""

    index: int
    netns: str
    ifname: str
    addr: str


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Byte and packet counters of each node's link interface (``tx``/``rx`` per node).

    Every byte between two nodes leaves exactly one node interface, so :attr:`total` (the sum of
    ``tx``) counts each byte that crossed the link once, whichever way it went.  Subtract two
    readings for the traffic in between."""

    tx: tuple[int, ...]
    rx: tuple[int, ...]
    tx_packets: tuple[int, ...]
    rx_packets: tuple[int, ...]

    @property
    def total(self) -> int:
        """Bytes (Ethernet frames) that crossed between nodes, each counted once."""
        return sum(self.tx)

    @property
    def packets(self) -> int:
        """Frames that crossed between nodes (a GSO frame counts once)."""
        return sum(self.tx_packets)

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        def d(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(x - y for x, y in zip(a, b, strict=True))

        return LinkBytes(
            d(self.tx, other.tx),
            d(self.rx, other.rx),
            d(self.tx_packets, other.tx_packets),
            d(self.rx_packets, other.rx_packets),
        )


@dataclasses.dataclass
class NodeProcess:
    """The launcher process of one node (``ip netns exec ... torch.distributed.run``)."""

    node: Node
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        """Everything the node's launcher and ranks wrote so far (stdout and stderr)."""
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Job:
    """The launchers of one :meth:`EmulatedNodes.launch`, one per node."""

    def __init__(self, procs: list[NodeProcess]) -> None:
        self.procs = procs

    def __iter__(self) -> Any:
        return iter(self.procs)

    def __getitem__(self, i: int) -> NodeProcess:
        return self.procs[i]

    def __len__(self) -> int:
        return len(self.procs)

    def output(self, i: int) -> str:
        """Node ``i``'s log so far."""
        return self.procs[i].output()

    def poll(self) -> list[int | None]:
        """Each node launcher's exit code, ``None`` while it runs."""
        return [p.popen.poll() for p in self.procs]

    def wait(self, timeout: float) -> list[int]:
        """Wait until every node's launcher exits; its exit codes.  Past ``timeout`` seconds
        every process still running is killed and :class:`TimeoutError` names the nodes, with
        the end of their logs."""
        deadline = time.monotonic() + timeout
        while any(c is None for c in self.poll()) and time.monotonic() < deadline:
            time.sleep(0.1)
        hung = [p for p in self.procs if p.popen.poll() is None]
        if hung:
            for p in hung:
                _kill_ns(p.node.netns)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=10)
            tails = "\n".join(f"--- node {p.node.index} ---\n{p.output()[-3000:]}" for p in hung)
            raise TimeoutError(
                f"node(s) {[p.node.index for p in hung]} did not finish within {timeout:g} s "
                f"(killed):\n{tails}"
            )
        return [int(p.popen.returncode) for p in self.procs]


class EmulatedNodes:
    """``n`` emulated nodes (network namespaces) joined by one link; a context manager.

    ``rate``: tc rate of each node's link (``"100mbit"``); ``delay``: one-way netem delay
    added on each node's egress (``"1ms"``); ``log_dir``: where :meth:`launch` writes the
    nodes' logs (default: a temporary folder removed on exit).
    """

    def __init__(
        self,
        n: int,
        rate: str | int | None = None,
        delay: str | None = None,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        python: str = sys.executable,
    ) -> None:
        if n < 2:
            raise ValueError(f"EmulatedNodes needs at least 2 nodes, got {n}")
        if n > 250:
            raise ValueError(f"EmulatedNodes: at most 250 nodes in {SUBNET}.0/24, got {n}")
        if rate is not None:
            _rate_bits(rate)  # validate early
        if delay is not None and not _DELAY.match(delay):
            raise ValueError(f"delay {delay!r}: expected a number and us, ms or s, e.g. '1ms'")
        self.n, self.rate, self.delay, self.python = n, rate, delay, python
        global _sets
        with _sets_lock:
            _sets += 1
            base = f"{PREFIX}-{os.getpid()}-{_sets}"
        self.nodes = [Node(i, f"{base}-n{i}", f"zh{i}", f"{SUBNET}.{i + 1}") for i in range(n)]
        self.bridge_ns = f"{base}-br" if n > 2 else None
        self._owned_logs = log_dir is None
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._jobs: list[Job] = []
        self._created: list[str] = []
        self._signals: dict[int, Any] = {}
        self._closed = False
        self._lock = threading.Lock()

    # -- set-up and clean-up ---------------------------------------------------------------------
    def __enter__(self) -> EmulatedNodes:
        reason = available(rate=self.rate is not None, delay=self.delay is not None)
        if reason is not None:
            raise NodesError(reason)
        self._trap_signals()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        names = ", ".join(n.netns for n in self.nodes)
        shaping = f"rate {self.rate or 'unlimited'}, delay {self.delay or 'none'}"
        _say(f"creating {self.n} nodes ({names}; {shaping})")
        for ns in [n.netns for n in self.nodes] + ([self.bridge_ns] if self.bridge_ns else []):
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        a, b = self.nodes[0], self.nodes[-1]
        if self.bridge_ns is None:
            _veth(a.ifname, a.netns, b.ifname, b.netns)
            _say(f"veth pair {a.netns}/{a.ifname} <-> {b.netns}/{b.ifname}")
        else:
            br = self.bridge_ns
            _run(["ip", "-n", br, "link", "add", "name", "br0", "type", "bridge"])
            _run(["ip", "-n", br, "link", "set", "br0", "up"])
            for node in self.nodes:
                port = f"p{node.index}"
                _veth(node.ifname, node.netns, port, br)
                _run(["ip", "-n", br, "link", "set", port, "master", "br0", "up"])
            _say(f"bridge {br}/br0 with a veth to each node")
        for node in self.nodes:
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname])
            _run(["ip", "-n", node.netns, "link", "set", node.ifname, "up"])
            self._shape(node.netns, node.ifname)
            if self.bridge_ns is not None:
                self._shape(self.bridge_ns, f"p{node.index}")
        _say("nodes: " + ", ".join(f"{n.index}={n.netns}/{n.ifname} {n.addr}" for n in self.nodes))

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate is None and self.delay is None:
            return
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        parent = ["root", "handle", "1:"]
        if self.delay is not None:
            try:
                _run([*tc, *parent, "netem", "delay", self.delay, "limit", "100000"])
            except NodesError as e:
                raise NodesError(
                    f"cannot add a {self.delay} delay (is sch_netem in this kernel?): {e}"
                ) from e
            parent = ["parent", "1:1", "handle", "10:"]
        if self.rate is not None:
            bits = _rate_bits(self.rate)
            # a burst of 2 ms at the rate (at least 64 KiB, so a GSO frame needs no splitting)
            burst = max(64 * 1024, int(bits / 8 * 0.002))
            _run([*tc, *parent, "tbf", "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "100ms"])
        _say(f"shaped {ns}/{dev}: rate {self.rate or 'unlimited'}, delay {self.delay or 'none'}")

    def _trap_signals(self) -> None:
        """While the block runs, SIGTERM/SIGHUP raise SystemExit (so ``__exit__`` cleans up)
        where nobody else handles them; only possible from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._signals[sig] = signal.signal(sig, handler)

    def close(self) -> None:
        """Kill every process of every node, delete the namespaces; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            for ns in self._created:
                killed = _kill_ns(ns)
                if killed:
                    _say(f"killed {len(killed)} process(es) left in {ns}")
            for job in self._jobs:
                for p in job.procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.popen.wait(timeout=10)
            inodes = {i for i in (_ns_inode(ns) for ns in self._created) if i is not None}
            for ns in reversed(self._created):
                _run(["ip", "netns", "del", ns], check=False)
            late = _kill_entering(inodes) if inodes else []
            if late:
                _say(f"killed {len(late)} process(es) that entered a node as it closed")
            left = set(self._created) & set(_namespaces())
            if left:
                _say(f"could not delete {sorted(left)}")
            elif self._created:
                _say(f"removed {len(self._created)} namespace(s)")
            self._created = []
            if self._owned_logs and self._log_dir is not None:
                shutil.rmtree(self._log_dir, ignore_errors=True)
        finally:
            for sig, old in self._signals.items():
                with contextlib.suppress(ValueError):
                    signal.signal(sig, old)
            self._signals = {}
            atexit.unregister(self.close)

    # -- use -------------------------------------------------------------------------------------
    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this set (nodes, then the bridge's)."""
        return [n.netns for n in self.nodes] + ([self.bridge_ns] if self.bridge_ns else [])

    def exec(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside node ``i``'s namespace and wait for it (``subprocess.run``)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(["ip", "netns", "exec", self.nodes[i].netns, *argv], check=False, **kwargs)

    def launch(
        self,
        argv: Sequence[str],
        nproc_per_node: int,
        env: Mapping[str, str] | None = None,
        *,
        master_port: int = 29500,
        launcher_args: Sequence[str] = (),
    ) -> Job:
        """Start ``torch.distributed.run`` with ``argv`` (a script and its arguments, or
        ``-m module ...``) on every node: ``nproc_per_node`` ranks each, node 0's address as
        the master, static rendezvous (rank = node * nproc_per_node + local rank).  ``env`` is
        added to this process's environment; ``GLOO_SOCKET_IFNAME`` is the node's interface.
        Each node's output goes to a log file (:meth:`Job.output`)."""
        if self._closed or not self._created:
            raise NodesError("EmulatedNodes.launch: use it inside the `with` block")
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-logs-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        procs = []
        for node in self.nodes:
            cmd = ["ip", "netns", "exec", node.netns, self.python, "-m", "torch.distributed.run"]
            cmd += ["--nnodes", str(self.n), "--node_rank", str(node.index)]
            cmd += ["--nproc_per_node", str(nproc_per_node), "--rdzv_backend", "static"]
            cmd += ["--master_addr", self.nodes[0].addr, "--master_port", str(master_port)]
            cmd += [*launcher_args, *argv]
            full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": node.ifname}
            log = self._log_dir / f"job{len(self._jobs)}-node{node.index}.log"
            out: IO[bytes]
            with open(log, "wb") as out:
                popen = subprocess.Popen(
                    cmd,
                    env=full_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            procs.append(NodeProcess(node, popen, log))
        _say(f"launched {nproc_per_node} rank(s) on each of {self.n} nodes: {' '.join(argv)}")
        job = Job(procs)
        self._jobs.append(job)
        return job

    def wait(self, timeout: float) -> list[int]:
        """:meth:`Job.wait` of the latest :meth:`launch`."""
        if not self._jobs:
            raise NodesError("EmulatedNodes.wait: nothing was launched")
        return self._jobs[-1].wait(timeout)

    def link_bytes(self) -> LinkBytes:
        """Counters of each node's link interface now (read with ``ip -s -j link``)."""
        tx, rx, txp, rxp = [], [], [], []
        for node in self.nodes:
            done = _run(["ip", "-n", node.netns, "-s", "-j", "link", "show", "dev", node.ifname])
            stats = json.loads(done.stdout)[0]["stats64"]
            tx.append(int(stats["tx"]["bytes"]))
            rx.append(int(stats["rx"]["bytes"]))
            txp.append(int(stats["tx"]["packets"]))
            rxp.append(int(stats["rx"]["packets"]))
        return LinkBytes(tuple(tx), tuple(rx), tuple(txp), tuple(rxp))

    def cut_link(self, i: int) -> None:
        """Take node ``i``'s link down: its packets are dropped without a reset reaching the
        other nodes (as when a machine loses power), until the set is closed."""
        _run(["ip", "-n", self.nodes[i].netns, "link", "set", self.nodes[i].ifname, "down"])
        _say(f"link of node {i} is down")

    def kill_node(self, i: int, *, cut_link: bool = False) -> list[int]:
        """SIGKILL every process of node ``i`` (all pids in its namespace); returns them.
        ``cut_link=True`` takes its link down first, so peers see silence, not closed sockets."""
        if cut_link:
            self.cut_link(i)
        killed = _kill_ns(self.nodes[i].netns)
        for job in self._jobs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.procs[i].popen.wait(timeout=10)
        _say(f"killed node {i}: {len(killed)} process(es)")
        return killed


def _main(argv: list[str] | None = None) -> int:
    """``python -m zerohooks.testing.nodes [--sweep]``: say whether nodes can be made here."""
    args = sys.argv[1:] if argv is None else argv
    if "--sweep" in args:
        sweep_stale()
    reason = available()
    print("emulated nodes: available" if reason is None else f"emulated nodes: not available: {reason}")
    return 0 if reason is None else 1


if __name__ == "__main__":
    sys.exit(_main())
