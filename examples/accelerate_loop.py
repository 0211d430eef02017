"""A tiny GPT-2 trained with an accelerate loop under DeepSpeed ZeRO, with zerohooks plugins.

CPU, 2 ranks over gloo::

    torchrun --nproc_per_node 2 examples/accelerate_loop.py
    accelerate launch --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        examples/accelerate_loop.py

GPU, one rank per GPU over NCCL::

    accelerate launch --num_processes 8 examples/accelerate_loop.py

The DeepSpeed config (with the plugin sections) is built in the script and handed to
``DeepSpeedPlugin(hf_ds_config=...)``; ``zerohooks.enable()`` runs before
``accelerator.prepare``.  With ``--no-enable`` the script leaves that to ``python -m
zerohooks.run``::

    accelerate launch --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        -m zerohooks.run examples/accelerate_loop.py --no-enable

It prints rank 0's per-micro-step losses and what each plugin did.
"""

from __future__ import annotations

import tempfile

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
    args = parser.parse_args()

    before_distributed()
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    import zerohooks

    if not args.no_enable:
        zerohooks.enable()  # before accelerator.prepare builds the engine
    plugins = [p for p in args.plugins.split(",") if p]
    config = ds_config(
        args.stage, args.gas, args.micro_batch, args.lr, plugins, args.nvme_path or tempfile.mkdtemp()
    )
    if not on_gpu():
        PartialState(cpu=True)  # Accelerator(cpu=True) would silently drop DeepSpeed
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=args.gas
    )
    model = tiny_gpt2()
    loader = torch.utils.data.DataLoader(token_ids(), batch_size=args.micro_batch, shuffle=False)
    optimizer = DummyOptim(model.parameters(), lr=args.lr)  # the optimizer is the config's
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    steps = 0
    for x in loader:
        with accelerator.accumulate(engine):
            loss = engine(input_ids=x, labels=x).loss
            accelerator.backward(loss)  # engine.backward, and engine.step() at the accumulation boundary
        losses.append(loss.item())
        if accelerator.sync_gradients:
            steps += 1
            if steps == args.steps:
                break
    report(accelerator.process_index, losses, engine, args.report)


if __name__ == "__main__":
    main()
