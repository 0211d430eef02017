"""Which checkpoint a ``load_checkpoint`` reads: the tag, checked, and ``latest`` read once.

A tag (passed by the caller, or named by ``latest`` / ``latest_universal``) must be one folder
name directly inside the checkpoint folder (:func:`tag_problem`): a ``latest`` holding
``../other_run/tag``, an absolute path or ``../../..`` is refused instead of loading another run
or walking the file system.  ``latest`` is read once per load, without following a link, and
only a regular file of at most :data:`POINTER_MAX` bytes of UTF-8 is accepted
(:func:`read_pointer`).  The tag folder must exist and be a folder, not a link
(:func:`check_tag_folder`); a missing one is refused naming the tags that do exist.  Every error
is a :class:`~zerohooks.errors.CheckpointStateError`.
"""

from __future__ import annotations

import dataclasses
import os
import stat

import torch.distributed as dist

from zerohooks import watchdog
from zerohooks.adapter.statefile import read_bytes
from zerohooks.errors import CheckpointStateError

__all__ = [
    "ACCEPTED",
    "POINTER_MAX",
    "TAG_MAX",
    "Choice",
    "check_tag_folder",
    "check_unmoved",
    "choose",
    "existing_tags",
    "read_pointer",
    "tag_problem",
]

TAG_MAX = 255
"""Bytes (UTF-8) a tag may have: one folder name on common file systems."""
POINTER_MAX = 4096
"""Bytes of ``latest`` read at most (a tag, which DeepSpeed writes without a newline)."""
ACCEPTED = (
    f"a tag is one folder name directly inside the checkpoint folder: 1 to {TAG_MAX} bytes of UTF-8, "
    "without '/', '\\', NUL or control characters, and not '.' or '..'"
)
"""What every refusal of a tag says is accepted."""
_SHOWN_TAGS = 5
"""Existing tags a missing-tag error lists (the rest are counted)."""


def tag_problem(tag: str) -> str | None:
    """What makes ``tag`` not a folder name directly inside a checkpoint folder, or None."""
    if not tag:
        return "it is empty"
    if "\0" in tag:
        return "it holds a NUL character"
    if "/" in tag or "\\" in tag or (os.altsep and os.altsep in tag):
        return "it holds a path separator" + (" (it is an absolute path)" if os.path.isabs(tag) else "")
    if tag in (".", ".."):
        return f"{tag!r} names the checkpoint folder or its parent"
    if any(ord(c) < 32 or ord(c) == 127 for c in tag):
        return "it holds a control character"
    size = len(tag.encode("utf-8", "surrogatepass"))
    if size > TAG_MAX:
        return f"it is {size} bytes long"
    return None


def existing_tags(folder: str) -> str:
    """The tag folders of ``folder`` in a few words (for an error about a missing one)."""
    try:
        with os.scandir(folder) as entries:
            tags = sorted(
                e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            )
    except FileNotFoundError:
        return f"the checkpoint folder {folder!r} does not exist"
    except OSError as e:
        return f"the checkpoint folder {folder!r} cannot be listed ({e})"
    if not tags:
        return f"{folder!r} holds no checkpoint folders"
    more = f" and {len(tags) - _SHOWN_TAGS} more" if len(tags) > _SHOWN_TAGS else ""
    return f"{folder!r} holds the tags {', '.join(repr(t) for t in tags[:_SHOWN_TAGS])}{more}"


