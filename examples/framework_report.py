"""What ``examples/hf_trainer.py`` and ``examples/accelerate_loop.py`` share: the tiny GPT-2, local
data, the DeepSpeed config with plugin sections, and the report of what each plugin did."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

# The examples run offline (the tiny GPT-2 is built here, nothing is downloaded): set before they
# import transformers, which they do after this module.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB, SEQ, SAMPLES = 128, 32, 256


def example_parser(doc: str | None) -> argparse.ArgumentParser:
    """An example's command line: its docstring as the help, then :func:`common_arguments`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(parser)
    return parser


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both examples take (training size, plugins, report, launcher flags)."""
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--gas", type=int, default=2, help="micro-steps per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--plugins", default="loco,accumdtype", help="comma-separated plugin sections")
    parser.add_argument("--nvme-path", default=None, help="nvmeswap's folder (default: a temporary one)")
    parser.add_argument("--report", default=None, help="write each rank's results to REPORT.<rank>.json")
    parser.add_argument(
        "--no-enable", action="store_true", help="leave zerohooks.enable() to python -m zerohooks.run"
    )
    parser.add_argument(
        "--local_rank", type=int, default=None, help=argparse.SUPPRESS
    )  # deepspeed's launcher


def on_gpu() -> bool:
    return torch.cuda.is_available()


def before_distributed() -> None:
    """On CPU, keep DeepSpeed from JIT-compiling its shared-memory op (inference only) at init."""
    if not on_gpu():
        from zerohooks.adapter.compat import skip_deepspeed_shm_op

        skip_deepspeed_shm_op()


def tiny_gpt2() -> Any:
    """A 2-layer GPT-2 built from a config (no download), the same weights on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def token_ids() -> torch.Tensor:
    """Random token ids made locally with a fixed seed."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)


def ds_config(
    stage: int, gas: int, micro_batch: int, lr: float, plugins: list[str], nvme_path: str
) -> dict[str, Any]:
    """DeepSpeed's config plus the plugin sections. Plugin keys are left out rather than set to
    "auto": Trainer and accelerate fill or reject every "auto" they find."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    sections: dict[str, Any] = {
        "loco": {},  # 4-bit gradient communication with error feedback
        "accumdtype": {"dtype": "fp32"},  # accumulate (and reduce) the bf16 model's gradients in fp32
        "mixedlayers": {"fp32_module_types": ["torch.nn.LayerNorm"]},  # LayerNorms stay fp32
        "autocastzero": {},  # fp32 parameters, bf16 autocast (replaces the bf16 section)
        "nvmeswap": {},  # ZeRO 3 optimizer state swapped to nvme_path
    }
    for name in plugins:
        cfg[name] = sections[name]
    if "autocastzero" in plugins:
        del cfg["bf16"]
    if "nvmeswap" in plugins:
        cfg["zero_optimization"]["stage"] = 3
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def describe(engine: Any) -> dict[str, Any]:
    """What zerohooks attached to ``engine`` and what each plugin did, as plain values."""
    import zerohooks

    att = zerohooks.attachment(engine)
    if att is None:
        return {"attached": False}
    out: dict[str, Any] = {"attached": True, "plugins": sorted(p.name for p in att.plugins)}
    last = att.counters.last_step()
    out["collective_bytes_last_step"] = {dt: n for per in last.values() for dt, n in per.items()}
    for p in att.plugins:
        if p.name == "loco":
            s = p.stats.last_step()
            out["loco"] = {
                "wire_bytes": s.get("wire_bytes", 0),
                "bf16_wire_bytes": s.get("bf16_wire_bytes", 0),
                "ratio": s.get("wire_bytes", 0) / max(1, s.get("bf16_wire_bytes", 0)),
            }
        elif p.name == "accumdtype":
            import accumdtype

            out["accumdtype"] = {"plan": str(accumdtype.accum_state(engine).plan.accum_dtype)}
        elif p.name == "mixedlayers":
            out["mixedlayers"] = {
                "fp32_params": sum(1 for q in engine.module.parameters() if q.dtype == torch.float32),
                "params": sum(1 for _ in engine.module.parameters()),
            }
    return out


def report(rank: int, losses: list[float], engine: Any, path: str | None) -> None:
    """Print rank 0's losses and plugin effects; write every rank's to ``path.<rank>.json``."""
    info = {"rank": rank, "losses": losses, **describe(engine)}
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(f"{path}.{rank}.json", "w") as f:
            json.dump(info, f)
    if rank == 0:
        print("losses (rank 0):", " ".join(f"{v:.4f}" for v in losses))
        print(
            "zerohooks:",
            "attached, plugins " + ", ".join(info["plugins"]) if info["attached"] else "NOT attached",
        )
        if "loco" in info:
            lo = info["loco"]
            print(
                f"loco: {lo['wire_bytes']} bytes on the wire last step, {lo['ratio']:.3f}x a bf16 all-reduce"
            )
        for key in ("accumdtype", "mixedlayers"):
            if key in info:
                print(f"{key}: {info[key]}")
        if info["attached"]:
            print(
                "bytes handed to the gradient collectives last step, by dtype:",
                info["collective_bytes_last_step"],
            )
