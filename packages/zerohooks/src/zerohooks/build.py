"""Build the just-in-time C++/CUDA extensions ahead of time, so that training starts at once.

    python -m zerohooks.build                   the installed plugins' kernels (e.g. loco, nvmeswap)
    python -m zerohooks.build --all             those, plus DeepSpeed's slow CPU ops
    python -m zerohooks.build loco deepspeed-shm
    python -m zerohooks.build --list            the targets, and whether each is built already

Run it in the environment (virtual environment, ``TORCH_EXTENSIONS_DIR``, machine) that trains:
the builds land in ``TORCH_EXTENSIONS_DIR`` (torch's default when unset) and the training
processes then load them in a second.  :func:`build` is the same from Python (the demo and the
benchmarks call it before they launch their ranks).

Targets:

``<plugin>``       every installed plugin (``zerohooks.plugins`` entry point) that declares native
                   extensions in ``ZeroPlugin.native`` (:class:`zerohooks.native.NativeExtension`):
                   loco's CPU kernels (and CUDA ones when a GPU is visible), about 1 min on 2 cores;
                   nvmeswap's C++ I/O engine and fused Adam kernel, about 1 min on 2 cores
``deepspeed-shm``  DeepSpeed's shared-memory comm op that ``deepspeed.init_distributed`` builds on
                   CPU, about 4 min (training does not need it: ``zerohooks.skip_deepspeed_compiles()``)
``deepspeed-adam`` DeepSpeed's CPU Adam and FusedAdam, about 4-5 min each on 2 cores (avoid them
                   with ``"torch_adam": true`` in the optimizer params)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerohooks.plugin import ZeroPlugin

__all__ = ["TARGETS", "BuildResult", "Target", "build", "main", "plugin_targets", "targets"]


@dataclass(frozen=True)
class BuildResult:
    """What :func:`build` did for one target."""

    target: str
    ok: bool
    seconds: float
    built: tuple[str, ...]
    """Extension names built or loaded."""
    where: tuple[str, ...]
    """Their build folders."""
    error: str | None = None
    skipped: str | None = None
    """Why the target was not attempted (package not installed), else None."""


@dataclass(frozen=True)
class Target:
    name: str
    help: str
    module: str
    """A module that must be importable for the target to apply."""
    names: Callable[[], list[str]]
    """The extension names the target builds (folders under TORCH_EXTENSIONS_DIR)."""
    run: Callable[[], str | None]
    """Build and load; None on success, else why not."""
    default: bool = True
    """Part of the default selection (the plugins' kernels), else only with --all or by name."""


def _plugin_target(name: str, load: Callable[[], type[ZeroPlugin]]) -> Target | None:
    """The target of an installed plugin that declares native extensions (``ZeroPlugin.native``),
    None for one without; a plugin that fails to import is a target that fails, saying why."""
    try:
        exts = load().native
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        return Target(name, f"plugin {name} (fails to import)", "zerohooks", lambda: [], lambda: why)
    if not exts:
        return None

    def names() -> list[str]:
        return [e.name for e in exts if e.not_applicable() is None]

    def run() -> str | None:
        errors = [f"{e.what}: {e.error}" for e in exts if e.not_applicable() is None and not e.load()]
        return "; ".join(errors) or None

    return Target(
        name, f"{name}'s {', '.join(e.what.removeprefix('the ') for e in exts)}", "zerohooks", names, run
    )


def plugin_targets() -> dict[str, Target]:
    """A target per installed plugin (``zerohooks.plugins`` entry points) with native extensions."""
    from zerohooks.config import load_plugin, plugin_entry_points

    out: dict[str, Target] = {}
    for name, ep in sorted(plugin_entry_points().items()):
        target = _plugin_target(name, lambda ep=ep: load_plugin(ep))  # type: ignore[misc]
        if target is not None:
            out[name] = target
    return out


def targets() -> dict[str, Target]:
    """Every target: the installed plugins' extensions, then DeepSpeed's ops (:data:`TARGETS`)."""
    return {**plugin_targets(), **TARGETS}


def _ds_builder(kind: str) -> object | None:
    from deepspeed.accelerator import get_accelerator

    builder: object | None = get_accelerator().create_op_builder(kind)
    return builder


def _ds_names(*kinds: str) -> Callable[[], list[str]]:
    def names() -> list[str]:
        out = []
        for kind in kinds:
            builder = _ds_builder(kind)
            if builder is not None:
                out.append(str(getattr(builder, "NAME", kind)))
        return out

    return names


def _ds_run(*kinds: str) -> Callable[[], str | None]:
    def run() -> str | None:
        from zerohooks.adapter.compat import route_deepspeed_op_builds

        errors = []
        with route_deepspeed_op_builds():  # announced, and shared through zerohooks.nativecache
            for kind in kinds:
                builder = _ds_builder(kind)
                if builder is None:
                    errors.append(f"{kind}: DeepSpeed has none for this accelerator")
                    continue
                try:
                    builder.load()  # type: ignore[attr-defined]
                except Exception as e:
                    first = str(e).splitlines()[0][:300] if str(e) else ""
                    errors.append(f"{kind}: {type(e).__name__}: {first}")
        return "; ".join(errors) or None

    return run


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "deepspeed-shm",
            "DeepSpeed's shared-memory comm op (deepspeed.init_distributed on CPU)",
            "deepspeed",
            _ds_names("ShareMemCommBuilder"),
            _ds_run("ShareMemCommBuilder"),
            default=False,
        ),
        Target(
            "deepspeed-adam",
            "DeepSpeed's CPU Adam and FusedAdam (the config's Adam/AdamW without torch_adam)",
            "deepspeed",
            _ds_names("CPUAdamBuilder", "FusedAdamBuilder"),
            _ds_run("CPUAdamBuilder", "FusedAdamBuilder"),
            default=False,
        ),
    )
}
"""DeepSpeed's slow ops, by name (the plugins' targets come from :func:`plugin_targets`)."""


