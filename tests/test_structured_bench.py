"""Structured outputs in `tandem chat` and `tandem spec-bench` (issue 30): the flags reach
generate() (the outputs parse and validate), bad input ends in Error:/Hint: and exit 2, and
the structured workload (data/structured.yaml) is well formed: every schema valid JSON Schema
and compiled by llguidance, its outputs checked per configuration."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inprocess import run_main
from tandem.errors import EXIT_OK, EXIT_USAGE

jsonschema = pytest.importorskip("jsonschema")
ROOT = Path(__file__).resolve().parents[1]

# bounded, so that the tiny models' random text completes it within a few tokens
SMALL = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "size", "n"], "additionalProperties": False}


# ----------------------------------------------------------------------- the workload

def test_the_structured_workload_is_well_formed():
    from tandem.bench import structured_workload as structured
    from tandem.engine.constrain.grammar import Constraint

    tasks = structured.load()
    assert len(tasks) >= 24
    assert {t.category for t in tasks} == set(structured.KINDS)
    assert len({t.id for t in tasks}) == len(tasks)
    for t in tasks:
        s = t.structure
        assert t.text.strip()
        schemas = [s.schema] if s.schema is not None else [x.parameters for x in s.tools]
        assert schemas and all(isinstance(x, dict) for x in schemas), t.id
        for schema in schemas:
            jsonschema.Draft202012Validator.check_schema(schema)
            Constraint("json_schema", json.dumps(schema)).compiled()
        s.constraint().compiled()  # the task's own grammar (a tool task's call grammar)
        if t.category == "tools":
            assert s.tool_choice == "required" or s.tool_choice in {x.name for x in s.tools}
    # varied shapes: nested objects, arrays, enums, optional fields, every scalar type
    text = json.dumps([t.structure.schema or [x.parameters for x in t.structure.tools]
                       for t in tasks])
    for word in ('"enum"', '"array"', '"integer"', '"number"', '"boolean"', '"pattern"'):
        assert word in text, word
    assert any(set(t.structure.schema["properties"]) - set(t.structure.schema["required"])
               for t in tasks if t.structure.schema)  # optional fields
    extraction = [t for t in tasks if t.category == "extraction"]
    assert all("\n" in t.text for t in extraction)  # the text to extract from is in the prompt


def test_outputs_are_checked_against_the_schema_and_the_tools():
    from tandem.bench.structured_workload import Structure, check
    from tandem.engine.constrain.grammar import Constraint
    from tandem.engine.constrain.tools import Tool

    s = Structure(schema=SMALL)
    assert check(s, None, '{"ok": true, "size": "m", "n": 3}', True) == (True, "")
    valid, why = check(s, None, '{"ok": true, "size": "xl", "n": 3}', True)
    assert valid is False and "size" in why
    assert check(s, None, '{"ok": tr', False, "length")[0] is False
    assert "token limit" in check(s, None, '{"ok": tr', False, "length")[1]
    assert check(None, None, "free text", None) == (None, "")
    # a constraint for the whole benchmark: a schema is checked, a GBNF grammar is complete
    assert check(None, Constraint("json_schema", json.dumps(SMALL)), '{"ok": 1}', True)[0] is False
    assert check(None, Constraint("gbnf", 'root ::= "a"'), "a", True) == (True, "")
    tool = Tool("get_weather", None, {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]})
    t = Structure(tools=(tool,), tool_choice="get_weather")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert check(t, None, call, True) == (True, "")
    assert check(t, None, call.replace('"city"', '"town"'), True)[0] is False
    assert check(t, None, "It is sunny.", True) == (False, "no tool call")
    assert check(t, None, call[:-5], True)[0] is False


# ----------------------------------------------------------------------- spec-bench


def _env(home) -> dict:
    env = {**os.environ, "TANDEM_HOME": str(home), "NO_COLOR": "1", "COLUMNS": "300"}
    env.pop("FORCE_COLOR", None)
    return env


def _bench(tiny_models, home, *args):
    cmd = [sys.executable, "-m", "tandem", "spec-bench", "-m", str(tiny_models["target"]),
           "-md", str(tiny_models["draft"]), "-t", "1", "--no-cost-curve", "--json", *args]
    return subprocess.run(cmd, capture_output=True, env=_env(home), timeout=120)


def test_spec_bench_runs_every_configuration_under_the_schema(tiny_models, tmp_path):
    res = _bench(tiny_models, tmp_path / "home", "--category", "json", "--per-category", "2",
                 "--strategies", "ngram,draft", "-n", "48", "-j", json.dumps(SMALL))
    assert res.returncode == EXIT_OK, res.stderr.decode()
    report = json.loads(res.stdout)
    assert report["meta"]["constraint"] == "--json-schema"
    assert {r["config"] for r in report["runs"]} == {"plain", "ngram", "draft"}
    for r in report["runs"]:
        jsonschema.validate(json.loads(r["text"]), SMALL)
        assert r["valid"] is True, r
    # every configuration checked all its outputs, and the keys came as free drafts
    overall = [c for c in report["cells"] if c["category"] == "overall"]
    assert all(c["valid"] == c["checked"] == 2 for c in overall)
    assert all(r["drafted"] > 0 for r in report["runs"] if r["config"] != "plain")


def test_spec_bench_structured_workload_checks_each_task_under_its_own_constraint(
        tiny_models, tmp_path):
    out = tmp_path / "out"
    res = _bench(tiny_models, tmp_path / "home", "--workload", "structured", "--per-category",
                 "1", "--strategies", "ngram", "-n", "32", "--out", str(out))
    assert res.returncode == EXIT_OK, res.stderr.decode()
    report = json.loads(res.stdout)
    assert set(report["categories"]) == {"extraction", "generation", "tools"}
    runs = report["runs"]
    assert len(runs) == 6 and all(r["valid"] is not None for r in runs)
    for r in runs:
        # the tiny models' values run long: a cut output is invalid and says why; a complete
        # one validates (the tool task's text is a call block)
        if r["reason"] == "length":
            assert r["valid"] is False and "token limit" in r["invalid"]
        else:
            assert r["valid"] is True, r
    tool_run = next(r for r in runs if r["category"] == "tools")
    assert tool_run["text"].startswith("<tool_call>\n{\"name\": \"")
    overall = {c["config"]: c for c in report["cells"] if c["category"] == "overall"}
    assert overall["ngram"]["checked"] == 3
    md = (out / "report.md").read_text()
    assert "valid " in md and "each task's own schema or tools" in md


BAD_BENCH = [
    (["-j", '{"type": "strin"}'], "Invalid type: strin"),
    (["--grammar", "root ::= foo"], "Rule 'foo' not found"),
    (["-j", "{}", "--json-object"], "cannot be used together"),
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--workload", "structured", "-j", "{}"], "its own schema or tools"),
    (["--workload", "structured", "--prompts", "x.jsonl"], "cannot be used together"),
    (["--workload", "structured", "--multi-turn"], "single prompts, not conversations"),
]


@pytest.mark.parametrize("flags,message", BAD_BENCH)
def test_spec_bench_bad_structured_input_is_a_clean_usage_error(flags, message, tmp_path,
                                                                 tiny_models):
    res = run_main(["spec-bench", "-m", str(tiny_models["target"]), "-t", "1", *flags],
                   home=tmp_path / "home")
    err = res.stderr.decode()
    assert res.returncode == EXIT_USAGE, err
    assert "Traceback" not in err and message in err
    assert "Error: " in err and "Hint: " in err


# ----------------------------------------------------------------------- chat


def _chat(tiny_models, home, script: str, *args):
    cmd = [sys.executable, "-m", "tandem", "chat", "-m", str(tiny_models["target"]),
           "-md", str(tiny_models["draft"]), "-t", "1", "--no-history", *args]
    return subprocess.run(cmd, input=script, capture_output=True, text=True, env=_env(home),
                          timeout=60)


def test_chat_constrains_every_answer(tiny_models, tmp_path):
    res = _chat(tiny_models, tmp_path / "home", "hello\nand again\n", "-n", "48",
                "--plain-probe", "0", "-j", json.dumps(SMALL))
    assert res.returncode == 0, res.stderr
    answers = [line.removeprefix(">>> ") for line in res.stdout.splitlines()
               if line.startswith(">>> {")]
    assert len(answers) == 2, res.stdout
    for a in answers:
        jsonschema.validate(json.loads(a), SMALL)
    assert "every answer follows --json-schema" in res.stdout


def test_chat_says_when_an_answer_is_cut_before_the_grammar_is_complete(tiny_models, tmp_path):
    res = _chat(tiny_models, tmp_path / "home", "hello\n", "-n", "3", "--plain-probe", "0",
                "--json-object")
    assert res.returncode == 0, res.stderr
    assert "before the grammar was" in res.stdout and "/max-tokens" in res.stdout


@pytest.mark.parametrize("flags,message", [
    (["-j", '{"type": "object",'], "is not valid JSON"),
    (["--grammar", 'root = "a"'], "invalid GBNF grammar"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "grammar file not found"),
    (["--json-object", "-j", "{}"], "cannot be used together"),
])
def test_chat_bad_structured_input_is_a_clean_usage_error(flags, message, tmp_path,
                                                          tiny_models):
    res = run_main(["chat", "-m", str(tiny_models["target"]), "-t", "1", *flags],
                   home=tmp_path / "home")
    err = res.stderr.decode()
    assert res.returncode == EXIT_USAGE, err
    assert "Traceback" not in err and message in err
    assert "Error: " in err and "Hint: " in err


# ----------------------------------------------------------------------- bench_structured.py


def test_api_answers_are_checked_as_both_servers_return_them():
    from tandem.bench.structured_workload import Structure, check_message
    from tandem.engine.constrain.tools import Tool

    s = Structure(schema=SMALL)
    assert check_message(s, {"content": '{"ok": true, "size": "s", "n": 1}'}, "stop") == (True, "")
    assert check_message(s, {"content": '{"ok": true'}, "length") == (False, "cut by max_tokens")
    tool = Tool("f", None, {"type": "object", "properties": {"x": {"type": "integer"}},
                            "required": ["x"]})
    t = Structure(tools=(tool,), tool_choice="f")
    call = {"function": {"name": "f", "arguments": '{"x": 3}'}}
    assert check_message(t, {"content": None, "tool_calls": [call]}, "tool_calls") == (True, "")
    bad = {"function": {"name": "f", "arguments": '{"x": "3"}'}}
    assert check_message(t, {"tool_calls": [bad]}, "tool_calls")[0] is False
    assert check_message(t, {"content": "{}"}, "stop") == (False, "no tool call")


def test_bench_structured_sends_one_body_to_both_sides_and_reports_validity():
    import bench_structured as bs

    tasks = bs.pick_tasks(None, 6)
    assert [t.category for t in tasks[:3]] == ["extraction", "generation", "tools"]
    schema_body = bs.request_body(tasks[0], 64, 1)
    assert schema_body["response_format"]["json_schema"]["schema"] == tasks[0].structure.schema
    named = next(t for t in bs.pick_tasks(["tools"], None) if t.structure.tool_choice != "required")
    body = bs.request_body(named, 64, 1)
    # llama-server takes only auto/none/required: a named tool is the only tool, required
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert [t["function"]["name"] for t in body["tools"]] == [named.structure.tool_choice]
    rows = [bs.Row("a", "extraction", "llama plain", True, e2e_s=2.0, tok_s=10, prompt_n=50),
            bs.Row("a", "extraction", "tandem default", True, e2e_s=1.0, tok_s=20, prompt_n=50),
            bs.Row("b", "tools", "llama plain", True, e2e_s=2.0, tok_s=10, prompt_n=40),
            bs.Row("b", "tools", "tandem default", False, "no tool call", e2e_s=1.0, tok_s=20,
                   prompt_n=41)]
    text = bs.report(rows, ["llama plain", "tandem default"])
    line = next(ln for ln in text.splitlines() if ln.startswith("| tandem default"))
    # e2e only where both evaluated as many prompt tokens (1 of 2 tasks); tok/s over both
    assert "| 1/2 |" in line and "2.00x | 2.00x | 1/2 |" in line
    assert "tandem default b: no tool call" in text


def test_bench_structured_help():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_structured.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--prompts N" in res.stdout and "--out" in res.stdout
