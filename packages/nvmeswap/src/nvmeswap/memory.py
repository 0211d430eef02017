"""How much RAM this process can still take: the machine's and its memory cgroup's.

Used where nvmeswap would bring state back into RAM that it keeps on disk (detach), so that a
request that cannot fit is refused before anything changes, instead of the kernel's OOM killer
ending the process half-way."""

from __future__ import annotations

from pathlib import Path

__all__ = ["NotEnoughMemoryError", "available_bytes", "cgroup_headroom", "meminfo"]


class NotEnoughMemoryError(RuntimeError):
    """What nvmeswap was asked to bring into RAM is more than this process can take now; nothing
    was changed."""


def meminfo(key: str) -> int | None:
    """``/proc/meminfo``'s ``key`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2's "max": no limit


def _stat(path: Path, keys: tuple[str, ...]) -> int:
    """The sum of ``keys`` in a cgroup's ``memory.stat`` (0 where it cannot be read)."""
    total = 0
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in keys and value.strip().isdigit():
                total += int(value)
    except OSError:
        pass
    return total


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's memory cgroup still allows: its limit less what it holds, the file
    pages it holds counted as free (the kernel reclaims them before it kills); None without a
    limit (or where it cannot be read).  cgroup v1's memory controller, else v2's."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    entries = [ln.split(":", 2) for ln in lines if ln.count(":") >= 2]  # id:controllers:path
    v1 = [rel for _, ctl, rel in entries if "memory" in ctl.split(",")]
    v2 = [rel for _, ctl, rel in entries if ctl == ""]
    if v1:
        base = Path(root, "memory", v1[0].strip("/"))
        limit, usage = _read_int(base / "memory.limit_in_bytes"), _read_int(base / "memory.usage_in_bytes")
        files = _stat(base / "memory.stat", ("total_inactive_file", "total_active_file"))
    elif v2:
        base = Path(root, v2[0].strip("/"))
        limit, usage = _read_int(base / "memory.max"), _read_int(base / "memory.current")
        files = _stat(base / "memory.stat", ("file",))
    else:
        return None
    if limit is None or usage is None or limit >= 1 << 60:  # v1 reports "no limit" as a huge number
        return None
    return max(0, limit - usage + files)


def available_bytes() -> int | None:
    """The RAM this process can take now: the machine's ``MemAvailable``, or its memory cgroup's
    headroom where that is less (None where neither can be read)."""
    known = [v for v in (meminfo("MemAvailable"), cgroup_headroom()) if v is not None]
    return min(known) if known else None
