"""The package's shape: no import circles, each vocabulary defined once, settings resolved once
per command, and the dependency rules (llama_cpp, typer and rich each imported where they
belong)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "cli" / "tandem"


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
    assert _importers("llama_cpp") == {"tandem.engine.llama"}
    # native calls: llama.cpp through the binding (llama), ggml's registry for RPC devices
    # and the RPC server, which the binding does not cover (ggml)
    assert _importers("ctypes") == {"tandem.engine.llama", "tandem.engine.ggml"}
    ui = _importers("typer") | _importers("rich")
    assert all(m.startswith("tandem.commands.") or m == "tandem.chat.tui" for m in ui), ui
    # the HTTP stack only where `tandem serve` runs it (tandem run never loads it)
    assert _importers("starlette") | _importers("uvicorn") == {"tandem.serve.app"}


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
    from tandem.config import prepare, settings

    calls = []
    real = settings.resolve_settings

    def counting(*args, **kwargs):
        calls.append(kwargs.get("models"))
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
    ("tandem.errors", "tandem.fsutil", "tandem.config.schema", "tandem.config.files"),
    ("tandem.models",),
    ("tandem.engine",),
    ("tandem.machine",),
    ("tandem.config",),
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
