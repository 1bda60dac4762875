"""The package's shape: no import circles, each vocabulary and each rule defined once, settings
resolved once per command, the dependency rules (llama_cpp, typer and rich each imported where
they belong), drafters read through their protocol, and functions short enough to read."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "cli" / "tandem"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every tandem module -> the tandem modules it imports, at any depth (a function-level
    import that breaks a circle at import time is still a circle in the design). Imports under
    `if TYPE_CHECKING:` are left out: they name types for annotations and never run."""
    mods = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", "") == "TYPE_CHECKING"
                       for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                base = node.module
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
            elif isinstance(node, ast.ImportFrom) and node.level:
                pkg = name.rsplit(".", node.level)[0] if path.name != "__init__.py" else name
                deps.add(f"{pkg}.{node.module}" if node.module else pkg)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name and d != "tandem"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circles():
    cycle = _cycle(_imports())
    assert cycle is None, " -> ".join(cycle)


def test_the_walker_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _importers(top: str) -> set[str]:
    out = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == top or n.startswith(top + ".") for n in names):
                out.add(_module_name(path))
    return out


def test_dependency_rules():
    assert _importers("llama_cpp") == BINDINGS
    # native calls: llama.cpp through the binding (engine/backend's binding modules), ggml's
    # registry for RPC devices and the RPC server, which the binding does not cover (ggml), and
    # libc's prctl that ends a benchmark's llama-server with the process that started it
    # (bench/llama_server.py)
    assert _importers("ctypes") == BINDINGS | {"tandem.engine.remote.ggml",
                                               "tandem.bench.llama_server"}
    ui = _importers("typer") | _importers("rich")
    assert all(m.startswith("tandem.commands.") or m == "tandem.chat.tui" for m in ui), ui
    # the HTTP stack only where `tandem serve` runs it (tandem run never loads it)
    assert _importers("starlette") | _importers("uvicorn") == {
        "tandem.serve.routes", "tandem.serve.request_flow", "tandem.serve.connection",
        "tandem.serve.completion_flow", "tandem.serve.openai_routes",
        "tandem.serve.llama_routes", "tandem.serve.server_state",
        "tandem.serve.anthropic_routes", "tandem.serve.responses_routes", "tandem.serve.webui"}


# The modules that need the compiled binding, engine/backend's binding modules: llama.py
# (contexts; what callers import), model.py (a loaded model and the process-wide set-up,
# which llama.py re-exports) and mtp.py (the MTP heads' context, which follows a Context
# and calls llama.cpp's staging API through llama_cpp.llama_cpp_ext). Three, not one, so that
# each stays a readable size and Context owns no MTP logic. Every other module only names
# their types (under `if TYPE_CHECKING:`) or imports them inside the function that loads a
# model.
BACKEND = "tandem.engine.backend.llama"
BINDINGS = {BACKEND, "tandem.engine.backend.model", "tandem.engine.backend.mtp"}


def _top_level_imports(tree) -> set[str]:
    """The modules a module imports when it is itself imported: statements outside functions
    and outside `if TYPE_CHECKING:` blocks."""
    found: set[str] = set()

    def walk(nodes):
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING":
                walk(n.orelse)
                continue
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                found.add(n.module)
                found.update(f"{n.module}.{a.name}" for a in n.names)
            walk(ast.iter_child_nodes(n))

    walk(tree.body)
    return found


def test_only_the_backend_loads_llama_cpp_at_import():
    """Only the binding modules import llama_cpp, and no other module imports one of them when
    it is itself imported: the types come under TYPE_CHECKING, a Model, Context or MtpHead is
    made by a function that imports the backend when it runs (engine/pair.py,
    engine/backend/loading.py)."""
    assert _importers("llama_cpp") == BINDINGS
    eager = sorted(m for m, tree in _trees() if m not in BINDINGS
                   and BINDINGS & _top_level_imports(tree))
    assert eager == [], eager


def test_the_import_check_sees_an_eager_import():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from tandem.engine.backend.llama import Context\n"
                     "def f():\n    from tandem.engine.backend import llama\n"
                     "from tandem.engine.backend import llama\n")
    assert BACKEND in _top_level_imports(tree)
    assert BACKEND not in _top_level_imports(ast.parse(
        "def f():\n    from tandem.engine.backend.llama import Model\n"))


