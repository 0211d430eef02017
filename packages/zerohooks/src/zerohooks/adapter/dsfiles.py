"""DeepSpeed's own checkpoint files, read without running code, for engines built by zerohooks.

DeepSpeed 0.19.8 reads ``mp_rank_*_model_states.pt`` and ``*_optim_states.pt`` with
``torch.load(..., weights_only=False)`` (``TorchCheckpointEngine.load``): a pickle planted in the
checkpoint folder would run at resume.  For the duration of one ``load_checkpoint`` of an engine
built by zerohooks (nothing global, plain ``deepspeed.initialize`` engines are untouched):

1. every rank checks the files DeepSpeed will read for it (:func:`_files`: its model-states and
   optimizer-state files, a universal checkpoint's ``zero/`` folder; nothing else of the folder is
   opened), each opened as a regular file without following a link or blocking, bounded before
   anything is allocated (:mod:`.pickscan`: at most :func:`limit` bytes expanded, no allocating
   calls such as ``bytearray(n)``, no huge strings, no deep nesting, tensor views within their
   storage), and scans its pickle for the globals it names, without unpickling it; the ranks agree: a file naming anything outside
   :data:`DEEPSPEED_GLOBALS`, the classes the engine's plugins declare
   (``ZeroPlugin.checkpoint_classes``) and torch's own weights-only allowlist is a
   :class:`~zerohooks.errors.CheckpointStateError` on every rank, naming the file, the rank and
   the globals, before DeepSpeed reads anything;
2. the engine's checkpoint engine reads each file with ``torch.load(..., weights_only=True)``
   under :func:`torch.serialization.safe_globals` of that same list, so a file replaced between
   the scan and the read is still refused (on the rank that read it) rather than run; it checks
   each file again from the fd it then reads, and every loaded object of an allowed class (a loss
   scaler) for the attributes and types such an object has (an injected attribute is refused at
   load, naming the file and the attribute, rather than failing at the next step).

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
import glob
import importlib
import os
import pickle
import zipfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from zerohooks.adapter import pickscan
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

BYTES_PER_PARAM = 32
"""Bytes per model parameter one checkpoint file may hold: DeepSpeed's largest file (ZeRO 0, one
rank: the module's weights and the optimizer's fp32 master and two Adam moments, 16 B/param in
fp32) twice over."""
SLACK_BYTES = 256 << 20
"""Bytes one checkpoint file may hold beyond :data:`BYTES_PER_PARAM` (the ``client_state``,
the pickle, the lr scheduler): less than any of the memory bombs of issue #33."""
LIMIT_ENV = "ZEROHOOKS_CHECKPOINT_FILE_MAX_BYTES"
"""Environment variable that replaces :func:`limit` (bytes), for a ``client_state`` larger than
:data:`SLACK_BYTES`."""

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


def _dp_rank(engine: Any, rank: int) -> int:
    group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
    try:
        return int(torch.distributed.get_rank(group=group)) if torch.distributed.is_initialized() else rank
    except (RuntimeError, ValueError):
        return rank


def _call(engine: Any, name: str, default: Any) -> Any:
    fn = getattr(engine, name, None)
    return default if fn is None else fn()


