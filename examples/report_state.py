"""The report's like-for-like comparisons, model state by kind and step-time noise.

Each run is compared with the baselines it names (``runs.Run.baselines``, saved in its result
as ``baselines``): the first of them that this command trained; a run whose baselines did not
run is compared with the first run, and the report says that it is not like for like.  Memory is
the model state each rank holds, by kind (``measure.model_state_bytes``), which is exact at any
model size; the peak RSS stays in the main table with its noise.  Step times are single runs on
a shared machine: each ratio comes with the spread of the steps (quartiles) and the machine's
load while the runs trained.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

Result = dict[str, Any]

KINDS = (
    "parameters",
    "master parameters",
    "gradients",
    "optimizer state",
    "swap buffers",
    "error buffers",
    "other",
)
"""Kinds drawn and summed in the table; DeepSpeed's gradient buckets are said apart (below)."""
BUCKETS = "gradient buckets"
"""ZeRO 3's reduce bucket: allocated at reduce_bucket_size (about 1 GB for bf16 by default),
its pages touched only as gradients pass through, so mostly not resident."""


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def references(r: Result, results: list[Result]) -> tuple[list[Result], bool]:
    """The runs ``r`` is compared with, and whether that is like for like: its named baselines
    that trained in this command, else the first trained run (not like for like)."""
    ok = {x["name"]: x for x in results if x.get("status") == "ok"}
    named = [ok[n] for n in r.get("baselines") or () if n in ok and n != r["name"]]
    if named:
        return named, True
    first = next(iter(ok.values()), None)
    if first is None or first is r:
        return [], True
    return [first], not r.get("baselines")


def state_rank0(r: Result) -> dict[str, int]:
    per_rank = r.get("state_bytes") or []
    return dict(per_rank[0]) if per_rank and per_rank[0] else {}


def state_total(state: dict[str, int]) -> int:
    return sum(v for k, v in state.items() if k != BUCKETS)


def state_cell(r: Result) -> str:
    """Rank 0's model state: the total, then each kind (gradient buckets apart)."""
    state = state_rank0(r)
    if not state:
        return "n/a"
    parts = [f"**{human(state_total(state))}**"]
    parts += [f"{k} {human(state[k])}" for k in KINDS if state.get(k)]
    if state.get(BUCKETS):
        parts.append(f"(+ gradient bucket {human(state[BUCKETS])} allocated)")
    return "<br>".join(parts)


def state_change(r: Result, ref: Result) -> str | None:
    """What changed in rank 0's model state, kind by kind, e.g. ``model state 1.20 MiB -> 0.80
    MiB/rank (optimizer state -640 KiB, swap buffers +136 KiB)``; None when unchanged or unknown."""
    a, b = state_rank0(r), state_rank0(ref)
    if not a or not b:
        return None
    diffs = [(k, a.get(k, 0) - b.get(k, 0)) for k in KINDS if a.get(k, 0) != b.get(k, 0)]
    if not diffs:
        return None
    said = ", ".join(f"{k} {'+' if d > 0 else '-'}{human(abs(d))}" for k, d in diffs)
    return f"model state {human(state_total(b))} -> {human(state_total(a))}/rank ({said})"


def steady_times(r: Result) -> list[float]:
    times = r.get("step_time_s") or []
    return times[r.get("warmup_steps", 0) :] or times


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        x = xs[0] if xs else math.nan
        return x, x, x
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return q1, q2, q3


def time_ratio(r: Result, ref: Result) -> str | None:
    """``step time 1.05x (steps' spread 0.91-1.22x, within the noise)``: the ratio of the median
    steady steps, and the range from the quartiles (q1/q3 of the reference to q3/q1)."""
    a, b = quartiles(steady_times(r)), quartiles(steady_times(ref))
    if any(math.isnan(x) or x <= 0 for x in (*a, *b)):
        return None
    ratio, lo, hi = a[1] / b[1], a[0] / b[2], a[2] / b[0]
    noise = "within the noise" if lo <= 1 <= hi else "beyond the steps' spread, still one run each"
    la, lb = r.get("load_avg") or [], ref.get("load_avg") or []
    load = f"; load {_span(la)} vs {_span(lb)}" if la and lb else ""
    return f"step time {ratio:.2f}x (steps' spread {lo:.2f}-{hi:.2f}x, {noise}{load})"