def test_every_module_but_the_backend_imports_without_llama_cpp(tmp_path):
    """With llama_cpp blocked (a machine where the 6-8 minute build has not run), each tandem
    module but the backend imports: the loop, drafters, pricing, serve's routes, the commands.
    One subprocess imports them all (__main__ is left out: importing it runs the CLI)."""
    import json
    import os
    import subprocess
    import sys

    names = sorted(_module_name(p) for p in PKG.rglob("*.py")
                   if _module_name(p) not in BINDINGS | {"tandem.__main__"})
    code = (
        "import importlib, json, sys\n"
        "sys.modules['llama_cpp'] = None\n"
        "bad = {}\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except BaseException as exc:\n"
        "        bad[name] = f'{type(exc).__name__}: {exc}'\n"
        "try:\n"  # the block itself: the backend must fail
        "    importlib.import_module('tandem.engine.backend.llama')\n"
        "    bad['llama_cpp was not blocked'] = ''\n"
        "except Exception:\n"
        "    pass\n"
        "print(json.dumps(bad))\n"
    )
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "PYTHONPATH": str(PKG.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


# The decode loop and the drafting internals: the loop (engine/loop/) knows drafters only
# through the Drafter protocol (engine/drafting/drafters.py), never an index, a controller or
# the history behind one.
PROTOCOL = "tandem.engine.drafting.drafters"


def test_the_loop_imports_no_drafting_internals():
    graph = _imports()
    loop = [m for m in graph if m.startswith("tandem.engine.loop.")]
    assert "tandem.engine.loop.speculative" in loop
    found = sorted((m, d) for m in loop for d in graph[m]
                   if d.startswith("tandem.engine.drafting.") and d != PROTOCOL)
    assert found == [], found


def _literals(path: Path):
    """Every tuple, list or set of strings in a module (a vocabulary), and every dict keyed by
    strings (a map from names to data), as (kind, set of the strings)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        kind, elts = (("map", node.keys) if isinstance(node, ast.Dict) else
                      ("names", node.elts) if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                      else (None, None))
        if elts and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
            yield kind, {e.value for e in elts}


@pytest.mark.parametrize("name", ["STRATEGIES", "KV_TYPES", "FLASH_ATTN", "MODES"])
def test_each_vocabulary_is_defined_once(name):
    """As names only in config.schema; elsewhere only maps from those names to data (the
    engine's llama.cpp integers, the planner's byte sizes), which must cover every name."""
    from tandem.config import schema

    words = set(getattr(schema, name))
    found = [(_module_name(p), kind, s) for p in PKG.rglob("*.py") for kind, s in _literals(p)
             if words <= s]
    defined = [m for m, kind, s in found if kind == "names"]
    assert defined == ["tandem.config.schema"], found
    assert all(s == words for _, kind, s in found), found


def _main(monkeypatch, capsys, *argv: str) -> int:
    """`tandem ARGV` in this process (so a counter can see inside); the exit code."""
    import io
    import sys
    import warnings

    from tandem.commands.app import main

    monkeypatch.setattr(sys, "argv", ["tandem", *argv])
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code


def test_settings_are_resolved_once_per_command(monkeypatch, capsys, tmp_path, tiny_models):
    from tandem.commands import compose as prepare
    from tandem.config import settings

    calls = []
    real = settings.resolve_settings

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(settings, "resolve_settings", counting)
    monkeypatch.setattr(prepare, "resolve_settings", counting)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    models = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"])]
    assert _main(monkeypatch, capsys, "run", *models, "-n", "2", "-t", "1", "--raw", "hi") == 0
    assert len(calls) == 1
    calls.clear()
    assert _main(monkeypatch, capsys, "hw", *models, "--json") == 0
    assert len(calls) == 1


# The layers of docs/architecture.md, lowest first: a module imports only from its own layer
# or lower ones.
LAYERS = (
    ("tandem.errors", "tandem.fsutil", "tandem.statefile", "tandem.bounded_json", "tandem.config",
     "tandem.build_flags"),
    ("tandem.models",),
    ("tandem.engine",),
    ("tandem.machine",),
    ("tandem.chat", "tandem.bench", "tandem.serve"),
    ("tandem.commands", "tandem.__main__"),
)


def _layer(module: str) -> int:
    best = (-1, -1)  # the longest matching prefix decides
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                best = max(best, (len(p), i))
    return best[1]


def test_imports_only_go_down_the_layers():
    graph = _imports()
    upward = [(m, d) for m, deps in graph.items() for d in deps if _layer(d) > _layer(m)]
    assert all(_layer(m) >= 0 for m in graph if m != "tandem"), [m for m in graph if _layer(m) < 0]
    assert upward == [], upward


def test_long_modules_say_why():
    """A module over ~400 lines says in its docstring why it is one module."""
    long = []
    for path in PKG.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 420 and "Over 400 lines because" not in doc:
            long.append(_module_name(path))
    assert long == []


def _trees():
    for path in sorted(PKG.rglob("*.py")):
        yield _module_name(path), ast.parse(path.read_text(encoding="utf-8"))


def _strings(tree) -> list[str]:
    """Every string constant of a module, f-strings' literal parts included."""
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


# Each rule's message, and the one module that defines the rule. A second module that words
# the same refusal is a second definition (they drifted apart: chat's /draft once took 1..64
# while --draft-max took 0..64, and chat's pair check forgot -md).
RULES = {
    "unknown strategy": "tandem.config.schema",
    "max tokens must be >= 1": "tandem.config.schema",
    "the prompt is empty": "tandem.config.schema",
    "needs a draft model": "tandem.engine.drafting.strategies",
    "or --model": "tandem.commands.options",  # a pair name or your own files, not both
}


@pytest.mark.parametrize("message", sorted(RULES))
def test_each_rule_is_defined_once(message):
    where = {m for m, tree in _trees() if any(message in s for s in _strings(tree))}
    assert where == {RULES[message]}, where


def test_strategy_names_are_checked_in_one_place():
    """`x in STRATEGIES` only where the strategies are defined (config.schema.check_strategy
    and the settings' own choice check); everyone else calls check_strategy."""
    where = {m for m, tree in _trees() for n in ast.walk(tree) if isinstance(n, ast.Compare)
             and any(getattr(c, "id", getattr(c, "attr", "")) == "STRATEGIES"
                     for c in n.comparators)}
    assert where <= {"tandem.config.schema"}, where


def test_the_draft_length_limit_is_one_constant():
    """MAX_DRAFT (config.schema) is the one number; the engine's logits rows derive from it,
    and the flags, files, chat's /draft and DraftParams check the n_max field."""
    found = [(m, t.id) for m, tree in _trees() for n in ast.walk(tree)
             if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
             and type(n.value.value) is int
             for t in n.targets if isinstance(t, ast.Name) and t.id.isupper()
             and ("DRAFT" in t.id and ("MAX" in t.id or "LIMIT" in t.id) or "OUTPUTS" in t.id)]
    assert found == [("tandem.config.schema", "MAX_DRAFT")], found


_UNITS = (" B", " KB", " MB", " GB", " TB", " KiB", " MiB", " GiB")


def test_bytes_are_formatted_in_one_place():
    """fsutil.fmt_bytes formats byte counts: no other module divides a count into units."""
    where = set()
    for m, tree in _trees():
        for n in ast.walk(tree):
            if not isinstance(n, ast.JoinedStr):
                continue
            for a, b in zip(n.values, n.values[1:]):
                if (isinstance(a, ast.FormattedValue) and isinstance(a.value, ast.BinOp)
                        and isinstance(a.value.op, ast.Div) and isinstance(b, ast.Constant)
                        and str(b.value).startswith(_UNITS)):
                    where.add(m)
    assert where <= {"tandem.fsutil"}, where


def test_yaml_places_come_from_the_schema():
    """A setting's YAML place (("batch", "n_batch")) is written once, in config.schema."""
    from tandem.config.schema import SETTING_FIELDS

    places = {f.path for f in SETTING_FIELDS if len(f.path) > 1}
    where = {m for m, tree in _trees() for n in ast.walk(tree)
             if isinstance(n, ast.Tuple) and len(n.elts) > 1
             and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.elts)
             and tuple(e.value for e in n.elts) in places}
    assert where <= {"tandem.config.schema"}, where


