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


# --- model state by kind --------------------------------------------------------------------

STATE_KINDS = (
    "parameters",
    "master parameters",
    "gradients",
    "gradient buckets",
    "optimizer state",
    "swap buffers",
    "error buffers",
    "other",
)
"""The kinds of :func:`model_state_bytes`, in the report's order."""
_PLUGIN_PARTS = {
    "loco": (("state.buffers", "error buffers"), ("state.snapshots", "error buffers")),
    "nvmeswap": (("state.slots", "swap buffers"),),
}
"""Where a plugin keeps the state the report names (attribute paths from the plugin object);
the rest of a plugin's tensors (loco's workspaces) count as "other"."""


def _optimizer_attr_kind(name: str) -> str:
    """The kind of a ZeRO optimizer's tensor attribute, from its name (DeepSpeed's own names:
    ``bit16_groups_flat``, ``single_partition_of_fp32_groups``, ``averaged_gradients``, ``ipg_buffer``,
    ``fp32_partitioned_groups_flat``, ``grad_partitions_flat_buffer`` ...)."""
    n = name.lower()
    if "ipg" in n or "bucket" in n:
        return "gradient buckets"
    if "grad" in n:
        return "gradients"
    if "fp32" in n or "master" in n:
        return "master parameters"
    if any(k in n for k in ("fp16", "bf16", "bit16", "param", "partition", "flat")):
        return "parameters"
    return "other"


def _skip(obj: Any) -> bool:
    """Objects a walk does not enter: modules, optimizers, process groups, engines, classes."""
    import torch

    return (
        isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, type))
        or type(obj).__module__.startswith(("torch.distributed", "deepspeed.comm", "threading"))
        or (hasattr(obj, "module") and hasattr(obj, "optimizer"))
    )


def _attributes(obj: Any) -> list[Any]:
    """The values of an object's attributes: its ``__dict__`` and its classes' ``__slots__``."""
    values = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                values.append(getattr(obj, name, None))
    return values


def _tensors(obj: Any, depth: int, seen: set[int]) -> Iterator[Any]:
    """The tensors reachable from ``obj`` through lists, tuples, dicts and (for plain objects)
    attributes, ``depth`` levels deep; each object once."""
    import torch

    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
        return
    if isinstance(obj, (str, bytes, int, float, bool)) or obj is None:
        return
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        items = obj
    elif not _skip(obj):
        items = _attributes(obj)
    else:
        return
    for item in list(items):
        yield from _tensors(item, depth - 1, seen)


def model_state_bytes(engine: Any) -> dict[str, int]:
    """This rank's bytes of model state by kind (:data:`STATE_KINDS`), counted from the tensors
    the engine holds: the module's parameters (ZeRO 3: this rank's partition ``ds_tensor``) and
    their ``.grad``; the ZeRO optimizer's tensor attributes by name (16-bit flat buffers:
    parameters; fp32 partitions: master parameters; gradient partitions and buffers: gradients);
    the torch optimizer's ``state`` (Adam's moments and step counts: optimizer state); every
    zerohooks plugin's tensors (nvmeswap: swap buffers, loco: error buffers).  A byte of memory
    is counted once, under the first kind that reached it, however many tensors view it (the
    parameters are views into the flat buffers).  Bytes on disk and meta tensors count nothing."""
    import torch

    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for p in engine.module.parameters():
        local = getattr(p, "ds_tensor", None)
        for t in (local if local is not None else p.data, p.grad):
            if t is not None:
                found.append(("parameters" if t is not p.grad else "gradients", t))
        seen.add(id(p))
    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", None) if opt is not None else None
    for base in (inner, opt if isinstance(opt, torch.optim.Optimizer) else None):
        for state in (getattr(base, "state", None) or {}).values():
            found += [("optimizer state", t) for t in _tensors(state, 2, seen)]
    if opt is not None and not isinstance(opt, torch.optim.Optimizer):
        for name, value in vars(opt).items():
            if value is not inner and not _skip(value):
                found += [(_optimizer_attr_kind(name), t) for t in _tensors(value, 3, seen)]
    plugins: Any = ()
    with contextlib.suppress(ImportError):
        import zerohooks

        plugins = getattr(zerohooks.attachment(engine), "plugins", ())
    for plugin in plugins:
        for path, kind in _PLUGIN_PARTS.get(getattr(plugin, "name", ""), ()):
            part: Any = plugin
            for attr in path.split("."):
                part = getattr(part, attr, None)
            found += [(kind, t) for t in _tensors(part, 3, seen)]
        found += [("other", t) for t in _tensors(plugin, 4, seen)]
    return _count_once(found)


def _count_once(found: list[tuple[str, Any]]) -> dict[str, int]:
    """Bytes by kind, each byte of each storage once (the union of the tensors' byte ranges in
    their storage), under the first kind listed for it."""
    by_storage: dict[int, list[tuple[int, int, str]]] = {}
    for kind, t in found:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        start = t.data_ptr()
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(
            (start, start + t.numel() * t.element_size(), kind)
        )
    out = dict.fromkeys(STATE_KINDS, 0)
    for ranges in by_storage.values():
        covered: list[tuple[int, int]] = []  # byte ranges already counted in this storage
        for lo, hi, kind in ranges:
            new = _uncovered(lo, hi, covered)
            out[kind] += new
            covered.append((lo, hi))
    return {k: v for k, v in out.items() if v}


def _uncovered(lo: int, hi: int, covered: list[tuple[int, int]]) -> int:
    """Bytes of [lo, hi) not in any of the ``covered`` ranges."""
    cuts = sorted((max(a, lo), min(b, hi)) for a, b in covered if a < hi and b > lo)
    free, at = 0, lo
    for a, b in cuts:
        if a > at:
            free += a - at
        at = max(at, b)
    return free + max(0, hi - at)
