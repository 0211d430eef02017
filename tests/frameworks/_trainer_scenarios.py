"""Hugging Face Trainer scenarios, all run in one 2-rank launch (see conftest.py).

Trainer builds the engine itself (``accelerator.prepare`` -> ``deepspeed.initialize``); the
scenarios call ``zerohooks.enable()`` before ``Trainer(...)`` (except ``no_enable``) and read the
engine back from ``trainer.model_wrapped``.
"""

from __future__ import annotations

import os
from typing import Any

from _frameworks_common import (
    GAS,
    LR,
    MICRO_BATCH,
    NVMESWAP_SECTION,
    SAMPLES,
    attachment_summary,
    ds_config,
    effects,
    enabled,
    full_params_digest,
    grad_accum_dtypes,
    hand_loop,
    make_model,
    nvme_config,
    proc_io,
    run_scenarios,
    swap_files,
    token_ids,
)

RESUME_STEPS, SAVE_AT = 5, 3
"""The resume scenario: 5 optimizer steps of 2 micro-steps, a checkpoint after step 3 (odd)."""


def train(
    out_dir: str,
    ds: dict[str, Any],
    steps: int,
    *,
    bf16: bool = True,
    save_steps: int | None = None,
    resume: str | None = None,
    probe: Any = None,
) -> dict[str, Any]:
    """Train the tiny GPT-2 with Trainer for ``steps`` optimizer steps; per-micro-step losses of
    this rank (exact floats), the batches it saw, and the engine."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    losses: list[float] = []
    batches: list[list[list[int]]] = []

    class RecordingTrainer(Trainer):
        def compute_loss(  # type: ignore[override]
            self,
            model: Any,
            inputs: dict[str, Any],
            return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Any:
            out = model(input_ids=inputs["input_ids"], labels=inputs["labels"])
            losses.append(out.loss.item())
            batches.append(inputs["input_ids"].tolist())
            return (out.loss, out) if return_outputs else out.loss

    callbacks = []
    if probe is not None:
        holder: dict[str, Any] = {}

        class Probe(TrainerCallback):
            def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                probe("substep", holder["trainer"].model_wrapped, state)

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                probe("step", holder["trainer"].model_wrapped, state)

        callbacks.append(Probe())

    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        deepspeed=ds,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=GAS,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        bf16=bf16,
        train_sampling_strategy="sequential",  # the hand loop's order (accelerate shards it)
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        save_only_model=False,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    model = make_model()
    data = [{"input_ids": x, "labels": x} for x in token_ids()]
    trainer = RecordingTrainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.model_accepts_loss_kwargs = False  # a plain per-batch mean loss, divided by GAS (no token counts)
    if probe is not None:
        holder["trainer"] = trainer
    trainer.train(resume_from_checkpoint=resume)
    engine = trainer.model_wrapped
    return {"losses": losses, "batches": batches, "engine": engine, "trainer": trainer, "model": model}


def _plugin_run(
    tmp: str, name: str, ds: dict[str, Any], *, bf16: bool = True, steps: int = 2
) -> dict[str, Any]:
    with enabled():
        run = train(os.path.join(tmp, name), ds, steps, bf16=bf16)
    return {"losses": run["losses"], **effects(run["engine"], run["model"], name.split("-")[0])}


def _accumdtype(tmp: str) -> dict[str, Any]:
    seen: list[Any] = []

    def probe(when: str, engine: Any, state: Any) -> None:
        if when == "substep":  # between the two micro-steps of a window
            seen.append(grad_accum_dtypes(engine))

    with enabled():
        run = train(
            os.path.join(tmp, "accumdtype"), ds_config(2, {"accumdtype": {"dtype": "fp32"}}), 2, probe=probe
        )
    return {"mid_window_dtypes": seen, **effects(run["engine"], run["model"], "accumdtype")}


def _nvmeswap(tmp: str) -> dict[str, Any]:
    folder = os.path.join(tmp, "nvme")
    io: list[tuple[int, int]] = []
    files: list[dict[str, int]] = []

    def probe(when: str, engine: Any, state: Any) -> None:
        if when == "step":
            io.append(proc_io())
            files.append(swap_files(folder))

    with enabled():
        run = train(
            os.path.join(tmp, "nvmeswap"),
            nvme_config(folder, {"nvmeswap": NVMESWAP_SECTION}),
            4,
            probe=probe,
        )
    engine = run["engine"]
    part = sum(p.ds_tensor.numel() for p in engine.module.parameters())  # this rank's partition
    return {"io": io, "files": files, "partition_numel": part, **effects(engine, run["model"], "nvmeswap")}


def _no_enable(tmp: str) -> dict[str, Any]:
    import logging

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if any(k in msg for k in ("loco", "accumdtype", "unknown", "Unknown", "ignored")):
                records.append(f"{record.name}: {msg[:300]}")

    grab = Grab(logging.DEBUG)
    logging.getLogger().addHandler(grab)
    for name in ("DeepSpeed", "transformers", "accelerate"):
        logging.getLogger(name).addHandler(grab)
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = train(
                os.path.join(tmp, "no_enable"),
                ds_config(2, {"loco": {}, "accumdtype": {"dtype": "fp32"}}),
                1,
            )
    finally:
        logging.getLogger().removeHandler(grab)
        for name in ("DeepSpeed", "transformers", "accelerate"):
            logging.getLogger(name).removeHandler(grab)
    engine = run["engine"]
    related = [
        str(w.message)[:300] for w in caught if "loco" in str(w.message) or "accumdtype" in str(w.message)
    ]
    cfg = engine.config if isinstance(engine.config, dict) else {}
    return {
        **attachment_summary(engine),
        "losses": run["losses"],
        "warnings": related,
        "logs": records,
        "sections_in_engine_config": sorted(k for k in ("loco", "accumdtype") if k in cfg),
    }


def _resume_and_hand_loop(tmp: str) -> dict[str, Any]:
    """One uninterrupted run saving at step 3, the run resumed from that checkpoint, and the
    same training through ``zerohooks.initialize`` with a hand loop."""
    ds = ds_config(2, {"accumdtype": {"dtype": "fp32"}, "loco": {}})
    out = os.path.join(tmp, "resume")
    with enabled():
        full = train(out, ds, RESUME_STEPS, save_steps=SAVE_AT)
        full_params = full_params_digest(full["engine"])
        full_summary = attachment_summary(full["engine"])
        ckpt = os.path.join(out, f"checkpoint-{SAVE_AT}")
        layout = sorted(os.path.relpath(os.path.join(r, f), ckpt) for r, _, fs in os.walk(ckpt) for f in fs)
        import torch.distributed as dist

        dist.barrier()
        resumed = train(os.path.join(tmp, "resumed"), ds, RESUME_STEPS, save_steps=None, resume=ckpt)
        resumed_params = full_params_digest(resumed["engine"])
        dist.barrier()
        # the same checkpoint resumed with the plugin sections taken out: refused, not dropped
        try:
            train(os.path.join(tmp, "mismatch"), ds_config(2), RESUME_STEPS, resume=ckpt)
            mismatch = "no error"
        except Exception as e:  # the error every rank must raise, recorded for the test
            mismatch = f"{type(e).__name__}: {e}"
    config_passed = full["trainer"].accelerator.deepspeed_config
    hand = hand_loop(ds, RESUME_STEPS)
    return {
        "full": {"losses": full["losses"], "batches": full["batches"], "params": full_params, **full_summary},
        "resumed": {"losses": resumed["losses"], "params": resumed_params},
        "mismatch": mismatch,
        "hand": hand,
        "layout": layout,
        "config_added": {k: repr(v) for k, v in config_passed.items() if ds.get(k) != v},
    }


def _zero3_init(tmp: str) -> dict[str, Any]:
    """Is a model built after ``TrainingArguments(deepspeed=<ZeRO 3>)`` made under zero.Init?"""
    from _frameworks_common import gpt2_config
    from transformers import GPT2LMHeadModel, TrainingArguments

    args = TrainingArguments(
        output_dir=os.path.join(tmp, "z3"), use_cpu=True, deepspeed=ds_config(3), report_to=[]
    )
    direct = GPT2LMHeadModel(gpt2_config())
    from_config = GPT2LMHeadModel._from_config(gpt2_config())
    del args
    return {
        "direct_partitioned": any(hasattr(p, "ds_id") for p in direct.parameters()),
        "from_config_partitioned": any(hasattr(p, "ds_id") for p in from_config.parameters()),
    }


def _hf_objects(tmp: str) -> dict[str, Any]:
    """No ``"optimizer"`` section: Trainer builds torch's AdamW and its LR scheduler itself and
    accelerate passes both objects to deepspeed.initialize.  Each plugin either trains or is
    refused with a message that names the fix; what happened is recorded per plugin."""
    mixed = {"fp32_module_types": ["torch.nn.LayerNorm"]}
    out: dict[str, Any] = {}
    for name, section in (("loco", {}), ("accumdtype", {"dtype": "fp32"}), ("mixedlayers", mixed)):
        ds = ds_config(2, {name: section})
        del ds["optimizer"]
        try:
            with enabled():
                run = train(os.path.join(tmp, f"objects-{name}"), ds, 2)
            att = attachment_summary(run["engine"])
            out[name] = {"trained": True, "losses": run["losses"], **att}
        except Exception as e:  # recorded for the test: a refusal must name the fix
            out[name] = {"trained": False, "error": f"{type(e).__name__}: {e}"}
    return out


def _zero3_init_plugins(tmp: str) -> dict[str, Any]:
    """ZeRO 3 with the model built by ``_from_config`` after ``TrainingArguments`` (so under
    ``deepspeed.zero.Init``), as HF users get it: loco + accumdtype train; mixedlayers is
    refused naming the Hugging Face ways out."""
    from _frameworks_common import gpt2_config
    from transformers import GPT2LMHeadModel, TrainingArguments

    out: dict[str, Any] = {}
    for name, sections in (
        ("loco+accumdtype", {"loco": {}, "accumdtype": {"dtype": "fp32"}}),
        ("mixedlayers", {"mixedlayers": {"fp32_module_types": ["torch.nn.LayerNorm"]}}),
    ):
        ds = ds_config(3, sections)
        args = TrainingArguments(
            output_dir=os.path.join(tmp, "z3i-" + name), use_cpu=True, deepspeed=ds, report_to=[]
        )
        model = GPT2LMHeadModel._from_config(gpt2_config())
        partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
        del args
        try:
            import deepspeed

            with enabled():
                engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
                ids = token_ids()[:MICRO_BATCH]
                losses = []
                for _ in range(2 * GAS):
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
            out[name] = {
                "partitioned": partitioned,
                "trained": True,
                "losses": losses,
                **attachment_summary(engine),
            }
        except Exception as e:
            out[name] = {"partitioned": partitioned, "trained": False, "error": f"{type(e).__name__}: {e}"}
    return out


def all_trainer_scenarios(tmp: str) -> dict[str, Any]:
    conv1d = {"lower_precision_safe_modules": ["torch.nn.Linear", "transformers.pytorch_utils.Conv1D"]}
    scenarios = {
        "plain": lambda: _plugin_run(tmp, "plain", ds_config(2)),
        "loco": lambda: _plugin_run(tmp, "loco", ds_config(2, {"loco": {}})),
        "accumdtype": lambda: _accumdtype(tmp),
        "autocastzero": lambda: _plugin_run(
            tmp, "autocastzero-default", ds_config(2, {"autocastzero": {}}, bf16=False), bf16=False
        ),
        "autocastzero_conv1d": lambda: _plugin_run(
            tmp, "autocastzero-conv1d", ds_config(2, {"autocastzero": conv1d}, bf16=False), bf16=False
        ),
        "mixedlayers": lambda: _plugin_run(
            tmp, "mixedlayers", ds_config(2, {"mixedlayers": {"fp32_module_types": ["torch.nn.LayerNorm"]}})
        ),
        "nvmeswap": lambda: _nvmeswap(tmp),
        "no_enable": lambda: _no_enable(tmp),
        "resume": lambda: _resume_and_hand_loop(tmp),
        "zero3_init": lambda: _zero3_init(tmp),
        "hf_objects": lambda: _hf_objects(tmp),
        "zero3_init_plugins": lambda: _zero3_init_plugins(tmp),
    }
    only = os.environ.get("FRAMEWORKS_ONLY")  # debugging: FRAMEWORKS_ONLY=loco,resume
    if only:
        scenarios = {k: v for k, v in scenarios.items() if k in only.split(",")}
    return run_scenarios(scenarios)


assert SAMPLES >= 2 * MICRO_BATCH * GAS * RESUME_STEPS, "the resume run must stay inside one epoch"
