"""bench_peer's harness (tandem.bench.llama_server, peer_runs, peer_report): ratio aggregation,
tables, output comparison, response parsing and the interleaved loop without a server; with
llama-server built (scripts/build_native.sh) a tiny-model smoke run of scripts/bench_peer.py."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tandem.bench import llama_server, peer_report, peer_runs
from tandem.bench.peer_report import Row
from tandem.bench.workloads import Prompt

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["plain", "draft", "tandem default"]


def row(pid: str, config: str, tok_s: float, text: str = "same", cat: str = "A",
        drafted: int = 0, accepted: int = 0, error: str | None = None) -> Row:
    kind = "tandem" if config.startswith("tandem") else "server"
    return Row(pid, cat, config, kind, tok_s=tok_s, text=text, drafted=drafted,
               accepted=accepted, error=error)


@pytest.fixture
def rows() -> list[Row]:
    """plain 10, 20, 40 tok/s; draft 20, 10, 80 (ratios 2, 0.5, 2); tandem 10, 30, 40
    (ratios 1, 1.5, 1), whose second output differs from plain's."""
    return [
        row("p1", "plain", 10), row("p2", "plain", 20), row("p3", "plain", 40),
        row("p1", "draft", 20, drafted=10, accepted=8), row("p2", "draft", 10, drafted=10,
                                                            accepted=2),
        row("p3", "draft", 80, text="  same\n"),
        row("p1", "tandem default", 10), row("p2", "tandem default", 30, text="other"),
        row("p3", "tandem default", 40),
    ]


def test_same_text_strips_whitespace_only():
    assert peer_report.same_text(" a b\n", "a b")
    assert not peer_report.same_text("a  b", "a b")
    assert not peer_report.same_text("A", "a")


def test_geomean():
    assert peer_report.geomean([2, 0.5]) == pytest.approx(1.0)
    assert peer_report.geomean([1, 2, 4]) == pytest.approx(2.0)
    assert math.isnan(peer_report.geomean([]))


def test_summarize_ratios_per_prompt(rows):
    s = peer_report.summarize(rows, CONFIGS)
    assert s["plain"].median == 1.0 and s["plain"].same == 3 and s["plain"].acceptance is None
    d = s["draft"]
    assert d.n == 3
    assert d.median == pytest.approx(2.0)  # median of per-prompt ratios, not a ratio of medians
    assert d.geomean == pytest.approx((2 * 0.5 * 2) ** (1 / 3))
    assert (d.lo, d.hi) == (0.5, 2.0)
    assert d.median_tok_s == 20
    assert d.acceptance == pytest.approx(10 / 20)
    assert (d.same, d.compared) == (3, 3)  # "  same\n" counts as the same text
    t = s["tandem default"]
    assert t.median == pytest.approx(1.0) and t.geomean == pytest.approx(1.5 ** (1 / 3))
    assert (t.same, t.compared) == (2, 3)


def test_summarize_skips_failed_runs(rows):
    rows[1].error = "HTTP 500"  # plain failed on p2: no ratio and no comparison for p2
    rows[-1].error = "tandem exited with code 1"
    s = peer_report.summarize(rows, CONFIGS)
    assert s["draft"].n == 2 and s["draft"].compared == 2
    assert s["tandem default"].n == 1 and s["tandem default"].compared == 1
    assert s["plain"].n == 2


def test_summarize_config_without_rows():
    s = peer_report.summarize([row("p1", "plain", 10)], ["plain", "ngram"])
    assert s["ngram"].n == 0 and math.isnan(s["ngram"].median)
    table = peer_report.render_table("A", s)
    assert "| ngram |  |  |  |  |  |  |  | 0/0 |" in table


