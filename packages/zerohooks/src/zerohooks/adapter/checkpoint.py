"""Plugin state in DeepSpeed checkpoints: one checked file per rank beside DeepSpeed's own files,
committed all or nothing.

Saving (every engine built by zerohooks, with or without plugin state):

1. the tag is checked to be one folder name (:func:`.ckpttag.tag_problem`); every rank creates and
   opens the tag folder without following a link (a tag folder that is a link is refused), removes
   the temporary files a killed save left there (:mod:`.ckptwrite`), and the ranks agree that each
   could;
2. DeepSpeed writes its files, called with ``save_latest=False`` so that it does not move
   ``latest`` itself; each file is created through a fresh temporary file renamed over its name,
   relative to the open folders, so a planted link is replaced, never followed (:mod:`.ckptwrite`);
3. (when a plugin keeps state) every rank writes its plugin state (:mod:`zerohooks.adapter.statefile`: checksum, temporary
   file, ``fsync``, rename, folder ``fsync``) and reads it back to check it;
4. the ranks agree that every rank succeeded (:func:`_agree`);
5. only then rank 0 points ``latest`` at the new tag atomically (when the caller asked for
   ``latest``: ``save_latest=False`` never writes it), and the ranks agree once more.

A failure on any rank makes every rank raise the same
:class:`~zerohooks.errors.CheckpointSaveError` naming the failing ranks and causes (a
:class:`~zerohooks.errors.CheckpointDiskFullError`, an ``OSError`` with ``errno.ENOSPC``, when the
file system is full), with ``latest`` still naming the previous checkpoint.  With a DeepSpeed
checkpoint engine that writes asynchronously (``is_decoupled()``), which moves ``latest`` itself
once its files are committed, the plugin state is written and agreed on before DeepSpeed's save.

Loading: the tag is chosen once (:func:`_choose_tag`): ``latest`` (or ``latest_universal``) is read
once per load, checked to name a tag folder directly inside the load folder
(:mod:`.ckpttag`), the ranks agree on it, and that tag is passed explicitly to DeepSpeed's load,
to the scan of DeepSpeed's files and to the plugin-state load, so a ``latest`` moved during the
load cannot mix checkpoints.  A missing, linked or malformed tag is a
:class:`~zerohooks.errors.CheckpointStateError` naming the folder and the tags that exist.

A checkpoint and the engine loading it must agree on which plugins keep state, and every
state file must pass its checksum; any mismatch or damage on any rank is a
:class:`~zerohooks.errors.CheckpointStateError` on every rank naming the file and the rank, never
a silent change of the run.  A universal checkpoint (``ds_to_universal`` output, loaded with
``checkpoint.load_universal``) carries no plugin-state file: each plugin keeping state restarts
it through its provider's ``load_universal()`` (:func:`_load_universal`).
``load_module_only=True`` and ``load_optimizer_states=False`` load weights only: plugin state is
neither read nor required, and the plugins start fresh (one warning, on rank 0).
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import os
import shutil
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from zerohooks import watchdog
from zerohooks.adapter import ckpttag, ckptwrite, dsfiles, universal
from zerohooks.adapter.statefile import FORMAT, read_latest, read_state, state_file, write_latest, write_state
from zerohooks.errors import CheckpointDiskFullError, CheckpointSaveError, CheckpointStateError

if TYPE_CHECKING:
    from zerohooks.adapter.base import Attachment

__all__ = ["install_checkpoint_patches", "state_file"]

DISK_FULL = "disk full"
"""How a rank's failure description begins when its file system was full (read by every rank)."""
FULL_MARGIN = 1 << 20
"""A write error with less free space than this (bytes) on the target is taken as a full disk:
torch's writer reports ENOSPC as ``RuntimeError: ... iostream error`` without an errno."""
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_FULL_WORDS = ("No space left on device", "Disk quota exceeded")
_MAX_CAUSE = 400
"""Characters of an exception's text kept in a failure description."""
_SHOWN = 4
"""Failing ranks whose causes a message quotes (the rest are counted)."""


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(ok: bool, what: str) -> dict[int, str]:
    """Every rank's verdict on one step of a checkpoint: the failing ranks and what each said.

    A collective on the default group: every rank calls it at the same point with its own
    ``ok`` and, when not ok, a description of what failed.  All ranks get the same answer."""
    rank, world = _rank_world()
    if world == 1:
        return {} if ok else {rank: what}
    verdicts = watchdog.gather_objects((bool(ok), str(what)), "checkpoint agreement")
    return {r: str(w) for r, (good, w) in enumerate(verdicts) if not good}


