"""What the framework tests share: a tiny GPT-2, local data, DeepSpeed configs, and the measurements.

Everything here runs inside the ranks (2 gloo processes started by ``zerohooks.testing``); the
test modules only assert on what the scenarios return.  Each scenario is caught on its own, so a
scenario that fails (a fix not landed yet) reports its traceback and the others still run.

Oracles are computed here from the model itself (parameter counts by module class), never from
what a plugin reports about itself: bytes a bf16 all-reduce would move, the dtypes the model
should have, the uninterrupted run, the hand loop.
"""

from __future__ import annotations

import contextlib
import copy
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# loco's C++ kernels and nvmeswap's C++ I/O engine are not what these tests are about: their
# pure-torch/Python versions keep CI from compiling them in yet another venv.
os.environ.setdefault("LOCO_KERNELS", "reference")

WORLD = 2
MICRO_BATCH = 2
GAS = 2
SEQ = 32
SAMPLES = 64
LR = 1e-3
SEED = 0
NVMESWAP_SECTION = {"io_engine": "python", "fused_adam": False}
"""nvmeswap without its JIT-built C++ engine and fused Adam kernel (the same files, bytes and
numerics, with a warning): nothing to compile in the test venv."""


def gpt2_config() -> Any:
    from transformers import GPT2Config

    # dropout off: the runs compared bit for bit must not depend on where the RNG stands
    return GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=128,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def make_model() -> Any:
    """The same tiny GPT-2 (about 0.1 M parameters) on every rank and in every run."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(SEED)
    return GPT2LMHeadModel(gpt2_config())


def token_ids() -> Any:
    """``SAMPLES`` sequences of random token ids, the same on every rank (fixed seed)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, gpt2_config().vocab_size, (SAMPLES, SEQ), generator=g)


def shard_batch(k: int, rank: int) -> Any:
    """Micro-batch ``k`` of ``rank`` as accelerate shards a sequential loader of ``MICRO_BATCH``
    samples per batch: batch ``WORLD * k + rank`` of the whole set."""
    i = (WORLD * k + rank) * MICRO_BATCH
    return token_ids()[i : i + MICRO_BATCH]


def ds_config(
    stage: int = 2, sections: dict[str, Any] | None = None, *, bf16: bool = True, **extra: Any
) -> dict[str, Any]:
    """A DeepSpeed config as a Trainer/accelerate user writes it: no ``"auto"`` anywhere (plugin
    keys left out rather than ``"auto"``), torch's AdamW (DeepSpeed's cpu_adam takes minutes to
    build), values equal to the ``TrainingArguments`` of :func:`training_args`."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    cfg.update(copy.deepcopy(sections or {}))
    cfg.update(extra)
    return cfg


def nvme_config(folder: str, sections: dict[str, Any]) -> dict[str, Any]:
    """ZeRO 3 with the optimizer state on "NVMe" (a temporary folder)."""
    cfg = ds_config(3, sections)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": folder}
    cfg["zero_force_ds_cpu_optimizer"] = False  # keep torch's AdamW (no cpu_adam build)
    return cfg


def run_scenarios(scenarios: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each scenario; ``{"ok": result}`` or ``{"error": traceback}`` per name."""
    out: dict[str, Any] = {}
    for name, fn in scenarios.items():
        try:
            out[name] = {"ok": fn()}
        except BaseException:
            out[name] = {"error": traceback.format_exc()}
        finally:
            reset_frameworks()
    return out


def reset_frameworks() -> None:
    """Forget accelerate's process-wide singletons so that the next scenario starts afresh."""
    import gc

    with contextlib.suppress(Exception):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    with contextlib.suppress(Exception):
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    gc.collect()


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    import zerohooks

    if not on:
        yield
        return
    handle = zerohooks.enable()
    try:
        yield
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------------
# measurements (per rank), plain Python values only
# ------------------------------------------------------------------------------------------------


def param_numel(model: Any) -> int:
    """Elements of the trainable parameters (full sizes, also under ZeRO 3), ties counted once."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            seen[id(p)] = int(getattr(p, "ds_numel", p.numel()))
    return sum(seen.values())


def safe_numel(model: Any) -> int:
    """Elements of the parameters autocastzero should reduce in bf16: those of ``nn.Linear`` and
    GPT-2's ``Conv1D`` modules, except a parameter also held by another module (GPT-2's lm_head
    weight is the tied token embedding)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    holders: dict[int, list[bool]] = {}
    sizes: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(isinstance(m, (torch.nn.Linear, Conv1D)))
            sizes[id(p)] = int(getattr(p, "ds_numel", p.numel()))
    return sum(sizes[i] for i, flags in holders.items() if all(flags))