def test_the_engine_reads_drafters_through_their_protocol():
    """No getattr/hasattr probing a drafter in the engine: what generate() and PairSession
    read is declared on engine.drafters.Drafter."""
    from tandem.engine.drafting.drafters import Drafter

    declared = set(Drafter.__annotations__) | {n for n in vars(Drafter) if not n.startswith("_")}
    probes = []
    for m, tree in _trees():
        if not m.startswith("tandem.engine."):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("getattr", "hasattr") \
                    and len(n.args) >= 2:
                target = ast.unparse(n.args[0])
                attr = n.args[1].value if isinstance(n.args[1], ast.Constant) else None
                if "draft" in target.lower() or attr in declared:
                    probes.append((m, n.lineno, ast.unparse(n)))
    assert probes == [], probes


def test_config_imports_nothing_above_it():
    """config is the bottom layer: it reads the settings' sources and merges them, and imports
    only errors, fsutil and itself. Choosing the profile (machine.profiles.choose_profile),
    the catalog's default pair, the home and the pair's files are the caller's
    (commands/compose.py: resolve), so no exception is left."""
    graph = _imports()
    config = {m: deps for m, deps in graph.items()
              if m == "tandem.config" or m.startswith("tandem.config.")}
    assert config, "no tandem.config modules found"
    allowed = ("tandem.errors", "tandem.fsutil", "tandem.config")
    bad = sorted((m, d) for m, deps in config.items() for d in deps
                 if not (d in allowed or d.startswith("tandem.config.")))
    assert bad == [], bad


LONG_FUNCTION = 80