def _free_bytes(folder: str) -> int | None:
    """Free bytes on the file system of ``folder`` (or of its nearest existing parent)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return int(shutil.disk_usage(path).free)
    except OSError:
        return None


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _is_disk_full(e: BaseException, free: int | None) -> bool:
    """Whether ``e``, raised while writing a checkpoint, means the file system is full."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _FULL_ERRNOS:
            return True
        if any(w in str(x) for w in _FULL_WORDS):
            return True
    return isinstance(e, (OSError, RuntimeError)) and free is not None and free < FULL_MARGIN


def _describe(e: BaseException, step: str, folder: str) -> str:
    """One rank's failure, as told to every rank (a full disk begins with :data:`DISK_FULL`)."""
    text = f"{type(e).__name__}: {e}"
    if len(text) > _MAX_CAUSE:
        text = text[:_MAX_CAUSE] + " ..."
    free = _free_bytes(folder)
    if _is_disk_full(e, free):
        return f"{DISK_FULL} ({free} bytes free) during {step}: {text}"
    return f"{step}: {text}"


def _summary(failed: dict[int, str]) -> str:
    ranks = sorted(failed)
    shown = "; ".join(f"rank {r}: {failed[r]}" for r in ranks[:_SHOWN])
    more = f"; and {len(ranks) - _SHOWN} more ranks" if len(ranks) > _SHOWN else ""
    return f"rank(s) {ranks} failed ({shown}{more})"


def _save_error(failed: dict[int, str], save_dir: str, tag: str, previous: str | None) -> CheckpointSaveError:
    """The error every rank raises when the save of ``tag`` failed somewhere."""
    if previous is None:
        kept = f"nothing was committed: there is no 'latest' in {save_dir!r} and none was written"
    elif previous == tag:
        kept = (
            f"'latest' still names {tag!r}, but that checkpoint was being overwritten in place and may "
            "now be damaged: save under a new tag"
        )
    else:
        kept = f"nothing was committed: 'latest' still names the previous checkpoint {previous!r}, which is intact"
    full = [r for r, w in failed.items() if w.startswith(DISK_FULL)]
    if full:
        msg = (
            f"no space left on the file system of {save_dir!r} while saving checkpoint {tag!r}: "
            f"{_summary(failed)}. {kept[0].upper()}{kept[1:]}. Free space (or save elsewhere) and save again"
        )
        return CheckpointDiskFullError(errno.ENOSPC, msg, save_dir)
    return CheckpointSaveError(
        f"checkpoint {tag!r} in {save_dir!r} was not saved: {_summary(failed)}. {kept[0].upper()}{kept[1:]}"
    )


def _payload(att: Attachment, rank: int, world: int) -> dict[str, Any]:
    ctx = att.step_ctx
    return {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "states": {name: p.state_dict() for name, p in att.registry.states.items()},
        # where the run is in its accumulation window (not saved by DeepSpeed)
        "position": {"micro_step": ctx.micro_step, "window_micro_step": ctx.window_micro_step},
    }


def _write_state(att: Attachment, save_dir: str, tag: str) -> str:
    """Write and check this rank's plugin state of checkpoint ``tag``; return the file's path
    (written into the open tag folder of the save running, :mod:`.ckptwrite`)."""
    rank, world = _rank_world()
    path = state_file(save_dir, tag, rank)
    target = ckptwrite.current(att)
    fd = None if target is None else target.fd_of(os.path.dirname(path))
    write_state(path, _payload(att, rank, world), rank, fd)
    return path


def _discard(path: str | None, target: ckptwrite.SaveTarget | None = None) -> None:
    """Remove this rank's state file of a save that did not commit (best effort): the
    incomplete checkpoint then fails to load by its tag instead of loading half-saved."""
    if path is None:
        return
    fd = None if target is None else target.fd_of(os.path.dirname(path))
    with contextlib.suppress(OSError):
        if fd is None:
            os.unlink(path)
        else:
            os.unlink(os.path.basename(path), dir_fd=fd)


