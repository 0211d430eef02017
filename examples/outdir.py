"""Where a demo command writes its report, without overwriting another command's.

Without ``--out`` every command gets its own folder under ``reports/``, named by its start time
and run set (``reports/20261126-201502-default``), and ``reports/latest`` is a link to the
newest.  With ``--out DIR`` the command writes to DIR, but refuses a DIR that already holds
another command's report (its ``results.json``) unless ``--force`` is given.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

REPORTS = Path("reports")
"""The parent of the per-command folders, relative to the working directory."""
LATEST = "latest"
"""The link, inside :data:`REPORTS`, to the newest command's folder."""


def run_set_tag(runs: str | None, nodes: int = 1) -> str:
    """A short name for the command's runs: ``default``, ``all`` or the names joined by ``-``
    (cut to 40 characters), with ``-2nodes`` for emulated nodes."""
    if runs is None:
        tag = "default"
    elif runs.strip() == "all":
        tag = "all"
    else:
        tag = re.sub(r"[^A-Za-z0-9.+-]+", "-", runs.strip()).strip("-")[:40] or "runs"
    return tag + (f"-{nodes}nodes" if nodes > 1 else "")


def new_folder(tag: str, parent: Path = REPORTS, now: float | None = None) -> Path:
    """A folder name under ``parent`` that no command used yet: start time (UTC) and ``tag``,
    with ``-2``, ``-3``... when two commands start in the same second.  Not created here."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    folder = parent / f"{stamp}-{tag}"
    n = 2
    while folder.exists():
        folder = parent / f"{stamp}-{tag}-{n}"
        n += 1
    return folder


class OutExists(Exception):
    """``--out`` names a folder with another command's report, and ``--force`` was not given."""


def choose(out: str | None, force: bool, tag: str, parent: Path = REPORTS) -> Path:
    """The report folder of this command (see the module docstring); raises :class:`OutExists`
    naming the folder and the two ways out when ``out`` holds a report and ``force`` is off."""
    if out is None:
        return new_folder(tag, parent)
    folder = Path(out)
    if (folder / "results.json").exists() and not force:
        raise OutExists(
            f"--out {out}: that folder already holds a report (results.json) of an earlier command; "
            "give another --out, leave --out out (each command then writes its own folder under "
            f"{parent}/, {parent}/{LATEST} the newest), or add --force to overwrite it"
        )
    return folder


def point_latest(folder: Path, parent: Path = REPORTS) -> Path | None:
    """Make ``parent/latest`` a link to ``folder`` when ``folder`` is directly under ``parent``
    (replacing the old link at once); returns the link, or None when it was left alone."""
    folder = Path(folder)
    if folder.parent.resolve() != Path(parent).resolve():
        return None
    link = Path(parent) / LATEST
    if link.exists() and not link.is_symlink():
        return None  # a real folder named latest: not ours to replace
    tmp = Path(parent) / f".{LATEST}-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(folder.name, tmp)
    os.replace(tmp, link)
    return link