def test_render_table(rows):
    table = peer_report.render_table("qa", peer_report.summarize(rows, CONFIGS))
    lines = table.splitlines()
    assert lines[0] == "### qa (3 prompts)"
    assert lines[2].startswith("| configuration | median ratio to plain | geomean |")
    # no timings in these rows: the end-to-end and per-step columns stay empty
    assert "| plain | 1.00 | 1.00 | 1.00-1.00 |  |  | 20.0 |  | 3/3 |" in lines
    assert "| draft | 2.00 | 1.26 | 0.50-2.00 |  |  | 20.0 | 50.0% | 3/3 |" in lines
    assert "| tandem default | 1.00 | 1.14 | 1.00-1.50 |  |  | 30.0 |  | 2/3 |" in lines


def test_report_per_category_and_overview(rows):
    more = [row("q1", "plain", 10, cat="B"), row("q1", "draft", 15, cat="B"),
            row("q1", "tandem default", 12, cat="B")]
    out = peer_report.report(rows + more, CONFIGS, ["A", "B"])
    assert "### A (3 prompts)" in out and "### B (1 prompt)" in out
    assert "| configuration | A | B |" in out
    assert "| draft | 2.00 | 1.50 |" in out
    assert "| tandem default | 1.00 | 1.20 |" in out
    # a single category gets no overview
    assert "per category" not in peer_report.report(rows, CONFIGS, ["A"])


def test_parse_named():
    assert peer_runs.parse_named("plain", llama_server.SERVER_CONFIGS) == ("plain", "")
    assert peer_runs.parse_named('none=--strategy none') == ("none", "--strategy none")
    assert peer_runs.parse_named("default=") == ("default", "")
    assert peer_runs.parse_named("x=-fa on -ctk q8_0", llama_server.SERVER_CONFIGS) == ("x", "-fa on -ctk q8_0")
    with pytest.raises(ValueError, match="unknown configuration"):
        peer_runs.parse_named("nope", llama_server.SERVER_CONFIGS)
    with pytest.raises(ValueError, match="no name"):
        peer_runs.parse_named("=--strategy none")


def test_parse_server_response():
    resp = {"choices": [{"message": {"role": "assistant", "content": "def f(): pass"},
                         "finish_reason": "length"}],
            "timings": {"prompt_n": 30, "prompt_ms": 400.0, "predicted_n": 128,
                        "predicted_ms": 8000.0, "predicted_per_second": 16.0,
                        "draft_n": 50, "draft_n_accepted": 40}}
    r = peer_runs.parse_server_response(Row("p", "c", "draft", "server"), resp)
    assert (r.text, r.tok_s, r.n_generated, r.drafted, r.accepted) == ("def f(): pass", 16.0,
                                                                      128, 50, 40)
    # 128 tokens, 40 of them accepted drafts: 88 steps in 8 s; 8.4 s end to end
    assert r.step_ms == pytest.approx(8000 / 88) and r.e2e_s == pytest.approx(8.4)
    assert r.ok and r.extra["finish_reason"] == "length"
    bad = peer_runs.parse_server_response(Row("p", "c", "plain", "server"), {"choices": []})
    assert not bad.ok and "predicted_ms" in bad.error


def test_parse_tandem_output():
    stats = {"tokens_per_second": 13.5, "n_generated": 128, "drafted": 20, "accepted": 15,
             "strategy": "auto", "notes": ["draft model off"], "n_prompt": 31,
             "t_decode": 128 / 13.5, "t_prefill": 0.5, "n_steps": 113}
    out = "Warning: ignored\n" + json.dumps({"text": "hi", "finish_reason": "length",
                                             "stats": stats}) + "\n"
    r = peer_runs.parse_tandem_output(Row("p", "c", "tandem default", "tandem"), out)
    assert (r.text, r.drafted, r.accepted) == ("hi", 20, 15)
    assert r.tok_s == pytest.approx(13.5) and r.e2e_s == pytest.approx(0.5 + 128 / 13.5)
    assert r.extra["notes"] == ["draft model off"]
    assert peer_runs.parse_tandem_output(Row("p", "c", "t", "tandem"), "nothing").error


