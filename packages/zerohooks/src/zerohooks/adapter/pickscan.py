"""Bounded, allocation-free inspection of a ``torch.save`` zip file before it is unpickled.

``torch.load(..., weights_only=True)`` cannot run code, but the objects it may build can still
cost memory out of all proportion to the file: ``builtins.bytearray(4_000_000_000)`` from an 8 KB
file, a legacy ``torch.FloatStorage(n)`` or ``torch.FloatTensor(n)``, a tensor view larger than
its storage, a deflated zip member that expands a
thousandfold.  This module judges such a file from its bytes alone, without building any of its
objects:

* :func:`open_regular` opens a path without following a link and without blocking (a FIFO or a
  device named ``*.pt`` is refused at once, never read);
* :func:`check_zip` reads the zip directory: the file and the sum of its members' expanded sizes
  must be within a cap, no member may be compressed beyond :data:`MAX_RATIO`, and ``data.pkl``
  must exist and be within :attr:`Limits.max_pickle`;
* :func:`check_pickle` walks ``data.pkl`` opcode by opcode (``pickletools.genops``), keeping a
  shadow stack of small descriptions (never the objects): strings and bytes over
  :attr:`Limits.max_string`, ``BYTEARRAY8`` and out-of-band buffers, containers nested deeper than
  :attr:`Limits.max_depth` or holding more than :attr:`Limits.max_items`, calls of anything but
  the rebuild functions and allowed classes, storages larger than their zip record and tensor
  views larger than their storage are refused;
* :func:`check_loaded` walks an object that was loaded (iteratively, each object once): nesting
  depth, and every object of an allowed class (DeepSpeed's loss scalers and the like) checked
  against the attributes and types such an object has (:func:`schema`).

Every check raises :class:`Refused` with what was found; the caller names the file and the rank.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pickletools
import stat
import warnings
import zipfile
from collections.abc import Iterable
from typing import IO, Any

import torch

from zerohooks.adapter.schemas import Refused, check_loaded, known_schemas, schema

__all__ = [
    "MAX_RATIO",
    "Limits",
    "Refused",
    "check_loaded",
    "check_pickle",
    "check_zip",
    "open_regular",
    "schema",
]

MAX_RATIO = 4
"""A compressed zip member may expand at most this many times (``torch.save`` never compresses)."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_CALLS = frozenset(
    {
        "collections.OrderedDict",
        "collections.Counter",
        "builtins.set",
        "builtins.complex",
        "torch.Size",
        "torch.device",
        "_codecs.encode",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._tensor._rebuild_from_type_v2",
        "torch.serialization._get_layout",
    }
)
"""Callables of torch's weights-only allowlist whose result is bounded by their arguments (which
are in the pickle): they may be called.  The others (``bytearray``, legacy storage and tensor
constructors, sparse, nested, quantized and wrapper rebuilds) are refused: DeepSpeed's files
never call them and several allocate a size the file merely names."""

_REBUILDS = frozenset(
    {"torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3"}
)
"""Dense tensor rebuilds: allowed when the view fits in its storage (checked)."""


