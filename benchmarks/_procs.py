"""Child processes for the GPU suite and its benchmarks: each in its own process group, killed
with everything it started, results kept when a child prints its result and then hangs.

Standard library only (the suite must report even when the install is broken).

- :func:`start` starts a command in a new session (its own process group) with its output in a
  file; on Linux the child also gets ``PR_SET_PDEATHSIG`` (SIGKILL), so it dies with the suite
  even when the suite itself is killed with SIGKILL.
- :func:`run_group` runs one to its end, its time limit, or ``grace`` seconds after the line
  starting with ``tag`` appeared in its output (a child hanging at exit after printing its
  result: the result is kept, the group killed).
- :func:`kill_all` kills every group still running (the suite's SIGTERM handler and deadline).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LIVE: dict[int, tuple[subprocess.Popen[Any], float]] = {}
"""pid -> (process, start time) of every group started and not yet reaped."""


def _die_with_parent() -> None:
    os.setsid()
    with contextlib.suppress(Exception):  # Linux only; elsewhere the groups are killed explicitly
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, append: bool = False
) -> subprocess.Popen[Any]:
    """Start ``cmd`` in its own session and process group, stdout and stderr into ``log``."""
    with open(log, "ab" if append else "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
    _LIVE[proc.pid] = (proc, time.time())
    return proc


def remove_new_locks(since: float) -> list[str]:
    """Remove the JIT build locks made since ``since`` under TORCH_EXTENSIONS_DIR: a build killed
    midway leaves its ``lock`` file behind, and every later load of that extension waits on it."""
    folder = os.environ.get("TORCH_EXTENSIONS_DIR")
    removed = []
    for lock in Path(folder).rglob("lock") if folder and Path(folder).is_dir() else []:
        try:
            if lock.stat().st_mtime >= since - 1:
                lock.unlink()
                removed.append(str(lock))
        except OSError:
            pass
    return removed


def kill_group(proc: subprocess.Popen[Any], since: float | None = None, term_wait: float = 3.0) -> None:
    """Stop ``proc``'s process group (TERM, then KILL after ``term_wait`` s; the KILL goes to the
    group even when the leader is gone, for its children) and remove the JIT build locks made
    since ``since`` (default: the process's start)."""
    t0 = _LIVE.get(proc.pid, (proc, time.time()))[1]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=term_wait)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    _LIVE.pop(proc.pid, None)
    remove_new_locks(since if since is not None else t0)


def kill_all() -> int:
    """Kill every group started by :func:`start` that is still running; how many."""
    procs = list(_LIVE.values())
    for proc, t0 in procs:
        kill_group(proc, t0, term_wait=1.0)
    return len(procs)


def reap(proc: subprocess.Popen[Any]) -> int | None:
    """``proc.poll()``, forgetting the group once its leader ended; the leader's children (a
    compiler, a daemon thread's process) are killed with it."""
    rc = proc.poll()
    if rc is not None and proc.pid in _LIVE:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _LIVE.pop(proc.pid, None)
    return rc


@dataclass
class Outcome:
    rc: int | None
    """The exit status; None when the group was killed (its limit, or after its result line)."""
    text: str
    seconds: float
    cut: bool = False
    """Killed at its time limit."""
    hung_after_result: float | None = None
    """Seconds it was given after printing its result line before it was killed (it hung at exit)."""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rc == 0 or self.hung_after_result is not None


def run_group(
    cmd: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    tag: str | None = None,
    grace: float = 10.0,
) -> Outcome:
    """Run ``cmd`` in its own process group for at most ``timeout`` seconds, its output in ``log``
    (a temporary file when None) and returned.  When ``tag`` is given and a line starting with it
    appears, the child has ``grace`` seconds more to exit, then its group is killed and the
    outcome counts as a success (``hung_after_result``)."""
    import tempfile

    t0 = time.time()
    tmp = None
    if log is None:
        fd, name = tempfile.mkstemp(prefix="run_group-", suffix=".log")
        os.close(fd)
        log = tmp = Path(name)
    proc = None
    try:
        proc = start(cmd, log, env)
        end = t0 + max(timeout, 0.1)
        seen_at: float | None = None
        offset, partial = 0, b""
        rc: int | None = None
        while True:
            rc = reap(proc)
            if rc is not None:
                break
            if tag is not None and seen_at is None:
                with open(log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                if any(x.startswith(tag.encode()) for x in lines):
                    seen_at = time.time()
                    end = min(end, seen_at + grace)
            if time.time() >= end:
                break
            time.sleep(0.1)
        out = Outcome(rc=rc, text="", seconds=0.0)
        if rc is None:
            kill_group(proc, t0)
            if seen_at is not None:
                out.hung_after_result = round(time.time() - seen_at, 1)
                out.notes.append(f"printed its result, then did not exit within {grace:.0f} s: killed")
            else:
                out.cut = True
        out.text = log.read_text(errors="replace")
        out.seconds = round(time.time() - t0, 1)
        return out
    except BaseException:  # a signal handler's exception (SIGTERM from outside): the group goes too
        if proc is not None and proc.pid in _LIVE:
            kill_group(proc, t0, term_wait=1.0)
        raise
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