def _code_lines(fn) -> int:
    """A function's lines, signature included, docstring left out (a command's docstring is
    its --help text, with examples: documentation, not code to read through)."""
    lines = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_long_functions_say_why():
    """A function over 80 lines is split where its parts have names, or says in its docstring
    why it is one ("Over 80 lines because ...")."""
    long = []
    for m, tree in _trees():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and _code_lines(n) > LONG_FUNCTION \
                    and "Over 80 lines because" not in (ast.get_docstring(n) or ""):
                long.append((m, n.name, _code_lines(n)))
    assert long == [], long


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's tree names each module of the package (by its file name)."""
    import re

    doc = (PKG.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = doc[doc.index("```\ncli/tandem/"):doc.index("Layers, highest first")]
    missing = [_module_name(p) for p in sorted(PKG.rglob("*.py")) if p.name != "__init__.py"
               and not re.search(rf"\b{re.escape(p.stem)}\b", tree)]
    assert missing == [], missing


def _private(name: str) -> bool:
    """`_click`, `typer._click.utils`: a dotted name with a part that is private (not dunder)."""
    return any(p.startswith("_") and not p.endswith("__") for p in name.split("."))


def test_no_private_names_of_other_packages():
    """No module imports another package's private module or name, nor reaches one through an
    attribute (`typer._click`, `_detect_program_name`): they change without notice (typer 0.29
    moved click inside itself as typer._click). The standard library's documented ones
    (os._exit, sys._getframe) are allowed."""
    import sys

    found = []
    for m, tree in _trees():
        bound = set()  # local names of what came from another (non-stdlib) package
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    top = a.name.split(".")[0]
                    if top != "tandem" and top not in sys.stdlib_module_names:
                        if _private(a.name):
                            found.append((m, n.lineno, a.name))
                        bound.add(a.asname or top)
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                top = n.module.split(".")[0]
                if top == "tandem" or top in sys.stdlib_module_names:
                    continue
                for a in n.names:
                    if _private(f"{n.module}.{a.name}"):
                        found.append((m, n.lineno, f"{n.module}.{a.name}"))
                    bound.add(a.asname or a.name)
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _private(n.attr):
                root = n.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in bound:
                    found.append((m, n.lineno, ast.unparse(n)))
    assert found == [], found


def test_the_private_name_check_sees_one():
    assert _private("typer._click.utils") and _private("_detect_program_name")
    assert not _private("typer.main") and not _private("__future__")


def test_commands_are_declared_one_way():
    """Each command module declares its commands with decorators on its own module-level
    `app = typer.Typer(...)` (a named Typer is a group: pairs, history), and commands/app.py
    adds every such module the same way, in the order --help lists them: no register(), no
    command declared inside a function or by calling app.command()(f)."""
    declaring, bad = set(), []
    for m, tree in _trees():
        if not m.startswith("tandem.commands.") or m == "tandem.commands.app":
            continue
        top = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef) and n.name == "register":
                bad.append((m, "register()"))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Call) \
                    and getattr(n.func.func, "attr", "") in ("command", "callback"):
                bad.append((m, ast.unparse(n)))
            if not isinstance(n, ast.FunctionDef):
                continue
            for d in n.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if getattr(target, "attr", "") not in ("command", "callback"):
                    continue
                declaring.add(m.rsplit(".", 1)[1])
                if ast.unparse(target.value) != "app" or n not in top:
                    bad.append((m, n.name))
    assert bad == [], bad
    app_tree = ast.parse((PKG / "commands" / "app.py").read_text(encoding="utf-8"))
    added = [[e.id for e in n.iter.elts] for n in ast.walk(app_tree)
             if isinstance(n, ast.For) and isinstance(n.iter, ast.Tuple)]
    assert len(added) == 1 and sorted(added[0]) == sorted(declaring), (added, declaring)


def _shared_aliases() -> dict:
    """The typed option aliases of commands/options.py (Annotated[..., typer.Option])."""
    import typing

    from tandem.commands import options

    return {name: value for name, value in vars(options).items()
            if typing.get_origin(value) is typing.Annotated}


def test_shared_options_are_declared_once():
    """The options run, chat, serve and spec-bench share are typed aliases in
    commands/options.py (huggingface_hub's CLI style), declared there only: no command
    declares one of their flags again, and no command's signature is rewritten (the
    `__signature__` of @shared_options once filled them in)."""
    aliases = _shared_aliases()
    assert {"DraftMax", "Temp", "TargetFile", "Exact"} <= set(aliases)  # the check sees them
    shared_flags = {d for annotation in aliases.values() for d in _option_flags(annotation)}
    again, rewritten = [], []
    for m, tree in _trees():
        # rpc-server's --threads is llama.cpp rpc-server's own flag, another program's
        if not m.startswith("tandem.commands.") or m in ("tandem.commands.options",
                                                           "tandem.commands.rpc_server"):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "typer.Option":
                flags = {a.value for a in n.args if isinstance(a, ast.Constant)}
                again += [(m, f) for f in sorted(flags & shared_flags)]
            if isinstance(n, ast.Attribute) and n.attr == "__signature__":
                rewritten.append(m)
    assert again == [] and rewritten == [], (again, rewritten)


def test_shared_options_have_no_default_of_their_own():
    """A shared option's default in each command is None, or False for a switch: not given,
    so the settings (or SamplingParams, for sampling) decide, and no default is restated."""
    import inspect

    from tandem.commands.bench import spec_bench
    from tandem.commands.chat import chat
    from tandem.commands.run import run
    from tandem.commands.serve import serve

    aliases = {id(a) for a in _shared_aliases().values()}
    own = []
    for command in (run, chat, serve, spec_bench):
        for p in inspect.signature(command, eval_str=True).parameters.values():
            if id(p.annotation) in aliases and p.default not in (None, False):
                own.append((command.__name__, p.name, p.default))
    assert own == [], own