def _files(folder: str, engine: Any = None, rank: int = 0) -> list[str]:
    """The ``.pt`` files of tag folder ``folder`` that DeepSpeed 0.19.8's ``load_checkpoint`` of
    ``engine`` may read on rank ``rank`` (``engine._load_checkpoint``, ``_load_zero_checkpoint``):

    * the model-states files its glob matches: ``mp_rank_*_model_states.pt`` (ZeRO 0-2) or
      ``zero_pp_rank_<dp>_mp_rank_*_model_states.pt`` (ZeRO 3; ``<dp>`` 0 for universal loads);
    * with a ZeRO optimizer, this rank's ``[bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt``
      (every data-parallel rank's with ``zero_elastic_checkpoint``; the old name without the ``_``
      before ``optim_states`` where the new one is absent);
    * on ZeRO 3 every ``*_model_states.pt`` and ``*_optim_states.pt`` of the folder (with
      ``load_optimizer_states=False`` DeepSpeed rebuilds the fp32 weights from all of them);
    * MoE expert files, pipeline layer files and a universal checkpoint's ``zero/`` folder where
      the engine has them.

    Nothing else in the folder is opened (a ``junk.pt`` is not DeepSpeed's to read).  Without an
    engine: every ``.pt`` file of the folder and its sub-folders (plugin-state files excluded: they
    are read as plain data by :mod:`zerohooks.adapter.statefile`)."""
    if engine is None:
        found: list[str] = []
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            found.extend(
                os.path.join(root, n)
                for n in sorted(files)
                if n.endswith(".pt") and not n.startswith("zerohooks_state")
            )
        return found
    here = glob.escape(folder)
    universal = bool(_call(engine, "load_universal_checkpoint", False))
    stage3 = bool(_call(engine, "zero_optimization_partition_weights", False))
    dp = _dp_rank(engine, rank)
    mp = int(getattr(engine, "checkpoint_mp_rank", 0) or 0)
    patterns = [
        f"zero_pp_rank_{0 if universal else dp}_mp_rank_*_model_states.pt"
        if stage3
        else "mp_rank_*_model_states.pt"
    ]
    names: list[str] = []
    if _call(engine, "zero_optimization", True):
        prefix = "bf16_" if _call(engine, "bfloat16_enabled", False) else ""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        ranks = range(world) if _call(engine, "zero_elastic_checkpoint", False) else (dp,)
        for d in ranks:
            name = os.path.join(folder, f"{prefix}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")
            old = name.replace("_optim_states.pt", "optim_states.pt")
            names.append(name if os.path.lexists(name) or not os.path.lexists(old) else old)
    if stage3:
        patterns += ["*_model_states.pt", "*_optim_states.pt"]
    if getattr(engine, "has_moe_layers", False):
        patterns += ["*expert_*_mp_rank_*_model_states.pt", "expp_rank_*_mp_rank_*_optim_states.pt"]
    if type(getattr(engine, "module", None)).__name__ == "PipelineModule":
        patterns += ["layer_*-model_*states.pt"]
    for pattern in patterns:
        names.extend(glob.glob(os.path.join(here, pattern)))
    if universal:
        names.extend(_files(os.path.join(folder, "zero")))
    return sorted({n for n in names if os.path.lexists(n)})


def limit(att: Attachment) -> int:
    """The most bytes one of DeepSpeed's checkpoint files of ``att``'s engine may hold (its size,
    and the expanded size of its zip members): :data:`BYTES_PER_PARAM` per parameter of the whole
    model (``ds_numel`` on ZeRO 3), twice its buffers, plus :data:`SLACK_BYTES` for the
    ``client_state`` and the pickle; ``ZEROHOOKS_CHECKPOINT_FILE_MAX_BYTES`` replaces it."""
    override = os.environ.get(LIMIT_ENV)
    if override:
        return int(override)
    module = getattr(att.engine, "module", None)
    if module is None:
        return SLACK_BYTES
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())
    buffers = sum(int(b.numel()) * int(b.element_size()) for b in module.buffers())
    return BYTES_PER_PARAM * params + 2 * buffers + SLACK_BYTES


def _limits(max_bytes: int) -> pickscan.Limits:
    return pickscan.Limits(max_bytes=max_bytes)


def _accepted(limits: pickscan.Limits) -> str:
    return (
        f"accepted: a regular torch.save zip file of at most {limits.max_bytes / (1 << 20):.1f} MiB "
        f"(this engine's limit; set {LIMIT_ENV} to change it) holding tensors, plain data and "
        f"{', '.join(DEEPSPEED_GLOBALS)}, nested at most {limits.max_depth} deep, strings at most "
        f"{limits.max_string >> 20} MiB"
    )


