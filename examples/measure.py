"""What a run's plugins changed, measured in the ranks for the report's "what each plugin
changed" table: the parameters by dtype (mixedlayers keeps some in fp32), the bytes written to
and read from the swap files per step (nvmeswap), and the error of the gradient the optimizer
receives against the same micro-step gradients accumulated and reduced in fp64 (accumdtype's
accumulation dtype; loco's 4-bit reduction).  Every figure is optional: a measurement that does
not fit an engine is left out (None), never fails the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def param_dtypes(engine: Any) -> dict[str, int]:
    """Parameters of the engine's module by dtype, ``{"bfloat16": n, "float32": m}`` (whole
    tensors: ZeRO 3's partitioned parameters count with their full size)."""
    out: dict[str, int] = {}
    for p in engine.module.parameters():
        numel = int(getattr(p, "ds_numel", 0) or p.numel())
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + numel
    return dict(sorted(out.items()))


def _plugin(engine: Any, name: str) -> Any:
    try:
        import zerohooks
    except ImportError:
        return None
    att = zerohooks.attachment(engine)
    return next((p for p in getattr(att, "plugins", ()) if p.name == name), None)


def swap_bytes(engine: Any) -> tuple[int, int] | None:
    """(written, read) bytes of nvmeswap's swap files so far on this rank, None without nvmeswap."""
    plugin = _plugin(engine, "nvmeswap")
    state = getattr(plugin, "state", None)
    if state is None:
        return None
    return int(state.bytes_written), int(state.bytes_read)


def comm_dtypes(comm: dict[str, dict[str, int]] | None) -> list[str]:
    """The dtypes handed to the gradient collectives in one step's counters."""
    return sorted({d for by_dtype in (comm or {}).values() for d in by_dtype})


@contextlib.contextmanager
def _captured(params: list[Any]) -> Iterator[dict[int, Any]]:
    """Every gradient autograd produces for ``params`` (before DeepSpeed takes it), summed in fp64."""
    import torch

    sums: dict[int, torch.Tensor] = {}
    handles = []

    def hook_for(i: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            g = grad.detach().double()
            sums[i] = g if i not in sums else sums[i] + g

        return hook

    for i, p in enumerate(params):
        if p.requires_grad:
            handles.append(p.register_hook(hook_for(i)))
    try:
        yield sums
    finally:
        for h in handles:
            h.remove()


def gradient_error(engine: Any, batches: list[tuple[Any, Any]], world: int) -> float | None:
    """The relative error (L2 norm over all parameters) of the averaged gradient the optimizer
    holds after one optimizer step's micro-steps on ``batches`` (one per micro-step, this rank's),
    against the very gradients autograd produced for them (in the model's dtype), summed over the
    micro-steps and ranks in fp64 and averaged as DeepSpeed averages.  What remains is the error
    of accumulating and reducing: the accumulation/communication dtype (bf16 or fp32), or loco's
    4-bit reduction.  Call it after training (it runs forward and backward without a step)."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    params = list(engine.module.parameters())
    device = engine.device
    try:
        with _captured(params) as sums:
            for i, (x, y) in enumerate(batches):
                engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
                loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
        num = torch.zeros((), dtype=torch.float64)
        den = torch.zeros((), dtype=torch.float64)
        for i, p in enumerate(params):
            if i not in sums:
                continue
            ref = sums[i].to(device)
            dist.all_reduce(ref)  # every rank's micro-step gradients, in fp64
            ref = (ref / world).cpu()
            got = safe_get_full_grad(p)  # every rank takes part under ZeRO 3
            if got is None:
                return None
            got = got.detach().double().cpu().reshape(ref.shape)
            num += (got - ref).pow(2).sum()
            den += ref.pow(2).sum()
        return float((num / den).sqrt()) if den > 0 else None
    except Exception:  # a stage or offload where DeepSpeed does not give the full gradient
        return None


def step_comm_bytes(engine: Any, wire: bool = False) -> dict[str, dict[str, int]] | None:
    """Bytes per collective and dtype in the last step from zerohooks' counters, if any: handed
    to the collective (before any owner), or sent on the wire (``wire=True``)."""
    try:
        import zerohooks
    except ImportError:
        return None
    try:
        att = zerohooks.attachment(engine)
        counters = getattr(att, "counters", None) if att is not None else None
        if counters is None:
            return None
        last = counters.last_step(wire=True) if wire else counters.last_step()
    except Exception:  # counters are optional decoration; never fail training for them
        return None
    if last is None:
        return None
    return {str(c): {str(d): int(n) for d, n in v.items()} for c, v in dict(last).items()}


def sum_over_ranks(per_rank: list[list[Any]], steps: int) -> list[dict[str, dict[str, int]]] | None:
    """Per step, ``{collective: {dtype: bytes}}`` summed over the ranks (None if a rank had none)."""
    if not all(r[i] is not None for r in per_rank for i in range(steps)):
        return None
    summed = []
    for i in range(steps):
        step_sum: dict[str, dict[str, int]] = {}
        for r in per_rank:
            for coll, by_dtype in r[i].items():
                for dt_name, n in by_dtype.items():
                    d = step_sum.setdefault(coll, {})
                    d[dt_name] = d.get(dt_name, 0) + n
        summed.append(step_sum)
    return summed