def _option_flags(annotation) -> set[str]:
    info = annotation.__metadata__[0]
    return {d for d in (info.default, *(info.param_decls or ())) if isinstance(d, str)}


def test_module_names_say_what_they_hold():
    """No two modules share a file name (three `session.py`, two `app.py` and two `worker.py`
    once did), except a command's module named after its command (commands/history.py runs
    the answers engine/drafting/history.py keeps) and a drafter named after the binding
    module it drafts with (engine/drafting/mtp.py drafts with engine/backend/mtp.py's heads)."""
    import collections

    by_stem = collections.defaultdict(list)
    for path in PKG.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            by_stem[path.stem].append(_module_name(path))
    drafters_of_bindings = {f"tandem.engine.drafting.{m.rsplit('.', 1)[1]}" for m in BINDINGS}
    shared = {stem: sorted(mods) for stem, mods in by_stem.items() if len(mods) > 1
              and len([m for m in mods if not m.startswith("tandem.commands.")
                       and m not in drafters_of_bindings]) > 1}
    assert shared == {}, shared


# a code reference in the docs: `tandem.module:attr` (issue 39's spelling) or a dotted
# `tandem.module.attr`, optionally called: `...()`
_DOC_REF = re.compile(r"`(tandem(?:\.\w+)+(?::\w+(?:\.\w+)*)?)(?:\(\))?`")


def _resolve(ref: str):
    """The object a reference names (importlib for the module, getattr for the rest), or
    an exception."""
    import importlib

    if ":" in ref:
        module, _, attrs = ref.partition(":")
        obj = importlib.import_module(module)
        for name in attrs.split("."):
            obj = getattr(obj, name)
        return obj
    parts = ref.split(".")
    for cut in range(len(parts), 1, -1):  # the longest prefix that imports is the module
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(ref)


def test_code_references_in_the_docs_resolve():
    """Every `tandem.module:attr` (or dotted `tandem.module.attr`) in docs/ and README.md
    names something that exists: three once named what had moved (serve.native.Limiter,
    tandem.config.prepare, tandem.engine.pair.check_pair)."""
    broken, seen = [], 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for ref in _DOC_REF.findall(doc.read_text(encoding="utf-8")):
            seen += 1
            try:
                _resolve(ref)
            except (ImportError, AttributeError) as exc:
                broken.append((doc.name, ref, type(exc).__name__))
    assert seen >= 10 and broken == [], broken


def test_settings_flags_are_declared_from_the_schema():
    """A command's option for a settings key is made by options.setting_flag from the schema
    (its flag, type, variable and config key), never spelled again by hand: `--draft-max`
    was once written in the schema and again in options.py (issue 39). rpc-server's --host,
    --port and --threads are llama.cpp rpc-server's own, another program's flags."""
    from tandem.config.schema import SETTING_FIELDS

    flags = {f.flag for f in SETTING_FIELDS if f.flag}
    by_hand = []
    for path in sorted((PKG / "commands").glob("*.py")):
        if path.name == "rpc_server.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Option":
                spelled = {a.value for a in node.args if isinstance(a, ast.Constant)}
                by_hand += [(path.name, node.lineno, flag) for flag in spelled & flags]
    assert by_hand == [], by_hand


def _restated_defaults(tree: ast.AST, defaults: dict) -> list[tuple[int, str]]:
    """Fields and parameters named after a setting whose literal default is the setting's."""
    pairs = []
    for n in ast.walk(tree):
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value:
            pairs.append((n.target.id, n.value, n.lineno))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            pos = a.posonlyargs + a.args
            pairs += [(arg.arg, d, n.lineno)
                      for arg, d in zip(pos[len(pos) - len(a.defaults):], a.defaults)]
            pairs += [(arg.arg, d, n.lineno) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d]
    return [(line, name) for name, value, line in pairs
            if name in defaults and isinstance(value, ast.Constant)
            and value.value is not None and value.value == defaults[name]]


def test_each_setting_default_is_written_once():
    """A setting's default is the schema's alone: a field or parameter named after a setting
    reads it from config.schema (FIELDS_BY_KEY[key].default) rather than spelling the value
    again (`n_ctx: int = 4096` in three modules, `p_min=0.0` against the schema's 0.5; issue
    39). rpc-server's --host is llama.cpp rpc-server's own flag, another program's."""
    from tandem.config.schema import SETTING_FIELDS

    defaults = {f.key: f.default for f in SETTING_FIELDS}
    again = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name in ("schema.py", "rpc_server.py"):
            continue
        again += [(_module_name(path), line, name) for line, name in
                  _restated_defaults(ast.parse(path.read_text(encoding="utf-8")), defaults)]
    assert again == [], again


