"""The demo across emulated nodes (``examples/train_gpt.py --nodes N --link-rate R``): its options
are checked before anything starts, it refuses clearly where namespaces cannot be made, and one
short real run (2 nodes x 2 ranks, root only) reports the bytes that crossed the link per run."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def train_gpt(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """examples/train_gpt.py as a module; its folder leaves sys.path and its sibling modules
    (runs, nodes, ...) leave sys.modules afterwards, so no other test imports them by chance."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # undone, with train_gpt's own insert, afterwards
    yield importlib.import_module("train_gpt")
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").parent == EXAMPLES:
            del sys.modules[name]


def _error(train_gpt: ModuleType, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        train_gpt.parse_args(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_node_options_settle_the_ranks(train_gpt: ModuleType) -> None:
    a = train_gpt.parse_args(["--nodes", "2"])
    assert (a.nproc, a.nproc_per_node, a.link_rate, a.link_delay) == (4, 2, "1gbit", None)
    a = train_gpt.parse_args(["--nodes", "3", "--nproc", "6", "--link-rate", "none"])
    assert (a.nproc, a.nproc_per_node, a.link_rate) == (6, 2, None)
    a = train_gpt.parse_args(["--nodes", "2", "--nproc-per-node", "3", "--link-rate", "12.5mbps"])
    assert (a.nproc, a.nproc_per_node, a.link_rate) == (6, 3, "12.5mbps")
    a = train_gpt.parse_args([])
    assert (a.nodes, a.nproc, a.link_rate) == (1, None, None)  # one machine, as before


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nodes", "2", "--nproc", "3"], ["--nproc 3", "--nodes 2", "multiple of 2"]),
        (["--nodes", "2", "--nproc", "4", "--nproc-per-node", "3"], ["--nproc 4", "= 6 ranks"]),
        (["--nodes", "2", "--link-rate", "10furlongs"], ["'10furlongs'", "100mbit", "gbit", "'none'"]),
        (["--nodes", "2", "--link-rate", "0mbit"], ["'0mbit'", "positive"]),
        (["--nodes", "2", "--link-delay", "5"], ["'5'", "us, ms or s"]),
        (["--nodes", "0"], ["--nodes 0", "250"]),
        (["--link-rate", "1gbit"], ["--link-rate 1gbit", "--nodes 2 or more"]),
        (["--nproc-per-node", "2"], ["--nodes 2 or more", "--nproc"]),
    ],
)
def test_bad_node_options_are_named(
    train_gpt: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], says: list[str]
) -> None:
    err = _error(train_gpt, capsys, *argv)
    for text in says:
        assert text in err, (text, err)


def test_no_namespaces_fails_before_anything_starts(
    train_gpt: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import zerohooks.testing.nodes as nodes

    reason = "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    monkeypatch.setattr(nodes, "available", lambda **kw: reason)

    def started(*a: Any, **kw: Any) -> None:
        raise AssertionError("nothing may be built or launched")

    launcher = sys.modules["launch"]  # examples/launch.py, train_gpt's launcher
    monkeypatch.setattr(launcher, "prebuild", started)
    monkeypatch.setattr(launcher.emulated, "run", started)
    argv = ["--nodes", "2", "--link-rate", "100mbit"]
    assert train_gpt.launch(train_gpt.parse_args(argv), argv) == 2
    err = capsys.readouterr().err
    for text in (reason, "--nodes 2", "root", "iproute2", "leave out --nodes"):
        assert text in err, (text, err)


@pytest.mark.multirank
@pytest.mark.slow
def test_two_nodes_report_the_link_bytes(tmp_path: Path) -> None:
    from zerohooks.testing.nodes import available

    reason = available(rate=True)
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "report"
    model = ["--layers", "1", "--d-model", "64", "--heads", "2", "--seq-len", "32", "--micro-batch", "4"]
    cmd = [sys.executable, str(EXAMPLES / "train_gpt.py"), "--nodes", "2", "--link-rate", "1gbit"]
    cmd += ["--steps", "2", "--runs", "baseline,loco", "--stage", "0", "--dtype", "fp32", *model]
    cmd += ["--eval-every", "2", "--eval-batches", "1", "--data-mb", "0.25", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        text, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, text[-6000:]
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["world_size"] == 4
    baseline, loco = data["runs"]
    assert (baseline["name"], loco["name"], baseline["status"], loco["status"]) == (
        "baseline",
        "loco",
        "ok",
        "ok",
    ), loco.get("reason")
    # both runs crossed the same link; loco's 4-bit codes are a fraction of the fp32 all-reduce
    assert baseline["link_bytes"] > 0 and loco["link_bytes"] > 0
    assert loco["link_bytes"] < 0.5 * baseline["link_bytes"], (loco["link_bytes"], baseline["link_bytes"])
    # loco found the 2 nodes from torchrun (LOCAL_WORLD_SIZE): an inter-node hop of its own
    assert all("all_to_all_inter" in step for step in loco["wire_bytes"])
    report = (out / "report.md").read_text()
    assert "## Across 2 emulated nodes of 2 ranks, link 1gbit" in report
    link_table = report[report.index("## Across") :]
    rows = [ln for ln in link_table.splitlines() if ln.startswith(("| baseline |", "| loco |"))]
    assert len(rows) == 2 and "two-level" in rows[-1], rows
    assert "crossed the link between the nodes in all" in text
    # the namespaces are gone with the command
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert f"zhnodes-{proc.pid}-" not in left, left
