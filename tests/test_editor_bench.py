"""The editors' benchmark: its workloads from the shipped code files (holes cut where they
should be, typed lines that add up to the file) and scripts/bench_editors.py on the tiny FIM
pair (tandem serve only; the figures against llama-server are docs/benchmarks.md's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tandem.bench.editor_workload import (RING_SIZE, agrees, code_files, fim_cases,
                                          typing_session)

ROOT = Path(__file__).resolve().parents[1]


def test_fim_holes_are_one_to_five_lines_of_a_function_body():
    files = code_files()
    assert {"textwrap.py", "shlex.py", "csv.py"} <= set(files)
    cases = fim_cases()
    assert len(cases) >= 20 and cases == fim_cases()  # deterministic
    for c in cases:
        name = c.id.split(":")[0]
        b = c.body
        assert b["input_prefix"] + c.extra["hole"] + b["input_suffix"] == files[name]
        assert 1 <= c.extra["lines"] <= 5
        assert c.extra["hole"].startswith((" ", "\t"))  # inside a body: indented
        assert c.expected == c.extra["hole"].splitlines()[0]
        assert all(chunk["filename"] != name for chunk in b["input_extra"])


def test_typing_session_types_a_function_as_llama_vim_asks():
    reqs = typing_session()
    typed = [r for r in reqs if r.kind == "typing"]
    warm = [r for r in reqs if r.kind == "warmup"]
    assert len(typed) >= 40 and warm
    lines = code_files()["textwrap.py"].splitlines()
    for r in typed:
        line = lines[r.extra["line"] - 1]
        assert r.body["prompt"] + r.expected == line  # the cursor splits the true line
        assert r.body["input_suffix"].startswith(r.expected)
        assert r.body["n_indent"] == len(line) - len(line.lstrip())
        assert len(r.body["input_extra"]) <= RING_SIZE
    assert all(w.body["n_predict"] == 0 and w.body["input_extra"] for w in warm)
    assert any(r.repeats for r in typed)  # some lines copy text already there


def test_first_line_agreement():
    assert agrees("x = 1\ny = 2", "x = 1")
    assert agrees("x = 1  \n", "x = 1")
    assert not agrees("x = 2", "x = 1")


def test_bench_editors_smoke(tiny_models, tmp_path):
    out = tmp_path / "editors.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_editors.py"), "-m",
         str(tiny_models["fim"]), "-md", str(tiny_models["fim_draft"]), "--no-llama",
         "--limit", "3", "-t", "1", "-c", "2048", "--out", str(out),
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(r["error"] is None for r in rows)
    assert {r["kind"] for r in rows} == {"fim", "typing"}
    assert all(r["agrees"] is not None for r in rows)
    assert "| fim | tandem |" in res.stdout and "| typing | tandem |" in res.stdout
    # a recorded session replays the same requests
    rec = tmp_path / "session.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_editors.py"),
                          "--workload", "typing", "--limit", "5", "--record", str(rec)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    recorded = json.loads(rec.read_text())
    assert [r["body"] for r in recorded] == [c.body for c in typing_session()[:5]]
