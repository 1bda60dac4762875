"""tandem installed as a user installs it (`pip install .` into a fresh venv, no checkout
beside it): every command a hint or message names exists there (issue 39: hints once told
wheel users to run scripts/bootstrap.sh, which only a checkout has)."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a checkout has and an installed tandem does not
CHECKOUT_ONLY = re.compile(r"scripts/|bootstrap\.sh|\bmake (?:test|demo)\b|pip install -e\b|\.venv/")
# how messages name a command: in backticks (`tandem pull qwen2.5-coder-7b`)
NAMED_COMMAND = re.compile(r"`tandem ([a-z][\w-]*)")


def _messages(tree: ast.AST):
    """The string constants of a module that are not docstrings (messages, hints, help)."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value


def _problems(package: Path, commands: set[str]) -> list[str]:
    out = []
    for path in sorted(package.rglob("*.py")):
        for line, text in _messages(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(package)}:{line}"
            out += [f"{where}: {m.group(0)!r}" for m in CHECKOUT_ONLY.finditer(text)]
            out += [f"{where}: `tandem {m.group(1)}` is no command"
                    for m in NAMED_COMMAND.finditer(text) if m.group(1) not in commands]
    return out


def test_the_message_check_sees_one(tmp_path):
    (tmp_path / "m.py").write_text('"""scripts/ in a docstring is for readers."""\n'
                                   'HINT = "run scripts/bootstrap.sh"\n'
                                   'OTHER = "try `tandem pul` or `tandem pull`"\n')
    assert _problems(tmp_path, {"pull"}) == [
        "m.py:2: 'scripts/'", "m.py:2: 'bootstrap.sh'", "m.py:3: `tandem pul` is no command"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv (with pip, as `python -m venv` makes it) holding tandem installed from a
    copy of the project's packaged files; its dependencies are read from this venv."""
    base = tmp_path_factory.mktemp("installed")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "cli", src / "cli", ignore=ignore)
    shutil.copytree(ROOT / "profiles", src / "profiles")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the dependencies (llama-cpp-python, typer...) from the test venv, appended after the
    # fresh venv's own packages: tandem itself comes from the install below, not the checkout
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    res = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps",
                          "--no-build-isolation", "--no-index", str(src)],
                         capture_output=True, text=True, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    return python, Path(site) / "tandem"


# the install alone: no PYTHONPATH (a suite run from a checkout may set one to its cli/)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _tandem(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python.parent / "tandem"), *args], capture_output=True,
                          text=True, cwd=python.parents[2], timeout=300, env=ENV)


def test_installed_tandem_is_not_the_checkout(installed):
    python, package = installed
    res = subprocess.run([str(python), "-c", "import tandem; print(tandem.__file__)"],
                         capture_output=True, text=True, check=True, env=ENV)
    assert Path(res.stdout.strip()).parent == package
    assert not (package / "bench" / "native.py").exists()  # checkout-only code stays out


def test_every_command_a_message_names_exists_in_the_install(installed):
    python, package = installed
    res = _tandem(python, "--help")
    assert res.returncode == 0, res.stderr
    named = {m.group(1) for path in package.rglob("*.py")
             for _, text in _messages(ast.parse(path.read_text(encoding="utf-8")))
             for m in NAMED_COMMAND.finditer(text)}
    commands = {name for name in named if _tandem(python, name, "--help").returncode == 0}
    assert {"pull", "hw", "pairs"} <= named  # the check reads the messages at all
    assert _problems(package, commands) == []


def test_the_rebuild_hint_runs_in_the_install(installed):
    """The hint for a missing or CPU-only llama-cpp-python: this venv's own pip, the pin
    from the installed metadata, the CMake flags for this machine."""
    python, _ = installed
    code = "from tandem.build_flags import rebuild_hint; print(rebuild_hint('cuda'))"
    hint = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          check=True, env=ENV).stdout.strip()
    assert f"{python} -m pip install --force-reinstall" in hint
    assert "-DGGML_CUDA=on" in hint and "-DGGML_RPC=ON" in hint
    pin = next(r for r in ROOT.joinpath("pyproject.toml").read_text().splitlines()
               if '"llama-cpp-python==' in r).strip().strip('",')
    assert hint.endswith(pin)
    assert subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True,
                          env=ENV).returncode == 0
