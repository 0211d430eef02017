"""The demo's report folder: loss.png, comm_bytes.png, report.md and results.json.

Works from the plain dicts that ``train_gpt.py`` collects (one per run), so a report can be
redrawn from a saved ``results.json``: ``python examples/report.py reports/demo``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def comm_per_step(result: Result) -> dict[str, float] | None:
    """Mean bytes per optimizer step, summed over ranks, keyed ``"collective dtype"``."""
    steps = result.get("comm_bytes")  # per step: {collective: {dtype: bytes}} summed over ranks
    if not steps:
        return None
    totals: dict[str, float] = {}
    for step in steps:
        for coll, by_dtype in step.items():
            for dtype, nbytes in by_dtype.items():
                key = f"{coll} {dtype}"
                totals[key] = totals.get(key, 0.0) + nbytes
    return {k: v / len(steps) for k, v in sorted(totals.items())}


def summarize(result: Result) -> dict[str, Any]:
    warmup = result.get("warmup_steps", 0)
    times = result.get("step_time_s", [])
    steady = times[warmup:] or times
    step_s = _mean(steady)
    losses = result.get("train_loss", [])
    tail = losses[-10:]
    val = result.get("val_loss", [])
    return {
        "final_train_loss": _mean(tail),
        "final_val_loss": val[-1][1] if val else math.nan,
        "step_time_ms": step_s * 1e3,
        "tokens_per_s": result.get("tokens_per_step", 0) / step_s if step_s else math.nan,
        "comm_bytes_per_step": comm_per_step(result),
    }


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(results: list[Result], meta: dict[str, Any]) -> str:
    lines = ["# GPT training demo", ""]
    lines.append(f"Command: `{meta.get('command', '')}`  ")
    lines.append(
        f"{meta.get('world_size')} ranks on {meta.get('device')} ({meta.get('backend')}); "
        f"torch {meta.get('torch')}, deepspeed {meta.get('deepspeed')}, "
        f"zerohooks {meta.get('zerohooks') or 'not installed'}.  "
    )
    m = meta.get("model", {})
    lines.append(
        f"Model: {m.get('n_layer')} layers, d_model {m.get('d_model')}, {m.get('n_head')} heads, "
        f"seq {m.get('seq_len')}, {meta.get('n_params', 0) / 1e6:.2f} M parameters (tied head).  "
    )
    lines.append(
        f"Data: {meta.get('data', {}).get('train_bytes', 0) / 2**20:.1f} MiB train / "
        f"{meta.get('data', {}).get('val_bytes', 0) / 2**10:.0f} KiB validation bytes of "
        f"Python standard library source ({meta.get('data', {}).get('root')}).  "
    )
    lines.append(
        f"{meta.get('steps')} optimizer steps of {meta.get('tokens_per_step')} tokens "
        f"(micro-batch {meta.get('micro_batch')} x grad-accum {meta.get('grad_accum')} x "
        f"{meta.get('world_size')} ranks x seq {m.get('seq_len')}).  "
    )
    lines.append(f"Wall time from the command's start to this report: {meta.get('wall_time_s')} s.")
    lines += [
        "",
        "| run | ZeRO stage | dtype | offload | final train loss | final val loss "
        "| step time (ms) | tokens/s | gradient-collective bytes/step | peak memory |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    skipped: list[str] = []
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | | | | {r.get('status')}: {r.get('reason', '')} | | | | | |")
            skipped.append(f"- `{r['name']}` {r.get('status')}: {r.get('reason', '')}")
            continue
        s = summarize(r)
        comm = s["comm_bytes_per_step"]
        comm_txt = "<br>".join(f"{k}: {human_bytes(v)}" for k, v in comm.items()) if comm else "n/a"
        if comm == {}:
            comm_txt = "none counted"
        peak = r.get("peak_memory_bytes")
        lines.append(
            f"| {r['name']} | {r.get('zero_stage')} | {r.get('dtype')} | "
            f"{r.get('offload') or 'none'} | {_fmt(s['final_train_loss'], '.4f')} | "
            f"{_fmt(s['final_val_loss'], '.4f')} | {_fmt(s['step_time_ms'], '.1f')} | "
            f"{_fmt(s['tokens_per_s'], ',.0f')} | {comm_txt} | "
            f"{human_bytes(peak) if peak else 'n/a'} |"
        )
    lines += [
        "",
        "- final train loss: mean over the last 10 steps (each step's loss averaged over ranks);"
        " final val loss: the last evaluation on the held-out files.",
        f"- step time: mean wall time of an optimizer step (slowest rank), excluding the first "
        f"{meta.get('warmup_steps')} steps and the evaluations; tokens/s: global.",
        "- gradient-collective bytes/step: bytes handed to each collective per optimizer step, "
        "summed over all ranks, from `zerohooks` communication counters (n/a without them).",
        f"- peak memory: {meta.get('memory_kind', '')}, the largest over ranks.",
    ]
    if skipped:
        lines += ["", "Skipped runs:", *skipped]
    lines += ["", "![loss](loss.png)", "", "![communication bytes](comm_bytes.png)", ""]
    return "\n".join(lines)


def centered_mean(xs: list[float], window: int) -> list[float]:
    """Moving average centred on each point (shorter windows at the ends): no lag."""
    half = window // 2
    out = []
    for i in range(len(xs)):
        lo, hi = max(0, i - half), min(len(xs), i + half + 1)
        out.append(sum(xs[lo:hi]) / (hi - lo))
    return out


def plot_loss(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    ok = [r for r in results if r.get("status") == "ok"]
    for i, r in enumerate(ok):
        color = f"C{i % 10}"
        style = ("-", "--", "-.", ":")[i % 4]
        marker = "osD^v"[i % 5]
        losses = r["train_loss"]
        steps = list(range(1, len(losses) + 1))
        ax.plot(steps, losses, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(
            steps,
            centered_mean(losses, 9),
            color=color,
            linewidth=1.8,
            linestyle=style,  # identical runs overlap: the styles keep each one visible
            label=f"{r['name']} train (9-step mean)",
        )
        if r.get("val_loss"):
            vs, vl = zip(*r["val_loss"], strict=True)
            ax.plot(
                vs,
                vl,
                color=color,
                marker=marker,
                markersize=7 - 1.5 * (i % 3),
                linestyle=":",
                linewidth=1,
                label=f"{r['name']} val",
            )
    if not ok:
        ax.text(0.5, 0.5, "no completed run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("GPT on Python stdlib bytes: training loss (light: raw) and validation loss")
    ax.grid(True, alpha=0.3)
    if ok:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_comm(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_run: dict[str, dict[str, float]] = {}
    for r in results:
        comm = comm_per_step(r) if r.get("status") == "ok" else None
        if comm:
            per_run[r["name"]] = comm
    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    if not per_run:
        ax.text(
            0.5,
            0.5,
            "no communication counters\n(zerohooks is not installed, or it counted nothing)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
    else:
        keys = sorted({k for v in per_run.values() for k in v})
        xs = list(range(len(per_run)))
        bottom = [0.0] * len(per_run)
        for j, key in enumerate(keys):  # one bar per run, stacked by collective and dtype
            ys = [v.get(key, 0.0) / 2**20 for v in per_run.values()]
            ax.bar(xs, ys, width=0.5, bottom=bottom, label=key, color=f"C{j % 10}")
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        for x, total in zip(xs, bottom, strict=True):
            ax.annotate(f"{total:.2f} MiB", (x, total), ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, max(bottom) * 1.12 or 1.0)
        ax.set_xticks(range(len(per_run)), list(per_run))
        ax.set_xlim(-0.6, len(per_run) - 0.4)
        ax.set_ylabel("MiB per optimizer step (sum over ranks)")
        ax.set_title("Bytes handed to the gradient collectives per step, by collective and dtype")
        ax.legend(title="collective dtype", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(out: str | os.PathLike[str], results: list[Result], meta: dict[str, Any]) -> Path:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "results.json", "w") as f:
        json.dump({"meta": meta, "runs": results}, f, indent=1)
    plot_loss(results, folder / "loss.png")
    plot_comm(results, folder / "comm_bytes.png")
    (folder / "report.md").write_text(markdown(results, meta))
    return folder


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python examples/report.py REPORT_FOLDER  (redraws it from results.json)")
        return 2
    data = json.loads((Path(argv[0]) / "results.json").read_text())
    print(write_report(argv[0], data["runs"], data["meta"]) / "report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
