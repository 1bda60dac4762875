"""scripts/bench_host_work.py (issue 52): its options, the report's arithmetic (ratios and
"beyond" taken per repetition, then the median), and one round on the tiny target with tandem
serve only (no llama-server)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_options_and_their_defaults():
    from bench_host_work import build_parser

    ns = build_parser().parse_args([])
    assert (ns.reps, ns.n_predict, ns.slots, ns.threads, ns.ctx) == (3, 128, 4, 2, 4096)
    assert ns.model is None and not ns.no_llama and not ns.no_run
    ns = build_parser().parse_args(["-m", "a.gguf", "-m", "b.gguf", "--reps", "1", "-n", "16",
                                    "--no-llama", "--no-run", "--slots", "2"])
    assert ns.model == [Path("a.gguf"), Path("b.gguf")]
    assert (ns.reps, ns.n_predict, ns.slots, ns.no_llama, ns.no_run) == (1, 16, 2, True, True)


def test_refuses_no_repetitions():
    from bench_host_work import main

    with pytest.raises(SystemExit, match="--reps"):
        main(["--reps", "0", "-m", "x.gguf", "--no-llama"])


def test_summary_pairs_each_repetition_with_its_own():
    from bench_host_work import ALONE, LLAMA, TANDEM, Row, summary

    rows = [Row("m", LLAMA, ALONE, 0, tok_s=100.0, ms=10.0, client_ms=11.0),
            Row("m", TANDEM, ALONE, 0, tok_s=80.0, ms=12.5, client_ms=14.0),
            Row("m", LLAMA, ALONE, 1, tok_s=50.0, ms=20.0, client_ms=21.0),
            Row("m", TANDEM, ALONE, 1, tok_s=50.0, ms=20.0, client_ms=22.0),
            Row("m", LLAMA, ALONE, 2, tok_s=100.0, ms=10.0, client_ms=10.0),
            Row("m", TANDEM, ALONE, 2, tok_s=90.0, ms=11.0, client_ms=12.0),
            Row("m", TANDEM, ALONE, 3, error="failed"),  # left out
            Row("other", TANDEM, ALONE, 0, tok_s=1.0, ms=1.0)]  # another model
    s = summary(rows, "m", ALONE)
    assert s["reps"] == 3
    assert s[LLAMA]["tok_s"] == 100.0 and s[TANDEM]["tok_s"] == 80.0
    assert s["ratio"] == pytest.approx(0.9)  # median of 0.8, 1.0, 0.9
    assert s["beyond_ms"] == pytest.approx(1.0)  # median of 2.5, 0.0, 1.0
    assert s["beyond_client_ms"] == pytest.approx(2.0)  # median of 3, 1, 2


def test_tandem_run_summary_is_per_prompt():
    from bench_host_work import run_summary
    from tandem.bench.peer_report import Row as PeerRow

    rows = []
    for pid, server, tandem in (("p1", 100.0, 95.0), ("p2", 50.0, 55.0), ("p3", 80.0, 80.0)):
        for kind, tok_s in (("server", server), ("tandem", tandem)):
            r = PeerRow(pid, "code", kind, kind)
            r.tok_s, r.extra = tok_s, {"model": "m"}
            rows.append(r)
    s = run_summary(rows, "m")
    assert s["prompts"] == 3 and s["ratio"] == pytest.approx(1.0)
    assert s["range"] == (pytest.approx(0.95), pytest.approx(1.1))
    assert run_summary(rows, "another") is None


def test_one_round_on_the_tiny_target_without_llama_server(tiny_models, tmp_path):
    out = tmp_path / "host.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_host_work.py"), "-m",
         str(tiny_models["target"]), "--no-llama", "--no-quiet-check", "--reps", "1", "-n", "8",
         "-t", "1", "-c", "1024", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    rows = {r["scenario"]: r for r in data["rows"]}
    assert set(rows) == {"alone", "four"}
    assert all(r["server"] == "tandem" and r["error"] is None for r in rows.values())
    alone, four = rows["alone"], rows["four"]
    assert len(alone["requests"]) == 1 and len(four["requests"]) == 4
    assert alone["tokens"] == alone["requests"][0]["predicted_n"] > 0
    assert alone["ms"] > 0 and alone["tok_s"] > 0
    assert four["tokens"] == sum(q["predicted_n"] for q in four["requests"])
    assert four["tok_s"] == pytest.approx(four["tokens"] / four["wall_s"])
    assert all(q["chunks"] > 0 for q in four["requests"])
    assert data["meta"]["slots"] == 4 and data["meta"]["ctx_per_slot"] == 1024
    assert "--parallel" in data["meta"]["tandem"] and "none" in data["meta"]["tandem"]
    assert f"| {tiny_models['target'].name} (" in res.stdout
    assert "one alone (ms a token) | 1 | - |" in res.stdout
