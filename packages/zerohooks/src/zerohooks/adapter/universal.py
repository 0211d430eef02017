"""DeepSpeed's universal-checkpoint converter (``ds_to_universal``) run in the calling process
(the tests' way; from a shell: ``python -m deepspeed.checkpoint.ds_to_universal --input_folder
... --output_folder ... --inject_missing_state``): one worker (no process pool), the missing
``universal_checkpoint_info`` injected (the converter wants it in the client state, as Megatron
writes it).  It converts DeepSpeed's files only: zerohooks' plugin-state files are not copied,
and each plugin keeping state says what it does on a universal load (``load_universal``)."""

from __future__ import annotations

import os
from argparse import Namespace

__all__ = ["to_universal"]


def to_universal(save_dir: str, tag: str) -> str:
    """Convert checkpoint ``tag`` of ``save_dir`` into ``save_dir/universal/<tag>`` (which also
    gets ``latest_universal``, so ``load_checkpoint(save_dir + "/universal")`` finds it); returns
    the converted folder."""
    from deepspeed.checkpoint import ds_to_universal

    out = os.path.join(save_dir, "universal", tag)
    args = Namespace(
        input_folder=os.path.join(save_dir, tag),
        output_folder=out,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds_to_universal.main(args)
    return out