def read_pointer(folder: str, name: str = "latest") -> str | None:
    """The tag ``folder/name`` names (stripped, as DeepSpeed reads it), or None when there is no
    such file; :class:`CheckpointStateError` when it is a link, not a regular file, not UTF-8,
    longer than :data:`POINTER_MAX` bytes or does not name a tag (:func:`tag_problem`)."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    what = f"the checkpoint pointer {name!r}"
    data = read_bytes(path, 0, POINTER_MAX + 1, what=what)
    if len(data) > POINTER_MAX:
        raise CheckpointStateError(
            f"{what}, {path!r}, is longer than {POINTER_MAX} bytes: it is not a tag; {ACCEPTED}; "
            "point it at a checkpoint of this folder, or pass tag=... to load_checkpoint"
        )
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointStateError(
            f"{what}, {path!r}, is not UTF-8 text: it is not a tag; {ACCEPTED}; point it at a checkpoint "
            "of this folder, or pass tag=... to load_checkpoint"
        ) from None
    problem = tag_problem(tag)
    if problem:
        raise CheckpointStateError(
            f"{what}, {path!r}, names {tag!r}, which is not a checkpoint of {folder!r}: {problem}; {ACCEPTED}; "
            "point it at a checkpoint of this folder, or pass tag=... to load_checkpoint"
        )
    return tag


def check_tag_folder(folder: str, tag: str, source: str) -> None:
    """Refuse (:class:`CheckpointStateError`) a tag folder ``folder/tag`` that does not exist,
    is a symbolic link or is not a folder; ``source`` says where the tag came from."""
    path = os.path.join(folder, tag)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointStateError(
            f"there is no checkpoint {tag!r} ({source}): {path!r} does not exist; {existing_tags(folder)}. "
            "Pass one of them as tag=..., or point 'latest' at one"
        ) from None
    except OSError as e:
        raise CheckpointStateError(f"cannot read the checkpoint folder {path!r} ({source}): {e}") from e
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise CheckpointStateError(
            f"the checkpoint folder {path!r} ({source}) is a symbolic link (to {target!r}); zerohooks does not "
            "follow links in checkpoint folders: put the checkpoint itself there"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointStateError(
            f"{path!r} ({source}) is not a checkpoint folder (mode {stat.filemode(st.st_mode)}); "
            f"{existing_tags(folder)}"
        )


@dataclasses.dataclass(frozen=True)
class Choice:
    """The checkpoint one ``load_checkpoint`` reads, decided once before anything is read."""

    tag: str | None
    """The tag to load; None when none was passed and the pointer file does not exist."""
    pointer: str
    """The pointer file a load without tag reads: ``latest`` or ``latest_universal``."""
    latest: str | None
    """What ``latest`` named when it was read (None: not read, or absent)."""


def _local(load_dir: str, tag: str | None, universal: bool, zero3_weights: bool) -> Choice:
    """This rank's choice (``latest`` read at most once); :class:`CheckpointStateError` when the
    tag cannot be loaded."""
    pointer = "latest_universal" if universal else "latest"
    latest = None
    if tag is None:
        tag = read_pointer(load_dir, pointer)
        source = f"named by {pointer!r}"
        if pointer == "latest":
            latest = tag
    else:
        problem = tag_problem(tag)
        if problem:
            raise CheckpointStateError(
                f"load_checkpoint({load_dir!r}, tag={tag!r}) refused: the tag is not a checkpoint folder "
                f"name, {problem}; {ACCEPTED}"
            )
        source = "the tag passed to load_checkpoint"
    if tag is None:
        return Choice(None, pointer, None)
    if zero3_weights and latest is None:  # not read above: read it once now
        latest = read_pointer(load_dir, "latest")
    check_tag_folder(load_dir, tag, source)
    if zero3_weights and latest != tag:
        named = f"names {latest!r}" if latest is not None else "does not exist"
        raise CheckpointStateError(
            f"load_checkpoint({load_dir!r}, tag={tag!r}, load_optimizer_states=False) on ZeRO 3 refused: "
            f"DeepSpeed then reads the weights of the checkpoint 'latest' names, whatever the tag, and "
            f"'latest' {named}. Load with tag=None (or point 'latest' at {tag!r}), or with "
            "load_optimizer_states=True"
        )
    return Choice(tag, pointer, latest)


def _said(problems: dict[int, str]) -> str:
    texts = set(problems.values())
    if len(texts) == 1:
        return f"rank(s) {sorted(problems)}: {texts.pop()}"
    return "; ".join(f"rank {r}: {p}" for r, p in sorted(problems.items())[:4])


def choose(load_dir: str, tag: str | None, universal: bool, zero3_weights: bool) -> Choice:
    """The checkpoint to load, the same on every rank (a collective when there are several):
    the caller's ``tag``, or the one ``latest`` (``latest_universal`` when ``universal``) names,
    read once; ``zero3_weights``: DeepSpeed will read ``latest`` itself (ZeRO 3 without optimizer
    states), which must then name the same tag.  :class:`CheckpointStateError` on every rank when
    any rank cannot load it or the ranks read different tags."""
    problem = None
    choice = Choice(None, "latest", None)
    try:
        choice = _local(load_dir, tag, universal, zero3_weights)
    except CheckpointStateError as e:
        problem = str(e)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if problem:
            raise CheckpointStateError(problem)
        return choice
    views = watchdog.gather_objects((problem, choice.tag, choice.latest), "checkpoint tag choice")
    failed = {r: str(p) for r, (p, _, _) in enumerate(views) if p}
    if failed:
        raise CheckpointStateError(f"checkpoint in {load_dir!r} cannot be loaded: {_said(failed)}")
    seen = {(t, latest) for _, t, latest in views}
    if len(seen) > 1:
        read = ", ".join(f"rank {r}: {t!r}" for r, (_, t, _) in enumerate(views))
        raise CheckpointStateError(
            f"the ranks chose different checkpoints in {load_dir!r} ({read}): {choice.pointer!r} changed "
            "while they read it. Nothing was loaded; load again, or pass tag=... to load_checkpoint"
        )
    return choice


def check_unmoved(load_dir: str, choice: Choice) -> None:
    """After a ZeRO-3 load without optimizer states (DeepSpeed read ``latest`` itself):
    :class:`CheckpointStateError` when ``latest`` no longer names what it named before."""
    try:
        now: str | None = read_pointer(load_dir, "latest")
    except CheckpointStateError as e:
        now = f"<unreadable: {e}>"
    if now != choice.latest:
        raise CheckpointStateError(
            f"'latest' in {load_dir!r} changed from {choice.latest!r} to {now!r} during the load; DeepSpeed "
            "read the ZeRO-3 weights through 'latest', so they may come from another checkpoint than "
            f"{choice.tag!r}. Build the engine again and load again"
        )
