"""Rewrite trusted old zerohooks plugin-state files as plain, checked data.

Usage::

    python -m zerohooks.convert_state --trust FILE [FILE ...]

Each ``FILE`` is a ``zerohooks_state_rank<R>.pt`` of a checkpoint folder.  A file zerohooks can
already read with ``weights_only=True`` and a checksum (format 2, plain data) is left as it is.
Any other (format 1, written before state files carried a checksum, or a payload holding objects
other than plain data) is loaded with ``torch.load(..., weights_only=False)``, **which runs any
code the file holds**: convert only files written by your own runs, in folders nobody else could
write to.  Its payload is turned into plain data (``torch.dtype`` and ``torch.device`` into their
names, ``torch.Size`` into a tuple, NumPy scalars and arrays into numbers and tensors; any other
object is an error naming it and nothing is written), then written in the current format in place
(temporary file and rename, as checkpoints are written) and read back with ``weights_only=True``.

``--trust`` is required: it is the user's statement that they made these files themselves.
Without it nothing is loaded or written; the command says why and exits with status 2.

Exit status: 0 when every file is current or was converted, 1 otherwise (each failure named),
2 without ``--trust`` or without a file.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from typing import Any

import torch

from zerohooks.adapter import statefile
from zerohooks.errors import CheckpointStateError

__all__ = ["convert", "main", "to_plain"]


def to_plain(obj: Any, where: str = "payload") -> Any:
    """``obj`` as plain data (see :func:`zerohooks.adapter.statefile.check_plain`); ``ValueError``
    naming the place of anything that has no plain form."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if type(obj) is not torch.Tensor else obj
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, torch.Size):
        return tuple(int(x) for x in obj)
    if isinstance(obj, dict):
        return {to_plain(k, f"a key of {where}"): to_plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    module = type(obj).__module__
    if module == "numpy" or module.startswith("numpy."):
        if hasattr(obj, "shape") and getattr(obj, "shape", ()) != ():
            return torch.from_numpy(obj.copy())
        return obj.item()
    raise ValueError(f"{where} holds a {module}.{type(obj).__qualname__}, which has no plain-data form")


def convert(path: str) -> str:
    """Convert one file in place (see the module's docstring); what was done, in words.

    Raises :class:`CheckpointStateError` or ``ValueError`` naming the file when it cannot be
    converted (nothing is written then)."""
    data = statefile.read_bytes(path, rank=0, what="the state file")
    legacy = data.startswith(b"PK\x03\x04")
    if not legacy:
        try:
            statefile.read_state(path, rank=0)
            return f"{path}: already plain data of format {statefile.FORMAT}, left as it is"
        except CheckpointStateError:
            pass  # objects beyond plain data: converted below (after the checksum is checked)
    body = data if legacy else statefile.verify_file(path, rank=0)
    assert body is not None
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(f"{path}: cannot be loaded ({type(e).__name__}: {e})") from e
    if not isinstance(payload, dict) or "states" not in payload or "world_size" not in payload:
        raise ValueError(f"{path}: not a zerohooks plugin-state payload (a {type(payload).__name__})")
    plain = to_plain(payload)
    plain["format"] = statefile.FORMAT
    statefile.write_atomic(path, statefile.encode(plain))
    statefile.read_state(path, rank=int(plain.get("rank", 0)))
    return f"{path}: converted to plain data of format {statefile.FORMAT}"


TRUST_FLAG = "--trust"
"""The flag without which nothing is converted."""

REFUSAL = (
    "not converted: converting loads each file with torch.load(..., weights_only=False), which runs "
    "any code the file's pickle holds (a forged file runs its author's code as you). Convert only "
    "plugin-state files that your own runs wrote, in folders nobody else could write to, and say so "
    "with --trust: `python -m zerohooks.convert_state --trust FILE [FILE ...]`. A file you did not "
    "make yourself: do not convert it; resume from another checkpoint, or load weights only with "
    "load_checkpoint(..., load_module_only=True)"
)
"""What the command says, on stderr, when called without ``--trust``."""


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0 if args else 2
    trust = TRUST_FLAG in args
    args = [a for a in args if a != TRUST_FLAG]
    if not trust:
        print(f"{', '.join(args) or 'no file'}: {REFUSAL}", file=sys.stderr)
        return 2
    if not args:
        print(__doc__)
        return 2
    status = 0
    for path in args:
        try:
            print(convert(path))
        except (CheckpointStateError, ValueError, OSError) as e:
            print(f"{path}: not converted: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
