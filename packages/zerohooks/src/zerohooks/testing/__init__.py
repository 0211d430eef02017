"""Multi-rank test harness: run a function on N ``gloo`` ranks, each in its own process.

``run_distributed(fn, world_size)`` starts the ranks with the ``spawn`` method, initialises
torch.distributed through ``deepspeed.init_distributed("gloo")`` in each, runs ``fn`` and
returns every rank's result in rank order.  A rank that raises fails the call with that rank's
traceback; ranks that do not finish within ``timeout`` seconds (a hung collective) are killed
and the call fails naming them, so a test never hangs CI.

``@distributed(world_size=2)`` turns a plain module-level test function into one that runs on
every rank (as DeepSpeed's own ``DistributedTest`` does).

How ranks start (``ZEROHOOKS_TEST_START_METHOD``): ``forkserver`` (the default) forks every rank
from one server process per test process that imported torch, DeepSpeed and torch._dynamo
(which a rank's first torch optimizer needs) once, so a rank starts in well under a second
instead of importing them again (several seconds of CPU per rank, 30 s a launch on a loaded
2-core machine).  Each rank is still a fresh process used by one
call: it receives the caller's current environment, working folder, ``sys.path``, stdout and
stderr, and runs the interpreter's exit handlers (``atexit``) when it ends, as a spawned rank
does.  ``spawn`` starts every rank as a new interpreter instead.  Either way a rank runs ``fn``
with what its imports made frozen (``gc.freeze``): DeepSpeed runs ``gc.collect()`` in every ZeRO-3
engine it builds, and each would otherwise walk the millions of objects torch, DeepSpeed and
torch._dynamo made (half the time of the conformance tests); what ``fn`` makes is collected as usual.

A launch starts in two phases: every rank joins the process group and reports ready, and only
then does any rank run ``fn``.  When a rank cannot join because gloo's connection to a peer
failed (``connectFullMesh``: a connection closed or reset by the other end, which happens when
many gloo jobs run side by side on one machine and one connects to a port another job's dead
rank had used), the launch is abandoned before ``fn`` ran anywhere and started again, at most
:data:`RENDEZVOUS_ATTEMPTS` times, saying so on stderr.  Any other failure fails the call at once.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any, TypeVar

__all__ = [
    "MultiRankError",
    "distributed",
    "install_fp16_cpu_accelerator",
    "run_distributed",
]

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_TIMEOUT = float(os.environ.get("ZEROHOOKS_TEST_TIMEOUT", "300"))
RENDEZVOUS_ATTEMPTS = 3
"""How many times a launch is started when a rank cannot join the process group (a gloo
connection to a peer that failed: :data:`RENDEZVOUS_ERRORS`)."""
RENDEZVOUS_ERRORS = ("connectFullMesh failed", "Connection closed by peer", "Connection reset by peer")
"""The texts of the errors that start a launch again: a rank's connection to a peer failed while
the process group was being made, before the function ran on any rank."""
_FAULT_ENV = "ZEROHOOKS_TEST_RENDEZVOUS_FAULT"
"""For the harness's own tests: ``<folder>:<message>``; rank 1 of the first launch that finds no
``<folder>/done`` creates it and fails to join with ``message``."""
START_METHODS = ("forkserver", "spawn")
_PRELOAD = ["torch", "deepspeed", "torch._dynamo"]
"""What the fork server imports once for every rank it forks (nothing of ours: each rank
imports zerohooks and the plugins itself, under the caller's environment).  torch._dynamo is
not imported by ``import torch`` but by the first torch optimizer a rank builds (about 1,400
modules: 3 s a rank on the loaded 2-core machine with bytecode cached, 30 s without).  Then
the module every ZeRO engine's optimizer check imports
(:data:`zerohooks.adapter.surface.OPTIMIZER_CHECK_MODULE`), which imports torch._inductor
(about 180 modules: 1.6 s of CPU a rank with bytecode cached, 4.3 s without); a DeepSpeed
release without it is passed by (the fork server ignores a preload that fails to import).
Neither starts a thread (the fork server must fork a single-threaded process)."""
_forkserver: Any = None


class MultiRankError(RuntimeError):
    """A rank failed, died or hung."""


def _rendezvous_store(world_size: int, timeout: float) -> Any:
    """A TCP rendezvous store served by this process on a port of the OS's choosing (ranks
    connect as clients: ``TORCHELASTIC_USE_AGENT_STORE``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=max(timeout, 60.0)),
        wait_for_workers=False,
    )


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


