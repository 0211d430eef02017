"""Shared pieces of the nvmeswap tests: the model, configs, training loop and the 2-rank scenarios.

The model has 1.2 M parameters so that DeepSpeed's own NVMe swapper (the oracle) swaps its
sub-groups: it keeps sub-groups under 1 MiB (262,144 fp32 values) in RAM.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch

import zerohooks

SUB_GROUP = 300_000
"""sub_group_size: two or three swapped sub-groups per rank."""


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(600, 1000), torch.nn.LayerNorm(1000), torch.nn.Linear(1000, 600)
    )


def config(
    path: str, dtype: str = "bf16", nvmeswap: dict[str, Any] | None = None, gas: int = 2
) -> dict[str, Any]:
    """DeepSpeed's NVMe optimizer offload (AdamW from torch), plus an nvmeswap section if given."""
    from zerohooks.testing.toy import ds_config

    cfg = ds_config(3, dtype, gas=gas, lr=1e-3)
    cfg["zero_optimization"].update(
        offload_optimizer={"device": "nvme", "nvme_path": path, "pin_memory": False},
        sub_group_size=SUB_GROUP,
    )
    cfg["zero_force_ds_cpu_optimizer"] = False
    if nvmeswap is not None:
        cfg["nvmeswap"] = nvmeswap
    return cfg


def train(
    engine: Any, steps: int, gas: int = 2, first: int = 0, before_step: Any = None, probe: Any = None
) -> list[float]:
    """``steps`` optimizer steps of ``gas`` micro-steps; the losses.  ``before_step(engine)`` runs
    after the last backward of each step, before ``engine.step()``; ``probe(engine, boundary)``
    after every backward."""
    rank = int(os.environ.get("RANK", "0"))
    losses = []
    for s in range(first, first + steps):
        for m in range(gas):
            g = torch.Generator().manual_seed(1000 * s + 10 * m + rank)
            x = torch.randn(4, 600, generator=g).to(next(engine.module.parameters()).dtype)
            loss = (engine(x).float() - x.float()).pow(2).mean()
            engine.backward(loss)
            if probe is not None:
                probe(engine, m == gas - 1)
            if m == gas - 1 and before_step is not None:
                before_step(engine)
            engine.step()
            losses.append(float(loss))
    return losses


def params16(engine: Any) -> list[torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def masters(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()]


def moments(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_optimizer_state

    return [
        safe_get_full_optimizer_state(p, k).detach().clone()
        for p in engine.module.parameters()
        for k in ("exp_avg", "exp_avg_sq")
    ]


def swap_files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "**", "*.swp"), recursive=True))


def _oracle_config(path: str, **kw: Any) -> dict[str, Any]:
    """DeepSpeed's own CPU offload of the same run: the numerics nvmeswap must reproduce bit for bit."""
    cfg = config(path, **kw)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return cfg


def _build(model_cfg: dict[str, Any], plugins: bool = True) -> Any:
    import deepspeed

    import zerohooks

    model = make_model()
    init = zerohooks.initialize if plugins else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=model_cfg)
    return engine


def _halve_first_grad(engine: Any) -> None:
    """Write a gradient back through DeepSpeed's set-gradient API (as gradient surgery does)."""
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    p = next(engine.module.parameters())
    safe_set_full_grad(p, safe_get_full_grad(p) * 0.5)


def _state(engine: Any) -> Any:
    import zerohooks

    att = zerohooks.attachment(engine)
    return next(p for p in att.plugins if p.name == "nvmeswap").state


def _io_bytes() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        vals = dict(line.split(":") for line in f.read().splitlines())
    return int(vals["read_bytes"]), int(vals["write_bytes"])