def _rejoin() -> None:
    """After DeepSpeed's save raised on this rank, meet the ranks where it did not in the barrier
    DeepSpeed closes its save with, so that every rank reaches :func:`_agree` together."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer is gone: the agreement reports it
            watchdog.barrier("checkpoint save (DeepSpeed's closing barrier)")


class _Save:
    """One ``save_checkpoint`` call with plugin state, run as the module docstring describes."""

    __slots__ = ("att", "previous", "save_dir", "tag", "target", "written")

    def __init__(self, att: Attachment, save_dir: str, tag: str) -> None:
        self.att = att
        self.save_dir = save_dir
        self.tag = tag
        try:
            self.previous = read_latest(save_dir)
        except CheckpointStateError:  # a link or no regular file: replaced by this save's 'latest'
            self.previous = None
        self.written: str | None = None
        self.target: ckptwrite.SaveTarget | None = None

    def close(self) -> None:
        """Close the open save and tag folders."""
        if self.target is not None:
            self.target.close()

    def agree(self, failure: str | None) -> None:
        """Raise the save's error on every rank unless every rank succeeded."""
        try:
            failed = _agree(failure is None, failure or "")
        except Exception as e:  # a rank died or the group broke: nothing may be committed
            _discard(self.written, self.target)
            raise CheckpointSaveError(
                f"checkpoint {self.tag!r} in {self.save_dir!r} was not saved: the ranks could not agree "
                f"that every rank wrote it ({type(e).__name__}: {e}); 'latest' was not moved"
                + (f" and still names {self.previous!r}" if self.previous is not None else "")
            ) from e
        if failed:
            _discard(self.written, self.target)
            raise _save_error(failed, self.save_dir, self.tag, self.previous)

    def prepare(self) -> None:
        """Create and open the tag folder on every rank before DeepSpeed starts (DeepSpeed creates
        the checkpoint folder on rank 0 only, and a failure there would leave the ranks apart);
        a tag folder that is a link is refused (:func:`.ckptwrite.open_target`)."""
        failure = None
        try:
            self.target = ckptwrite.open_target(self.save_dir, self.tag)
        except Exception as e:
            failure = _describe(e, "creating the checkpoint folder", self.save_dir)
        try:
            self.agree(failure)
        except BaseException:
            self.close()
            raise

    def deepspeed(
        self, original: Callable[..., Any], bound: inspect.BoundArguments
    ) -> tuple[Any, str | None]:
        """DeepSpeed's own save; its result and this rank's failure (None when it succeeded)."""
        try:
            return original(*bound.args, **bound.kwargs), None
        except Exception as e:
            failure = _describe(e, "DeepSpeed's save", self.save_dir)
            _rejoin()
            return None, failure

    def plugin_state(self) -> str | None:
        """Write and check this rank's plugin state; this rank's failure, or None."""
        try:
            self.written = _write_state(self.att, self.save_dir, self.tag)
        except Exception as e:
            return _describe(e, "writing the zerohooks plugin state", self.save_dir)
        return None

    def commit(self) -> None:
        """Rank 0 points ``latest`` at the new tag; every rank learns whether it did.

        Nothing is discarded here: every rank's files were verified before, and ``latest`` may
        already name them (rank 0 writes it before the ranks agree), so removing them could leave
        ``latest`` naming a checkpoint that cannot be loaded."""
        failure = None
        if _rank_world()[0] == 0:
            try:
                write_latest(self.save_dir, self.tag, None if self.target is None else self.target.save_fd)
            except Exception as e:
                failure = _describe(e, "writing 'latest'", self.save_dir)
        try:
            failed = _agree(failure is None, failure or "")
        except Exception as e:
            try:
                now = read_latest(self.save_dir)
            except CheckpointStateError as unreadable:
                now = f"<unreadable: {unreadable}>"
            raise CheckpointSaveError(
                f"checkpoint {self.tag!r} in {self.save_dir!r}: every rank wrote and verified its files, "
                f"but the ranks could not agree on moving 'latest' ({type(e).__name__}: {e}); 'latest' "
                f"names {now!r} now, and both that checkpoint and {self.previous!r} are complete"
            ) from e
        if failed:  # only rank 0 writes 'latest': it failed, so 'latest' was not moved
            raise _save_error(failed, self.save_dir, self.tag, self.previous)