def _why(name: str) -> str:
    """Why calling global ``name`` is refused."""
    if name == "builtins.bytearray" or name.startswith("torch."):
        return "which allocates a size the file merely names (DeepSpeed's checkpoints never call it)"
    return "which is not among the classes these files may hold"


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds one file is held to."""

    max_bytes: int
    """The file's size and the sum of its zip members' expanded sizes."""
    max_pickle: int = 256 << 20
    """``data.pkl``'s expanded size (it is read into memory to be walked)."""
    max_string: int = 16 << 20
    """One string or bytes object of the pickle."""
    max_depth: int = 64
    """Containers nested in one another."""
    max_items: int = 1 << 24
    """Items of one container."""


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """An fd of ``path`` opened read-only without following a link and without blocking, and its
    ``fstat``; :class:`Refused` for a link, a FIFO, a device or anything but a regular file (the
    open of a FIFO with ``O_NONBLOCK`` returns at once, and it is never read)."""
    try:
        before = os.lstat(path)
    except OSError as e:
        raise Refused(f"it cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(before.st_mode):
        raise Refused(
            f"it is a symbolic link (to {os.readlink(path)!r}); links are not followed in checkpoint folders"
        )
    if not stat.S_ISREG(before.st_mode):
        raise Refused(f"it is not a regular file (mode {stat.filemode(before.st_mode)})")
    flags = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise Refused(f"it cannot be read ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between lstat and open
        os.close(fd)
        raise Refused(f"it is not a regular file (mode {stat.filemode(st.st_mode)})")
    return fd, st


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def check_zip(f: IO[bytes], size: int, limits: Limits, classes: Iterable[Any] = ()) -> dict[str, int]:
    """Check the zip directory of the open file ``f`` (``size`` bytes) and walk its ``data.pkl``
    (:func:`check_pickle`, ``classes``: the allowed classes it may build); the expanded size of
    each storage record, by key."""
    if size > limits.max_bytes:
        raise Refused(
            f"it is {_mib(size)}, over the {_mib(limits.max_bytes)} this engine's checkpoint file may be"
        )
    try:
        z = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError):
        raise Refused("it is not a torch.save zip file (DeepSpeed 0.19.8 writes only those)") from None
    with z:
        total, pkl, records = 0, None, {}
        for info in z.infolist():
            total += info.file_size
            if (
                info.compress_type != zipfile.ZIP_STORED
                and info.file_size > MAX_RATIO * info.compress_size + 4096
            ):
                raise Refused(
                    f"its member {info.filename!r} is compressed {_mib(info.compress_size)} -> "
                    f"{_mib(info.file_size)} (torch.save stores members uncompressed; at most "
                    f"{MAX_RATIO}x expansion is accepted)"
                )
            head, _, tail = info.filename.rpartition("/")
            if tail == "data.pkl" and "/" not in head:
                pkl = info
            elif head.endswith("/data") or head == "data":
                records[tail] = info.file_size
        if total > limits.max_bytes:
            raise Refused(
                f"its members expand to {_mib(total)}, over the {_mib(limits.max_bytes)} this engine's "
                "checkpoint file may be"
            )
        if pkl is None:
            raise Refused("it has no data.pkl (not a torch.save zip file)")
        if pkl.file_size > limits.max_pickle:
            raise Refused(f"its data.pkl is {_mib(pkl.file_size)}, over {_mib(limits.max_pickle)}")
        try:
            data = z.read(pkl)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise Refused(f"its data.pkl cannot be read ({e})") from None
    check_pickle(data, records, limits, classes)
    return records


class _Item:
    """What the shadow stack knows of one object: its nesting depth, its item count, and a small
    value (a literal, a tuple of known values, a global's name, a storage's size) or ``...`` (unknown)."""

    __slots__ = ("cls", "count", "depth", "fields", "value")

    def __init__(self, depth: int = 0, value: Any = ...) -> None:
        self.depth = depth
        self.count = 0
        self.value = value
        self.cls: str | None = None
        """The allowed class this item is an instance of (made by NEWOBJ)."""
        self.fields: dict[str, _Item] | None = None
        """A small dict's string keys and their values (to check an object's state)."""


@dataclasses.dataclass(frozen=True)
class _Global:
    name: str


@dataclasses.dataclass(frozen=True)
class _Storage:
    nbytes: int
    itemsize: int


_MARK = _Item(-1)
_KEEP = 256
"""Strings up to this length keep their value on the shadow stack (names, dtypes, storage keys)."""


_ITEMSIZES: dict[str, int] = {}
_RENAMED = {"__builtin__": "builtins", "copy_reg": "copyreg"}
"""Protocol-2 pickles spell some modules as Python 2 did; the unpickler maps them back."""


def _global(module: str, attr: str) -> _Global:
    return _Global(f"{_RENAMED.get(module, module)}.{attr}")


def _itemsize(name: str) -> int:
    """Bytes per element of the storage class ``name`` (``torch.FloatStorage``: 4); 1 for
    ``UntypedStorage`` and unknown names."""
    if name not in _ITEMSIZES:
        size = 1
        if name.startswith("torch.") and name.endswith("Storage") and "Untyped" not in name:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    size = int(getattr(torch, name[len("torch.") :]).dtype.itemsize)
                except (AttributeError, TypeError):
                    size = 1
        _ITEMSIZES[name] = size
    return _ITEMSIZES[name]


class _Walk:
    """One pass over a pickle's opcodes (see :func:`check_pickle`)."""

    def __init__(self, records: dict[str, int], limits: Limits, classes: Iterable[Any]) -> None:
        self.records, self.limits = records, limits
        self.classes = {_qualname(c): c for c in classes if isinstance(c, type)}
        self.calls = _CALLS | frozenset(_qualname(c) if isinstance(c, type) else str(c) for c in classes)
        self.stack: list[_Item] = []
        self.memo: dict[int, _Item] = {}

    def pop(self) -> _Item:
        if not self.stack or self.stack[-1] is _MARK:
            raise Refused("its pickle is malformed (stack underflow)")
        return self.stack.pop()

    def pop_mark(self) -> list[_Item]:
        items: list[_Item] = []
        while self.stack and self.stack[-1] is not _MARK:
            items.append(self.stack.pop())
        if not self.stack:
            raise Refused("its pickle is malformed (no mark)")
        self.stack.pop()
        items.reverse()
        return items

    def container(self, items: list[_Item], count: int, value: Any = ...) -> _Item:
        depth = 1 + max((i.depth for i in items), default=0)
        self.bound(depth, count)
        item = _Item(depth, value)
        item.count = count
        return item

    def bound(self, depth: int, count: int) -> None:
        if depth > self.limits.max_depth:
            raise Refused(f"its pickle nests containers deeper than {self.limits.max_depth} levels")
        if count > self.limits.max_items:
            raise Refused(f"its pickle holds a container of more than {self.limits.max_items} items")

    def add(self, items: list[_Item], count: int) -> None:
        if not self.stack or self.stack[-1] is _MARK:
            raise Refused("its pickle is malformed (no container)")
        target = self.stack[-1]
        target.depth = max(target.depth, 1 + max((i.depth for i in items), default=0))
        target.count += count
        target.value = ...
        self.bound(target.depth, target.count)

    def call(self, callee: _Item, args: _Item) -> _Item:
        name = callee.value.name if isinstance(callee.value, _Global) else None
        if name is None:
            raise Refused("its pickle calls an object that is not a named global")
        if name in _REBUILDS:
            self.view(name, args.value)
        elif name == "torch._tensor._rebuild_from_type_v2":
            inner = args.value
            if not (isinstance(inner, tuple) and len(inner) >= 3 and isinstance(inner[0], _Global)):
                raise Refused("its pickle rebuilds a tensor whose arguments cannot be checked")
            self.call(_Item(0, inner[0]), _Item(0, inner[2]))
        elif name not in self.calls:
            raise Refused(f"its pickle calls {name}, {_why(name)}")
        return _Item(1 + args.depth)

    def view(self, name: str, args: Any) -> None:
        """A dense tensor ``name(storage, offset, size, stride, ...)`` must fit in its storage."""
        ok = isinstance(args, tuple) and len(args) >= 4 and isinstance(args[0], _Storage)
        ok = ok and isinstance(args[1], int) and isinstance(args[2], tuple) and isinstance(args[3], tuple)
        ok = (
            ok
            and all(isinstance(x, int) and x >= 0 for x in (*args[2], *args[3]))
            and len(args[2]) == len(args[3])
        )
        if not ok:
            raise Refused(
                f"its pickle calls {name} with arguments that cannot be checked against the storage"
            )
        storage, offset, size, stride = args[0], args[1], args[2], args[3]
        span = 0 if 0 in size else offset + 1 + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
        if offset < 0 or span * storage.itemsize > storage.nbytes:
            raise Refused(
                f"its pickle holds a tensor of size {tuple(size)} needing {span * storage.itemsize} bytes "
                f"from a storage of {storage.nbytes} bytes"
            )

    def persistent(self, pid: _Item) -> _Item:
        v = pid.value
        ok = isinstance(v, tuple) and len(v) == 5 and v[0] == "storage" and isinstance(v[1], _Global)
        ok = ok and isinstance(v[2], str) and isinstance(v[4], int) and v[4] >= 0
        if not ok:
            raise Refused("its pickle holds a persistent reference that is not a torch storage")
        itemsize = _itemsize(v[1].name)
        record = self.records.get(v[2])
        if record is None:
            raise Refused(f"its pickle refers to storage {v[2]!r}, which the file does not hold")
        if v[4] * itemsize > record:
            raise Refused(
                f"its storage {v[2]!r} claims {v[4] * itemsize} bytes but its record holds {record}"
            )
        return _Item(0, _Storage(v[4] * itemsize, itemsize))

    def literal(self, name: str, arg: Any) -> _Item:
        if isinstance(arg, (str, bytes)):
            if len(arg) > self.limits.max_string:
                raise Refused(
                    f"its pickle holds a {type(arg).__name__} of {_mib(len(arg))}, over {_mib(self.limits.max_string)}"
                )
            return _Item(0, arg if len(arg) <= _KEEP else ...)
        if name in ("NEWTRUE", "NEWFALSE"):
            return _Item(0, name == "NEWTRUE")
        if name == "NONE":
            return _Item(0, None)
        return _Item(0, arg if isinstance(arg, (int, float)) else ...)

    def run(self, data: bytes) -> None:
        try:
            ops = pickletools.genops(data)
            for op, arg, _ in ops:
                if self.step(op.name, arg):
                    return
        except Refused:
            raise
        except Exception as e:  # genops' own complaints: truncated or invalid pickle
            raise Refused(f"its pickle is malformed ({type(e).__name__}: {e})") from None
        raise Refused("its pickle has no STOP")

    def step(self, name: str, arg: Any) -> bool:
        st = self.stack
        if name == "STOP":
            return True
        if name in ("PROTO", "FRAME"):
            return False
        if name in ("BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER"):
            raise Refused(
                "its pickle holds a bytearray or an out-of-band buffer (DeepSpeed's checkpoints never do)"
            )
        if name in ("EXT1", "EXT2", "EXT4", "PERSID", "INST", "OBJ"):
            raise Refused(f"its pickle uses the {name} opcode, which torch.save never writes")
        if name == "MARK":
            st.append(_MARK)
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            st.append(_Item(0, _global(module, attr)))
        elif name == "STACK_GLOBAL":
            attr, module = self.pop().value, self.pop().value
            if not (isinstance(attr, str) and isinstance(module, str)):
                raise Refused("its pickle names a global it does not spell out")
            st.append(_Item(0, _global(module, attr)))
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
            st.append(_Item(1))
            if name == "EMPTY_DICT":
                st[-1].fields = {}
        elif name == "EMPTY_TUPLE":
            st.append(_Item(1, ()))
        elif name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
            items = self.pop_mark() if name == "TUPLE" else [self.pop() for _ in range(int(name[-1]))][::-1]
            known = len(items) <= 64
            st.append(self.container(items, len(items), tuple(i.value for i in items) if known else ...))
        elif name in ("LIST", "DICT", "FROZENSET"):
            items = self.pop_mark()
            st.append(self.container(items, len(items)))
        elif name == "APPEND":
            self.add([self.pop()], 1)
        elif name == "SETITEM":
            value, key = self.pop(), self.pop()
            self.keys([key, value])
            self.add([key, value], 1)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            items = self.pop_mark()
            if name == "SETITEMS":
                self.keys(items)
            self.add(items, len(items) // 2 if name == "SETITEMS" else len(items))
        elif name == "BUILD":
            state = self.pop()
            if st and st[-1] is not _MARK and st[-1].cls is not None:
                self.state(st[-1].cls, state)
            self.add([state], 0)
        elif name == "REDUCE":
            args = self.pop()
            st.append(self.call(self.pop(), args))
        elif name in ("NEWOBJ", "NEWOBJ_EX"):
            kwargs = self.pop() if name == "NEWOBJ_EX" else _Item()
            args = self.pop()
            cls = self.pop()
            st.append(self.new(cls, args, kwargs))
        elif name == "BINPERSID":
            st.append(self.persistent(self.pop()))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            if not st or st[-1] is _MARK:
                raise Refused("its pickle is malformed (memoizes nothing)")
            self.memo[len(self.memo) if name == "MEMOIZE" else int(arg)] = st[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if int(arg) not in self.memo:
                raise Refused("its pickle is malformed (unknown memo key)")
            st.append(self.memo[int(arg)])
        elif name == "POP":
            self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            st.append(st[-1] if st else self.pop())
        else:  # literals: ints, floats, strings, bytes, None, booleans
            st.append(self.literal(name, arg))
        return False

    def new(self, cls: _Item, args: _Item, kwargs: _Item) -> _Item:
        name = cls.value.name if isinstance(cls.value, _Global) else None
        if name is None or name not in self.calls or name in _CALLS:
            raise Refused(
                f"its pickle creates an instance of {name or 'an unnamed class'}, {_why(name or '')}"
            )
        item = _Item(1 + max(args.depth, kwargs.depth))
        item.cls = name
        return item

    def keys(self, items: list[_Item]) -> None:
        """Record a dict's string keys and values (SETITEM/SETITEMS onto the top of the stack)."""
        if not self.stack or self.stack[-1] is _MARK or self.stack[-1].fields is None:
            return
        fields = self.stack[-1].fields
        for key, value in zip(items[::2], items[1::2], strict=False):
            if not isinstance(key.value, str) or len(fields) >= 256:
                self.stack[-1].fields = None
                return
            fields[key.value] = value

    def state(self, name: str, state: _Item) -> None:
        """An allowed class's state (BUILD) must have the attributes and types such an object has
        (:func:`schema`), checked from the pickle before the object is built."""
        cls = self.classes.get(name)
        expected = schema(cls) if cls is not None else None
        if cls is None or expected is None or isinstance(cls, enum.EnumMeta):
            return
        fields = state.fields
        if fields is None:
            raise Refused(f"its pickle gives a {name} a state that is not a dict of named attributes")
        for key, value in fields.items():
            kinds = expected.get(key)
            if kinds is None:
                raise Refused(
                    f"its pickle gives a {name} an attribute {key!r} it does not have "
                    f"(its attributes: {', '.join(sorted(expected))})"
                )
            found = _kind(value)
            if found is None or not issubclass(found, kinds) or (found is bool and bool not in kinds):
                shown = "an object" if found is None else f"a {found.__module__}.{found.__qualname__}"
                raise Refused(
                    f"its pickle gives a {name} an attribute {key!r} that is {shown}, not "
                    f"{'/'.join(k.__name__ for k in kinds)}"
                )
        missing = sorted(set(expected) - set(fields))
        if missing:
            raise Refused(f"its pickle gives a {name} no attribute(s) {', '.join(missing)}")


def check_pickle(data: bytes, records: dict[str, int], limits: Limits, classes: Iterable[Any] = ()) -> None:
    """Walk the pickle ``data`` (a torch ``data.pkl``) without building its objects; ``records``
    are the expanded sizes of the file's storage records by key, ``classes`` the classes (or
    their dotted names) beyond torch's rebuilds it may build, whose instances' state is checked
    against :func:`schema`.  :class:`Refused` with what was found."""
    known_schemas()
    _Walk(records, limits, classes).run(data)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _kind(item: _Item) -> type | None:
    """The type of the object ``item`` stands for, where the pickle says it (a literal, a dtype
    or another global of torch's); None for anything else."""
    value = item.value
    if isinstance(value, _Global):
        module, _, attr = value.name.rpartition(".")
        found = getattr(torch, attr, None) if module == "torch" else None
        return type(found) if isinstance(found, (torch.dtype, torch.device)) else None
    if value is ... or isinstance(value, (tuple, _Storage)) or item.depth > 0:
        return None
    return type(value)
