"""Every shell command in the READMEs' code blocks exists as written: run.sh subcommands, the
demo's flags and run names, nox session names (as ``nox -l`` lists them), scripts and their
options, paths handed to pip.  Parsed against the current CLI, nothing is run.  A command of a
kind this test does not know fails it, so a new kind of command must be taught here."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", ROOT / "examples" / "README.md"]
BLOCK = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.M | re.S)


def commands(readme: Path) -> Iterator[tuple[str, list[str]]]:
    """(line as written, its words without comments and leading VAR=value settings)."""
    for block in BLOCK.findall(readme.read_text()):
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            words = shlex.split(line, comments=True)
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                words.pop(0)
            if words:
                yield line, words


def nox_sessions() -> set[str]:
    """The sessions `nox -l` lists: every @nox.session function, `tests` once per package."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    names = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and any("session" in ast.unparse(d) for d in fn.decorator_list):
            names.add(fn.name)
    packages = {p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()}
    return names | {f"tests({p})" for p in packages}


def runsh_subcommands() -> set[str]:
    text = (ROOT / "run.sh").read_text()
    case = text[text.index('case "${1:-}" in') :]
    return set(re.findall(r"^([a-z][\w-]*)\)$", case, flags=re.M))


class _Refused(Exception):
    pass


def _parser_error(message: str) -> None:
    raise _Refused(message)


