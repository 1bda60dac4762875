"""spec-bench's equality check: in fast mode every greedy divergence from plain decoding is
reported with the target's logit gap there and counted as a near-tie flip or a mismatch; in
exact mode every divergence is a mismatch."""
from __future__ import annotations

import numpy as np
import pytest
from tandem.bench import report as rep
from tandem.bench.runner import BenchConfig, classify_divergences, run_bench
from tandem.bench.workloads import Prompt
from tandem.engine.backend.llama import ContextParams
from tandem.engine.pair import PairSession, SessionOptions
from tandem.engine.loop.speculative import GenParams

pytest.importorskip("llama_cpp")

PLAIN = BenchConfig("plain", "none")
NGRAM = BenchConfig("ngram", "ngram")


@pytest.fixture(scope="module")
def bench(tiny_models):
    opts = SessionOptions(strategy="none", target_ctx=ContextParams(n_ctx=512, n_threads=1))
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as s:
        prompts = [Prompt("p1", "code", "def add(a, b):"), Prompt("p2", "code", "abcabcabc"),
                   Prompt("p3", "qa", "What is 2+2?")]
        results = [ev.result for ev in run_bench(s, prompts, [PLAIN, NGRAM],
                                                 GenParams(max_tokens=24, ignore_eos=True),
                                                 warmup=False)]
        yield s, prompts, results


def _flip(session, prompts, results, prompt_id: str, at: int, rank: int):
    """Make the ngram run of `prompt_id` take plain's `rank`-th best token at `at`; the gap
    there is then a fact of the model, computed independently here."""
    plain = next(r for r in results if r.config == "plain" and r.prompt_id == prompt_id)
    other = next(r for r in results if r.config == "ngram" and r.prompt_id == prompt_id)
    p = next(p for p in prompts if p.id == prompt_id)
    tokens = session.prompt_tokens([{"role": "user", "content": p.text}]) + plain.tokens[:at]
    logits = np.array(session.target_ctx.sync(tokens))
    order = np.argsort(-logits)
    assert order[0] == plain.tokens[at]
    other.tokens = plain.tokens[:at] + [int(order[rank])] + plain.tokens[at + 1:]
    return float(logits[order[0]] - logits[order[rank]])


def test_every_divergence_gets_its_logit_gap_and_a_verdict(bench, monkeypatch):
    session, prompts, results = bench
    assert all(r.divergence is None for r in results)
    # the tiny models' runs are identical; make two differ: at the 2nd best and the 30th best
    near = _flip(session, prompts, results, "p1", 5, 1)
    far = _flip(session, prompts, results, "p2", 3, 30)
    assert classify_divergences(session, prompts, [PLAIN, NGRAM], results) == 2
    div = {r.prompt_id: r.divergence for r in results if r.divergence}
    assert div["p1"]["at"] == 5 and div["p1"]["gap"] == pytest.approx(near, abs=1e-4)
    assert div["p2"]["gap"] == pytest.approx(far, abs=1e-4)
    assert 0 < near < far
    # the tiny model's logits are not a real model's: put the threshold between the two gaps
    monkeypatch.setattr(rep, "NEAR_TIE_GAP", (near + far) / 2)

    fast = rep.aggregate(results, [PLAIN, NGRAM]).cell("ngram")
    assert (fast.identical, fast.compared) == (1, 3)
    assert fast.near_ties == 1 and len(fast.mismatches) == 1
    assert any("p2" in m and f"logit gap {far:.3f}" in m for m in fast.mismatches)

    exact = rep.aggregate(results, [PLAIN, NGRAM], exact=True).cell("ngram")
    assert exact.near_ties == 0 and len(exact.mismatches) == 2  # identity or a mismatch

    md = rep.to_markdown(rep.aggregate(results, [PLAIN, NGRAM]))
    assert "1/3 (" in md and "mismatch" in md and "logit gap" in md