def test_tandem_end_of_text_counts_as_llama_cpp_counts():
    """An answer that ends with end-of-text took one more step than it has tokens; llama-server
    counts that token, so the ratio does too (tandem's own figure is kept)."""
    stats = {"tokens_per_second": 10.0, "n_generated": 40, "t_decode": 4.0, "n_steps": 41}
    out = json.dumps({"text": "x", "finish_reason": "eos", "stats": stats})
    r = peer_runs.parse_tandem_output(Row("p", "c", "tandem default", "tandem"), out)
    assert r.tok_s == pytest.approx(41 / 4.0) and r.extra["tok_s_own"] == 10.0
    out = json.dumps({"text": "x", "finish_reason": "length", "stats": stats})
    assert peer_runs.parse_tandem_output(Row("p", "c", "t", "tandem"), out).tok_s == 10.0


def test_tandem_command_puts_prompt_after_double_dash():
    p = Prompt("x", "code", "-n is not an option here", system="be brief")
    cmd = peer_runs.tandem_command(["tandem"], p, 128, 2, 4096, 42,
                                   ["-m", "t.gguf", "-md", "d.gguf"], ["--strategy", "none"])
    assert cmd[:4] == ["tandem", "run", "--json", "-n"]
    assert cmd[-2:] == ["--", "-n is not an option here"]
    assert ["-s", "be brief"] == cmd[cmd.index("-s"):cmd.index("-s") + 2]
    assert "--strategy" in cmd and "--temp" in cmd
    by_name = peer_runs.tandem_command(["tandem"], p, 128, 2, 4096, 42, [], [],
                                       "qwen2.5-coder-1.5b")
    assert by_name[-3:] == ["--", "qwen2.5-coder-1.5b", "-n is not an option here"]


def test_coding_prompts_are_held_out():
    coding = peer_runs.CODING_PROMPTS
    assert len(coding) >= 8 and len(set(coding)) == len(coding)
    import bench_native
    from tandem.bench import workloads

    seen = {p.text.strip() for p in workloads.builtin()} | set(bench_native.PROMPTS)
    assert not seen & set(peer_runs.CODING_PROMPTS)


def test_load_prompts_spec_bench_first_turn_and_grouping(tmp_path):
    lines = [{"question_id": i, "category": c, "turns": [f"first {i}", "second"]}
             for i, c in enumerate(["writing", "coding", "qa", "qa", "rag"])]
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines))
    ps = peer_runs.load_prompts(f, 1, None, True, 2)
    assert [(p.category, p.text) for p in ps] == [
        ("mt-bench", "first 0"), ("qa", "first 2"), ("rag", "first 4"),
        ("code", peer_runs.CODING_PROMPTS[0]), ("code", peer_runs.CODING_PROMPTS[1])]
    assert [p.category for p in peer_runs.load_prompts(f, 1, ["qa"], True, 0)] == ["qa"]
    assert [p.id for p in peer_runs.load_prompts(None, 3, None, True, 3)] == [
        "code-1", "code-2", "code-3"]


def test_the_loop_interleaves_and_keeps_each_prompts_rows_in_order():
    """Every other prompt runs the configurations in reverse; a prompt's rows come back in the
    configurations' order, each with the load before it; errors and progress go to the log."""
    calls, said = [], []

    def run_config(name, p, n):
        calls.append((p.id, name))
        err = "boom" if (p.id, name) == ("b", "x") else None
        return Row(p.id, p.category, name, "server" if name == "x" else "tandem",
                   tok_s=0.0 if err else 10.0, error=err)

    prompts = [Prompt("a", "qa", "A"), Prompt("b", "qa", "B")]
    got = list(peer_runs.interleaved(prompts, ["x", "y"], run_config, 8, said.append))
    assert calls == [("a", "x"), ("a", "y"), ("b", "y"), ("b", "x")]
    assert [[r.config for r in done] for done in got] == [["x", "y"], ["x", "y"]]
    assert all("loadavg" in r.extra for done in got for r in done)
    assert "  x on b: boom" in said and any(s.startswith("[2/2] qa b: x ERROR") for s in said)