rank_op_builds: Any = None
"""In a rank of :func:`run_distributed`: the handle routing DeepSpeed's op builds through zerohooks
for the rank's life (:func:`zerohooks.route_deepspeed_op_builds`); a test judging the routing
itself removes it first."""


def _skip_shm_op() -> None:
    """:func:`zerohooks.adapter.compat.skip_deepspeed_shm_op` in this rank, unless
    ``ZEROHOOKS_TEST_SHM_OP=1`` asks to build and load DeepSpeed's shared-memory op anyway."""
    if os.environ.get("ZEROHOOKS_TEST_SHM_OP") == "1":
        return
    from zerohooks.adapter.compat import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()


def _start_method() -> str:
    method = os.environ.get("ZEROHOOKS_TEST_START_METHOD", "forkserver") or "forkserver"
    if method not in START_METHODS:
        raise ValueError(
            f"ZEROHOOKS_TEST_START_METHOD={method!r}: accepted values are {', '.join(START_METHODS)}"
        )
    if method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
        return "spawn"  # not on this platform (Windows)
    return method


def _context(method: str) -> Any:
    """The multiprocessing context starting ranks; the fork server's imports are set once."""
    global _forkserver
    if method == "spawn":
        return mp.get_context("spawn")
    if _forkserver is None:
        _forkserver = mp.get_context("forkserver")
        from zerohooks.adapter.surface import OPTIMIZER_CHECK_MODULE

        _forkserver.set_forkserver_preload([*_PRELOAD, OPTIMIZER_CHECK_MODULE])
    return _forkserver


class _Inherit:
    """What a rank forked by the fork server takes from its caller, as a spawned rank would: the
    environment, and stdout and stderr (pytest's capture files while a test runs), handed over
    as file descriptors when the rank is started (``reduction.DupFd`` while pickling)."""

    __slots__ = ("env", "fds")

    def __init__(self, env: dict[str, str], fds: tuple[Any, ...] = ()) -> None:
        self.env = env
        self.fds = fds

    @classmethod
    def capture(cls) -> _Inherit:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.flush()
        return cls(dict(os.environ))

    def __reduce__(self) -> tuple[Any, ...]:
        # called by Process.start() while the child is being launched: DupFd then sends the
        # descriptors with the process object
        return (_Inherit, (self.env, (reduction.DupFd(1), reduction.DupFd(2))))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        for fd, dup in zip((1, 2), self.fds, strict=False):
            new = dup.detach()
            os.dup2(new, fd)
            os.close(new)


@dataclasses.dataclass(frozen=True)
class _RankOptions:
    fp16: bool
    """Install the CPU accelerator that accepts fp16."""
    backend: str
    """torch.distributed backend: gloo (CPU) or nccl (one GPU per rank)."""
    threads: int
    """torch intra-op threads per rank."""
    start_timeout: float
    """How long a rank that joined waits for the others before giving up (the launch's timeout)."""


def _injected_fault(rank: int) -> None:
    spec = os.environ.get(_FAULT_ENV)
    if not spec or rank != 1:
        return
    folder, _, message = spec.partition(":")
    try:
        with open(os.path.join(folder, "done"), "x"):
            pass
    except FileExistsError:
        return
    raise RuntimeError(message)


