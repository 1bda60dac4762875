"""The structured workload (data/structured.yaml, issue 30) and the check of outputs.

Each task carries its own constraint: a JSON schema (extraction from a text the prompt
gives, or generation to the schema), or tools with a tool_choice (a call in the
`<tool_call>` format, engine/constrain/tools.py). spec-bench runs each task under its own
constraint and checks every output with jsonschema, apart from the grammar that produced
it: a grammar bug or a cut answer shows up as an invalid output, not as a fast one.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from tandem.bench.workloads import Prompt
from tandem.engine.constrain.tools import Tool
from tandem.errors import UsageError

STRUCTURED = Path(__file__).resolve().parents[1] / "data" / "structured.yaml"
KINDS = ("extraction", "generation", "tools")
WORKLOADS = ("spec-bench", "structured")  # spec-bench --workload: the built-in suites


@dataclass(frozen=True)
class Structure:
    """What a task's output must follow: a schema, or tools and the tool_choice."""

    schema: dict | None = field(default=None, compare=False)
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "required"

    def constraint(self):
        from tandem.engine.constrain.grammar import Constraint
        from tandem.engine.constrain.tools import call_grammar

        if self.tools:
            # one call: the tool tasks each ask for one action
            return call_grammar(self.tools, self.tool_choice, parallel=False)
        return Constraint("json_schema", json.dumps(self.schema), "the task's schema")

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (None: a schema task)."""
        return [t.as_openai() for t in self.tools] or None


def _fail(where: str, problem: str) -> UsageError:
    return UsageError(f"{where}: {problem}", f"fix the task in {STRUCTURED}")


def load(path: Path = STRUCTURED) -> list[Prompt]:
    """The workload's tasks as Prompts (category: the task's kind), each with its Structure."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    out, seen = [], set()
    for i, task in enumerate(data.get("tasks") or []):
        where = f"{path.name} task {i + 1} ({task.get('id', '?')})"
        tid, kind, text = task.get("id"), task.get("kind"), task.get("prompt")
        if not isinstance(tid, str) or not tid or tid in seen:
            raise _fail(where, "every task needs its own id")
        seen.add(tid)
        if kind not in KINDS:
            raise _fail(where, f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(text, str) or not text.strip():
            raise _fail(where, "no prompt")
        if kind == "tools":
            tools = tuple(_tool(t, where) for t in task.get("tools") or ())
            choice = task.get("tool_choice", "required")
            if not tools or (choice != "required" and choice not in {t.name for t in tools}):
                raise _fail(where, "a tool task needs tools and a tool_choice of required or "
                            "one of its tools' names")
            structure = Structure(tools=tools, tool_choice=choice)
        else:
            schema = task.get("schema")
            if not isinstance(schema, dict):
                raise _fail(where, "an extraction or generation task needs a schema")
            structure = Structure(schema=schema)
        out.append(Prompt(tid, kind, text.strip(), structure=structure))
    return out


def _tool(spec: Any, where: str) -> Tool:
    fn = spec.get("function") if isinstance(spec, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _fail(where, "a tool is {type: function, function: {name, parameters}}")
    return Tool(fn["name"], fn.get("description"), fn.get("parameters") or {"type": "object"})


def _jsonschema():
    try:
        import jsonschema
    except ImportError:
        raise UsageError("checking structured outputs needs the jsonschema package",
                         "pip install 'jsonschema>=4.20' into tandem's environment") from None
    return jsonschema


def need_checker() -> None:
    """Refused before the benchmark, not after it: the outputs are checked with jsonschema."""
    _jsonschema()


def _schema_problem(value: Any, schema: dict) -> str:
    js = _jsonschema()
    error = js.exceptions.best_match(js.Draft202012Validator(schema).iter_errors(value))
    if error is None:
        return ""
    path = "/".join(str(p) for p in error.absolute_path)
    return f"{'at ' + path + ': ' if path else ''}{error.message}"[:200]


def check(structure: Structure | None, constraint, text: str, complete: bool | None,
          reason: str = "") -> tuple[bool | None, str]:
    """(valid, why not) for an output: against the task's own structure, else against a
    constraint given for the whole benchmark (a JSON schema is checked with jsonschema; a
    GBNF grammar has no checker apart from the grammar, so only its completeness counts).
    (None, "") when nothing constrained the output."""
    if structure is None and constraint is None:
        return None, ""
    if complete is False:
        cut = {"length": "by the token limit (-n)", "context": "by the context end",
               "stop": "by a stop string"}.get(reason, f"({reason})" if reason else "")
        return False, f"cut {cut} before the grammar was complete".replace("  ", " ")
    if structure is not None and structure.tools:
        return _check_calls(structure, text)
    if structure is not None:
        schema = structure.schema
    elif constraint.kind == "json_schema":
        schema = json.loads(constraint.text)
    else:
        return bool(complete), "" if complete else "the grammar was not completed"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return False, f"not JSON: {exc}"[:200]
    problem = _schema_problem(value, schema) if not isinstance(schema, bool) else (
        "" if schema else "the schema is false")
    return not problem, problem


def _check_calls(structure: Structure, text: str) -> tuple[bool, str]:
    from tandem.engine.constrain.tools import read_calls

    by_name = {t.name: t for t in structure.tools}
    ids = (f"call_{i}" for i in itertools.count())
    content, calls, complete = read_calls(text, list(by_name), ids)
    if not complete:
        return False, "a tool call was left open"
    if not calls:
        return False, "no tool call"
    if content:
        return False, "text around the tool call"
    for call in calls:
        if structure.tool_choice not in ("required", call.name):
            return False, f"called {call.name}, not {structure.tool_choice}"
        problem = _schema_problem(call.arguments, by_name[call.name].parameters)
        if problem:
            return False, f"{call.name}: {problem}"
    return True, ""


def check_message(structure: Structure, message: dict,
                  finish_reason: str | None) -> tuple[bool, str]:
    """(valid, why not) for an OpenAI chat answer (`choices[0].message`), as llama-server
    and `tandem serve` return it: a schema task's `content` against the schema, a tool
    task's `tool_calls` (one or more; the arguments a JSON string) against their tools."""
    if finish_reason == "length":
        return False, "cut by max_tokens"
    if not structure.tools:
        return check(structure, None, message.get("content") or "", True)
    calls = message.get("tool_calls") or []
    if not calls:
        return False, "no tool call"
    by_name = {t.name: t for t in structure.tools}
    for call in calls:
        fn = call.get("function") or {}
        name = fn.get("name")
        if name not in by_name or structure.tool_choice not in ("required", name):
            return False, f"called {name!r}"
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError as exc:
            return False, f"{name}: arguments not JSON: {exc}"[:200]
        problem = _schema_problem(args, by_name[name].parameters)
        if problem:
            return False, f"{name}: {problem}"
    return True, ""


def compile_all(prompts: Sequence[Prompt]) -> None:
    """Every task's grammar compiled before any model loads (GrammarError names the task)."""
    from tandem.engine.constrain.grammar import GrammarError

    for p in prompts:
        if p.structure is None:
            continue
        try:
            p.structure.constraint().compiled()
        except GrammarError as exc:
            raise GrammarError(f"task {p.id}: {exc.message}", exc.hint) from None
