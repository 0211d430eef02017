"""Multi-rank test harness: run a function on N ``gloo`` ranks, each in its own process.

``run_distributed(fn, world_size)`` starts the ranks with the ``spawn`` method, initialises
torch.distributed through ``deepspeed.init_distributed("gloo")`` in each, runs ``fn`` and
returns every rank's result in rank order.  A rank that raises fails the call with that rank's
traceback; ranks that do not finish within ``timeout`` seconds (a hung collective) are killed
and the call fails naming them, so a test never hangs CI.

``@distributed(world_size=2)`` turns a plain module-level test function into one that runs on
every rank (as DeepSpeed's own ``DistributedTest`` does).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "MultiRankError",
    "distributed",
    "install_fp16_cpu_accelerator",
    "run_distributed",
]

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_TIMEOUT = float(os.environ.get("ZEROHOOKS_TEST_TIMEOUT", "300"))


class MultiRankError(RuntimeError):
    """A rank failed, died or hung."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def install_fp16_cpu_accelerator() -> None:
    """Let DeepSpeed's CPU accelerator run fp16, through DeepSpeed's public ``set_accelerator``.

    DeepSpeed refuses fp16 on CPUs without oneDNN fp16 support (AVX512-FP16), though torch
    computes fp16 on any CPU.  Tests use this to exercise fp16 code paths (loss scaling,
    overflow skips) on ordinary CPUs; it changes nothing on CUDA machines.
    """
    import torch
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    if get_accelerator().device_name() != "cpu":
        return

    class _FP16CPUAccelerator(CPU_Accelerator):  # type: ignore[misc]
        def is_fp16_supported(self) -> bool:
            return True

        def supported_dtypes(self) -> list[torch.dtype]:
            return [torch.float32, torch.bfloat16, torch.float16]

    set_accelerator(_FP16CPUAccelerator())


def _skip_shm_op() -> None:
    """:func:`zerohooks._compat.skip_deepspeed_shm_op` in this rank, unless
    ``ZEROHOOKS_TEST_SHM_OP=1`` asks to build and load DeepSpeed's shared-memory op anyway."""
    if os.environ.get("ZEROHOOKS_TEST_SHM_OP") == "1":
        return
    from zerohooks._compat import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()


@dataclasses.dataclass(frozen=True)
class _RankOptions:
    fp16: bool
    """Install the CPU accelerator that accepts fp16."""
    backend: str
    """torch.distributed backend: gloo (CPU) or nccl (one GPU per rank)."""
    threads: int
    """torch intra-op threads per rank."""


def _worker(
    target: Any,
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
    opts: _RankOptions,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch

        torch.set_num_threads(opts.threads)
        if opts.backend == "nccl":
            torch.cuda.set_device(rank)
        if opts.fp16:
            install_fp16_cpu_accelerator()
        import deepspeed

        _skip_shm_op()
        deepspeed.init_distributed(dist_backend=opts.backend, verbose=False)
        if isinstance(target, tuple):  # (module, qualname) of a @distributed test
            mod, name = target
            fn = getattr(importlib.import_module(mod), name).__wrapped__
        else:
            fn = target
        out = fn(*args, **kwargs)
        results.put(("ok", rank, out))
    except BaseException:
        results.put(("err", rank, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(
    fn: Callable[..., Any] | tuple[str, str],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    fp16_on_cpu: bool = False,
    backend: str = "gloo",
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return results in rank order.

    ``fn`` must be importable by name (module level).  Raises :class:`MultiRankError` with the
    failing rank's traceback, or naming the ranks that hung past ``timeout`` seconds.
    ``backend``: ``"gloo"`` (CPU; tests) or ``"nccl"`` (rank ``r`` on GPU ``r``; benchmarks);
    ``threads``: torch intra-op threads per rank.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f'backend must be "gloo" or "nccl", got {backend!r}')
    opts = _RankOptions(fp16_on_cpu, backend, max(1, threads))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, kwargs or {}, results, opts),
            name=f"zerohooks-rank{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            try:
                status, rank, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in done and p.exitcode not in (None, 0)]
                if dead:
                    raise MultiRankError(
                        f"rank(s) {dead} died without reporting (exit codes "
                        f"{[procs[i].exitcode for i in dead]}), e.g. killed or crashed in native code"
                    ) from None
                if time.monotonic() > deadline:
                    hung = [i for i in range(world_size) if i not in done]
                    raise MultiRankError(
                        f"rank(s) {hung} did not finish within {timeout:.0f}s (a hung collective?); "
                        f"ranks {sorted(done)} finished"
                    ) from None
                continue
            if status == "err":
                raise MultiRankError(f"rank {rank} of {world_size} failed:\n{payload}")
            done[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if len(done) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [done[r] for r in range(world_size)]


def distributed(
    world_size: int = 2, *, timeout: float = DEFAULT_TIMEOUT, fp16_on_cpu: bool = False
) -> Callable[[F], F]:
    """Run the decorated module-level test on ``world_size`` ranks (arguments pass through).

    The test passes when every rank returns; a rank's assertion fails the test with its traceback.
    """

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_distributed(
                (fn.__module__, fn.__qualname__),
                world_size,
                args=args,
                kwargs=kwargs,
                timeout=timeout,
                fp16_on_cpu=fp16_on_cpu,
            )

        return wrapper  # type: ignore[return-value]

    return deco