def _worker(
    target: Any,
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
    opts: _RankOptions,
    go: Any,
    inherit: _Inherit | None = None,
) -> None:
    if inherit is not None:
        inherit.apply()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # the caller hosts the rendezvous store (as torchrun's agent does): every rank a client
        TORCHELASTIC_USE_AGENT_STORE=str(True),
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
        # the tests' ranks build DeepSpeed's ops (plain DeepSpeed's too: the oracles) announced
        # and through zerohooks.nativecache, as zerohooks.initialize does; for the rank's life
        global rank_op_builds
        from zerohooks.adapter.compat import route_deepspeed_op_builds

        rank_op_builds = route_deepspeed_op_builds()
        try:
            _injected_fault(rank)
            deepspeed.init_distributed(dist_backend=opts.backend, verbose=False)
        except BaseException:
            results.put(("init", rank, traceback.format_exc()))
            return
        # only this rendezvous: groups the test makes itself, and processes it starts, host their own
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        results.put(("ready", rank, None))
        if not go.wait(timeout=opts.start_timeout):  # set once every rank joined
            return
        if isinstance(target, tuple):  # (module, qualname) of a @distributed test
            mod, name = target
            fn = getattr(importlib.import_module(mod), name).__wrapped__
        else:
            fn = target
        # what the imports made stays for the rank's life: kept out of the collector's full passes
        # (DeepSpeed runs gc.collect() in every ZeRO-3 engine it builds, and would walk them each time)
        gc.freeze()
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
        if inherit is not None:
            # a forked rank ends with os._exit: run the exit handlers a spawned rank's interpreter
            # runs when it exits (zerohooks' exit guard and heartbeat, nvmeswap's swap-file cleanup)
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(AttributeError, ValueError, OSError):
                    stream.flush()


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
    opts = _RankOptions(fp16_on_cpu, backend, max(1, threads), timeout)
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _launch(fn, world_size, args, kwargs or {}, timeout, opts)
        except _RendezvousFailed as failed:
            if attempt == RENDEZVOUS_ATTEMPTS:
                raise MultiRankError(
                    f"rank {failed.rank} of {world_size} could not join the process group in "
                    f"{RENDEZVOUS_ATTEMPTS} launches:\n{failed.payload}"
                ) from None
            last = failed.payload.strip().splitlines()[-1]
            print(
                f"zerohooks.testing: rank {failed.rank} of {world_size} could not join the process "
                f"group ({last}); nothing ran yet: starting the launch again "
                f"({attempt + 1} of {RENDEZVOUS_ATTEMPTS})",
                file=sys.stderr,
                flush=True,
            )
    raise AssertionError("unreachable")  # pragma: no cover


class _RendezvousFailed(Exception):
    def __init__(self, rank: int, payload: str) -> None:
        super().__init__(rank, payload)
        self.rank, self.payload = rank, payload


def _launch(
    fn: Callable[..., Any] | tuple[str, str],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    opts: _RankOptions,
) -> list[Any]:
    """One launch: start the ranks, wait until every one joined the process group (or raise
    :class:`_RendezvousFailed` for a failed gloo connection), let them run, collect results."""
    method = _start_method()
    ctx = _context(method)
    results = ctx.Queue()
    go = ctx.Event()
    # The rendezvous store lives in this process on a port the OS gives it, held until the ranks
    # are gone: a port picked free and bound later by rank 0 could be taken in between by another
    # launch's process (seen once: a rank joined a store that was not its launch's).
    store = _rendezvous_store(world_size, timeout)
    port = int(store.port)
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, kwargs, results, opts, go)
            + ((_Inherit.capture(),) if method == "forkserver" else ()),
            name=f"zerohooks-rank{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    ready: set[int] = set()
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
            if status == "init":
                if any(text in payload for text in RENDEZVOUS_ERRORS):
                    raise _RendezvousFailed(rank, payload)
                raise MultiRankError(f"rank {rank} of {world_size} could not start:\n{payload}")
            if status == "ready":
                ready.add(rank)
                if len(ready) == world_size:
                    go.set()
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
        del store
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
