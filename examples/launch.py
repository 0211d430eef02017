"""The demo's launcher (``train_gpt.py`` run outside a distributed launch): it starts the ranks
under ``torch.distributed.run`` once per run, or once for all runs (``--same-process``), reports
the runs that cannot run here as skipped without starting anything, the launches that fail as
failed, and writes the final report with the command's wall time."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nodes as emulated  # sibling modules of train_gpt.py
import runs as run_registry


def prebuild(args: argparse.Namespace) -> None:
    """Build the C++ kernels of the plugins these runs use once, here, before the ranks start
    (`python -m zerohooks.build`): the ranks then load them, and the build says what it does."""
    try:
        from zerohooks.build import build, plugin_targets
    except ImportError:
        return
    used = {p for spec in args.run_list for p in run_registry.resolve(spec, args.plugin_list).plugins}
    targets = [t for t in plugin_targets() if t in used]
    if targets:
        build(targets)


def where(args: argparse.Namespace, world_size: int, cuda: bool) -> run_registry.Where:
    return run_registry.Where(world_size=world_size, nodes=args.nodes, stage=args.stage, cuda=cuda)


def launch(
    args: argparse.Namespace, argv: list[str], script: Path | None = None, t0: float | None = None
) -> int:
    """Start this script under torch.distributed.run, once per run (or once for all runs with
    ``--same-process``), and return the exit status (the first failed launch's, else 0).  A run
    that cannot run here is reported as skipped with the reason, without starting anything; a
    launch that fails is reported as failed, with the rank's error, and the next run goes on."""
    import torch

    script = script or Path(__file__).resolve().parent / "train_gpt.py"
    t0 = time.time() if t0 is None else t0
    if args.nodes > 1:
        reason = emulated.unavailable(args)  # before the kernel build: say at once
        if reason is not None:
            print(reason, file=sys.stderr)
            return 2
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() and args.nodes == 1 else 0
    nproc = args.nproc or n_gpu or 2
    if n_gpu and nproc > n_gpu:
        print(f"error: --nproc {nproc} but only {n_gpu} GPUs (one rank per GPU)", file=sys.stderr)
        return 2
    if not n_gpu and args.dtype == "fp16":
        print(
            "error: --dtype fp16 needs GPUs: DeepSpeed's CPU accelerator refuses fp16 here. "
            "Use --dtype bf16 or fp32 (or auto, the default).",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    if n_gpu:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    else:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("LOCAL_SIZE", str(nproc))  # DeepSpeed's CPU accelerator reads it
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if args.nodes > 1:
        emulated.rank_env(args, env)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
    ]  # our options go through the environment: torchrun's parser would take e.g. --nproc as its own
    here = where(args, nproc, bool(n_gpu))
    skips = {spec: run_registry.resolve(spec, args.plugin_list).skip_reason(here) for spec in args.run_list}
    trained = [s for s in args.run_list if not skips[s]]
    print(f"train_gpt: {expected_time(len(trained), args.steps)}", flush=True)
    prebuild(argparse.Namespace(**{**vars(args), "run_list": trained}))
    where_text = f"{nproc} GPU rank(s), NCCL" if n_gpu else f"{nproc} CPU rank(s), gloo"
    where_text = emulated.describe(args) if args.nodes > 1 else where_text
    batches = [list(args.run_list)] if args.same_process else [[s] for s in args.run_list]
    print(
        f"train_gpt: {len(args.run_list)} run(s) on {where_text}, "
        + ("all in one launch" if args.same_process else "one launch per run")
        + f": {', '.join(args.run_list)}",
        flush=True,
    )
    env["TRAIN_GPT_ARGV"] = json.dumps(argv)
    env["TRAIN_GPT_T0"] = str(t0)
    env["TRAIN_GPT_COMMAND"] = command_line()
    env["TRAIN_GPT_LAUNCH"] = f"{os.getpid()}-{int(t0)}"
    first_rc = 0
    t_runs = time.time()
    done_runs = 0
    with tempfile.TemporaryDirectory(prefix="train_gpt_") as tmp, cleanup_on_signal(env["TRAIN_GPT_LAUNCH"]):
        state = Path(tmp, "results.json")  # the runs so far, handed from launch to launch
        state.write_text("[]")
        env["TRAIN_GPT_STATE"] = str(state)
        for batch in batches:
            if done_runs and len(trained) > done_runs:
                left = (time.time() - t_runs) / done_runs * (len(trained) - done_runs)
                print(
                    f"train_gpt: {done_runs} of {len(trained)} run(s) done; about {left / 60:.1f} min "
                    "left at this pace",
                    flush=True,
                )
            todo = [s for s in batch if not (skips[s] and not args.same_process)]
            for spec in batch:
                if spec not in todo:  # said here, without starting ranks for it
                    name = run_registry.resolve(spec, args.plugin_list).name
                    print(f"[{name}] skipped: {skips[spec]}", flush=True)
                    _append_state(state, {"name": name, "status": "skipped", "reason": skips[spec]})
            if not todo:
                continue
            errors = Path(tmp, "errors")
            shutil.rmtree(errors, ignore_errors=True)
            errors.mkdir()
            env["TRAIN_GPT_ERROR_DIR"] = str(errors)
            env["TRAIN_GPT_RUNS"] = json.dumps(todo)
            print(f"train_gpt: launching {where_text} for {', '.join(todo)}", flush=True)
            try:
                if args.nodes > 1:
                    rc = emulated.run(args, cmd[-1], env)
                else:
                    rc = _run_ranks(cmd, env)
            except KeyboardInterrupt:
                print("train_gpt: interrupted; the report lists the runs not reached", file=sys.stderr)
                done = {r["name"] for r in json.loads(state.read_text())}
                for spec in args.run_list:
                    name = run_registry.resolve(spec, args.plugin_list).name
                    if name not in done:
                        now = spec in todo  # training when the signal came, else not started
                        _append_state(
                            state,
                            {
                                "name": name,
                                "status": "interrupted" if now else "not reached",
                                "reason": "stopped by a signal" + ("" if now else " before it started"),
                            },
                        )
                finish_report(args.out, 130, json.loads(state.read_text()), args, t0)
                return 130
            done_runs += sum(1 for s in todo if not skips[s])
            if rc != 0:
                why = [p.read_text().strip() for p in sorted(errors.glob("rank*.txt"))]
                print(
                    f"train_gpt: {', '.join(todo)} failed (exit status {rc})"
                    + ("".join(f"\n  {w}" for w in why) if why else "; see the errors above"),
                    file=sys.stderr,
                )
                done = {r["name"] for r in json.loads(state.read_text())}
                for spec in todo:
                    name = run_registry.resolve(spec, args.plugin_list).name
                    if name not in done:
                        reason = f"exit status {rc}" + (f": {why[0]}" if why else "")
                        _append_state(state, {"name": name, "status": "failed", "reason": reason})
                first_rc = first_rc or rc
        finish_report(args.out, first_rc, json.loads(state.read_text()), args, t0)
    return first_rc


SECONDS_PER_STEP = 0.4
"""Rough seconds per optimizer step of the default model on an idle 2-core machine (2 CPU ranks,
bf16), ZeRO 3 and swap runs included (benchmarks/RESULTS.md), for the expected time only."""
SECONDS_PER_LAUNCH = 18.0
"""Rough seconds to start a run's ranks, build its engine and evaluate (the same machine)."""


def expected_time(n_runs: int, steps: int) -> str:
    """What the command is expected to take on an idle 2-core machine, in words."""
    s = n_runs * (SECONDS_PER_LAUNCH + steps * SECONDS_PER_STEP)
    return (
        f"{n_runs} run(s) of {steps} steps to train: about {s / 60:.0f} min on an idle 2-core machine "
        "(more under load, less on GPUs); the time left is said after each run"
    )


def _run_ranks(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun and wait; on an interrupt (SIGINT, or SIGTERM turned into one) stop it first
    (torchrun stops its ranks), so that no rank outlives the command."""
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise


@contextlib.contextmanager
def cleanup_on_signal(launch_id: str) -> Iterator[None]:
    """While the runs train: SIGTERM (and SIGHUP) act as Ctrl-C (KeyboardInterrupt), so the
    launch's temporary folder goes however the command ends; on the way out, the swap folders of
    this launch's runs (``runs.swap_folder``) go too, and their parent if it is left empty."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        parent = Path(run_registry.swap_folder("x")).parent
        for folder in parent.glob(f"{launch_id}-*"):
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            parent.rmdir()  # only when empty: another command's folders stay


def _append_state(state: Path, result: dict[str, Any]) -> None:
    state.write_text(json.dumps([*json.loads(state.read_text()), result]))


def command_line() -> str:
    """The command line this process was started with, as typed (interpreter included)."""
    argv = getattr(sys, "orig_argv", None) or ["python", *sys.argv]
    return shlex.join(argv)


def registered_runs() -> dict[str, str]:
    """Every registered run and what it shows (the report says which ones --runs all adds)."""
    return {name: run.help for name, run in run_registry.RUNS.items()}


def finish_report(
    out: str, rc: int, results: list[dict[str, Any]], args: argparse.Namespace, t0: float
) -> None:
    """In the launcher, once the ranks are gone: the report of every run of the command (trained,
    skipped or failed) with the wall time of the whole command (start-up and shut-down included)
    in report.md and results.json, and print it."""
    path = Path(out) / "results.json"
    wall = round(time.time() - t0, 1)
    meta: dict[str, Any] = {}
    try:
        data = json.loads(path.read_text())
        if data.get("meta", {}).get("launch_t0") == t0:
            meta = data["meta"]  # written by this command's ranks
    except (OSError, ValueError, KeyError):
        pass
    if not results:
        return
    if not meta:  # no rank wrote a report: every run was skipped, or failed before reporting
        meta = {"command": command_line(), "launch_t0": t0, "steps": args.steps}
        meta["args"] = {k: v for k, v in vars(args).items() if k not in ("run_list", "plugin_list")}
    meta["registered_runs"] = registered_runs()
    meta["runs_requested"] = [run_registry.resolve(s, args.plugin_list).name for s in args.run_list]
    meta["wall_time_s"] = wall
    meta["wall_time_final"] = rc == 0
    try:
        from report import write_report

        folder = write_report(out, results, meta)
    except (OSError, ValueError, KeyError, ImportError) as e:
        print(f"train_gpt: could not write the report: {type(e).__name__}: {e}", file=sys.stderr)
        return
    report = (folder / "report.md").read_text().splitlines()
    print("\n".join(ln for ln in report if ln[:1] == "|" or ln[:3] == "## "), flush=True)
    if rc == 0:
        print(f"train_gpt: done in {wall:.0f} s; report: {Path(out).resolve()}", flush=True)