def test_the_restated_default_check_sees_one():
    tree = ast.parse("class C:\n    n_ctx: int = 4096\n\ndef f(p_min=0.5, *, port=8080):\n    pass\n")
    assert sorted(_restated_defaults(tree, {"n_ctx": 4096, "p_min": 0.5, "port": 8080})) == [
        (2, "n_ctx"), (4, "p_min"), (4, "port")]


def _drafters_with_defaults() -> list[str]:
    """Drafter constructors (classes of engine/drafting with a `propose`) that give a
    parameter a default, or take a draft length apart from DraftParams."""
    import importlib
    import inspect
    import pkgutil

    import tandem.engine.drafting as drafting

    found = []
    for info in pkgutil.iter_modules(drafting.__path__):
        module = importlib.import_module(f"tandem.engine.drafting.{info.name}")
        for name, cls in vars(module).items():
            if not (inspect.isclass(cls) and cls.__module__ == module.__name__
                    and hasattr(cls, "propose") and "__init__" in vars(cls)):
                continue
            for param in inspect.signature(cls.__init__).parameters.values():
                if param.default is not inspect.Parameter.empty or \
                        param.name in ("n_max", "n_min", "p_min"):
                    found.append(f"{name}({param.name})")
    return found


def test_drafter_constructors_take_the_settings_whole():
    """Each drafter takes a DraftParams (the settings' draft length and stops) and no default
    of its own: `DraftModelDrafter(n_max=4, p_min=0.0)` once disagreed with the schema's p_min
    0.5 (issue 39). The constructors that take one are found at all (the check is live)."""
    import inspect

    from tandem.engine.drafting.auto import AutoDrafter
    from tandem.engine.drafting.drafters import DraftModelDrafter, DraftParams, NgramDrafter
    from tandem.engine.drafting.hybrid import HybridDrafter

    assert _drafters_with_defaults() == []
    for cls in (DraftModelDrafter, NgramDrafter, HybridDrafter, AutoDrafter):
        kinds = {p.annotation for p in inspect.signature(cls.__init__).parameters.values()}
        assert "DraftParams" in kinds or DraftParams in kinds, cls


def test_the_drafter_default_check_sees_one(monkeypatch):
    from tandem.engine.drafting.drafters import NgramDrafter

    def init(self, draft, min_match: int = 2):
        pass

    monkeypatch.setattr(NgramDrafter, "__init__", init)
    assert _drafters_with_defaults() == ["NgramDrafter(min_match)"]


