"""The grammar limits (config/schema.py GRAMMAR_LIMITS) and the JSON depth bound: each limit
refuses what passes it by name and lets what reaches it compile; a deep JSON text is
refused with its path, never a RecursionError; llguidance compiles on a thread whose stack
holds more than the bounds let through (checked in a subprocess: a crash would take pytest
down with it)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tandem import bounded_json
from tandem.config.schema import GRAMMAR_LIMITS
from tandem.engine.constrain import bounds
from tandem.engine.constrain.grammar import Constraint, GrammarError

pytest.importorskip("llguidance")

LIM = {k: v.value for k, v in GRAMMAR_LIMITS.items()}


def _chain(n: int) -> str:
    """A GBNF grammar of n rules, each naming the next."""
    return "".join(f"r{i} ::= r{i + 1}\n" for i in range(n - 1)).replace("r0", "root", 1) \
        + f'r{n - 1} ::= "z"\n' if n > 1 else 'root ::= "z"\n'


def _refs(n: int) -> dict:
    """A schema whose $ref chain is n links long."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def _nest(n: int) -> str:
    return "root ::= " + "(" * n + '"a"' + ")" * n


# (limit, a grammar at the limit, one past it)
CASES = [
    ("rules", ("gbnf", _chain(LIM["rules"])), ("gbnf", _chain(LIM["rules"] + 1))),
    ("alternatives", ("gbnf", "root ::= " + " | ".join(f'"a{i}"' for i in range(
        LIM["alternatives"] + 1))), ("gbnf", "root ::= " + " | ".join(
            f'"a{i}"' for i in range(LIM["alternatives"] + 2)))),
    ("repeat", ("gbnf", f'root ::= "a"{{1,{LIM["repeat"]}}}'),
     ("gbnf", f'root ::= "a"{{{LIM["repeat"] + 1}}}')),
    ("nesting", ("gbnf", _nest(LIM["nesting"])), ("gbnf", _nest(LIM["nesting"] + 1))),
    ("refs", ("json_schema", json.dumps(_refs(LIM["refs"] - 1))),
     ("json_schema", json.dumps(_refs(LIM["refs"])))),
    ("branches", ("json_schema", json.dumps({"enum": [[i] for i in range(LIM["branches"])]})),
     ("json_schema", json.dumps({"anyOf": [{"const": i} for i in range(
         LIM["branches"] + 1)]}))),
    ("text_bytes", ("gbnf", 'root ::= "' + "a" * (LIM["text_bytes"] - 20) + '"'),
     ("gbnf", 'root ::= "' + "\u00e9" * (LIM["text_bytes"] // 2) + '"')),
    ("json_depth", ("json_schema", "[" * LIM["json_depth"] + "]" * LIM["json_depth"]),
     ("json_schema", "[" * 10000 + "]" * 10000)),
]


@pytest.mark.parametrize("key,at,past", CASES, ids=[c[0] for c in CASES])
def test_each_limit_refuses_past_it_and_names_itself(key, at, past):
    with pytest.raises(GrammarError) as info:
        Constraint(*past, "grammar").compiled()
    assert info.value.limit == key
    assert len(info.value.message) < 200 and "limit" in info.value.message + info.value.hint
    if key == "json_depth":  # nested arrays are not a schema: the limit is what is checked
        with pytest.raises(GrammarError) as info:
            Constraint(*at).compiled()
        assert info.value.limit is None
    else:
        Constraint(*at).compiled()


def test_an_enum_of_strings_is_bounded_by_its_text_alone():
    # JSONSchemaBench holds an enum of 1,554 codes: one lexeme, not 1,554 parser items
    Constraint("json_schema", json.dumps({"enum": [f"{i:03}-x" for i in range(5000)]})).compiled()
    assert bounds.in_schema({"enum": [{"k": i} for i in range(LIM["branches"] + 1)]})


def test_gbnf_counts_skip_strings_classes_and_comments():
    text = 'root ::= "a|b(c" [|(){}] # | ( ::= {9999}\n'
    assert bounds.in_gbnf(text) is None
    assert bounds.in_gbnf('root ::= "a"{' + "9" * 5000 + "}").limit.key == "repeat"


def test_deep_json_is_refused_with_its_path_not_a_recursion_error():
    text = '{"a": [1, {"b": ' + "[" * 5000 + "]" * 5000 + "}]}"
    with pytest.raises(bounded_json.TooDeep) as info:
        bounded_json.loads(text)
    assert info.value.path.startswith("a[1].b[0][0]")
    # under Python's recursion limit, the walk finds it
    with pytest.raises(bounded_json.TooDeep) as info:
        bounded_json.loads(json.dumps({"x": [[[[1]]]]}), limit=3)
    assert info.value.path == "x[0][0]"
    assert bounded_json.loads(json.dumps({"x": [[1]]}), limit=3) == {"x": [[1]]}


def test_a_compile_past_the_default_stack_runs_on_the_native_stack():
    # 5,000 chained rules overflowed the 8 MiB stack of a thread and killed the process;
    # on tandem's compile thread it compiles (the bounds keep requests to 1,000)
    code = (
        "import llguidance as llg\n"
        "from tandem.engine.constrain.grammar import on_native_stack\n"
        f"text = {_chain(5000)!r}\n"
        "def go():\n"
        "    g = llg.grammar_from('gbnf', text)\n"
        "    return llg.LLMatcher.validate_grammar_with_warnings(g)[0]\n"
        "print('error' if on_native_stack(go) else 'compiled')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "compiled"


def test_llguidance_errors_are_one_short_line():
    with pytest.raises(GrammarError) as info:
        Constraint("json_schema", json.dumps({"$ref": "#/$defs/missing"})).compiled()
    assert "\n" not in info.value.message and len(info.value.message) < 300


def test_the_docs_table_states_each_limit_as_the_schema_does():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "structured.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] \
            if line.startswith("| `") else []  # a cell's "\|" is text, not a border
        if len(cells) == 3 and cells[0].strip("`") in GRAMMAR_LIMITS:
            rows[cells[0].strip("`")] = int(cells[2].replace(",", ""))
    assert rows == LIM
