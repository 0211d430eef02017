"""A tiny GPT-2 trained with Hugging Face Trainer under DeepSpeed ZeRO, with zerohooks plugins.

CPU, 2 ranks over gloo (what this project's CI machine runs)::

    torchrun --nproc_per_node 2 examples/hf_trainer.py

GPU, one rank per GPU over NCCL (the same script; bf16 needs Ampere or newer)::

    torchrun --nproc_per_node 8 examples/hf_trainer.py
    deepspeed --num_gpus 8 examples/hf_trainer.py

The script calls ``zerohooks.enable()`` before ``Trainer(...)``; with ``--no-enable`` it is an
unmodified Trainer script, and ``python -m zerohooks.run`` does that for it::

    torchrun --nproc_per_node 2 -m zerohooks.run examples/hf_trainer.py --no-enable

It prints rank 0's per-step losses and what each plugin did (loco's bytes on the wire against a
bf16 all-reduce, the accumulation dtype, the bytes per dtype handed to the collectives).
Plugins: ``--plugins loco,accumdtype`` (default); also ``mixedlayers``, ``autocastzero`` (no bf16
section then), ``nvmeswap`` (ZeRO 3, optimizer state in ``--nvme-path``).
"""

from __future__ import annotations

import tempfile
from typing import Any

from framework_report import (
    before_distributed,
    ds_config,
    example_parser,
    on_gpu,
    report,
    tiny_gpt2,
    token_ids,
)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument(
        "--output-dir", default=None, help="Trainer's output folder (default: a temporary one)"
    )
    args = parser.parse_args()

    before_distributed()
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import zerohooks

    if not args.no_enable:
        zerohooks.enable()  # before Trainer builds its engine; every rank runs this line
    tmp = tempfile.mkdtemp(prefix="hf_trainer_")
    plugins = [p for p in args.plugins.split(",") if p]
    config = ds_config(args.stage, args.gas, args.micro_batch, args.lr, plugins, args.nvme_path or tmp)
    training_args = TrainingArguments(
        output_dir=args.output_dir or tmp,
        use_cpu=not on_gpu(),
        deepspeed=config,
        bf16="bf16" in config,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.gas,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    losses: list[float] = []

    class KeepLosses(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    data = [{"input_ids": x, "labels": x} for x in token_ids()]
    trainer = Trainer(model=tiny_gpt2(), args=training_args, train_dataset=data, callbacks=[KeepLosses()])
    trainer.train()
    report(training_args.process_index, losses, trainer.model_wrapped, args.report)


if __name__ == "__main__":
    main()