def _bounded(path: str, limits: pickscan.Limits, allowed: list[Any]) -> int:
    """Open ``path`` (regular file, no link, no blocking) and check it with :mod:`.pickscan`
    before anything is unpickled; its fd (the caller closes it).  :class:`.pickscan.Refused`
    saying what was wrong."""
    fd, st = pickscan.open_regular(path)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            pickscan.check_zip(f, st.st_size, limits, allowed)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _before(path: str, rank: int, why: str, limits: pickscan.Limits) -> str:
    return f"{path!r} (rank {rank}) was refused without running it, before it was unpickled: {why}; {_accepted(limits)}"


def _foreign_globals(path: str, f: Any = None) -> list[str] | None:
    """The globals that ``path``'s pickle (read from ``f`` when given) names outside torch's
    allowlist and the active ``safe_globals`` (read statically, never unpickled); None for a file
    that is not a zip checkpoint (the weights-only read then judges it)."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path if f is None else f))
    except Exception:
        return None


def scan(folder: str, allowed: list[Any], rank: int, att: Attachment | None = None) -> str | None:
    """This rank's verdict on the files of tag folder ``folder`` that DeepSpeed will read for
    ``att``'s engine (:func:`_files`): None when each is a bounded torch zip file
    (:mod:`.pickscan`) naming only allowed globals, else what was found (file, rank, what)."""
    engine = None if att is None else att.engine
    limits = _limits(limit(att) if att is not None else SLACK_BYTES)
    with torch.serialization.safe_globals(allowed):
        for path in _files(folder, engine, rank):
            try:
                fd = _bounded(path, limits, allowed)
            except pickscan.Refused as e:
                return _before(path, rank, str(e), limits)
            with os.fdopen(fd, "rb") as f:
                f.seek(0)
                bad = _foreign_globals(path, f)
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


def _weights_only_load(allowed: list[Any], rank: int, mmap: bool, max_bytes: int = 0) -> Callable[..., Any]:
    """A ``checkpoint_engine.load`` that checks each file with :mod:`.pickscan` (regular file, at
    most ``max_bytes``, no allocating calls; 0: :data:`SLACK_BYTES`), reads it from the fd it
    checked with ``weights_only=True`` and ``allowed`` (DeepSpeed's optimizer files memory-mapped
    when ``mmap``: those are read by name), and checks the loaded objects of allowed classes for
    the attributes they should have (:func:`~zerohooks.adapter.pickscan.check_loaded`)."""
    limits = _limits(max_bytes or SLACK_BYTES)
    classes = [c for c in allowed if isinstance(c, type)]

    def load(path: str, map_location: Any = None) -> Any:
        where = os.fspath(path)
        try:
            fd = _bounded(where, limits, allowed)
        except pickscan.Refused as e:
            raise CheckpointStateError(f"{_before(where, rank, str(e), limits)}. {TRUST_HINT}") from None
        with torch.serialization.safe_globals(allowed), os.fdopen(fd, "rb") as f:
            f.seek(0)  # the check read the same open file (a dup of the fd shares its offset)
            mapped = _mapped(where, mmap)
            try:
                out = torch.load(
                    where if mapped else f, map_location=map_location, weights_only=True, mmap=mapped
                )
            except pickle.UnpicklingError as e:
                if "Weights only load failed" not in str(e):
                    raise
                raise _refused(where, rank, refusal(str(e))) from None
        try:
            pickscan.check_loaded(out, classes, limits.max_depth)
        except pickscan.Refused as e:
            raise CheckpointStateError(
                f"{_before(where, rank, f'it holds {e}', limits)}. {TRUST_HINT}"
            ) from None
        return out

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
        found = found or (scan(folder, allowed, rank, att) if os.path.isdir(folder) else None)
    agree(found)
    reader = _weights_only_load(allowed, rank, att.map_checkpoint_reads, limit(att))
    with _engine_load(att, reader, allowed):
        yield
