"""``bash run.sh test``'s sessions in lanes that run side by side, on machines with the cores for it.

    python tools/test_lanes.py [nox options] [-- pytest options]    # what run.sh test runs
    ZEROHOOKS_TEST_LANES=2 bash run.sh test                         # two lanes, whatever the machine

Each nox session of the test command builds its own venv and runs its own pytest; none shares a
folder, a port or a namespace name with another (junit files, JIT folders and bytecode caches are
per session, the kernels' shared cache builds each kernel once under a lock and stores it by
atomic rename, rendezvous ports come from the OS, emulated nodes are named by the creating pid),
so sessions can run side by side.

One session keeps 1.1-1.5 CPUs busy on average (ranks wait on each other, fault tests wait on
limits), so the default is two lanes from 2 CPUs on, one lane per 2 CPUs beyond 4, at most 3
(one lane on 1 CPU). **Two lanes on the project's 2-CPU machine** (benchmarks/CI_TIME.md): 22.4
min against 31.4 one after another on a quiet machine, the machine busy 1.82 CPUs on average; on
the earlier, loaded machine the gain had been 12 %.

The sessions of the default run (``nox.options.sessions`` of noxfile.py, one ``tests(<pkg>)`` per
package) are dealt to the lanes longest first, each to the lane with the least expected time so
far (the minutes each took, from benchmarks/CI_TIME.md; one minute for a session not measured).
Each lane is one ``nox -s <its sessions>`` with the options given; its output lines come prefixed
``[lane N] `` (tools/ci_report.py reads them so). One lane, or naming sessions (``-s``, ``-t``,
``-k``), listing them or asking nox for help, runs plain nox instead.

Exit status: 0 when every lane's nox passed, else the first failing lane's status. SIGTERM or
SIGINT (CI's time limit) stops every lane's process group and exits 124 on SIGTERM, 130 on SIGINT.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_plan  # a sibling script, not a package

ENV = "ZEROHOOKS_TEST_LANES"
"""How many lanes (default: :func:`default_lanes`; 1 runs the sessions one after another in one nox)."""

MAX_DEFAULT_LANES = 3
"""The most lanes the default gives, however many CPUs (more is not measured)."""


def default_lanes(cpus: int | None = None) -> int:
    """Two lanes on 2-5 CPUs, one per 2 CPUs beyond (a session keeps 1.1-1.5 busy), one on 1 CPU,
    at most :data:`MAX_DEFAULT_LANES`."""
    n = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, min(MAX_DEFAULT_LANES, max(n // 2, min(n, 2))))


UNMEASURED_SECONDS = 60.0
"""What a session not in benchmarks/CI_TIME.md is expected to take, for dealing it to a lane."""

_PLAIN = ("-s", "-e", "--session", "--sessions", "-t", "--tags", "-k", "--keywords", "-l", "--list")
_PLAIN += ("--json", "-h", "--help", "--usage", "--version")


def lanes_wanted(environ: dict[str, str] | None = None) -> int:
    """``ZEROHOOKS_TEST_LANES`` as a count of lanes; a value that is not a whole number >= 1 is an
    error naming the variable and what it accepts."""
    raw = (environ if environ is not None else os.environ).get(ENV, "").strip()
    if not raw:
        return default_lanes()
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise SystemExit(
            f"test_lanes: {ENV}={raw!r} is not a number of lanes; give a whole number >= 1 (1: no lanes)"
        )
    return n


def wants_plain_nox(argv: list[str]) -> bool:
    """Whether the options choose sessions or ask nox something (then nox runs as given)."""
    for a in argv:
        if a == "--":
            return False
        if a in _PLAIN or a.startswith(tuple(f"{p}=" for p in _PLAIN if p.startswith("--"))):
            return True
    return False


def deal(sessions: list[str], seconds: dict[str, float], lanes: int) -> list[list[str]]:
    """The sessions dealt to ``lanes`` lanes: longest first, each to the lane expected to finish
    first so far (ties: the lower lane). Within a lane they keep the order they were dealt in."""
    out: list[list[str]] = [[] for _ in range(max(1, lanes))]
    load = [0.0] * len(out)
    for s in sorted(sessions, key=lambda s: -seconds.get(s, UNMEASURED_SECONDS)):
        i = min(range(len(out)), key=lambda k: (load[k], k))
        out[i].append(s)
        load[i] += seconds.get(s, UNMEASURED_SECONDS)
    return [lane for lane in out if lane]


def lane_command(nox: list[str], argv: list[str], sessions: list[str]) -> list[str]:
    """``nox [options] -s <sessions> [-- posargs]``: the sessions go before any ``--``."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return [*nox, *argv[:cut], "-s", *sessions, *argv[cut:]]


def _nox() -> list[str]:
    found = shutil.which("nox")
    return [found] if found else [sys.executable, "-m", "nox"]


class _Lanes:
    """The lanes' processes, their output copied to ours line by line with a prefix."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.out_lock = threading.Lock()
        self.stopping: int | None = None

    def start(self, index: int, cmd: list[str]) -> threading.Thread:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        prefix = f"[lane {index}] ".encode()
        thread = threading.Thread(target=self._copy, args=(proc, prefix), daemon=True)
        thread.start()
        return thread

    def _copy(self, proc: subprocess.Popen[bytes], prefix: bytes) -> None:
        assert proc.stdout is not None
        out = sys.stdout.buffer
        for line in iter(proc.stdout.readline, b""):
            with self.out_lock:
                out.write(prefix + line)
                out.flush()

    def stop(self, signum: int, _frame: object = None) -> None:
        """Every lane's process group gets ``signum`` (SIGINT stays SIGINT, anything else is
        SIGTERM), then SIGKILL 30 s later if still there. Runs as a signal handler while the main
        thread waits on the lanes, so it only signals: the main thread's waits end as they die."""
        self.stopping = signum
        self._signal_all(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
        threading.Timer(30, self._signal_all, args=(signal.SIGKILL,)).start()

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)


def run(argv: list[str]) -> int:
    lanes = lanes_wanted()
    nox = _nox()
    if lanes == 1 or wants_plain_nox(argv):
        return subprocess.call([*nox, *argv])
    seconds, _ = test_plan.measured_seconds()
    dealt = deal(test_plan.default_sessions(), seconds, lanes)
    runner = _Lanes()
    signal.signal(signal.SIGTERM, runner.stop)
    signal.signal(signal.SIGINT, runner.stop)
    threads = []
    for i, sessions in enumerate(dealt, start=1):
        cmd = lane_command(nox, argv, sessions)
        with runner.out_lock:
            print(f"test_lanes: lane {i}: {' '.join(cmd)}", flush=True)
        threads.append(runner.start(i, cmd))
    codes = [p.wait() for p in runner.procs]
    if runner.stopping is not None:
        os._exit(130 if runner.stopping == signal.SIGINT else 124)  # the SIGKILL timer need not wait
    for t in threads:
        t.join(timeout=10)
    failed = [(i, c) for i, c in enumerate(codes, start=1) if c != 0]
    for i, c in failed:
        print(f"test_lanes: lane {i} ({' '.join(dealt[i - 1])}) failed with exit status {c}", flush=True)
    return failed[0][1] if failed else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
