"""DeepSpeed's own checkpoint files, read without running code, for engines built by zerohooks.

DeepSpeed 0.19.8 reads ``mp_rank_*_model_states.pt`` and ``*_optim_states.pt`` with
``torch.load(..., weights_only=False)`` (``TorchCheckpointEngine.load``): a pickle planted in the
checkpoint folder would run at resume.  For the duration of one ``load_checkpoint`` of an engine
built by zerohooks (nothing global, plain ``deepspeed.initialize`` engines are untouched):

1. every rank scans the pickles of every ``.pt`` file in the tag folder (its sub-folders too:
   universal checkpoints, which DeepSpeed reads with ``torch.load`` directly) for the globals they
   name, without unpickling them, and the ranks agree: a file naming anything outside
   :data:`DEEPSPEED_GLOBALS`, the classes the engine's plugins declare
   (``ZeroPlugin.checkpoint_classes``) and torch's own weights-only allowlist is a
   :class:`~zerohooks.errors.CheckpointStateError` on every rank, naming the file, the rank and
   the globals, before DeepSpeed reads anything;
2. the engine's checkpoint engine reads each file with ``torch.load(..., weights_only=True)``
   under :func:`torch.serialization.safe_globals` of that same list, so a file replaced between
   the scan and the read is still refused (on the rank that read it) rather than run.

An engine whose plugin asked for it (:func:`zerohooks.adapter.seams.read_checkpoints_mapped`,
nvmeswap) reads DeepSpeed's optimizer-state files memory-mapped (``mmap=True``): the tensors
DeepSpeed loads from them refer to the file's pages, not to RAM, whether the folder is trusted or
not.  The model-states file (with the user's ``client_state``) is read as usual.

A user who trusts a checkpoint folder that holds other objects (the usual case: a
``client_state`` with objects of their own) loads it inside :func:`trust_checkpoint_code`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import pickle
import zipfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from zerohooks.adapter.statefile import refusal
from zerohooks.errors import CheckpointStateError

if TYPE_CHECKING:
    from zerohooks.adapter.base import Attachment

__all__ = ["DEEPSPEED_GLOBALS", "allowed_globals", "guarded", "trust_checkpoint_code"]

DEEPSPEED_GLOBALS: tuple[str, ...] = (
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The DeepSpeed classes (beyond torch's weights-only allowlist) that DeepSpeed 0.19.8's own
checkpoint files hold, found by saving ZeRO 0-3 checkpoints in fp32, bf16 and fp16, with and
without CPU offload, with an lr scheduler and with each zerohooks plugin: the fp16 loss scalers,
the ZeRO stage and the bf16 optimizer's fragment addresses."""

TRUST_HINT = (
    "The usual cause is a client_state passed to save_checkpoint holding objects of your own: "
    "save plain data there (dicts, lists, numbers, strings, tensors). If this checkpoint was "
    "written by your own run and nobody else can write its folder, load it with "
    "`with zerohooks.trust_checkpoint_code(): engine.load_checkpoint(...)` on every rank (that "
    "runs whatever code the files hold); else resume from a checkpoint you trust"
)
"""What every refusal of a DeepSpeed checkpoint file tells the user to do."""

_TRUSTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "zerohooks_trust_checkpoint_code", default=False
)
_ALLOWED_CACHE: dict[str, Any] = {}


@contextlib.contextmanager
def trust_checkpoint_code() -> Iterator[None]:
    """Within this context, ``load_checkpoint`` of engines built by zerohooks reads DeepSpeed's
    own checkpoint files as DeepSpeed does (``torch.load(..., weights_only=False)``), which runs
    any code a pickle in them holds.

    Use it only for a checkpoint folder that your own runs wrote and nobody else can write,
    whose ``client_state`` holds objects of your own classes; enter it on every rank.  zerohooks'
    plugin-state files are read as plain data all the same."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def _resolve(name: str) -> Any:
    if name not in _ALLOWED_CACHE:
        module, _, attr = name.rpartition(".")
        _ALLOWED_CACHE[name] = getattr(importlib.import_module(module), attr)
    return _ALLOWED_CACHE[name]


def allowed_globals(att: Attachment) -> list[Any]:
    """The classes ``att``'s engine may find in DeepSpeed's checkpoint files beyond torch's own
    allowlist: :data:`DEEPSPEED_GLOBALS` and every enabled plugin's ``checkpoint_classes``."""
    allowed = [_resolve(n) for n in DEEPSPEED_GLOBALS]
    for p in att.plugins:
        allowed.extend(c for c in getattr(p, "checkpoint_classes", ()) if c not in allowed)
    return allowed