def _is_decoupled(engine: Any) -> bool:
    probe = getattr(getattr(engine, "checkpoint_engine", None), "is_decoupled", None)
    return bool(probe()) if callable(probe) else False


def _save(att: Attachment, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
    engine = att.engine
    args = bound.arguments
    if not args.get("save_dir"):
        return original(*bound.args, **bound.kwargs)  # DeepSpeed's own ValueError
    if args.get("tag") is None:
        args["tag"] = f"global_step{engine.global_steps}"  # DeepSpeed's own default tag
    save_dir, tag = os.fspath(args["save_dir"]), str(args["tag"])
    problem = ckpttag.tag_problem(tag)
    if problem:
        raise CheckpointSaveError(
            f"save_checkpoint({save_dir!r}, tag={tag!r}) refused: the tag is not a checkpoint folder name, "
            f"{problem}; {ckpttag.ACCEPTED}. Nothing was written"
        )
    args["tag"] = tag
    save_latest = bool(args.get("save_latest", True))
    ckptwrite.before_save(att)
    job = _Save(att, save_dir, tag)
    job.prepare()
    try:
        assert job.target is not None
        with ckptwrite.writing(att, job.target):
            return _run_save(job, original, bound, save_latest)
    finally:
        job.close()


def _run_save(
    job: _Save, original: Callable[..., Any], bound: inspect.BoundArguments, save_latest: bool
) -> Any:
    """Steps 2-5 of the module docstring, in the folders ``job`` opened."""
    att = job.att
    stateful = bool(att.registry.states)
    if _is_decoupled(att.engine):
        # DeepSpeed writes 'latest' itself once its asynchronous write commits: state goes first,
        # and a link at 'latest' is refused now (DeepSpeed's own write of it would follow it)
        failure = None
        try:
            if save_latest:
                ckptwrite.refuse_link(os.path.join(job.save_dir, "latest"), "the checkpoint pointer 'latest'")
        except CheckpointSaveError as e:
            failure = f"checking 'latest': {e}"
        if failure is None and stateful:
            failure = job.plugin_state()
        job.agree(failure)
        return original(*bound.args, **bound.kwargs)
    bound.arguments["save_latest"] = False
    out, failure = job.deepspeed(original, bound)
    if failure is None and stateful:
        failure = job.plugin_state()
    job.agree(failure)
    if save_latest:
        job.commit()
    return out


def _universal(engine: Any) -> bool:
    probe = getattr(engine, "load_universal_checkpoint", None)
    return bool(probe()) if callable(probe) else False


def _zero3_weights(engine: Any, bound: inspect.BoundArguments) -> bool:
    """Whether DeepSpeed's load reads ``latest`` itself: ZeRO 3 without optimizer states."""
    stage3 = getattr(engine, "zero_optimization_partition_weights", lambda: False)()
    return bool(stage3) and not bool(bound.arguments.get("load_optimizer_states", True))


def _no_pointer(engine: Any, load_dir: str, pointer: str) -> tuple[None, None]:
    """DeepSpeed's outcome of a load without tag and without ``latest``."""
    from deepspeed.utils import logger

    path = os.path.join(load_dir, pointer)
    if _universal(engine):
        raise ValueError(f"Invalid for universal checkpoint: {path} does not exist")
    logger.warning(
        f"Unable to find latest file at {path}, if trying to load latest checkpoint please ensure this "
        "file exists or pass an explicit checkpoint tag when loading a checkpoint."
    )
    return None, None


def _check(att: Attachment, load_dir: str, tag: str) -> dict[str, Any] | None:
    """This rank's checked payload for the plugins of this run (None when neither side has
    state); :class:`CheckpointStateError` for a mismatch or a damaged file."""
    rank, world = _rank_world()
    path = state_file(load_dir, tag, rank)
    names = sorted(att.registry.states)
    where = os.path.join(load_dir, tag)
    if not os.path.exists(path):
        if not names:
            return None  # neither side has plugin state
        raise CheckpointStateError(
            f"checkpoint {where!r} has no zerohooks plugin state for rank {rank} ({path!r}), but the plugins "
            f"{names} of this run keep state. It was saved without them (or without zerohooks routing "
            "deepspeed.initialize: call zerohooks.enable() before the framework builds the engine), or its "
            "save did not complete. Resume with the same plugin sections it was saved with, from a complete "
            "checkpoint, or load weights only with load_checkpoint(..., load_module_only=True)"
        )
    payload = read_state(path, rank)
    saved = sorted(payload["states"])
    extra = [n for n in saved if n not in names]
    if extra:
        raise CheckpointStateError(
            f"checkpoint {where!r} holds state of the plugins {extra}, which this run does not enable "
            f"(enabled with state: {names or 'none'}); resuming would silently drop it. Enable them again "
            "(their config sections, with zerohooks.enable() when a framework builds the engine), or load "
            "weights only with load_checkpoint(..., load_module_only=True)"
        )
    missing = [n for n in names if n not in saved]
    if missing:
        raise CheckpointStateError(
            f"checkpoint {where!r} has no state for the plugins {missing} of this run (it holds {saved}); "
            "resume with the plugin sections it was saved with, or load weights only with "
            "load_checkpoint(..., load_module_only=True)"
        )
    if payload["world_size"] != world or payload.get("rank", rank) != rank:
        raise CheckpointStateError(
            f"{path!r} was saved by rank {payload.get('rank')} of {payload['world_size']} but is read by rank "
            f"{rank} of {world}; plugin state is rank-local and cannot be resharded"
        )
    return payload


def _apply(att: Attachment, payload: dict[str, Any]) -> None:
    position = payload.get("position")
    if isinstance(position, dict):
        att.step_ctx.restore(position["micro_step"], position["window_micro_step"])
    for name in sorted(att.registry.states):
        att.registry.states[name].load_state_dict(payload["states"][name])


def _load_universal(att: Attachment) -> None:
    """A universal checkpoint (``ds_to_universal`` output) holds no zerohooks plugin-state file:
    the converter copies DeepSpeed's files only.  Each plugin keeping state is told so through its
    provider's ``load_universal()`` (it restarts what is rank-local, or takes what DeepSpeed's own
    universal load restored); a provider without it is refused on every rank."""
    lacking = [
        n for n, p in sorted(att.registry.states.items()) if not callable(getattr(p, "load_universal", None))
    ]
    if lacking:
        raise CheckpointStateError(
            f"the plugins {lacking} keep state that a universal checkpoint does not carry (ds_to_universal "
            "converts DeepSpeed's files only); load a regular checkpoint on the same number of ranks, or load "
            "the universal checkpoint without their config sections"
        )
    for name in sorted(att.registry.states):
        att.registry.states[name].load_universal()  # type: ignore[attr-defined]


def _load(att: Attachment, load_dir: str, tag: str) -> None:
    if _universal(att.engine):
        if att.setup.zero_stage == 3:
            universal.separate_step_counters(att.engine.optimizer)
        _load_universal(att)
        return
    if not att.registry.states:
        # no plugin keeps state: each rank only refuses state it would drop (no collective, as the
        # ranks of a half-saved checkpoint may disagree on whether a file exists)
        _check(att, load_dir, tag)
        return
    payload: dict[str, Any] | None = None
    problem = None
    try:
        payload = _check(att, load_dir, tag)
    except CheckpointStateError as e:
        problem = str(e)
    except Exception as e:  # a payload of the wrong shape: damage all the same
        problem = f"{type(e).__name__} while reading the plugin state: {e}"
    where = os.path.join(load_dir, tag)
    failed = _agree(problem is None, problem or "")
    if failed:
        raise CheckpointStateError(f"checkpoint {where!r} cannot be resumed: {_summary(failed)}")
    if payload is None:
        return
    try:
        _apply(att, payload)
    except Exception as e:  # plain data of the wrong shape for a plugin: refused on every rank
        rank = _rank_world()[0]
        problem = (
            f"{state_file(load_dir, tag, rank)!r} (rank {rank}) holds plugin state that a plugin refused "
            f"({type(e).__name__}: {e})"
        )
    failed = _agree(problem is None, problem or "")
    if failed:
        raise CheckpointStateError(
            f"checkpoint {where!r} cannot be resumed: {_summary(failed)}. The plugin state of the other "
            "ranks was loaded; resume from another checkpoint or load weights only with "
            "load_checkpoint(..., load_module_only=True)"
        )


def _warn_weights_only(att: Attachment, how: str) -> None:
    if att.registry.states and _rank_world()[0] == 0:
        warnings.warn(
            f"load_checkpoint({how}): weights only, without the zerohooks plugin state; the plugins "
            f"{sorted(att.registry.states)} start with fresh state",
            RuntimeWarning,
            stacklevel=3,
        )


def _guarded(att: Attachment, load_dir: str, tag: str) -> contextlib.AbstractContextManager[None]:
    """DeepSpeed's own files of checkpoint ``tag`` read without running code (:mod:`.dsfiles`)."""
    folder = os.path.join(load_dir, tag)
    rank = _rank_world()[0]

    def agree(found: str | None) -> None:
        failed = _agree(found is None, found or "")
        if failed:
            raise CheckpointStateError(
                f"checkpoint {folder!r} cannot be resumed: DeepSpeed's files were refused without "
                f"running them, {_summary(failed)}. DeepSpeed's own checkpoint files are read with "
                f"weights_only=True and may hold only torch's allowed types and {', '.join(dsfiles.DEEPSPEED_GLOBALS)} "
                f"(and the classes the enabled plugins declare). {dsfiles.TRUST_HINT}"
            )

    # with ZeRO 3 and no optimizer states DeepSpeed reads the weights of 'latest': the same tag
    # (ckpttag.choose refuses any other)
    return dsfiles.guarded(att, [folder], rank, agree)


def _bound_call(
    original: Callable[..., Any], then: Callable[[inspect.BoundArguments], Any]
) -> Callable[..., Any]:
    """A wrapper of ``original`` that hands ``then`` the call's arguments bound to ``original``'s
    signature; a call that does not bind goes to ``original`` as it is (DeepSpeed reports it)."""
    signature = inspect.signature(original)

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        return then(bound)

    return call


def install_checkpoint_patches(att: Attachment) -> None:
    """Wrap ``engine.save_checkpoint`` and ``engine.load_checkpoint`` of ``att``'s engine."""
    engine = att.engine

    def make_save(original: Callable[..., Any]) -> Callable[..., Any]:
        return _bound_call(original, lambda bound: _save(att, original, bound))

    def make_load(original: Callable[..., Any]) -> Callable[..., Any]:
        def load_checkpoint(bound: inspect.BoundArguments) -> Any:
            module_only = bool(bound.arguments.get("load_module_only", False))
            optimizer = bool(bound.arguments.get("load_optimizer_states", True))
            load_dir, given = os.fspath(bound.arguments["load_dir"]), bound.arguments.get("tag")
            zero3_weights = _zero3_weights(engine, bound)
            # the one read of 'latest' of this load: every later step gets this tag
            choice = ckpttag.choose(
                load_dir, None if given is None else str(given), _universal(engine), zero3_weights
            )
            if choice.tag is None:
                return _no_pointer(engine, load_dir, choice.pointer)
            bound.arguments["tag"] = choice.tag
            with _guarded(att, load_dir, choice.tag):
                out = original(*bound.args, **bound.kwargs)
            if zero3_weights:
                ckpttag.check_unmoved(load_dir, choice)
            load_path = out[0] if isinstance(out, tuple) else out
            if load_path is None:
                return out
            if module_only or not optimizer:
                how = "load_module_only=True" if module_only else "load_optimizer_states=False"
                _warn_weights_only(att, how)
                return out
            _load(att, load_dir, choice.tag)
            return out

        return _bound_call(original, load_checkpoint)

    att.patch(engine, "save_checkpoint", make_save, "DeepSpeedEngine")
    ckptwrite.install(att)
    att.patch(engine, "load_checkpoint", make_load, "DeepSpeedEngine")