def check_demo(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        train_gpt = importlib.import_module("train_gpt")
        try:
            train_gpt.parse_args(argv)
        except SystemExit as e:
            raise _Refused(f"train_gpt.py refuses {argv}") from e
    finally:
        sys.path.remove(str(ROOT / "examples"))


def check_framework_example(script: str, argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        common = importlib.import_module("framework_report").common_arguments
        p = argparse.ArgumentParser()
        common(p)
        p.error = _parser_error  # type: ignore[method-assign]
        p.parse_args(argv)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert (ROOT / script).is_file(), script


def check_nox(argv: list[str]) -> None:
    sessions = nox_sessions()
    if "--" in argv:
        argv = argv[: argv.index("--")]
    i = 0
    while i < len(argv):
        if argv[i] in ("-s", "--session", "-k"):
            name = argv[i + 1]
            if argv[i] == "-k":
                assert any(name in s for s in sessions), (name, sorted(sessions))
            else:
                assert name in sessions, f"nox session {name!r} does not exist; nox -l: {sorted(sessions)}"
            i += 2
        else:
            assert argv[i] in ("-l", "--list", "-R", "-r", "--reuse-existing-virtualenvs"), argv[i]
            i += 1


def _argparse_of(path: Path) -> argparse.ArgumentParser:
    """The parser a tool's ``main`` builds, captured without running the tool."""
    spec = importlib.util.spec_from_file_location(f"_readme_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    captured: list[argparse.ArgumentParser] = []

    def refuse(self: argparse.ArgumentParser, message: str) -> None:
        raise _Refused(f"{path.name}: {message}")

    def capture(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> None:
        captured.append(self)
        raise _Refused("captured")

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[assignment,method-assign]
    try:
        module.main([])
    except _Refused:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    assert captured, f"{path} builds no argparse parser in main()"
    parser = captured[0]
    parser.error = refuse.__get__(parser)  # type: ignore[method-assign]
    return parser


def check_gpu_bundle(argv: list[str]) -> None:
    _argparse_of(ROOT / "tools" / "gpu_bundle.py").parse_args(argv)


def check_run_suite(argv: list[str]) -> None:
    """run_suite.sh's own options (its case list), then the suite's options after ``--``."""
    text = (ROOT / "tools" / "run_suite.sh").read_text()
    options = dict(re.findall(r"^\s*(--[\w-]+)\) (\w+=)?", text, flags=re.M))
    takes_value = {o for o, assign in re.findall(r"^\s*(--[\w-]+)\) (\w+=\$2)?", text, flags=re.M) if assign}
    i = 0
    while i < len(argv):
        if argv[i] == "--":
            _argparse_of(ROOT / "tools" / "gpu_suite.py").parse_args(["--out", "x", *argv[i + 1 :]])
            return
        if argv[i] not in options:
            raise _Refused(f"run_suite.sh has no option {argv[i]!r} (it has {sorted(options)})")
        i += 2 if argv[i] in takes_value else 1


def check(words: list[str]) -> None:
    head, rest = words[0], words[1:]
    if head == "sudo":
        raise _Refused("sudo: the README's commands run as the user (run.sh says what needs root)")
    if head == "bash" and rest[:1] == ["run.sh"]:
        sub, args = rest[1], rest[2:]
        if sub == "--help":  # run.sh's own usage, checked before anything is installed
            assert not args and "-h | --help | help)" in (ROOT / "run.sh").read_text()
            return
        assert sub in runsh_subcommands(), f"run.sh has no {sub!r} (it has {sorted(runsh_subcommands())})"
        if sub == "demo":
            check_demo(args)
        elif sub == "test":
            check_nox(args)
        elif sub == "examples":
            check_framework_example("examples/hf_trainer.py", args)
        elif sub == "gpu-bundle":
            check_gpu_bundle(args)
        return
    if head == "bash" and rest[:1] and rest[0].endswith("run_suite.sh"):
        # tools/run_suite.sh in a checkout, or DIR/run_suite.sh in a bundle (the same script)
        check_run_suite(rest[1:])
        return
    if head == "nox":
        check_nox(rest)
        return
    if head == "python" and rest[:1] == ["examples/train_gpt.py"]:
        check_demo(rest[1:])
        return
    if head == "python" and rest[:1] == ["examples/report.py"]:
        return
    if head == "python" and rest[:2] == ["-m", "zerohooks.build"]:
        assert set(rest[2:]) <= {"--all", "--list", "loco", "nvmeswap", "deepspeed-shm", "deepspeed-adam"}
        return
    if head == "python" and rest[:2] == ["-m", "zerohooks.run"]:
        return  # the generic form: `python -m zerohooks.run -m some.module ARGS`
    if head in ("torchrun", "accelerate", "deepspeed"):
        module = rest.index("-m") if "-m" in rest else rest.index("--module") if "--module" in rest else None
        scripts = [w for w in rest if w.endswith(".py")]
        if module is not None:
            assert rest[module + 1] == "zerohooks.run", rest
        for script in scripts:
            if script.startswith("examples/"):
                after = rest[rest.index(script) + 1 :]
                check_framework_example(script, after)
        return
    if head == "pip" and rest[:1] == ["install"]:
        for w in rest[1:]:
            if w.startswith("./") or w.endswith(".txt"):
                assert (ROOT / w).exists(), w
        return
    if head == "git" or head == "cd" or head == "time":
        return
    raise AssertionError(f"a command this test does not know: {words}; teach test_readme_commands.py")


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_readme_command_parses(readme: Path) -> None:
    seen = 0
    for line, words in commands(readme):
        try:
            check(words)
        except (_Refused, AssertionError) as e:
            raise AssertionError(f"{readme.relative_to(ROOT)}: `{line.strip()}`: {e}") from None
        seen += 1
    assert seen >= 5


def test_the_checks_can_fail() -> None:
    for words in (
        ["bash", "run.sh", "demo", "--runs", "baseline,lcoo"],
        ["bash", "run.sh", "demo", "--no-such-flag"],
        ["bash", "run.sh", "nosuch"],
        ["nox", "-s", "nosuch"],
        ["sudo", "python", "examples/train_gpt.py"],
        ["torchrun", "--nproc_per_node", "2", "examples/hf_trainer.py", "--no-such-flag"],
        ["frobnicate"],
        ["bash", "run.sh", "gpu-bundle", "out", "--no-such-flag"],
        ["bash", "tools/run_suite.sh", "--no-such-flag"],
        ["bash", "tools/run_suite.sh", "--out", "x", "--", "--no-such-flag"],
    ):
        with pytest.raises((_Refused, AssertionError)):
            check(words)


def test_the_readme_lists_every_default_nox_session() -> None:
    text = (ROOT / "README.md").read_text()
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    defaults = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "nox.options.sessions"
    )
    for name in defaults:
        assert f"`{name}" in text, f"README's session table lacks {name}"
    for sub in runsh_subcommands():
        assert f"bash run.sh {sub}" in text, f"README does not show `bash run.sh {sub}`"
