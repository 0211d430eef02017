"""A plugin's native (C++/CUDA) extension: one description, one build-or-load-else-fallback life.

A plugin that ships kernels describes each just-in-time extension once, as a
:class:`NativeExtension` (name, sources, flags, what needs it, what runs instead), and lists them
in its ``ZeroPlugin.native`` class attribute.  Everything else is here, the same for every plugin:

* :meth:`NativeExtension.load` builds it with ``torch.utils.cpp_extension.load`` (announced by
  :func:`zerohooks.jit.announce_build`) once per process, then runs the plugin's ``verify``;
  a failure is a warning naming the fallback, never a crash;
* :meth:`NativeExtension.load_distributed` has local rank 0 of each machine build while the
  other ranks wait (:func:`zerohooks.jit.local_rank0_first`);
* :attr:`~NativeExtension.available`, :attr:`~NativeExtension.error` and
  :attr:`~NativeExtension.module` say what happened;
* ``python -m zerohooks.build`` builds every installed plugin's extensions ahead of time.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["NativeExtension"]


@dataclasses.dataclass
class _LoadState:
    tried: bool = False
    ok: bool = False
    module: Any = None
    error: str | None = None
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)


@dataclasses.dataclass(frozen=True, eq=False)
class NativeExtension:
    """How to build one just-in-time extension of a plugin, and what runs when it cannot be."""

    owner: str
    """The plugin's name: the prefix of its warnings and its ``python -m zerohooks.build`` target."""
    name: str
    """The extension name (its build folder under ``TORCH_EXTENSIONS_DIR``).  Name a CPU build
    after the instruction set it is compiled for, so machines sharing a build cache never load
    each other's instructions."""
    what: str
    """What it is, for messages: ``"the CPU kernels"``, ``"the C++ I/O engine"``."""
    sources: tuple[Path, ...]
    """Its C++ (and CUDA) source files."""
    why: str
    """What needs it, and how to skip it (an environment variable), for the build announcement."""
    eta: str
    """Roughly how long it takes to build (``"about 1 min on 2 CPU cores"``)."""
    fallback: str
    """What runs instead when it is not available (``"the pure-torch reference (slower, same results)"``)."""
    cflags: tuple[str, ...] = ("-O3",)
    """C++ compiler flags."""
    ldflags: tuple[str, ...] = ()
    """Linker flags."""
    cuda_cflags: tuple[str, ...] | None = None
    """nvcc flags for the CUDA sources; None for a CPU-only extension."""
    include_paths: tuple[Path, ...] = ()
    """Extra include folders."""
    python_module: bool = False
    """True: a pybind11 module (:attr:`module` is it); False: a library of ``torch.ops`` operators."""
    disable_env: tuple[str, str] | None = None
    """``(variable, value)``: the environment setting that skips the build (no warning)."""
    verbose_env: str | None = None
    """An environment variable that, set to anything but ``""`` or ``"0"``, makes the build verbose."""
    needs: tuple[NativeExtension, ...] = ()
    """Extensions that must load first (e.g. the CPU library holding the operator schemas)."""
    precondition: Callable[[], str | None] | None = None
    """Whether it can be used in this process at all: None, or why not (``"no CUDA device"``).
    A failed precondition is no warning and, in ``python -m zerohooks.build``, a skip."""
    verify: Callable[[Any], str | None] | None = None
    """Run once after a successful build with the loaded module (None for operator libraries):
    finish setting up (fake kernels) and check it; None when usable, else why not (a warning)."""
    _state: _LoadState = dataclasses.field(default_factory=_LoadState, init=False, repr=False)

    # -- what happened -------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """True when it was loaded and verified (no build is attempted)."""
        return self._state.ok

    @property
    def error(self) -> str | None:
        """Why it is not available (None when it is, or was not tried yet)."""
        return self._state.error

    @property
    def module(self) -> Any:
        """The loaded pybind11 module (``python_module``), else None."""
        return self._state.module if self._state.ok else None

    @property
    def build_target(self) -> str:
        """The ``python -m zerohooks.build`` command that builds it ahead of time."""
        return f"python -m zerohooks.build {self.owner}"

    def not_applicable(self) -> str | None:
        """Why it cannot be used here (its precondition), or None."""
        return self.precondition() if self.precondition is not None else None

    def reset(self) -> None:
        """Forget the outcome of an earlier :meth:`load` (tests; the library stays loaded)."""
        with self._state.lock:
            self._state.tried, self._state.ok, self._state.module, self._state.error = (
                False,
                False,
                None,
                None,
            )

    # -- loading --------------------------------------------------------------------------------
    def load(self, build: bool = True) -> bool:
        """Build (first call in this process) and load it; True when usable.  ``build=False``
        gives up without building (local rank 0 of this machine tried and failed).  A failed
        build or check warns once, naming :attr:`fallback`; later calls return the same answer."""
        st = self._state
        with st.lock:
            if st.tried:
                return st.ok
            st.tried = True
            if (
                self.disable_env is not None
                and os.environ.get(self.disable_env[0], "") == self.disable_env[1]
            ):
                st.error = f"disabled by {self.disable_env[0]}={self.disable_env[1]}"
                return False
            for dep in self.needs:
                if not dep.load(build):
                    st.error = f"{dep.what} ({dep.name}) is not available"
                    return False
            why = self.not_applicable()
            if why is not None:
                st.error = why
                return False
            if not build:
                self._fail(f"{self.what} is not used (its build failed on local rank 0 of this machine)")
                return False
            try:
                module = self._build()
            except Exception as e:  # no compiler, build or load error: fall back, never crash
                self._fail(
                    f"could not build {self.what} ({type(e).__name__}: {e})", f"{type(e).__name__}: {e}"
                )
                return False
            if self.verify is not None:
                bad = self.verify(module)
                if bad is not None:
                    self._fail(f"{self.what} is not used ({bad})", bad)
                    return False
            st.ok, st.module = True, module
            return True

    def load_distributed(self) -> bool:
        """:meth:`load` on local rank 0 of each machine while the other ranks wait; they then load
        its cached build, or give up without building when it failed.  Every rank must call it."""
        from zerohooks.jit import local_rank0_first

        return bool(local_rank0_first(self.load))

    def _fail(self, message: str, error: str | None = None) -> None:
        self._state.error = error or message
        text = message if len(message) < 400 else message[:300] + " ...)"
        warnings.warn(
            f"{self.owner}: {text.splitlines()[0]}; using {self.fallback} instead",
            RuntimeWarning,
            stacklevel=4,
        )

    def _build(self) -> Any:
        """Load a build shared by another environment (:mod:`zerohooks.nativecache`, when
        ``ZEROHOOKS_NATIVE_CACHE`` is set) or build it; a new build is then shared."""
        from zerohooks import nativecache

        if nativecache.cache_dir() is not None:
            digest = nativecache.key(
                self.name,
                self.sources,
                flags=(self.cflags, self.ldflags, self.cuda_cflags or ()),
                include_paths=self.include_paths,
                python_module=self.python_module,
            )
            return nativecache.build_once(
                self.name, digest, lambda: self._shared(digest), lambda: self._build_and_share(digest)
            )
        return self._build_and_share(None)

    def _shared(self, digest: str) -> Any:
        """The shared build ``digest`` names, loaded; None when there is none (or it did not load:
        then it is built as if it were not there)."""
        from zerohooks import nativecache

        hit = nativecache.lookup(self.name, digest)
        if hit is None:
            return None
        try:
            return nativecache.load_library(self.name, hit, self.python_module)
        except Exception as e:  # damaged or foreign
            warnings.warn(
                f"{self.owner}: the shared build {hit} did not load ({type(e).__name__}: {e}); "
                "building it again",
                RuntimeWarning,
                stacklevel=7,
            )
            return None

    def _build_and_share(self, digest: str | None) -> Any:
        from zerohooks import nativecache

        built = self._jit_build()
        if digest is not None:
            path = built if isinstance(built, str) else getattr(built, "__file__", None)
            if path:
                nativecache.store(self.name, digest, Path(path))
        return built

    def _jit_build(self) -> Any:
        from torch.utils import cpp_extension

        from zerohooks.jit import announce_build, extension_cached

        kwargs: dict[str, Any] = {}
        if self.cuda_cflags is not None:
            kwargs["extra_cuda_cflags"] = list(self.cuda_cflags)
        if self.include_paths:
            kwargs["extra_include_paths"] = [str(p) for p in self.include_paths]
        verbose = self.verbose_env is not None and os.environ.get(self.verbose_env, "") not in ("", "0")
        with announce_build(
            f"{self.owner}'s {self.what.removeprefix('the ')} ({self.name})",
            why=self.why,
            eta=self.eta,
            hint=self.build_target,
            cached=extension_cached(self.name),
        ):
            return cpp_extension.load(
                name=self.name,
                sources=[str(s) for s in self.sources],
                extra_cflags=list(self.cflags),
                extra_ldflags=list(self.ldflags),
                is_python_module=self.python_module,
                verbose=verbose,
                **kwargs,
            )
