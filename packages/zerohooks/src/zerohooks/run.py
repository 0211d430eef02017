"""``python -m zerohooks.run SCRIPT [ARGS]`` / ``python -m zerohooks.run -m MODULE [ARGS]``.

Runs an unmodified training script (a Hugging Face example, a Lightning CLI, any script whose
framework calls ``deepspeed.initialize``) with :func:`zerohooks.enable` in force, so the plugin
sections of its DeepSpeed config take effect.  Works under every launcher's module flag::

    torchrun --nproc_per_node 2 -m zerohooks.run train.py --deepspeed ds.json
    deepspeed --num_gpus 2 --module zerohooks.run train.py --deepspeed ds.json
    accelerate launch --use_deepspeed -m zerohooks.run train.py

The script sees ``sys.argv`` as if it had been started directly, and runs as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m zerohooks.run SCRIPT [ARGS...]  |  python -m zerohooks.run -m MODULE [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    # DeepSpeed's launcher (`deepspeed --module zerohooks.run ...`) puts --local_rank=N before
    # the script: hand it on after the script, where the script would have received it.
    launcher: list[str] = []
    while args and args[0].startswith("--local_rank"):
        if args[0] == "--local_rank" and len(args) > 1:
            launcher += args[:2]
            args = args[2:]
        else:
            launcher.append(args.pop(0))
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "").strip(), file=sys.stderr if not args else sys.stdout)
        raise SystemExit(0 if args else 2)
    module = None
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit(f"zerohooks.run: -m needs a module name\n{USAGE}")
        module, rest = args[1], [*launcher, *args[2:]]
        sys.argv = [module, *rest]
    else:
        script, rest = args[0], [*launcher, *args[1:]]
        if not os.path.isfile(script):
            raise SystemExit(f"zerohooks.run: {script!r} is not a file\n{USAGE}")
        sys.argv = [script, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does

    import zerohooks

    zerohooks.enable()
    if module is not None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