def test_every_script_says_what_it_is_for():
    """scripts/README.md names each script (what, when, output): one-off measurements sit
    beside the product's tools, and a reader tells them apart there (issue 39)."""
    scripts = ROOT / "scripts"
    page = (scripts / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w.-]+\.(?:py|sh))`", page))
    present = {p.name for p in scripts.iterdir() if p.suffix in (".py", ".sh")}
    assert present - named == set() and named - present == set()


_PATH_EDIT = re.compile(r"\bsys\.path\.(?:insert|append)\b")


def _path_edits(folder: Path) -> list[str]:
    """'file:line' of every sys.path edit in a folder's Python files."""
    return [f"{path.relative_to(folder)}:{i}" for path in sorted(folder.rglob("*.py"))
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if _PATH_EDIT.search(line)]


def test_no_script_or_test_edits_sys_path():
    """Scripts run with the venv's python, where tandem is installed, and a script's own
    folder is already sys.path[0] for its siblings; the tests find scripts/ through pytest's
    `pythonpath` (pyproject.toml). Edits of sys.path once let five scripts and three tests
    import a library that lived in scripts/ (issue 39)."""
    assert _path_edits(ROOT / "scripts") == [] and _path_edits(ROOT / "tests") == []


def test_the_sys_path_check_sees_one(tmp_path):
    edit = "sys.path."  # spelled in two parts: this file is checked too
    (tmp_path / "s.py").write_text(f"import sys\n\n{edit}insert(0, 'cli')\n")
    (tmp_path / "t.py").write_text(f"import sys\n{edit}append('scripts')\nsys.path[0]\n")
    assert _path_edits(tmp_path) == ["s.py:3", "t.py:2"]


def test_class_names_say_what_they_hold():
    """No two modules define a class of the same name (two Jobs, two Budgets and two Models
    once meant a generation and a worker's load, a prompt's size and memory, a loaded model
    and a reference): a reader finds each by its name alone."""
    import collections

    by_name = collections.defaultdict(list)
    for module, tree in _trees():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                by_name[node.name].append(module)
    shared = {name: mods for name, mods in by_name.items() if len(mods) > 1}
    assert shared == {}, shared


def test_settings_hold_values_only():
    """Settings carries the resolved values and their sources, typed; the hardware, the
    profile object, the files and the warnings resolving took are commands/compose.py's
    Resolved (no Any-typed passengers)."""
    import typing

    from tandem.config.settings import Settings

    untyped = [k for k, hint in typing.get_type_hints(Settings).items() if hint is typing.Any]
    assert untyped == [], untyped


_CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns"}


def _is_clock(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr in _CLOCKS and getattr(node.func.value, "id", "") == "time"


def _wall_clock_asserts(tree) -> list[int]:
    """Lines of asserts that compare a measured duration: a clock reading minus a start
    (`time.perf_counter() - t0`), or a name assigned one, on a side of a comparison. A
    deadline guard of a wait loop (`time.monotonic() < deadline`, `deadline - time.monotonic()
    > 0`) is a timeout, not a measurement: allowed."""
    def duration(node) -> bool:
        return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and \
            any(_is_clock(n) for n in ast.walk(node.left))

    durations = {t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
                 and any(duration(v) or (isinstance(v, ast.Call) and getattr(v.func, "id", "")
                                         == "max" and any(duration(a) for a in v.args))
                         for v in [n.value])
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                 if isinstance(t, ast.Name)}
    # a local function that returns one (`return text, time.monotonic() - t0`): the names its
    # callers bind to that place (`text, took = finish()`, or `took = elapsed()`)
    returned: dict[str, set[int]] = {}  # function -> places of a duration (-1: the value)
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for r in ast.walk(f):
                if isinstance(r, ast.Return) and r.value is not None:
                    elts = r.value.elts if isinstance(r.value, ast.Tuple) else [r.value]
                    places = {i for i, e in enumerate(elts) if duration(e)}
                    if places and not isinstance(r.value, ast.Tuple):
                        places = {-1}
                    returned.setdefault(f.name, set()).update(places)
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            places = returned.get(getattr(n.value.func, "id", ""), set())
            for t in n.targets:
                if isinstance(t, ast.Name) and -1 in places:
                    durations.add(t.id)
                elif isinstance(t, ast.Tuple):
                    durations |= {e.id for k, e in enumerate(t.elts)
                                  if k in places and isinstance(e, ast.Name)}
    found = []
    for a in ast.walk(tree):
        if isinstance(a, ast.Assert):
            for c in ast.walk(a.test):
                if isinstance(c, ast.Compare) and any(
                        duration(s) or (isinstance(s, ast.Name) and s.id in durations)
                        for s in [c.left, *c.comparators]):
                    found.append(a.lineno)
    return found


def _in_the_tests(lines_of) -> list[tuple[str, int]]:
    """(file, line) of what `lines_of(tree)` finds in each module under tests/."""
    tests = PKG.parents[1] / "tests"
    return [(p.name, line) for p in sorted(tests.glob("*.py"))
            for line in lines_of(ast.parse(p.read_text(encoding="utf-8")))]


def test_no_wall_clock_asserts_in_the_tests():
    """Tests assert behaviour (bytes read, calls made, what was refused), never how long
    something took: on a loaded machine a wall-clock bound fails a correct program (issue 29).
    Timing belongs to the benchmarks."""
    found = _in_the_tests(_wall_clock_asserts)
    assert found == [], found


def test_the_wall_clock_check_sees_one():
    tree = ast.parse("import time\nt0 = time.perf_counter()\nf()\n"
                     "assert time.perf_counter() - t0 < 0.5\n"
                     "took = time.monotonic() - t0\nassert took < 3\n"
                     "deadline = time.monotonic() + 9\nassert time.monotonic() < deadline\n"
                     "left = deadline - time.monotonic()\nassert left > 0\n"
                     "def finish():\n    t = time.monotonic()\n    return 1, time.monotonic() - t\n"
                     "out, took = finish()\nassert took < 5\nassert out == 1\n"
                     "def elapsed():\n    return time.perf_counter() - t0\n"
                     "spent = elapsed()\nassert spent <= 2\n")
    assert _wall_clock_asserts(tree) == [4, 6, 15, 20]


def _or_over_and(tree) -> list[int]:
    """Lines of asserts with an `or` over an `and` (`assert A and B or C`): it reads as
    "A, B, or else C" and passes on C alone."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert) and any(
        isinstance(b, ast.BoolOp) and isinstance(b.op, ast.Or)
        and any(isinstance(v, ast.BoolOp) and isinstance(v.op, ast.And) for v in b.values)
        for b in ast.walk(n.test))]


def test_no_assert_passes_on_its_last_operand():
    """One in test_rpc.py did, checking nothing of A and B (issue 29): an assert has no `or`
    over an `and`; each case says the one thing it expects."""
    found = _in_the_tests(_or_over_and)
    assert found == [], found


def test_the_or_over_and_check_sees_one():
    tree = ast.parse("assert a and b or c\nassert (a or b) and c\nassert a or b\n"
                     "assert x == 1 and (y or (z and w))\nassert a and b\n")
    assert _or_over_and(tree) == [1, 4]


# what makes an HTTP route in Starlette, besides a row of serve/routes.py's table
_ROUTE_MAKERS = {"Route", "Mount", "Host", "WebSocketRoute", "Router", "add_route",
                 "add_websocket_route", "route", "websocket_route"}


def _served(app) -> set[tuple[str, str, object]]:
    """An app's routes as (path, method, the handler its endpoint wraps, or the endpoint)."""
    return {(r.path, m, getattr(r.endpoint, "__wrapped__", r.endpoint))
            for r in app.routes for m in r.methods - {"HEAD"}}


def test_every_route_of_serve_is_in_the_table():
    """`tandem serve` answers exactly serve/routes.py's ROUTES, each (path, method) once and
    each a named module-level handler of an API's handler module (openai_routes.py,
    llama_routes.py, anthropic_routes.py, responses_routes.py; webui.py the page) (issue 41:
    one table a reader scans, not routes among closures); no other module makes a route."""
    import importlib
    import inspect
    from types import SimpleNamespace

    from tandem.serve import routes
    from tandem.serve.scheduler import Defaults
    from tandem.serve.prompt import PromptBudget

    pair = SimpleNamespace(tokenizes_aside=True, fim_tokens=None, props=lambda: {"n_vocab": 9})
    app = routes.build_app(SimpleNamespace(pair=pair), routes.ServeConfig(
        model_id="m", defaults=Defaults(), budget=PromptBudget(64)))
    table = {(e.path, e.method, e.handler) for e in routes.ROUTES}
    assert len(table) == len({(e.path, e.method) for e in routes.ROUTES}) == len(routes.ROUTES)
    assert _served(app) == table
    for handler in {e.handler for e in routes.ROUTES}:
        module = importlib.import_module(handler.__module__)
        assert inspect.iscoroutinefunction(handler), handler
        assert handler.__qualname__ == handler.__name__, handler  # not nested, not a lambda
        assert getattr(module, handler.__name__) is handler, handler
        assert module.__name__ in ("tandem.serve.openai_routes", "tandem.serve.llama_routes",
                                   "tandem.serve.anthropic_routes",
                                   "tandem.serve.responses_routes", "tandem.serve.webui")
    makers = {m for m, tree in _trees() for n in ast.walk(tree)
              if (getattr(n, "id", None) or getattr(n, "attr", None)) in _ROUTE_MAKERS}
    assert makers == {"tandem.serve.routes"}, makers
    app.add_route("/slots", lambda request: None, methods=["GET"])  # the check sees one
    assert _served(app) != table


def test_both_decoding_surfaces_have_every_member():
    """generate() and the drafters take a DecodingSurface (engine/backend/surface.py): the whole
    Context and a slot's SeqContext each have every member, as a method, property or a field
    their __init__ sets (issue 52: two surfaces that nothing tied had drifted apart)."""
    import inspect

    from tandem.engine.backend.llama import Context
    from tandem.engine.backend.sequences import SeqContext
    from tandem.engine.backend.surface import SURFACE, DecodingSurface

    declared = {n for n in vars(DecodingSurface) if not n.startswith("_")} | set(
        DecodingSurface.__annotations__)
    assert declared == set(SURFACE)
    for cls in (Context, SeqContext):
        source = inspect.getsource(cls)
        missing = [n for n in SURFACE if not hasattr(cls, n)
                   and not re.search(rf"self\.{n}\b[^=\n]*=[^=]", source)]
        assert missing == [], (cls.__name__, missing)


# serve/ and engine/ start threads in these modules only, each once (never one per slot or
# per request): the engine loop, the tokenizer and utility pools, a grammar's compilation
_THREAD_STARTERS = {"tandem.serve.scheduler": 1, "tandem.serve.server_state": 2,
                    "tandem.engine.constrain.grammar": 1}


def _thread_starts(tree) -> int:
    """Calls that make a thread or a pool of them, and how many sit in a loop (a thread per
    slot, per request) counted apart as 100 each."""
    makers = ("Thread", "ThreadPoolExecutor")
    loops = {id(n) for block in ast.walk(tree)
             if isinstance(block, (ast.For, ast.While, ast.ListComp, ast.GeneratorExp))
             for n in ast.walk(block)}
    return sum(100 if id(n) in loops else 1 for n in ast.walk(tree) if isinstance(n, ast.Call)
               and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in makers)


def test_one_engine_thread_and_the_named_helpers_only():
    """Issue 52: one loop thread owns the contexts and every generation; HTTP's threads and
    the bounded helpers above are the only others, each named in docs/architecture.md's
    table of what generations share."""
    found = {m: n for m, tree in _trees() if m.startswith(("tandem.serve", "tandem.engine"))
             for n in [_thread_starts(tree)] if n}
    assert found == _THREAD_STARTERS
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name in ("tandem-engine", "tandem-tokenizer", "tandem-utility", "tandem-grammar"):
        assert f"`{name}`" in page, name
    per_slot = ast.parse("for s in slots:\n    threading.Thread(target=run).start()\n")
    assert _thread_starts(per_slot) == 100  # the check sees a thread per slot
