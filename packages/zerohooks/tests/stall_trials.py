"""Driver for the stalled-rank trials: ``python stall_trials.py STAGES TRIALS LIMIT SEED``.

Imports torch, DeepSpeed and zerohooks once, then forks each trial's two ranks from that state
(fast: no import per trial).  The ranks build a zerohooks engine (no plugin: only DeepSpeed's own
collectives run) and train in a loop; at a random moment the driver stops rank 1 with SIGSTOP
and waits for rank 0 to raise.  Prints one JSON line per trial: stage, the delay before the
stop, seconds from the stop to rank 0's error, its type and message.  With
``STALL_TRIALS_FILL_STDERR=1`` the pipe on stderr is filled before the stop (a launcher that
does not read its ranks' output).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
import traceback

import deepspeed
import torch
import torch._dynamo  # (a torch optimizer imports it: once here, not in each trial's ranks)

import zerohooks
from zerohooks import stepwatch, watchdog
from zerohooks.adapter.compat import skip_deepspeed_shm_op
from zerohooks.adapter.surface import OPTIMIZER_CHECK_MODULE
from zerohooks.errors import CollectiveTimeoutError
from zerohooks.testing.toy import ds_config, make_model, train

with contextlib.suppress(ImportError):  # every ZeRO engine's optimizer check imports it (and torch._inductor)
    importlib.import_module(OPTIMIZER_CHECK_MODULE)


def _rank(rank: int, port: int, stage: int, limit: float, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    code = 0
    try:
        torch.set_num_threads(1)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        watchdog.set_collective_timeout(limit)
        model = make_model()
        cfg = ds_config(stage, gas=1, gradient_clipping=1.0)  # clipping: ZeRO 1/2's grad-norm all-reduce
        engine, *_ = zerohooks.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        with open(f"{out}.ready{rank}", "w"):
            pass
        step = 0
        try:
            while True:
                train(engine, 1, 1, first=step)
                step += 1
        except CollectiveTimeoutError as e:
            result = {"error": "CollectiveTimeoutError", "message": str(e)}
        except Exception as e:
            result = {"error": type(e).__name__, "message": str(e)[:2000]}
        result["t"] = time.monotonic()
        w = stepwatch._watch
        if w is not None:  # the watching thread's last looks: when, what each counted
            result["looks"] = [[round(x, 2) for x in look] for look in w.looks]
        result["steps"] = step
    except BaseException:
        result = {"error": "setup", "message": traceback.format_exc()[-3000:], "t": time.monotonic()}
        code = 1
    with open(f"{out}.tmp{rank}", "w") as f:
        json.dump(result, f)
    os.replace(f"{out}.tmp{rank}", f"{out}.result{rank}")
    sys.stderr.flush()
    os._exit(code)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _fill_stderr() -> None:
    """Fill the pipe on stderr (the ranks share it) to the last byte, as a launcher that does not
    read its ranks' output leaves it: the next write to it blocks."""
    flags = fcntl.fcntl(2, fcntl.F_GETFL)
    fcntl.fcntl(2, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        for chunk in (b"." * 4096, b"."):  # whole pages, then single bytes (each write atomic)
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(2, chunk)
    finally:
        fcntl.fcntl(2, fcntl.F_SETFL, flags)


def trial(stage: int, limit: float, rng: random.Random, tmp: str, n: int) -> dict[str, object]:
    out = os.path.join(tmp, f"trial{n}")
    port = _port()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            _rank(rank, port, stage, limit, out)
        pids.append(pid)
    try:
        ready = all(_wait_for(f"{out}.ready{r}", 300) for r in range(2))
        delay = rng.uniform(0.0, 1.5)
        if os.environ.get("STALL_TRIALS_FILL_STDERR") == "1":
            time.sleep(5.0)  # past the first steps' warnings: from here on the ranks write nothing
            _fill_stderr()
        time.sleep(delay)
        stopped_at = time.monotonic()
        if ready:
            os.kill(pids[1], signal.SIGSTOP)
        got = _wait_for(f"{out}.result0", limit + 60)
        result: dict[str, object] = {"stage": stage, "delay": round(delay, 2), "ready": ready}
        if got:
            with open(f"{out}.result0") as f:
                r0 = json.load(f)
            result.update(
                error=r0["error"],
                message=r0["message"],
                detected_after=round(r0["t"] - stopped_at, 2),
                steps=r0.get("steps"),
                looks=[[round(look[0] - stopped_at, 2), *look[1:]] for look in r0.get("looks", [])],
            )
        else:
            result.update(error="none within limit + 60 s")
        return result
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def main() -> None:
    stages = [int(s) for s in sys.argv[1].split(",")]
    trials, limit, seed = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    skip_deepspeed_shm_op()  # as the test harness does: no op build in each rank
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(trials):
            print(json.dumps(trial(stages[n % len(stages)], limit, rng, tmp, n)), flush=True)


if __name__ == "__main__":
    main()
