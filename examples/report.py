"""The demo's report folder: loss.png, comm_bytes.png, report.md and results.json.

Works from the plain dicts that ``train_gpt.py`` collects (one per run), so a report can be
redrawn from a saved ``results.json``: ``python examples/report.py reports/latest``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import report_state

Result = dict[str, Any]


human_bytes = report_state.human
"""Bytes in B/KiB/MiB/GiB (one formatter for the wire, disk and model-state columns)."""


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def run_colors(results: list[Result]) -> dict[str, str]:
    """One colour per run, the same in every figure (by the run's place in ``results``)."""
    return {r["name"]: f"C{i % 10}" for i, r in enumerate(results)}


def comm_per_step(result: Result, key: str = "comm_bytes") -> dict[str, float] | None:
    """Mean bytes per optimizer step, summed over ranks, keyed ``"collective dtype"``:
    ``key="comm_bytes"`` handed to the gradient collectives, ``"wire_bytes"`` sent on the wire."""
    steps = result.get(key)  # per step: {collective: {dtype: bytes}} summed over ranks
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
        "wire_bytes_per_step": comm_per_step(result, "wire_bytes"),
    }


def wire_ratios(results: list[Result]) -> tuple[str | None, dict[str, float]]:
    """Each run's wire bytes per step over the first completed run's (the reference)."""
    ref_name, ref, out = None, None, {}
    for r in results:
        wire = comm_per_step(r, "wire_bytes") if r.get("status") == "ok" else None
        if not wire:
            continue
        total = sum(wire.values())
        if ref is None:
            ref_name, ref = r["name"], total
        if ref:
            out[r["name"]] = total / ref
    return ref_name, out


def _breakdown(comm: dict[str, float] | None) -> str:
    if comm is None:
        return "n/a"
    if not comm:
        return "none counted"
    total = f"**{human_bytes(sum(comm.values()))}**"
    return total + "".join(f"<br>{k}: {human_bytes(v)}" for k, v in comm.items())


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _dtype_split(dtypes: dict[str, int] | None) -> str:
    if not dtypes:
        return "n/a"
    total = sum(dtypes.values()) or 1
    return ", ".join(f"{d} {n / total:.0%}" for d, n in sorted(dtypes.items(), key=lambda kv: -kv[1]))


def changes(r: Result, ref: Result | None) -> list[str]:
    """In words, what run ``r`` changed against the reference run ``ref`` (its like-for-like
    baseline, ``report_state.references``), by how much: each measured figure that differs."""
    out: list[str] = []
    if ref is None or r is ref:
        return out
    s, s0 = summarize(r), summarize(ref)
    wire, wire0 = s["wire_bytes_per_step"], s0["wire_bytes_per_step"]
    if wire and wire0:
        a, b = sum(wire.values()), sum(wire0.values())
        if b and abs(a / b - 1) > 0.005:
            out.append(f"bytes on the wire {human_bytes(a)}/step, {a / b:.3f}x")
    cd, cd0 = r.get("comm_dtypes") or [], ref.get("comm_dtypes") or []
    if cd and cd != cd0:
        out.append(f"gradients handed over in {'/'.join(cd)} (was {'/'.join(cd0) or 'n/a'})")
    err, err0 = r.get("grad_error"), ref.get("grad_error")
    if err is not None and err0 is not None and (err0 == 0 or abs(err / err0 - 1) > 0.05 or err == 0):
        out.append(f"gradient error vs fp64 {err:.2e} (was {err0:.2e})")
    pd, pd0 = r.get("param_dtypes"), ref.get("param_dtypes")
    if pd and pd != pd0:
        out.append(f"parameters {_dtype_split(pd)} (was {_dtype_split(pd0)})")
    if r.get("zero_stage") != ref.get("zero_stage"):
        out.append(f"ZeRO stage {r.get('zero_stage')} (was {ref.get('zero_stage')})")
    if r.get("offload") != ref.get("offload"):
        out.append(
            f"optimizer state on {r.get('offload') or 'the rank'} (was {ref.get('offload') or 'the rank'})"
        )
    disk = r.get("disk_bytes_per_step")
    if disk:
        out.append(
            f"swap files: {human_bytes(disk['written'])} written, {human_bytes(disk['read'])} read /step"
        )
    state = report_state.state_change(r, ref)
    if state:
        out.append(state)
    timing = report_state.time_ratio(r, ref)
    if timing:
        out.append(timing)
    loss, loss0 = s["final_val_loss"], s0["final_val_loss"]
    if not math.isnan(loss) and not math.isnan(loss0):
        out.append(f"final val loss {loss - loss0:+.4f}")
    return out