def _span(xs: list[float]) -> str:
    return f"{min(xs):.1f}" if max(xs) - min(xs) < 0.05 else f"{min(xs):.1f}-{max(xs):.1f}"


def left_out_lines(meta: dict[str, Any]) -> list[str]:
    """The like-for-like baselines this command did not train, with the reason."""
    left = meta.get("baselines_left_out") or {}
    return [f"- baseline `{name}` not trained here: {why}." for name, why in left.items()]


def load_range(results: list[Result]) -> tuple[float, float] | None:
    loads = [x for r in results if r.get("status") == "ok" for x in r.get("load_avg") or []]
    return (min(loads), max(loads)) if loads else None


def noise_lines(results: list[Result], cores: int | None) -> list[str]:
    """What the step times are worth: single runs, the spread shown, the load while they ran."""
    load = load_range(results)
    said = (
        f"the machine's 1-minute load average was {load[0]:.1f} to {load[1]:.1f} while the runs trained"
        + (f" ({cores} cores)" if cores else "")
        if load
        else "the machine's load was not measured"
    )
    return [
        f"- step times are single runs, one after another, on a machine that may be shared: {said}. "
        "Each ratio is of the median steps after the warm-up, with the range the steps' quartiles "
        "give (q1/q3 to q3/q1); a range that holds 1.00x is within the noise. Repeat the command "
        "(or --runs a,b,a,b) before reading a difference smaller than that range.",
    ]


def memory_lines() -> list[str]:
    return [
        "- model state /rank: bytes of the tensors the engine holds on rank 0, by kind, counted "
        "once however many tensors view them (`measure.model_state_bytes`), at the second step "
        "between backward and the optimizer step (gradients held, optimizer state made): "
        "parameters (16-bit model weights; ZeRO 3: this rank's partition), master parameters "
        "(fp32 copies the optimizer steps), gradients, optimizer state (Adam's moments), swap "
        "buffers (nvmeswap's RAM buffers; its state on disk counts nothing), error buffers (loco's "
        "error feedback), other (scratch, flags). ZeRO 3's gradient bucket is said apart: "
        "DeepSpeed allocates it at reduce_bucket_size and touches its pages only as used.",
    ]


def plot_memory(results: list[Result], path: Path, colors: dict[str, str]) -> None:
    """Rank 0's model state by kind, one stacked bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(r["name"], state_rank0(r)) for r in results if r.get("status") == "ok" and state_rank0(r)]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.45 * max(1, len(rows))), dpi=110)
    if not rows:
        ax.text(0.5, 0.5, "no model state measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        kib = 1024
        for kind_i, kind in enumerate(KINDS):
            lefts = [sum(s.get(k, 0) for k in KINDS[:kind_i]) / kib for _, s in rows]
            widths = [s.get(kind, 0) / kib for _, s in rows]
            ax.barh(range(len(rows)), widths, left=lefts, color=f"C{kind_i}", label=kind, height=0.6)
        for i, (_, s) in enumerate(rows):
            note = human(state_total(s)) + (f"  (+ bucket {human(s[BUCKETS])})" if s.get(BUCKETS) else "")
            ax.annotate(f" {note}", (state_total(s) / kib, i), va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [n for n, _ in rows], fontsize=9)
        for tick, (name, _) in zip(ax.get_yticklabels(), rows, strict=True):
            tick.set_color(colors.get(name, "black"))
        ax.invert_yaxis()
        top = max(state_total(s) for _, s in rows) / kib
        ax.set_xlim(0, top * 1.45)
        ax.set_xlabel("KiB on rank 0")
        ax.legend(fontsize=8, loc="lower right", ncol=2)
        ax.grid(True, axis="x", alpha=0.3)
    ax.set_title("Model state per rank by kind (tensors the engine holds; ZeRO 3's gradient bucket apart)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