def scenario_training(tmp: str) -> dict[str, Any]:
    """nvmeswap (both modes) against DeepSpeed's own offload: losses, parameters, moments, bytes."""
    import torch

    import zerohooks

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    ref = _build(_oracle_config(f"{tmp}/oracle{rank}"), plugins=False)
    out["oracle_losses"] = train(ref, 3)
    oracle = (params16(ref), masters(ref), moments(ref))
    out["oracle_after_detach"] = train(ref, 1, first=3)

    modes = (("default", {}), ("ram", {"keep_master_in_ram": True}), ("unfused", {"fused_adam": False}))
    for mode, section in modes:
        folder = f"{tmp}/{mode}{rank}"
        eng = _build(config(folder, nvmeswap=section))
        st = _state(eng)
        out[f"{mode}_files_at_start"] = swap_files(folder)
        out[f"{mode}_file_sizes"] = [os.path.getsize(f) for f in swap_files(folder)]
        out[f"{mode}_numels"] = [g.numel for g in st.groups.values()]
        losses = train(eng, 2)
        r0, w0, b0 = st.bytes_read, st.bytes_written, _io_bytes()
        losses += train(eng, 1, first=2)
        from nvmeswap import swapper

        swapper.flush(st)  # the step's last writes are asynchronous
        b1 = _io_bytes()
        out[f"{mode}_step_bytes"] = (st.bytes_read - r0, st.bytes_written - w0)
        out[f"{mode}_proc_io"] = (b1[0] - b0[0], b1[1] - b0[1])
        out[f"{mode}_losses"] = losses
        out[f"{mode}_fused_steps"] = st.fused_steps
        out[f"{mode}_scratch"] = st.scratch.numel()  # the fp32 gradient buffer (0: never made)
        out[f"{mode}_equal"] = [
            all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
            for x, y in zip(oracle, (params16(eng), masters(eng), moments(eng)), strict=True)
        ]
        zerohooks.detach(eng)
        out[f"{mode}_files_after_detach"] = swap_files(folder)
        out[f"{mode}_after_detach"] = train(eng, 1, first=3)  # a plain CPU-offload engine again
    return out


def scenario_set_grad(tmp: str) -> dict[str, Any]:
    """Gradients written back through DeepSpeed's set-gradient API reach the optimizer step."""
    from deepspeed.utils import safe_get_full_grad

    rank = int(os.environ["RANK"])
    ref = _build(_oracle_config(f"{tmp}/sg_oracle{rank}"), plugins=False)
    eng = _build(config(f"{tmp}/sg{rank}", nvmeswap={}))
    plain = _build(config(f"{tmp}/sg_plain{rank}", nvmeswap={}))
    reader = _build(config(f"{tmp}/sg_read{rank}", nvmeswap={}))
    read_after_step = []
    for s in range(3):  # gradients read between steps must not leak into the next step
        read_after_step += train(reader, 1, first=s)
        safe_get_full_grad(next(reader.module.parameters()))
    return {
        "oracle": train(ref, 3, before_step=_halve_first_grad),
        "nvmeswap": train(eng, 3, before_step=_halve_first_grad),
        "without_set": train(plain, 3),
        "read_after_step": read_after_step,
    }


def scenario_corruption(tmp: str) -> dict[str, Any]:
    """A flipped byte in a swap file stops training with an error naming the file."""
    import zerohooks
    from nvmeswap import SwapCorruptionError

    rank = int(os.environ["RANK"])
    folder = f"{tmp}/corrupt{rank}"
    eng = _build(config(folder, nvmeswap={}))
    train(eng, 1)
    victim = swap_files(folder)[0]
    with open(victim, "r+b") as f:  # one byte in the middle of the fp32 master segment
        f.seek(4096 + 1000)
        b = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([b[0] ^ 0x10]))
    try:
        train(eng, 1, first=1)
        caught = None
    except SwapCorruptionError as e:
        caught = str(e)
    import warnings

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        zerohooks.detach(eng)
    return {
        "victim": victim,
        "error": caught,
        "files_after": swap_files(folder),
        "detach_warnings": [str(w.message) for w in got if "nvmeswap" in str(w.message)],
    }


