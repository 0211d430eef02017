"""The GPU suite's time plan, its section statuses and its markdown report.  Standard library only.

The plan splits a slot (default 500 s, ``--budget``) between the sections in order of value; each
section may run until its planned end (the sum of its and the earlier sections' budgets), so time
an earlier section did not use goes to the next ones.  A section stopped at its planned end is
``cut by its own limit``; one stopped by the hard deadline (``--deadline``, or SIGTERM from
outside) ``cut by the deadline``.
"""

from __future__ import annotations

from typing import Any

RESERVE_S = 8.0
"""Kept after the last section: killing a group (up to 8 s) and writing the results."""

PLAN: tuple[tuple[str, float, float, str], ...] = (
    # name, weight (share of the slot), floor (s), what it answers
    # Weights from the H100 run of 2026-11-26 (benchmarks/gpu-runs/): info 8 s, build 54 s, gpu-tests
    # 13 s, loco-kernels 9 s, pairs 283 s for one round of 12 runs, nvme 29 s (nvmeswap alone;
    # DeepSpeed's run doubles it where libaio is there), multirank one pair of processes per crash.
    # gpu-tests doubled after the third session (2026-11-27): beside DeepSpeed's async_io build in
    # the background its 61 tests did not finish in 27 s (8.5 s alone, in the slot that followed).
    (
        "info",
        3,
        15,
        "versions, device, CUDA_HOME, ninja; DeepSpeed's async_io probe alongside (its real reason)",
    ),
    (
        "build",
        12,
        5,
        "loco's and nvmeswap's kernels, side by side where there are >= 4 cores; DeepSpeed's "
        "async_io op builds in the background until the nvme section",
    ),
    (
        "gpu-tests",
        10,
        8,
        "loco's CUDA kernels bitwise against the reference, vec16 (the default) and warp (pytest -m gpu)",
    ),
    (
        "loco-kernels",
        3,
        5,
        "loco's kernels' bandwidth against the device's copy, vec16 (the default) and warp (goal >= 0.7)",
    ),
    (
        "pairs",
        62,
        8,
        "accumdtype, autocastzero, mixedlayers against their DeepSpeed equivalents, ZeRO 2 then 3, "
        "1 round of 12 timed steps per run (quartiles), one process per run, one profiled step each "
        "(the ops whose time differs); loco's pair skipped (world size 1 shows nothing)",
    ),
    ("ds-aio-build", 0, 0, "joins DeepSpeed's async_io build (waits at most a third of the nvme budget)"),
    (
        "nvme",
        11,
        8,
        "nvmeswap against DeepSpeed's NVMe offload, ZeRO 3, a 43 M-parameter GPT, 1 round (fits its budget)",
    ),
    (
        "multirank",
        5,
        5,
        "two ranks on the one GPU over gloo (NCCL refuses two ranks on one device): which collectives "
        "take CUDA tensors, loco's exchange on device buffers",
    ),
)
SECTIONS = tuple(name for name, *_ in PLAN)

STATES = ("ok", "failed", "cut-limit", "cut-deadline", "skipped")
"""Every section ends in exactly one: ok / failed (why) / cut by its own limit / cut by the
deadline / skipped (why)."""


def make_plan(total: float) -> dict[str, float]:
    """Seconds for each section out of ``total``: shares by weight, but at least the floor; where
    the floors do not fit, the first sections (in order of value) get theirs and the last none."""
    if sum(floor for _, _, floor, _ in PLAN) >= total:
        budgets, left = {}, max(total, 0.0)
        for n, _, floor, _ in PLAN:
            budgets[n] = round(min(floor, left), 1)
            left -= budgets[n]
        return budgets
    budgets = {}
    fixed: dict[str, float] = {}
    while True:
        free = total - sum(fixed.values())
        weights = sum(w for n, w, _, _ in PLAN if n not in fixed)
        budgets = {n: fixed.get(n, max(free, 0) * w / weights if weights else 0.0) for n, w, _, _ in PLAN}
        low = [n for n, _, floor, _ in PLAN if n not in fixed and budgets[n] < floor]
        if not low:
            break
        for n, _, floor, _ in PLAN:
            if n in low:
                fixed[n] = floor
    scale = total / sum(budgets.values()) if sum(budgets.values()) > total > 0 else 1.0
    return {n: round(b * scale, 1) for n, b in budgets.items()}