def test_the_warm_up_stops_only_for_tandem():
    said = []

    def failing(kind):
        return lambda name, p, n: Row(p.id, p.category, name, kind, error="no")

    peer_runs.warm_up(["plain"], failing("server"), said.append)
    assert said == ["warning: llama-server 'plain' failed the warm-up: no"]
    with pytest.raises(llama_server.ServerError, match="failed on the warm-up prompt"):
        peer_runs.warm_up(["tandem x"], failing("tandem"), said.append)


def test_server_that_fails_to_start_says_why(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: unknown argument: --bogus' >&2\nexit 1\n")
    fake.chmod(0o755)
    s = llama_server.LlamaServer("plain", fake, tmp_path / "m.gguf", ["--bogus"], tmp_path)
    with pytest.raises(llama_server.ServerError, match="exited with code 1 while starting") as exc:
        s.start(timeout=20)
    assert "unknown argument: --bogus" in str(exc.value)
    s.stop()


# ------------------------------------------------------------------ tiny-model smoke

def _server_bin() -> Path | None:
    from_env = os.environ.get("TANDEM_LLAMA_SERVER")
    if from_env:
        return Path(from_env)
    cache = Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))
    found = sorted(cache.glob("native/*/bin/llama-server"))
    return found[-1] if found else None


def test_smoke_tiny_models(tiny_models, tmp_path, monkeypatch):
    """End to end against a real llama-server: tiny pair, one prompt, two server configs and
    tandem; skipped unless llama-server is built."""
    server = _server_bin()
    if server is None or not server.exists():
        pytest.skip("llama-server not built (scripts/build_native.sh)")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi there"]}))
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_peer.py"),
           "-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]),
           "--prompts", str(prompts), "--per-category", "1", "-n", "16", "-c", "512",
           "--server", "plain", "--server", "draft", "--tandem", "none=--strategy none",
           "--server-bin", str(server), "--tandem-bin", f"{sys.executable} -m tandem",
           "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "### qa (1 prompt)" in res.stdout
    data = json.loads(out.read_text())
    by = {r["config"]: r for r in data["rows"]}
    assert set(by) == {"plain", "draft", "tandem none"}
    assert all(r["tok_s"] > 0 and r["error"] is None for r in by.values())
    assert by["draft"]["drafted"] > 0  # --spec-type draft-simple speculates
    # same template, same greedy decoding: tandem's plain output equals llama-server's
    assert peer_report.same_text(by["tandem none"]["text"], by["plain"]["text"])


def test_skip_takes_other_prompts_and_pool_pairs_within_each_run(tmp_path):
    lines = [json.dumps({"question_id": i, "category": "qa", "turns": [f"q{i}"]}) for i in range(6)]
    src = tmp_path / "q.jsonl"
    src.write_text("\n".join(lines))
    first = peer_runs.load_prompts(src, 2, None, True, 0)
    second = peer_runs.load_prompts(src, 2, None, True, 0, skip=2)
    assert [p.id for p in first] == ["0", "1"] and [p.id for p in second] == ["2", "3"]
    # the same prompt in two runs: each ratio is taken against its own run's baseline
    files = []
    for i, (base, mine) in enumerate([(10.0, 11.0), (5.0, 6.0)]):
        rows = [Row("0", "qa", "plain", "server", tok_s=base),
                Row("0", "qa", "tandem default", "tandem", tok_s=mine)]
        f = tmp_path / f"run{i}.json"
        f.write_text(json.dumps({"meta": {}, "rows": [dataclasses.asdict(r) for r in rows]}))
        files.append(f)
    out = peer_report.pool(files)
    assert "qa (2 prompts)" in out and "| tandem default | 1.15 |" in out