def scenario_checkpoint(tmp: str) -> dict[str, Any]:
    """Save after 2 steps, train 2 more; a fresh engine loads and trains the same 2 steps."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    rank = int(os.environ["RANK"])
    ckpt = f"{tmp}/ckpt"
    eng = _build(config(f"{tmp}/ck_a{rank}", nvmeswap={}))
    losses = train(eng, 2)
    eng.save_checkpoint(ckpt, tag="s2")
    saved_masters = masters(eng)
    import deepspeed

    losses += train(eng, 2, first=2)
    fresh = _build(config(f"{tmp}/ck_b{rank}", nvmeswap={}))
    with _recording_loads() as reads, _watching_saved_masters(rank) as written_back:
        fresh.load_checkpoint(ckpt, tag="s2")
    gc.collect()
    with open("/proc/self/maps") as f:  # the checkpoint's files still mapped once the load is done
        still_mapped = sorted({os.path.basename(line.split()[-1]) for line in f if ckpt in line})
    resumed = train(fresh, 2, first=2)
    # module-only load: DeepSpeed refreshes the (swapped-out) fp32 masters from the 16-bit
    # weights.  One step first, so the masters hold more than their 16-bit rounding.
    third = _build(config(f"{tmp}/ck_c{rank}", nvmeswap={}))
    train(third, 1)

    def weights(e: Any) -> list[torch.Tensor]:
        with deepspeed.zero.GatheredParameters(list(e.module.parameters())):
            return [p.detach().float().clone() for p in e.module.parameters()]

    masters_before = [torch.equal(m, w) for m, w in zip(masters(third), weights(third), strict=True)]
    # streamed: at most one sub-group resident at a time (it used to make them all resident)
    from nvmeswap import swapper

    resident_counts: list[int] = []
    real_swap_in = swapper.swap_in

    def counting_swap_in(state: Any, index: int, prefetch: bool = True) -> None:
        real_swap_in(state, index, prefetch)
        resident_counts.append(len(state.resident))

    swapper.swap_in = counting_swap_in  # type: ignore[assignment]
    try:
        third.load_checkpoint(ckpt, tag="s2", load_module_only=True)
    finally:
        swapper.swap_in = real_swap_in  # type: ignore[assignment]
    module_only_resident = list(resident_counts)
    module_only = [torch.equal(m, w) for m, w in zip(masters(third), weights(third), strict=True)]
    module_only_losses = train(third, 1, first=2)
    # load_optimizer_states=False, against DeepSpeed's own CPU offload doing the same: through
    # load_checkpoint (DeepSpeed 0.19.8 then refreshes the masters from the loaded 16-bit weights),
    # then through DeepSpeed's ZeRO load itself (_load_zero_checkpoint, as other releases call it:
    # the checkpoint's masters, the moments kept); streamed, one sub-group resident at a time
    no_moments: dict[str, Any] = {}
    for who, cfg, plugins in (
        ("nvmeswap", config(f"{tmp}/ck_e{rank}", nvmeswap={}), True),
        ("oracle", _oracle_config(f"{tmp}/ck_f{rank}"), False),
    ):
        e = _build(cfg, plugins=plugins)
        train(e, 1)
        out: dict[str, Any] = {}
        for how in ("load_checkpoint", "zero_load"):
            kept = moments(e)
            resident_counts.clear()
            swapper.swap_in = counting_swap_in  # type: ignore[assignment]
            try:
                if how == "load_checkpoint":
                    e.load_checkpoint(ckpt, tag="s2", load_optimizer_states=False)
                else:
                    e._load_zero_checkpoint(ckpt, "s2", load_optimizer_states=False)
            finally:
                swapper.swap_in = real_swap_in  # type: ignore[assignment]
            out[how] = {
                "moments_kept": all(torch.equal(a, b) for a, b in zip(moments(e), kept, strict=True)),
                "masters_are_weights": all(
                    torch.equal(m, w) for m, w in zip(masters(e), weights(e), strict=True)
                ),
                "masters_loaded": all(
                    torch.equal(a, b) for a, b in zip(masters(e), saved_masters, strict=True)
                ),
                "resident": list(resident_counts),
                "tensors": (masters(e), moments(e), weights(e)),
            }
        out["losses"] = train(e, 1, first=2)
        out["tensors"] = (masters(e), moments(e), weights(e))
        if plugins:
            zerohooks.detach(e)
        del e
        no_moments[who] = out

    def equal(x: Any, y: Any) -> bool:  # tensors stay in the rank: only the comparison goes back
        return all(
            torch.equal(a, b) for xs, ys in zip(x, y, strict=True) for a, b in zip(xs, ys, strict=True)
        )

    no_moments["equal"] = {
        k: equal(no_moments["nvmeswap"][k].pop("tensors"), no_moments["oracle"][k].pop("tensors"))
        for k in ("load_checkpoint", "zero_load")
    }
    no_moments["equal"]["after"] = equal(
        no_moments["nvmeswap"].pop("tensors"), no_moments["oracle"].pop("tensors")
    )
    fourth = _build(config(f"{tmp}/ck_d{rank}", nvmeswap={}))
    with zerohooks.trust_checkpoint_code(), _recording_loads() as trusted_reads:
        fourth.load_checkpoint(ckpt, tag="s2")
    del fourth
    consolidated_equal = None
    if rank == 0:
        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="s2")
        names = [n for n, _ in eng.module.named_parameters()]
        consolidated_equal = [
            torch.equal(sd[n].float(), m.view_as(sd[n])) for n, m in zip(names, saved_masters, strict=True)
        ]
    dist.barrier()
    return {
        "uninterrupted": losses,
        "resumed": resumed,
        "consolidated_equal": consolidated_equal,
        "module_only": module_only,
        "masters_before_module_only": masters_before,
        "module_only_losses": module_only_losses,
        "module_only_resident": module_only_resident,
        "written_back": written_back,
        "no_moments": no_moments,
        "reads": reads,
        "trusted_reads": trusted_reads,
        "still_mapped": still_mapped,
    }


def _loaded_name(f: Any) -> str:
    """The file ``torch.load`` is given: a path, or an open file (zerohooks reads the open file it
    checked), named by what it is open on."""
    return os.readlink(f"/proc/self/fd/{f.fileno()}") if hasattr(f, "fileno") else str(f)


def _pages_present(t: Any) -> tuple[int, int]:
    """How many of the pages under ``t``'s bytes are in this process's memory (the present bit
    of ``/proc/self/pagemap``; a page of a mapped file counts once it is read), and how many
    pages they are."""
    page = mmap.PAGESIZE
    first = t.data_ptr() // page
    last = (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return sum(e >> 63 for e in struct.unpack(f"{len(raw) // 8}Q", raw)), last - first + 1


@contextlib.contextmanager
def _watching_saved_masters(rank: int) -> Iterator[list[tuple[int, int, int]]]:
    """During a checkpoint load: at each swapped sub-group written back to its swap file,
    ``(pages of its own saved master present, pages of the saved masters of the sub-groups not
    yet written back present, their pages)``, the saved masters being those of this rank's
    mapped optimizer file (the load itself runs unchanged)."""
    import torch

    from nvmeswap import swapper

    seen: list[tuple[int, int, int]] = []
    loaded: list[Any] = []
    real_load, real_swap_out = torch.load, swapper.swap_out

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        name = _loaded_name(f)
        out = real_load(f, *args, **kwargs)
        if f"zero_pp_rank_{rank}_mp_rank" in name and name.endswith("optim_states.pt"):
            loaded.append(list(out["optimizer_state_dict"]["fp32_flat_groups"]))
        return out

    def swap_out(state: Any, index: int, *args: Any, **kwargs: Any) -> None:
        if loaded:
            saved = loaded[-1]
            later = state.order[state.order.index(index) + 1 :]
            seen.append(
                (
                    _pages_present(saved[index])[0],
                    sum(_pages_present(saved[j])[0] for j in later),
                    sum(_pages_present(saved[j])[1] for j in later),
                )
            )
        real_swap_out(state, index, *args, **kwargs)

    torch.load, swapper.swap_out = load, swap_out  # type: ignore[assignment]
    try:
        yield seen
    finally:
        torch.load, swapper.swap_out = real_load, real_swap_out  # type: ignore[assignment]


@contextlib.contextmanager
def _recording_loads() -> Iterator[list[tuple[str, bool, bool]]]:
    """Record ``(file name, weights_only, mmap)`` of each ``torch.load`` meanwhile (the load itself
    runs unchanged)."""
    import torch

    calls: list[tuple[str, bool, bool]] = []
    real = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        name = _loaded_name(f)
        calls.append((os.path.basename(name), bool(kwargs.get("weights_only")), bool(kwargs.get("mmap"))))
        return real(f, *args, **kwargs)

    torch.load = load
    try:
        yield calls
    finally:
        torch.load = real


def scenario_variants(tmp: str) -> dict[str, Any]:
    """fp16 with dynamic loss scaling (skipped steps) and gradient clipping; the Python I/O engine."""
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    adam_l2 = {
        "type": "Adam",
        "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False, "weight_decay": 0.1},
    }
    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "fp16_clip": ({"dtype": "fp16"}, {"gradient_clipping": 0.05}),
        "fp16_clip_unfused": ({"dtype": "fp16"}, {"gradient_clipping": 0.05}),
        "adam_l2": ({}, {"optimizer": adam_l2}),
        "python_engine": ({}, {}),
    }
    for name, (kw, extra) in cases.items():
        section = {"io_engine": "python"} if name == "python_engine" else {}
        if name.endswith("_unfused"):
            section = {"fused_adam": False}
        ref_cfg = _oracle_config(f"{tmp}/{name}_oracle{rank}", **kw)
        cfg = config(f"{tmp}/{name}{rank}", nvmeswap=section, **kw)
        ref_cfg.update(extra)
        cfg.update(extra)
        ref = _build(ref_cfg, plugins=False)
        eng = _build(cfg)
        out[name] = {"oracle": train(ref, 4), "nvmeswap": train(eng, 4)}
        out[name]["skipped"] = (ref.skipped_steps, eng.skipped_steps)
        out[name]["algorithm"] = _state(eng).algorithm
        out[name]["fused_steps"] = _state(eng).fused_steps
    # fused_adam: true with an optimizer the kernel cannot follow is refused when the engine is built
    cfg = config(f"{tmp}/amsgrad{rank}", nvmeswap={"fused_adam": True})
    cfg["optimizer"]["params"]["amsgrad"] = True
    try:
        _build(cfg)
        out["amsgrad_error"] = None
    except Exception as e:
        out["amsgrad_error"] = f"{type(e).__name__}: {e}"
    return out


def scenario_shared_folder(tmp: str) -> dict[str, Any]:
    """A second engine given the swap folder of a live one is refused; the first trains on; once it
    is detached the folder serves a new engine (whose run repeats the first one's exactly)."""
    import zerohooks
    from nvmeswap import SwapFolderInUseError

    path = f"{tmp}/shared"
    first = _build(config(path, nvmeswap={}))
    losses = train(first, 1)
    try:
        _build(config(path, nvmeswap={}))
        error = ""
    except SwapFolderInUseError as e:
        error = f"{type(e).__name__}: {e}"
    losses += train(first, 1, first=1)
    zerohooks.detach(first)
    second = _build(config(path, nvmeswap={}))
    again = train(second, 2)
    zerohooks.detach(second)
    import torch.distributed as dist

    dist.barrier()  # the folder holds every rank's files: look once every rank has detached
    return {"error": error, "losses": losses, "again": again, "left": swap_files(path)}


def all_two_rank_scenarios(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in (
        ("variants", scenario_variants),
        ("training", scenario_training),
        ("set_grad", scenario_set_grad),
        ("corruption", scenario_corruption),
        ("checkpoint", scenario_checkpoint),
        ("shared_folder", scenario_shared_folder),
    ):
        out[name] = fn(tmp)
    return out


def scenario_sgd(tmp: str) -> dict[str, Any]:
    """Issue #33: SGD (momentum) with nvmeswap.  Without ``zero_allow_untested_optimizer`` it is
    refused by zerohooks.initialize before DeepSpeed builds anything (was DeepSpeed's "untested
    ZeRO Optimizer" assertion); with it, nvmeswap's unfused step equals DeepSpeed's own CPU
    offload of the same SGD bit for bit (one state tensor, the momentum buffer, swapped)."""
    rank = int(os.environ["RANK"])
    sgd = {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}
    out: dict[str, Any] = {}
    refused = config(f"{tmp}/sgd_refused{rank}", nvmeswap={"io_engine": "python"})
    refused["optimizer"] = sgd
    try:
        _build(refused)
        out["refusal"] = None
    except zerohooks.ConfigError as e:
        out["refusal"] = str(e)
    out["refused_files"] = swap_files(f"{tmp}/sgd_refused{rank}")
    ref_cfg = _oracle_config(f"{tmp}/sgd_oracle{rank}")
    ref_cfg.update(optimizer=sgd, zero_allow_untested_optimizer=True)
    ref = _build(ref_cfg, plugins=False)
    out["oracle_losses"] = train(ref, 3)
    oracle = (params16(ref), masters(ref))
    cfg = config(f"{tmp}/sgd{rank}", nvmeswap={"io_engine": "python"})
    cfg.update(optimizer=sgd, zero_allow_untested_optimizer=True)
    eng = _build(cfg)
    out["losses"] = train(eng, 3)
    state = zerohooks.attachment(eng).plugins[0].state  # type: ignore[union-attr]
    out["swapped"] = len(state.groups)
    out["keys"] = sorted({k for g in state.groups.values() for k in g.keys})
    out["equal"] = [
        all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
        for x, y in zip(oracle, (params16(eng), masters(eng)), strict=True)
    ]
    zerohooks.detach(eng)
    return out


def two_rank_results(tmp_path_factory: Any, prefix: str, scenarios: Any) -> list[dict[str, Any]]:
    """Every rank's result of ``scenarios(tmp)`` on 2 gloo ranks, in a fresh folder named after
    ``prefix`` (``fp16_on_cpu``: DeepSpeed's CPU accelerator accepts fp16; nothing changes for bf16)."""
    from zerohooks.testing import run_distributed

    tmp = str(tmp_path_factory.mktemp(prefix))
    return run_distributed(scenarios, 2, args=(tmp,), timeout=1200, fp16_on_cpu=True)
