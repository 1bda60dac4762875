"""One accounting for tandem and llama-server (tandem.bench.accounting), used by spec-bench
and bench_peer's harness (tandem.bench.peer_runs) alike: end to end, per decode step, and tok/s with end-of-text
counted as llama-server counts it. Hand-made numbers: issue 25's "Guten Morgen"."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tandem.bench import peer_report, peer_runs
from tandem.bench.peer_report import Row
from tandem.bench.accounting import server_counts, tandem_counts
from tandem.bench.runner import RunResult
from tandem.bench.workloads import Prompt
from tandem.engine.loop.events import DoneEvent
from tandem.engine.loop.stats import GenStats

ROOT = Path(__file__).resolve().parents[1]


# "Translate to German: good morning" -> "Guten Morgen" (4 tokens, then end-of-text):
# tandem made 5 steps in 177 ms (its first step evaluates the last prompt token), llama-server
# 4 in 149 ms (that token is in its prompt time); they reported 22.6 and 26.9 tok/s
TANDEM = dict(n_generated=4, eos=True, n_steps=5, t_prefill=0.060, t_decode=0.177)
SERVER = dict(predicted_n=4, predicted_ms=149.0, prompt_ms=95.0)


def test_guten_morgen_counted_alike():
    t, s = tandem_counts(**TANDEM), server_counts(**SERVER)
    assert 1000 * t.step_s == pytest.approx(35.4) and 1000 * s.step_s == pytest.approx(37.25)
    # tandem's own figure left end-of-text out: 4 / 0.177 = 22.6; counted as llama-server
    # counts it, 5 / 0.177 = 28.2 against llama-server's 4 / 0.149 = 26.8
    assert t.tokens == 5 and t.tokens_per_second == pytest.approx(5 / 0.177)
    assert s.tokens == 4 and s.tokens_per_second == pytest.approx(4 / 0.149)
    assert t.t_e2e == pytest.approx(0.237) and s.t_e2e == pytest.approx(0.244)
    # an answer cut by the token limit has no end-of-text to count
    assert tandem_counts(4, False, 4, 0.06, 0.14).tokens == 4
    # llama-server's speculative steps yield their accepted drafts too
    assert server_counts(128, 8000.0, 400.0, draft_accepted=40).steps == 88
    assert server_counts(0, 0.0, 0.0).tokens_per_second == 0.0


def test_spec_bench_and_bench_peer_count_the_same_run_the_same_way():
    stats = GenStats(strategy="auto", n_prompt=12, n_prompt_eval=12, n_generated=4)
    for _ in range(TANDEM["n_steps"]):
        stats.record_step(0, 0)
    stats.t_prefill, stats.t_total = TANDEM["t_prefill"], TANDEM["t_prefill"] + TANDEM["t_decode"]
    done = DoneEvent(stats, "eos", "Guten Morgen", (1, 2, 3, 4))
    run = RunResult.from_done("auto", Prompt("t1", "translation", "x"), 0, done)
    row = peer_runs.parse_tandem_output(Row("t1", "translation", "tandem default", "tandem"),
                                        json.dumps({"text": "Guten Morgen", "finish_reason": "eos",
                                                    "stats": stats.to_dict()}))
    assert run.tokens_per_second == pytest.approx(row.tok_s) == pytest.approx(5 / 0.177)
    assert run.step_s * 1000 == pytest.approx(row.step_ms) == pytest.approx(35.4)
    assert run.t_e2e == pytest.approx(row.e2e_s) == pytest.approx(0.237)
    assert run.tokens_per_second_own == pytest.approx(4 / 0.177)
    server = peer_runs.parse_server_response(Row("t1", "translation", "plain", "server"), {
        "choices": [{"message": {"content": "Guten Morgen"}, "finish_reason": "stop"}],
        "timings": {"predicted_n": 4, "predicted_ms": 149.0, "prompt_ms": 95.0}})
    assert server.step_ms == pytest.approx(37.25) and server.tok_s == pytest.approx(4 / 0.149)
    summary = peer_report.summarize([server, row], ["plain", "tandem default"])["tandem default"]
    assert summary.per_step == pytest.approx(37.25 / 35.4)  # tandem's steps are faster
    assert summary.e2e == pytest.approx(0.244 / 0.237)
    assert summary.median == pytest.approx((5 / 0.177) / (4 / 0.149))


def test_one_function_no_second_copy():
    """The accounting lives in one module: neither caller recomputes end-of-text by hand."""
    for path in ("cli/tandem/bench/peer_runs.py", "cli/tandem/bench/runner.py"):
        text = (ROOT / path).read_text(encoding="utf-8")
        assert "tandem_counts(" in text
        assert "n_generated + 1" not in text


def _run(config: str, t_prefill: float, t_decode: float, n_prompt_eval: int) -> RunResult:
    stats = GenStats(strategy=config, n_prompt=12, n_prompt_eval=n_prompt_eval, n_generated=8)
    for _ in range(8):
        stats.record_step(0, 0)
    stats.t_prefill, stats.t_total = t_prefill, t_prefill + t_decode
    return RunResult.from_done(config, Prompt("p", "qa", "x"), 0,
                               DoneEvent(stats, "length", "x", tuple(range(8))))


def test_spec_bench_reports_end_to_end_only_for_the_same_work():
    from tandem.bench import report as rep
    from tandem.bench.runner import BenchConfig

    configs = [BenchConfig("plain", "none"), BenchConfig("auto", "auto")]
    # both evaluated the whole prompt: 0.2 + 0.8 s against 0.2 + 0.6 s
    cell = rep.aggregate([_run("plain", 0.2, 0.8, 12), _run("auto", 0.2, 0.6, 12)],
                         configs).cell("auto")
    assert cell.e2e_speedup == pytest.approx(1.0 / 0.8)
    assert cell.step_ms == pytest.approx(1000 * 0.6 / 8)
    assert "1.25x e2e, 75.0 ms/step" in rep.to_markdown(rep.aggregate(
        [_run("plain", 0.2, 0.8, 12), _run("auto", 0.2, 0.6, 12)], configs))
    # the prompt came from the KV cache for one of them: not the same work, no ratio
    cell = rep.aggregate([_run("plain", 0.2, 0.8, 12), _run("auto", 0.01, 0.6, 1)],
                         configs).cell("auto")
    assert cell.e2e_speedup is None


def test_spec_bench_runs_single_prompts_cold(tiny_models, tmp_path, monkeypatch):
    """Every run evaluates its whole prompt (the previous configuration left it cached)."""
    from tandem.bench.runner import BenchConfig, run_bench
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions
    from tandem.engine.loop.speculative import GenParams

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    opts = SessionOptions(strategy="none", target_ctx=ContextParams(n_ctx=256, n_threads=1))
    with PairSession(tiny_models["target"], None, opts) as s:
        configs = [BenchConfig("plain", "none"), BenchConfig("ngram", "ngram")]
        runs = [p.result for p in run_bench(s, [Prompt("p", "qa", "hello there, hello")],
                                            configs, GenParams(max_tokens=4), warmup=False)
                if p.result is not None]
    assert len(runs) == 2 and runs[0].n_prompt_eval == runs[1].n_prompt_eval > 1
