"""The end every benchmark shares: its results as JSON and markdown under ``OUT`` (and a plot).

Benchmarks run as ``python benchmarks/<name>.py``, so this module is imported by name from the
script's folder.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_report(
    out: Path,
    name: str,
    results: Any,
    markdown: str,
    plot: Callable[[Any, Path], None] | None = None,
    indent: int = 1,
    echo: bool = True,
) -> None:
    """Write ``<name>.json`` and ``<name>.md`` into ``out``, print the markdown (unless not
    ``echo``: a partial report rewritten as a long benchmark goes), and draw ``<name>.png`` with
    ``plot(results, path)`` when given (skipped, saying so, without matplotlib)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=indent))
    (out / f"{name}.md").write_text(markdown + "\n")
    if echo:
        print(markdown)
    if plot is None:
        return
    try:
        plot(results, out / f"{name}.png")
        if echo:
            print(f"plot: {out / f'{name}.png'}")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)


def save_figure(fig: Any, path: Path, dpi: int = 100) -> None:
    """Lay out, save and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