def _say(text: str, quiet: bool) -> None:
    if not quiet:
        print(f"zerohooks.build: {text}", file=sys.stderr, flush=True)


def build(
    targets: Iterable[str] | None = None, *, all: bool = False, quiet: bool = False
) -> list[BuildResult]:
    """Build ``targets`` (names from :data:`TARGETS`; default: the installed plugins' kernels,
    every target with ``all=True``) into ``TORCH_EXTENSIONS_DIR`` and load each once, saying on
    stderr what it builds, where, and how long it took.  A target whose package is not installed
    is skipped (named explicitly, it is a failure).  Never raises for a failed build: see
    :attr:`BuildResult.ok`."""
    from zerohooks.jit import extension_build_dir, extension_root

    known = {**plugin_targets(), **TARGETS}
    explicit = targets is not None
    if targets is None:
        names = [n for n, t in known.items() if all or t.default]
    else:
        names = list(targets)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown build target(s) {unknown}; known: {sorted(known)}")
    _say(f"building {', '.join(names)} into {extension_root()}", quiet)
    results = []
    for i, name in enumerate(names, 1):
        target = known[name]
        if importlib.util.find_spec(target.module) is None:
            why = f"{target.module} is not installed"
            _say(f"[{i}/{len(names)}] {name}: skipped ({why})", quiet)
            results.append(BuildResult(name, not explicit, 0.0, (), (), None if not explicit else why, why))
            continue
        _say(f"[{i}/{len(names)}] {name}: {target.help} ...", quiet)
        start = time.monotonic()
        try:
            ext = target.names()
            error = target.run()
        except Exception as e:
            ext, error = [], f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        where = tuple(str(extension_build_dir(n)) for n in ext)
        result = BuildResult(name, error is None, took, tuple(ext), where, error)
        results.append(result)
        if error is None:
            _say(f"[{i}/{len(names)}] {name}: ready in {took:.0f} s: {', '.join(where) or '-'}", quiet)
        else:
            _say(f"[{i}/{len(names)}] {name}: FAILED after {took:.0f} s: {error}", quiet)
    return results


def _status() -> None:
    from zerohooks.jit import extension_build_dir, extension_cached, extension_root

    print(f"TORCH_EXTENSIONS_DIR: {extension_root()}")
    for name, target in targets().items():
        extra = "" if target.default else "  (--all or by name)"
        if importlib.util.find_spec(target.module) is None:
            print(f"  {name:<15} {target.help}: {target.module} not installed{extra}")
            continue
        try:
            ext = target.names()
        except Exception as e:
            print(f"  {name:<15} {target.help}: {type(e).__name__}: {e}{extra}")
            continue
        state = ", ".join(
            f"{n} {'built' if extension_cached(n) else 'not built'} ({extension_build_dir(n)})" for n in ext
        )
        print(f"  {name:<15} {target.help}: {state or 'nothing to build here'}{extra}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m zerohooks.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    known = targets()
    ap.add_argument(
        "targets", nargs="*", help=f"what to build: {', '.join(known)} (default: the plugins' kernels)"
    )
    ap.add_argument("--all", action="store_true", help="every target, DeepSpeed's slow CPU ops included")
    ap.add_argument(
        "--list", action="store_true", help="list the targets and whether they are built, then exit"
    )
    args = ap.parse_args(argv)
    if os.environ.get("DS_ACCELERATOR") is None:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"  # what the training processes use on this machine
    if args.list:
        _status()
        return 0
    if args.all and args.targets:
        ap.error("--all or target names, not both")
    unknown = [t for t in args.targets if t not in known]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    start = time.monotonic()
    results = build(args.targets or None, all=args.all)
    failed = [r for r in results if not r.ok]
    done = [r for r in results if r.ok and r.skipped is None]
    print(
        f"zerohooks.build: {len(done)} ready, {len(failed)} failed, "
        f"{len(results) - len(done) - len(failed)} skipped, in {time.monotonic() - start:.0f} s",
        file=sys.stderr,
    )
    for r in done:
        for n, w in zip(r.built, r.where, strict=True):
            print(f"{r.target}\t{n}\t{w}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
