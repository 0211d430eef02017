"""zerohooks.testing.nodes: emulated nodes are made, joined, shaped, counted and always removed.

Needs root and iproute2 (skipped otherwise, with the reason).  Child processes load the module by
its file path, so they start in well under a second (no torch or DeepSpeed import).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zerohooks.testing import nodes as nodes_mod
from zerohooks.testing.nodes import EmulatedNodes, available, sweep_stale

MODULE = Path(nodes_mod.__file__).resolve()
LOADER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("nodes", {str(MODULE)!r})
nodes = importlib.util.module_from_spec(spec); sys.modules["nodes"] = nodes; spec.loader.exec_module(nodes)
"""
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(8); print("listening", flush=True)
for _ in range(int(sys.argv[1])):
    c, _ = s.accept(); n = 0
    while (b := c.recv(1 << 16)):
        n += len(b)
    c.sendall(str(n).encode()); c.close()
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5001), timeout=20); c.sendall(b"x" * int(sys.argv[2]))
c.shutdown(socket.SHUT_WR); print(c.recv(64).decode())
"""


def _need(**kwargs: bool) -> None:
    reason = available(**kwargs)
    if reason is not None:
        pytest.skip(reason)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process. A zombie counts as dead: it was killed, and whether
    anyone reaps it is up to the container's init, which need not reap at all."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _send(nodes: EmulatedNodes, dst: int, srcs: list[int], nbytes: int) -> float:
    """``nbytes`` over TCP from each node of ``srcs`` to node ``dst``; the seconds it took."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", nodes.nodes[dst].netns, sys.executable, "-c", SERVER, str(len(srcs))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        t0 = time.monotonic()
        for src in srcs:
            done = nodes.exec(
                src, [sys.executable, "-c", CLIENT, nodes.nodes[dst].addr, str(nbytes)], timeout=60
            )
            assert done.returncode == 0 and done.stdout.strip() == str(nbytes), done.stderr
        return time.monotonic() - t0
    finally:
        server.kill()
        server.wait()


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 2 nodes"):
        EmulatedNodes(1)
    with pytest.raises(ValueError, match="tc's units"):
        EmulatedNodes(2, rate="fast")
    with pytest.raises(ValueError, match="us, ms or s"):
        EmulatedNodes(2, delay="1 minute")
    assert nodes_mod._rate_bits("100mbit") == 1e8
    assert nodes_mod._rate_bits("12.5mbps") == 1e8  # tc: bps are bytes per second


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in (nodes_mod._probe(False, False) or "")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(nodes_mod.shutil, "which", lambda name: None)
    assert "iproute2" in (nodes_mod._probe(False, False) or "")


def test_two_nodes_link_counts_what_crosses() -> None:
    _need()
    with EmulatedNodes(2) as nodes:
        names = set(nodes.namespaces)
        assert names <= _namespaces()
        before = nodes.link_bytes()
        _send(nodes, 0, [1], 2_000_000)
        moved = nodes.link_bytes() - before
        # one node's tx is the other's rx (read a moment apart: the last acks may fall between)
        assert abs(moved.tx[1] - moved.rx[0]) < 2048 and abs(moved.tx[0] - moved.rx[1]) < 2048
        # payload plus TCP/IP headers and acks: a few percent at most
        assert 2_000_000 < moved.total < 2_000_000 * 1.1, moved
        assert moved.packets > 0
    assert not names & _namespaces()


def test_rate_limits_the_link() -> None:
    _need(rate=True)
    nbytes = 1_500_000
    with EmulatedNodes(2, rate="40mbit") as nodes:
        seconds = _send(nodes, 0, [1], nbytes)
    # 12 Mbit at 40 Mbit/s: 0.3 s at least (a 64 KiB burst passes at once), and not stuck
    assert 0.25 < seconds < 10, seconds


def test_three_nodes_meet_through_a_bridge() -> None:
    _need()
    with EmulatedNodes(3) as nodes:
        assert nodes.bridge_ns is not None and nodes.bridge_ns in _namespaces()
        before = nodes.link_bytes()
        _send(nodes, 2, [0, 1], 500_000)
        moved = nodes.link_bytes() - before
        assert moved.tx[0] > 500_000 and moved.tx[1] > 500_000 and moved.rx[2] > 1_000_000
        names = set(nodes.namespaces)
    assert not names & _namespaces()


def test_kill_node_kills_every_process_of_the_node() -> None:
    _need()
    with EmulatedNodes(2) as nodes:
        sleepers = [
            subprocess.Popen(["ip", "netns", "exec", nodes.nodes[i].netns, "sleep", "300"]) for i in (0, 1, 1)
        ]
        time.sleep(0.2)
        killed = nodes.kill_node(1, cut_link=True)
        assert sorted(killed) == sorted(p.pid for p in sleepers[1:])
        assert [p.wait(timeout=10) for p in sleepers[1:]] == [-signal.SIGKILL] * 2
        assert sleepers[0].poll() is None
    assert sleepers[0].wait(timeout=10) == -signal.SIGKILL  # closing killed the rest


def _child(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    """A process that makes 2 nodes, starts a sleeper in node 0, prints its pid and the namespaces,
    then runs ``body`` in the ``with`` block."""
    script = tmp_path / "child.py"
    script.write_text(
        LOADER
        + textwrap.dedent(
            """
            import os, signal, subprocess, sys, time
            with nodes.EmulatedNodes(2) as n:
                sleeper = subprocess.Popen(["ip", "netns", "exec", n.nodes[0].netns, "sleep", "300"])
                print(sleeper.pid, " ".join(n.namespaces), flush=True)
            """
        )
        + textwrap.indent(textwrap.dedent(body), "    ")
    )
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("how", ["exception", "sigterm", "sigint"])
def test_namespaces_go_whatever_ends_the_block(tmp_path: Path, how: str) -> None:
    _need()
    body = {
        "exception": "raise RuntimeError('boom')",
        "sigterm": "time.sleep(60)",
        "sigint": "time.sleep(60)",
    }
    child = _child(tmp_path, body[how])
    assert child.stdout is not None
    pid, *names_ = child.stdout.readline().split()
    names = set(names_)
    assert len(names) == 2 and names <= _namespaces()
    if how != "exception":
        child.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
    assert child.wait(timeout=30) != 0
    assert not names & _namespaces()
    assert not _running(int(pid))


def test_stale_namespaces_of_a_dead_creator_are_swept(tmp_path: Path) -> None:
    _need()
    child = _child(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert child.stdout is not None
    pid, *names_ = child.stdout.readline().split()
    names = set(names_)
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert _running(int(pid))  # its sleeper lives on in the namespace
    assert names <= _namespaces()  # left behind: nobody could clean up
    swept = sweep_stale()
    assert names <= set(swept)
    assert not names & _namespaces()
    assert not _running(int(pid))