def _files(folder: str) -> list[str]:
    """Every ``.pt`` file DeepSpeed may read in a tag folder (plugin-state files excluded: they are
    read as plain data by :mod:`zerohooks.adapter.statefile`)."""
    found: list[str] = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        found.extend(
            os.path.join(root, n)
            for n in sorted(names)
            if n.endswith(".pt") and not n.startswith("zerohooks_state")
        )
    return found


def _foreign_globals(path: str) -> list[str] | None:
    """The globals that ``path``'s pickle names outside torch's allowlist and the active
    ``safe_globals`` (read statically, never unpickled); None for a file that is not a zip
    checkpoint (the weights-only read then judges it)."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:
        return None


def scan(folder: str, allowed: list[Any], rank: int) -> str | None:
    """This rank's verdict on the files of tag folder ``folder``: None when every file names only
    allowed globals, else what was found (file, rank, globals)."""
    with torch.serialization.safe_globals(allowed):
        for path in _files(folder):
            bad = _foreign_globals(path)
            if bad:
                return f"{path!r} (rank {rank}) names {', '.join(bad)}, which DeepSpeed's checkpoints do not hold"
    return None


def _refused(path: str, rank: int, found: str) -> CheckpointStateError:
    return CheckpointStateError(
        f"{path!r} (rank {rank}) was refused without running it: {found}; DeepSpeed's own checkpoint "
        f"files are read with weights_only=True and may hold only torch's allowed types and "
        f"{', '.join(DEEPSPEED_GLOBALS)}. {TRUST_HINT}"
    )


def _mapped(path: Any, mmap: bool) -> bool:
    """Whether to map ``path``: only DeepSpeed's optimizer-state files (what a plugin streams
    elsewhere), never the model-states file, whose ``client_state`` tensors go back to the user
    (mapped, they would change under a later save to the same tag), and only torch's zip format
    (the legacy one cannot be mapped)."""
    name = os.path.basename(os.fspath(path))
    return mmap and name.endswith("optim_states.pt") and zipfile.is_zipfile(os.fspath(path))


def _weights_only_load(allowed: list[Any], rank: int, mmap: bool) -> Callable[..., Any]:
    """A ``checkpoint_engine.load`` that reads with ``weights_only=True`` and ``allowed``
    (DeepSpeed's optimizer files memory-mapped when ``mmap``)."""

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            try:
                return torch.load(
                    path, map_location=map_location, weights_only=True, mmap=_mapped(path, mmap)
                )
            except pickle.UnpicklingError as e:
                if "Weights only load failed" not in str(e):
                    raise
                raise _refused(os.fspath(path), rank, refusal(str(e))) from None

    return load


def _trusted_mapped_load(path: str, map_location: Any = None) -> Any:
    """DeepSpeed's own read (inside :func:`trust_checkpoint_code`), its optimizer files memory-mapped."""
    return torch.load(path, map_location=map_location, weights_only=False, mmap=_mapped(path, True))


def _is_torch_engine(engine: Any) -> bool:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return isinstance(engine, TorchCheckpointEngine)


@contextlib.contextmanager
def _engine_load(att: Attachment, load: Callable[..., Any] | None, allowed: list[Any]) -> Iterator[None]:
    """The engine's torch checkpoint engine reads with ``load`` for the duration (None: its own)."""
    cp = getattr(att.engine, "checkpoint_engine", None)
    if load is None or cp is None or not _is_torch_engine(cp):
        # another checkpoint engine keeps its own reader; torch's default is weights_only=True
        with torch.serialization.safe_globals(allowed):
            yield
        return
    had = "load" in vars(cp)
    previous = vars(cp).get("load")
    cp.load = load
    try:
        yield
    finally:
        if had:
            cp.load = previous
        else:
            del cp.load


def trusted() -> bool:
    """Whether the caller is inside :func:`trust_checkpoint_code`."""
    return _TRUSTED.get()


@contextlib.contextmanager
def guarded(
    att: Attachment, folders: list[str], rank: int, agree: Callable[[str | None], None]
) -> Iterator[None]:
    """The body of one ``load_checkpoint``: the scan of the tag ``folders`` DeepSpeed may read,
    agreed on by every rank through ``agree`` (which raises for a failure anywhere), and
    the weights-only reader installed around it.  Inside :func:`trust_checkpoint_code` nothing is
    scanned or replaced (the ranks still agree, so that a rank outside the context cannot wait
    alone)."""
    if trusted():
        agree(None)
        with _engine_load(att, _trusted_mapped_load if att.map_checkpoint_reads else None, []):
            yield
        return
    allowed = allowed_globals(att)
    found = None
    for folder in folders:
        found = found or (scan(folder, allowed, rank) if os.path.isdir(folder) else None)
    agree(found)
    with _engine_load(att, _weights_only_load(allowed, rank, att.map_checkpoint_reads), allowed):
        yield
