"""Every file a zerohooks engine writes in a checkpoint folder, DeepSpeed's own included, is
created without following a link.

For each ``save_checkpoint`` (with or without plugin state) every rank opens the save folder
(its own path followed: the caller chose it) and the tag folder inside it with ``O_NOFOLLOW``
(:func:`open_target`): a tag folder that is a symbolic link, or not a folder, refuses the save
naming it.  While DeepSpeed saves, the engine's checkpoint engine writes each file relative to
those open folders (:func:`install`): into a fresh temporary file (``O_CREAT|O_EXCL|O_NOFOLLOW``),
``fsync``-ed and renamed over the final name (:func:`~zerohooks.adapter.statefile.write_via_temp`),
so a link planted at ``mp_rank_00_model_states.pt``, ``*_optim_states.pt`` or
``zero_to_fp32.py`` is replaced, never followed, and a tag folder swapped for a link after it was
opened is not followed either.  DeepSpeed's recovery scripts are copied by DeepSpeed into a private
temporary folder of the user, then written into the save folder the same way, with DeepSpeed's
mode (executable).  ``latest`` is written by zerohooks, never by DeepSpeed (see
:mod:`zerohooks.adapter.checkpoint`).

Temporary files (``.<name>.<8 characters>.tmp``) are removed when a write fails; one left by a
rank killed mid-save is removed by the next save into that folder, by every rank before any rank
writes (:func:`clean_stale`).  A load never reads them.

Checkpoint engines other than DeepSpeed's torch one (the fast, decoupled and DataStates writers,
which write from other threads or processes by path) keep their writers; each path they are
handed is checked not to be a link just before (:func:`refuse_link`), which narrows but does not
close the window of an attacker racing the save.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from zerohooks.adapter.statefile import TEMP_NAME, open_folder, write_via_temp
from zerohooks.errors import CheckpointSaveError

if TYPE_CHECKING:
    from zerohooks.adapter.base import Attachment

__all__ = ["SaveTarget", "clean_stale", "current", "install", "open_target", "refuse_link", "writing"]

_SAVE_DIR_NAMES = frozenset({"latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py"})
"""The files zerohooks and DeepSpeed write directly in the save folder (their stale temporary
files are removed there; nothing else of the save folder is touched)."""
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_targets: weakref.WeakKeyDictionary[Any, SaveTarget] = weakref.WeakKeyDictionary()


def _key(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def _link_error(path: str, what: str, target: str) -> CheckpointSaveError:
    return CheckpointSaveError(
        f"{what} {path!r} is a symbolic link (to {target!r}); zerohooks does not write through links in "
        "checkpoint folders: remove the link, or save under another tag or folder"
    )


class SaveTarget:
    """The save folder and the tag folder of one save, open as file descriptors."""

    __slots__ = ("save_dir", "save_fd", "save_key", "tag", "tag_fd", "tag_key")

    def __init__(self, save_dir: str, tag: str, save_fd: int, tag_fd: int) -> None:
        self.save_dir = save_dir
        self.tag = tag
        self.save_fd = save_fd
        self.tag_fd = tag_fd
        self.save_key = _key(save_dir)
        self.tag_key = _key(os.path.join(save_dir, tag))

    def fd_of(self, folder: str) -> int | None:
        """The open descriptor of ``folder`` when it is this save's save or tag folder."""
        key = _key(folder)
        if key == self.tag_key:
            return self.tag_fd
        if key == self.save_key:
            return self.save_fd
        return None

    def close(self) -> None:
        """Close both descriptors (idempotent)."""
        for fd in (self.tag_fd, self.save_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.tag_fd = self.save_fd = -1


def _open_tag(save_fd: int, save_dir: str, tag: str) -> int:
    """The tag folder ``tag`` of the save folder open as ``save_fd``, created if missing and
    opened without following a link; :class:`CheckpointSaveError` for a link or a non-folder."""
    path = os.path.join(save_dir, tag)
    with contextlib.suppress(FileExistsError):
        os.mkdir(tag, 0o777, dir_fd=save_fd)
    try:
        return os.open(tag, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=save_fd)
    except OSError:
        st = os.lstat(tag, dir_fd=save_fd)
        if stat.S_ISLNK(st.st_mode):
            raise _link_error(path, "the checkpoint folder", os.readlink(tag, dir_fd=save_fd)) from None
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointSaveError(
                f"{path!r} is not a folder (mode {stat.filemode(st.st_mode)}): it cannot hold checkpoint "
                f"{tag!r}; remove it or save under another tag"
            ) from None
        raise


def clean_stale(dir_fd: int, keep: Callable[[str], bool]) -> list[str]:
    """Remove the temporary files (``.<name>.<8 characters>.tmp``, regular files only) that a
    killed save left in the folder open as ``dir_fd``, for the final names ``keep`` selects;
    the names removed."""
    removed = []
    for entry in os.listdir(dir_fd):
        m = TEMP_NAME.match(entry)
        if m is None or not keep(m["name"]):
            continue
        with contextlib.suppress(OSError):  # another rank removed it first
            if stat.S_ISREG(os.lstat(entry, dir_fd=dir_fd).st_mode):
                os.unlink(entry, dir_fd=dir_fd)
                removed.append(entry)
    return removed


def open_target(save_dir: str, tag: str) -> SaveTarget:
    """Create (when missing) and open the save folder and its tag folder, refusing a tag folder
    that is a link, and remove the stale temporary files of earlier killed saves (:func:`clean_stale`:
    of ``.pt`` files in the tag folder, of ``latest`` and the recovery scripts in the save folder)."""
    os.makedirs(save_dir, exist_ok=True)
    save_fd = open_folder(save_dir)
    try:
        tag_fd = _open_tag(save_fd, save_dir, tag)
    except BaseException:
        os.close(save_fd)
        raise
    target = SaveTarget(save_dir, tag, save_fd, tag_fd)
    try:
        clean_stale(tag_fd, lambda name: name.endswith(".pt"))
        clean_stale(save_fd, lambda name: name in _SAVE_DIR_NAMES)
    except BaseException:
        target.close()
        raise
    return target


def current(att: Attachment) -> SaveTarget | None:
    """The save target of the save ``att``'s engine is running, or None."""
    return _targets.get(att)


@contextlib.contextmanager
def writing(att: Attachment, target: SaveTarget) -> Iterator[None]:
    """Within this context the files of ``att``'s engine go to ``target``'s open folders."""
    _targets[att] = target
    try:
        yield
    finally:
        _targets.pop(att, None)


@contextlib.contextmanager
def _folder(att: Attachment, folder: str) -> Iterator[int]:
    """A descriptor of ``folder``: the open save or tag folder of the save running, else
    ``folder`` opened now (a write outside ``save_checkpoint``, e.g. ``save_16bit_model``)."""
    target = current(att)
    fd = None if target is None else target.fd_of(folder)
    if fd is not None:
        yield fd
        return
    fd = open_folder(folder)
    try:
        yield fd
    finally:
        os.close(fd)


def write_file(
    att: Attachment, path: str, fill: Callable[[BinaryIO], object], mode: int | None = None
) -> None:
    """Create ``path`` for ``att``'s engine without following a link (see the module docstring)."""
    folder, name = os.path.split(os.fspath(path))
    with _folder(att, folder) as fd:
        write_via_temp(fd, name, fill, mode)


def refuse_link(path: str, what: str) -> None:
    """:class:`CheckpointSaveError` when ``path`` (or its folder) is a symbolic link."""
    for p, w in ((os.path.dirname(path), "the checkpoint folder"), (path, what)):
        if p and os.path.islink(p):
            raise _link_error(p, w, os.readlink(p))


def _is_torch_save(cp: Any) -> bool:
    """Whether ``cp`` writes with DeepSpeed's own ``TorchCheckpointEngine.save``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return getattr(type(cp), "save", None) is TorchCheckpointEngine.save


def _make_save(att: Attachment, cp: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    torch_save = _is_torch_save(cp)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def save(state_dict: Any, path: str) -> Any:
            if not torch_save:
                refuse_link(os.fspath(path), "DeepSpeed's checkpoint file")
                return original(state_dict, path)
            zipped = getattr(cp, "zipfile_serialization", True)
            write_file(att, path, lambda f: torch.save(state_dict, f, _use_new_zipfile_serialization=zipped))
            return None

        return save

    return make


def _ensure_engine_save(att: Attachment) -> None:
    """Route the engine's checkpoint engine's ``save`` through :func:`write_file` (once per
    checkpoint-engine object; an instance-level ``save`` someone else set is left alone)."""
    cp = getattr(att.engine, "checkpoint_engine", None)
    if cp is None or "save" in vars(cp) or not callable(getattr(cp, "save", None)):
        return
    att.patch(cp, "save", _make_save(att, cp), "CheckpointEngine")


def _content(data: bytes) -> Callable[[BinaryIO], object]:
    """What writes ``data`` into an open file."""
    return lambda f: f.write(data)


def _make_recovery(att: Attachment) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _copy_recovery_script(save_path: str) -> None:
            # DeepSpeed copies and chmods its scripts into a folder of ours nobody else can
            # write; they are then created in the save folder without following a link
            private = tempfile.mkdtemp(prefix="zerohooks-recovery-")
            try:
                original(private)
                for name in sorted(os.listdir(private)):
                    src = os.path.join(private, name)
                    st = os.lstat(src)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    with open(src, "rb") as f:
                        fill = _content(f.read())
                    write_file(att, os.path.join(save_path, name), fill, stat.S_IMODE(st.st_mode))
            finally:
                shutil.rmtree(private, ignore_errors=True)

        return _copy_recovery_script

    return make


def install(att: Attachment) -> None:
    """Route the writes of DeepSpeed's save of ``att``'s engine through :func:`write_file`: its
    checkpoint engine's ``save`` and its recovery-script copy (per instance)."""
    _ensure_engine_save(att)
    if callable(getattr(att.engine, "_copy_recovery_script", None)):
        att.patch(att.engine, "_copy_recovery_script", _make_recovery(att), "DeepSpeedEngine")


def before_save(att: Attachment) -> None:
    """At each save: route a checkpoint engine that replaced the one seen at attach."""
    _ensure_engine_save(att)