def bytes_by_dtype(step: dict[str, dict[str, int]]) -> dict[str, int]:
    """zerohooks' counters of one step (collective -> dtype -> bytes), summed over collectives."""
    out: dict[str, int] = {}
    for per in step.values():
        for dt, n in per.items():
            out[dt] = out.get(dt, 0) + n
    return out


def attachment_summary(engine: Any) -> dict[str, Any]:
    """Which plugins zerohooks attached to ``engine`` (None: no attachment) and its counters."""
    import zerohooks

    att = zerohooks.attachment(engine)
    if att is None:
        return {"attached": False, "plugins": [], "steps": []}
    return {
        "attached": True,
        "plugins": sorted(p.name for p in att.plugins),
        "reducer": att.registry.reducer.name if att.registry.reducer is not None else None,
        "steps": [bytes_by_dtype(s) for s in att.counters.history],
    }


def plugin(engine: Any, name: str) -> Any:
    import zerohooks

    att = zerohooks.attachment(engine)
    assert att is not None, "no zerohooks attachment on the engine"
    (p,) = [p for p in att.plugins if p.name == name]
    return p


def effects(engine: Any, model: Any, name: str) -> dict[str, Any]:
    """What the plugin ``name`` did on ``engine``, and the model-derived numbers to judge it by."""
    out: dict[str, Any] = attachment_summary(engine)
    out["numel"] = param_numel(model)
    if name == "loco":
        stats = plugin(engine, "loco").stats
        out["loco"] = [dict(s) for s in stats.history]
    elif name == "autocastzero":
        out["safe_numel"] = safe_numel(model)
    elif name == "mixedlayers":
        import torch

        module = engine.module
        ln = [p for m in module.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()]
        out["ln_numel"] = sum(int(getattr(p, "ds_numel", p.numel())) for p in ln)
        out["ln_dtypes"] = sorted({str(p.dtype) for p in ln})
        ln_ids = {id(p) for p in ln}
        out["other_dtypes"] = sorted({str(p.dtype) for p in module.parameters() if id(p) not in ln_ids})
    elif name == "accumdtype":
        import accumdtype

        out["plan"] = str(accumdtype.accum_state(engine).plan)
    return out


def grad_accum_dtypes(engine: Any) -> list[str]:
    """dtypes of accumdtype's accumulation tensors (read between two micro-steps of a window)."""
    import accumdtype

    dts = set()
    for p in engine.module.parameters():
        g = accumdtype.grad_accum(engine, p)
        if g is not None:
            dts.add(str(g.dtype))
    return sorted(dts)


def proc_io() -> tuple[int, int]:
    """(bytes written, bytes read) to storage by this process so far (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["write_bytes"]), int(fields["read_bytes"])


def swap_files(folder: str) -> dict[str, int]:
    """Size of every file under ``folder`` (nvmeswap's swap files), by relative path."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            out[os.path.relpath(path, folder)] = os.path.getsize(path)
    return out


def full_params_digest(engine: Any) -> str:
    """sha256 of every parameter of ``engine.module``, in order (ZeRO 3: gathered): equal digests
    are bit-identical weights."""
    import hashlib

    import torch

    params = list(engine.module.parameters())
    ctx: Any = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with ctx:
        flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def hand_loop(config: dict[str, Any], steps: int) -> dict[str, Any]:
    """The oracle of the Trainer runs: ``zerohooks.initialize`` and a plain micro-step loop over
    the batches accelerate's sharded sequential loader hands this rank, the loss divided by the
    accumulation steps as Trainer does."""
    import torch

    import zerohooks

    rank = torch.distributed.get_rank()
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zerohooks.initialize(model=model, model_parameters=params, config=copy.deepcopy(config))
    engine.train()
    losses = []
    for k in range(steps * GAS):
        x = shard_batch(k, rank)
        loss = engine(input_ids=x, labels=x).loss
        losses.append(loss.item())
        engine.backward(loss / GAS, scale_wrt_gas=False)
        engine.step()
    return {"losses": losses, "params": full_params_digest(engine), **attachment_summary(engine)}