def plugin_section(results: list[Result], meta: dict[str, Any]) -> list[str]:
    """What each run changed against the first trained run, next to the figures; then the
    registered runs that this command did not run (what ``--runs all`` adds)."""
    ok = [r for r in results if r.get("status") == "ok"]
    lines: list[str] = []
    if len(ok) > 1:
        lines += [
            "",
            "## What each run changed, against its like-for-like baseline",
            "",
            "| run | against | what it does | what changed, by how much | model state /rank (rank 0) "
            "| gradient error vs fp64 | parameters by dtype | swap-file bytes /step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in ok:
            disk = r.get("disk_bytes_per_step")
            err = r.get("grad_error")
            refs, like = report_state.references(r, results)
            for ref in refs or [None]:
                said = "; ".join(changes(r, ref)) or ("(a reference)" if ref is None else "nothing measured")
                against = "-" if ref is None else ref["name"] + ("" if like else " (not like for like)")
                lines.append(
                    f"| {r['name']} | {against} | {r.get('help', '')} | {said} | "
                    f"{report_state.state_cell(r)} | {'n/a' if err is None else f'{err:.2e}'} | "
                    f"{_dtype_split(r.get('param_dtypes'))} | "
                    f"{'none' if not disk else human_bytes(disk['written'] + disk['read'])} |"
                )
        lines += [
            "",
            "- against: the run that differs from this one only by what it changes (same stage, "
            "dtype and offload; `runs.py` names each run's baselines): nvmeswap against ZeRO 3 with "
            "the optimizer state in RAM (and DeepSpeed's NVMe offload where it ran), loco against "
            "DeepSpeed's bf16 reduction, mixedlayers against the same 16-bit model, autocastzero "
            "against fp32 without autocast. Baselines themselves are compared with the first run.",
            *report_state.left_out_lines(meta),
            *report_state.memory_lines(),
            *report_state.noise_lines(results, meta.get("cpu_count")),
            "- gradient error vs fp64: after training, one more optimizer step's micro-steps (not "
            "taken): the averaged gradient the optimizer holds (`deepspeed.utils.safe_get_full_grad`) "
            "against the very gradients autograd produced for those micro-steps on every rank, summed "
            "and averaged in fp64; relative L2 norm over all parameters. What remains is the error of "
            "accumulating and reducing them: the accumulation and communication dtype (accumdtype), "
            "4-bit codes (loco; its error feedback carries the rest into the next step). n/a where "
            "DeepSpeed does not give the full gradient.",
            "- parameters by dtype: of the model's parameters (mixedlayers keeps LayerNorms and the "
            "head in fp32). swap-file bytes: nvmeswap's own counters, written plus read per optimizer "
            "step, summed over ranks.",
        ]
    registered = meta.get("registered_runs") or {}
    asked = {r["name"] for r in results} | set(meta.get("runs_requested") or ())
    more = {n: h for n, h in registered.items() if n not in asked}
    if more:
        lines += [
            "",
            f"`--runs all` adds {len(more)} more registered runs (trained, or skipped with the reason "
            "where they cannot run here):",
            "",
            *(f"- `{n}`: {h}" for n, h in more.items()),
        ]
    return lines


def link_section(results: list[Result], meta: dict[str, Any]) -> list[str]:
    """With ``--nodes``: per run, step time and the bytes that crossed the emulated link."""
    rows = [r for r in results if r.get("status") == "ok" and r.get("link_bytes") is not None]
    if not rows:
        return []
    a = meta.get("args", {})
    delay = f", {a['link_delay']} one-way delay" if a.get("link_delay") else ""
    lines = [
        "",
        f"## Across {a.get('nodes')} emulated nodes of {a.get('nproc_per_node')} ranks, link "
        f"{a.get('link_rate') or 'unshaped'}{delay}",
        "",
        f"| run | step time (ms) | vs {rows[0]['name']} | crossed the link /step | vs {rows[0]['name']} "
        "| reduction |",
        "|---|---|---|---|---|---|",
    ]
    ref_t = summarize(rows[0])["step_time_ms"]
    ref_b = rows[0]["link_bytes"] / max(1, len(rows[0].get("step_time_s", [])))
    for r in rows:
        t = summarize(r)["step_time_ms"]
        b = r["link_bytes"] / max(1, len(r.get("step_time_s", [])))
        two = any("all_to_all_inter" in step for step in r.get("wire_bytes") or [])
        lines.append(
            f"| {r['name']} | {_fmt(t, '.1f')} | {_fmt(t / ref_t if ref_t else math.nan, '.2f')}x | "
            f"{human_bytes(b)} | {_fmt(b / ref_b if ref_b else math.nan, '.3f')}x | "
            f"{'two-level (within, then between nodes)' if two else 'one level'} |"
        )
    lines += [
        "",
        "- each node is a network namespace on this machine with its own torchrun; every byte "
        "between two nodes crosses one virtual link shaped with tc (`zerohooks.testing.nodes`).",
        "- crossed the link: what the nodes' link interfaces sent (their tx counters, read by each "
        "node's first rank between barriers before and after the run's training steps), summed over "
        "the nodes (each byte once), divided by the steps: gradients and everything else, TCP/IP "
        "and gloo framing included, and the few bytes of the evaluations in between.",
        "- reduction: two-level when the run's wire counters show an inter-node hop "
        "(`all_to_all_inter`: loco finds the node layout from torchrun's LOCAL_WORLD_SIZE).",
    ]
    return lines


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
    if meta.get("wall_time_final"):
        lines.append(f"Wall time of this command, from its start to its exit: {meta.get('wall_time_s')} s.")
    else:
        lines.append(
            f"Wall time from the command's start to this report: {meta.get('wall_time_s')} s "
            "(written by the training ranks; the command had not exited yet)."
        )
    ref_name, ratios = wire_ratios(results)
    lines += [
        "",
        "| run | ZeRO stage | dtype | offload | final train loss | final val loss "
        "| step time (ms) | tokens/s | handed to the gradient collectives /step "
        f"| sent on the wire /step | wire vs {ref_name or 'first run'} | peak RSS (noisy) | run wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    skipped: list[str] = []
    load = report_state.load_range(results)
    if load:
        lines.insert(
            len(lines) - 3,
            f"Machine load while the runs trained (1-minute load average): {load[0]:.1f} to {load[1]:.1f}"
            + (f" on {meta['cpu_count']} cores" if meta.get("cpu_count") else "")
            + ": step times are single samples under that load.  ",
        )
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | | | | {r.get('status')}: {r.get('reason', '')} | | | | | | | | |")
            skipped.append(f"- `{r['name']}` {r.get('status')}: {r.get('reason', '')}")
            continue
        s = summarize(r)
        ratio = ratios.get(r["name"])
        peak = r.get("peak_memory_bytes")
        lines.append(
            f"| {r['name']} | {r.get('zero_stage')} | {r.get('dtype')} | "
            f"{r.get('offload') or 'none'} | {_fmt(s['final_train_loss'], '.4f')} | "
            f"{_fmt(s['final_val_loss'], '.4f')} | {_fmt(s['step_time_ms'], '.1f')} | "
            f"{_fmt(s['tokens_per_s'], ',.0f')} | {_breakdown(s['comm_bytes_per_step'])} | "
            f"{_breakdown(s['wire_bytes_per_step'])} | "
            f"{'n/a' if ratio is None else f'{ratio:.3f}x'} | "
            f"{human_bytes(peak) if peak else 'n/a'} | {_fmt(r.get('wall_time_s', math.nan), '.1f')} |"
        )
    lines += [
        "",
        "- final train loss: mean over the last 10 steps (each step's loss averaged over ranks);"
        " final val loss: the last evaluation on the held-out files.",
        f"- step time: mean wall time of an optimizer step (slowest rank), excluding the first "
        f"{meta.get('warmup_steps')} steps and the evaluations; tokens/s: global.",
        "- handed to the gradient collectives: the bytes DeepSpeed hands to its gradient "
        "collective (`all_reduce`, `reduce_scatter`) per optimizer step, in the communication "
        "dtype, summed over all ranks, from `zerohooks` counters (`counters.last_step()`; n/a "
        "without zerohooks). A plugin that owns the collective (loco) receives these bytes and "
        "decides what to send.",
        "- sent on the wire: the bytes the ranks send to each other per optimizer step, by the "
        "collective that really ran and the format that travelled (`counters.last_step(wire=True)`): "
        "as the owner reports them (loco: 4-bit codes, fp32 scales, the exact path for small "
        "tensors), else DeepSpeed's collective with the ring model (an all-reduce sends 2(W-1)/W "
        "of its input per rank, a reduce-scatter (W-1)/W). The ratio compares each run with the "
        "first one.",
        "- run wall time: from building the run's engine to its last evaluation (rank 0).",
        "- peak RSS: noisy at this model size (allocator, libraries, threads: tens of MiB from "
        "one launch to the next); what the plugins change is in the model state column below. "
        f"Measured as: {meta.get('memory_kind', '')}, the largest over ranks"
        + (
            "; each run trained in its own processes (one launch per run)."
            if meta.get("one_process_per_run")
            else "; all runs in one process (--same-process): what earlier runs left counts."
        ),
    ]
    if skipped:
        lines += ["", "Skipped, failed or not reached runs:", *skipped]
    lines += plugin_section(results, meta)
    lines += link_section(results, meta)
    lines += ["", "![loss](loss.png)", "", "![communication bytes](comm_bytes.png)", ""]
    lines += ["![model state per rank](memory.png)", ""]
    return "\n".join(lines)


def centered_mean(xs: list[float], window: int) -> list[float]:
    """Moving average centred on each point (shorter windows at the ends): no lag."""
    half = window // 2
    out = []
    for i in range(len(xs)):
        lo, hi = max(0, i - half), min(len(xs), i + half + 1)
        out.append(sum(xs[lo:hi]) / (hi - lo))
    return out


LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = "osD^vP*X"


def plot_loss(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = run_colors(results)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    ok = [r for r in results if r.get("status") == "ok"]
    n_ok = len(ok)
    for i, r in enumerate(ok):
        color = colors[r["name"]]
        style = LINE_STYLES[i % len(LINE_STYLES)]
        marker = MARKERS[i % len(MARKERS)]
        losses = r["train_loss"]
        steps = list(range(1, len(losses) + 1))
        ax.plot(steps, losses, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(
            steps,
            centered_mean(losses, 9),
            color=color,
            linewidth=2.4 - 0.5 * (i % 3),  # identical runs overlap: width and style keep each visible
            linestyle=style,
            label=f"{r['name']} train (9-step mean)",
        )
        if r.get("val_loss"):
            vs, vl = zip(*r["val_loss"], strict=True)
            # validation points of identical runs coincide: shift each run's markers a little
            shift = (i - (n_ok - 1) / 2) * max(1.0, len(losses) / 150)
            ax.plot(
                [v + shift for v in vs],
                vl,
                color=color,
                marker=marker,
                markersize=8 - 1.5 * (i % 3),
                markerfacecolor="none" if i % 2 else color,
                linestyle=":",
                linewidth=1,
                label=f"{r['name']} val",
            )
    if not ok:
        ax.text(0.5, 0.5, "no completed run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("optimizer step (validation at 0 is before training)")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("GPT on Python stdlib bytes: training loss (light: raw) and validation loss")
    ax.grid(True, alpha=0.3)
    if ok:
        handles, labels = ax.get_legend_handles_labels()
        if n_ok > 1:
            from matplotlib.lines import Line2D

            handles.append(Line2D([], [], linestyle="none"))
            labels.append(
                "one colour per run in every figure;\nline styles, widths and markers differ and\n"
                "val points are shifted slightly so that\nruns that coincide stay visible"
            )
        ax.legend(handles, labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_comm(results: list[Result], path: Path) -> None:
    """Left: per run, bytes handed to the gradient collectives (hatched) next to bytes sent on the
    wire (solid) per step, in the run's colour.  Right: the same split by collective and dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = run_colors(results)
    per_run: dict[str, tuple[dict[str, float], dict[str, float] | None]] = {}
    for r in results:
        handed = comm_per_step(r) if r.get("status") == "ok" else None
        if handed:
            per_run[r["name"]] = (handed, comm_per_step(r, "wire_bytes"))
    if not per_run:
        fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
        ax.text(
            0.5,
            0.5,
            "no communication counters\n(zerohooks is not installed, or it counted nothing)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return
    rows = sum(len(h) + len(w or {}) for h, w in per_run.values())
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(13, max(4.8, 1.6 + 0.3 * rows)), dpi=110, gridspec_kw={"width_ratios": [1.4, 1.3]}
    )
    mib = 2**20
    ref_name, ratios = wire_ratios(results)
    top = 0.0
    for x, (name, (handed, wire)) in enumerate(per_run.items()):
        color = colors[name]
        h = sum(handed.values()) / mib
        ax.bar(x - 0.2, h, width=0.38, color="white", edgecolor=color, hatch="///", linewidth=1.5)
        ax.annotate(f"{h:.2f}", (x - 0.2, h / 2), ha="center", va="center", fontsize=7, rotation=90)
        top = max(top, h)
        if wire is not None:
            w = sum(wire.values()) / mib
            ax.bar(x + 0.2, w, width=0.38, color=color, edgecolor=color, linewidth=1.5)
            ratio = ratios.get(name)
            note = f"{w:.2f}" + (f"\n{ratio:.2f}x" if ratio is not None and name != ref_name else "")
            ax.annotate(note, (x + 0.2, w), ha="center", va="bottom", fontsize=7)
            top = max(top, w)
    ax.set_ylim(0, top * 1.45 or 1.0)  # room for the labels under the legend
    ax.set_xticks(range(len(per_run)), list(per_run), rotation=35, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(per_run) - 0.4)
    ax.set_ylabel("MiB per optimizer step (sum over ranks)")
    ax.set_title("Gradient collectives: handed over vs on the wire", fontsize=10)
    ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="gray", hatch="///", label="handed to the collective"),
            Patch(facecolor="gray", edgecolor="gray", label=f"sent on the wire (Nx: vs {ref_name})"),
        ],
        loc="upper right",
        fontsize=8,
    )
    ax.grid(True, axis="y", alpha=0.3)

    labels: list[str] = []
    ys: list[float] = []
    y = 0.0
    for name, (handed, wire) in per_run.items():
        color = colors[name]
        for record, comm, solid in (("handed", handed, False), ("wire", wire or {}, True)):
            for key, v in comm.items():
                bx.barh(
                    y,
                    v / mib,
                    height=0.7,
                    color=color if solid else "white",
                    edgecolor=color,
                    hatch=None if solid else "///",
                    linewidth=1.2,
                )
                bx.annotate(f" {human_bytes(v)}", (v / mib, y), va="center", fontsize=7)
                labels.append(f"{name}  {record}: {key}")
                ys.append(y)
                y += 1
        y += 0.5  # a gap between runs
    bx.set_yticks(ys, labels, fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("MiB per optimizer step (sum over ranks)")
    bx.set_title("by collective and dtype / wire format", fontsize=10)
    bx.grid(True, axis="x", alpha=0.3)
    bx.set_xlim(0, top * 1.25 or 1.0)
    fig.suptitle(
        "Bytes of the gradient collectives per step (colour: run; hatched: handed over, solid: wire)"
    )
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
    report_state.plot_memory(results, folder / "memory.png", run_colors(results))
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