def plan_table(plan: dict[str, float], skip: set[str], start_s: float) -> str:
    """The plan as a markdown table: section, budget, planned end (s since the start), what."""
    lines = ["| section | budget (s) | planned end (s) | what |", "|---|---|---|---|"]
    end = start_s
    for name, _, _, what in PLAN:
        b = 0.0 if name in skip else plan[name]
        end += b
        shown = "skipped (--skip)" if name in skip else f"{b:.0f}"
        lines.append(f"| {name} | {shown} | {end:.0f} | {what} |")
    return "\n".join(lines)


def status_text(state: str, detail: str = "") -> str:
    words = {
        "ok": "ok",
        "failed": "failed",
        "cut-limit": "cut by its own limit",
        "cut-deadline": "cut by the deadline",
        "skipped": "skipped",
    }[state]
    return f"{words} ({detail})" if detail else words


def remaining(sections: list[dict[str, Any]]) -> list[str]:
    """Sections a second run should do: those cut, failed, or not started because of the deadline."""
    done = {s["name"] for s in sections if s.get("state") in ("ok", "skipped")}
    return [n for n in SECTIONS if n not in done]


def markdown(data: dict[str, Any], render: dict[str, Any]) -> str:
    """results.md; ``render`` maps a section name to the function writing its data's markdown."""
    lines = [
        "# GPU suite results",
        "",
        f"Device: {data.get('device', '?')}; status: {data['status']}; budget {data.get('budget_s', '?')} s, "
        f"deadline {data['deadline_s']} s"
        + ("; CPU smoke check (tiny model)" if data.get("cpu_smoke") else ""),
        f"Command: `{data['command']}`",
    ]
    if data.get("remaining"):
        again = f"--skip {data['continue_skip']}" if data.get("continue_skip") else "no --skip"
        lines.append(f"Not done: {', '.join(data['remaining'])}; a second run continues with `{again}`")
    lines += [f"- {n}" for n in data.get("notes", [])]
    lines += ["", "| section | status | seconds | budget (s) |", "|---|---|---|---|"]
    for s in data["sections"]:
        lines.append(f"| {s['name']} | {s['status']} | {s.get('seconds', 0)} | {s.get('budget_s', '-')} |")
    if data.get("plan_table"):
        lines += ["", "## Time plan", "", data["plan_table"]]
    env = data.get("env") or {}
    if env:
        lines += ["", "## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
    for s in data["sections"]:
        d = s.get("data")
        if not d:
            continue
        lines += ["", f"## {s['name']}", ""]
        if s["name"] in ("info", "build", "ds-aio-build"):
            lines += [f"- {k}: {v}" for k, v in d.items()]
        elif s["name"] == "gpu-tests":
            lines.append(", ".join(f"{v} {k}" for k, v in d.items()))
        elif s["name"] == "loco-kernels":
            if "skipped" in d:
                lines.append(f"skipped: {d['skipped']}")
            else:
                lines.append(f"device copy {d['copy_GBps']:.0f} GB/s; {d['elements']} elements")
                lines += ["", "| variant | kernel | GB/s | of copy |", "|---|---|---|---|"]
                for variant, figures in d.get("variants", {"warp": d["kernels"]}).items():
                    for k, v in figures.items():
                        lines.append(
                            f"| {variant} | {k} | {v.get('GBps', 0):.0f} | {v.get('fraction_of_copy', 0):.2f} |"
                        )
        elif s["name"] in render:
            lines.append(render[s["name"]](d))
    return "\n".join(lines) + "\n"
