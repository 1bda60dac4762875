"""spec-bench's multi-turn workloads: conversations run turn by turn, reported per turn, the
fresh sessions drafting from the history of the conversations before them."""
from __future__ import annotations

import json

import pytest
from tandem.bench import multiturn
from tandem.bench.multiturn import Conversation, run_conversations
from tandem.bench.report import aggregate
from tandem.bench.runner import BenchConfig, classify_divergences
from tandem.engine.backend.llama import ContextParams
from tandem.engine.pair import PairSession, SessionOptions
from tandem.engine.loop.speculative import GenParams
from tandem.errors import UsageError


def test_builtin_conversations_are_code_edits_of_three_turns_or_more_with_a_holdout():
    convs = multiturn.builtin_conversations()
    assert len(convs) >= 6 and all(len(c.turns) >= 3 and c.fresh for c in convs)
    assert {c.group for c in convs} == {"code-edit", "holdout"}
    assert sum(c.group == "holdout" for c in convs) >= 2
    assert all(isinstance(t, str) and t for c in convs for t in c.turns)


def test_spec_bench_two_turn_rows(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "qa", "turns": ["one"]},
        {"question_id": 2, "category": "writing", "turns": ["a", "b"]}]))
    convs = multiturn.spec_bench_conversations(path)
    assert [(c.id, c.group, c.turns) for c in convs] == [("2", "mt-bench", ("a", "b"))]
    path.write_text(json.dumps({"turns": ["only one"]}))
    with pytest.raises(UsageError, match="two or more turns"):
        multiturn.spec_bench_conversations(path)


def test_conversations_run_per_turn_and_fresh_sessions_see_the_history(tiny_models):
    convs = [Conversation("a", "code-edit", ("w x y z", "again w x y z"), "fresh edit"),
             Conversation("m", "mt-bench", ("q1", "q2"))]
    configs = [BenchConfig("plain", "none"), BenchConfig("auto", "auto")]
    opts = SessionOptions(strategy="none", target_ctx=ContextParams(n_ctx=512, n_threads=1))
    seen = []
    with PairSession(tiny_models["target"], None, opts) as s:
        real = s.generate

        def spy(tokens, gen, strategy=None, draft=None, record=True):
            seen.append((strategy, len(s.library.history)))
            return real(tokens, gen, strategy, draft, record)

        s.generate = spy
        turns: dict[str, list[int]] = {}
        results = [ev.result for ev in run_conversations(
            s, convs, configs, GenParams(max_tokens=12, ignore_eos=True), None, turns)]
        assert set(turns) == {r.prompt_id for r in results}
        # a divergence from plain output is measured in the turn's own context
        auto = next(r for r in results if r.config == "auto" and r.prompt_id == "a#2")
        auto.tokens = auto.tokens[:3] + [(auto.tokens[3] + 1) % 50] + auto.tokens[4:]
        assert classify_divergences(s, [], configs, results, turns.get) == 1
        assert auto.divergence["at"] == 3
    assert len(results) == multiturn.count_runs(convs, configs) == 10
    cats = sorted({r.category for r in results})
    assert cats == ["code-edit fresh", "code-edit t1", "code-edit t2+", "mt-bench t1",
                    "mt-bench t2"]
    # only the fresh session has a history: the four answers given before it
    assert all(n == 0 for _, n in seen[:8]) and all(n > 0 for _, n in seen[8:])
    # greedy: every configuration gives plain decoding's tokens (but the one altered above)
    by = {}
    for r in results:
        if r is auto:
            continue
        by.setdefault(r.prompt_id, set()).add(tuple(r.tokens))
    assert all(len(v) == 1 for v in by.values())
    report = aggregate(results, configs)
    assert report.cell("auto", "code-edit fresh") is not None
