"""The demo's rank-side helpers (``train_gpt.py``): peak memory, releasing a run's engine, the
progress lines off a terminal, and DeepSpeed's start-up quieted."""

from __future__ import annotations

import logging
import resource
import shutil
import sys
import time
from typing import Any


def reset_peak_memory(cuda: bool, own_process: bool = False) -> str:
    """Start counting a run's peak memory; what is counted, in words.  ``own_process``: the
    process trains this run only, so its peak since start-up is the run's own."""
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return "torch.cuda.max_memory_allocated" + (", one process per run" if own_process else "")
    if own_process:
        return "peak RSS of the rank process, which trained this run only (getrusage ru_maxrss)"
    try:  # Linux: resets the process's peak RSS, so each run gets its own figure
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "peak RSS of the rank process (getrusage ru_maxrss, reset per run)"
    except OSError:
        return "peak RSS of the rank process since start (getrusage ru_maxrss)"


def peak_memory(cuda: bool) -> int:
    import torch

    if cuda:
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def release(engine: Any, config: dict[str, Any], rank: int) -> None:
    """Let the run's engine go, so the next run in this process shares nothing with it:
    ``engine.destroy()`` (DeepSpeed's hooks and buffers; zerohooks detaches first: the plugins
    release their swap files and the folder's lock, buffers and threads, and every patch goes),
    ``zerohooks.detach`` where the engine has no ``destroy``; then the run's swap folder goes."""
    import torch.distributed as dist

    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    try:
        import zerohooks

        if zerohooks.attachment(engine) is not None:
            zerohooks.detach(engine)
    except ImportError:
        pass
    folder = ((config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("nvme_path")
    if folder:
        dist.barrier()  # every rank has closed its swap files
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


class Progress:
    """A line every few seconds with the step, steps/s and the time left, for rank 0 when its
    output is not a terminal (where tqdm's bar, redrawn in place, shows nothing until the end:
    a pipe, a log file, nox's output)."""

    def __init__(self, name: str, steps: int, enabled: bool, every_s: float = 5.0) -> None:
        self.name, self.steps, self.enabled, self.every_s = name, steps, enabled, every_s
        self.t0 = self.last = time.time()

    def update(self, step: int) -> None:
        now = time.time()
        if not self.enabled or (now - self.last < self.every_s and step < self.steps):
            return
        self.last = now
        rate = step / max(now - self.t0, 1e-9)
        eta = (self.steps - step) / rate if rate else float("nan")
        print(
            f"[{self.name}] step {step}/{self.steps}, {rate:.2f} steps/s, about {eta:.0f} s left",
            flush=True,
        )


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(f in msg for f in self.fragments)


def quiet_deepspeed() -> None:
    """Keep DeepSpeed's warnings, drop its info chatter and two known-harmless messages."""
    import warnings

    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    ds_logger.addFilter(_DropMessages("get learning rate from scheduler before it has started"))
    warnings.filterwarnings(  # DeepSpeed's calls of torch's renamed collectives
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )


def skip_shm_build() -> None:
    """Do not JIT-build DeepSpeed's shared-memory comm op on CPU (about a minute of C++; only
    DeepSpeed's inference all-reduce uses it)."""
    from zerohooks.adapter.compat import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()
