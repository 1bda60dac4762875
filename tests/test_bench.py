"""spec-bench internals, no models: report arithmetic from recorded event streams, the prompt
readers (built-in suite, Spec-Bench JSONL, plain JSONL, text), select, the sweep parser and
configurations, the interleaved plan, run_bench against a scripted session, and tuned settings."""
from __future__ import annotations

import csv
import io
import json
import shutil
import xml.dom.minidom
from dataclasses import replace
from pathlib import Path

import pytest
from tandem.bench import report as rep
from tandem.bench import tune, workloads
from tandem.bench.runner import BenchConfig, RunResult, plan, run_bench
from tandem.bench.sweep import SWEEP_KEYS, build_configs, parse_sweep
from tandem.bench.workloads import Prompt
from tandem.config import tuned as tuned_file
from tandem.engine.backend.llama import ContextParams
from tandem.engine.drafting.drafters import DraftParams
from tandem.engine.loop.events import DoneEvent
from tandem.engine.loop.speculative import GenParams
from tandem.engine.loop.stats import GenStats
from tandem.errors import UsageError

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "spec_bench" / "question.dev.jsonl"

PLAIN = BenchConfig("plain", "none")
DRAFT = BenchConfig("draft", "draft", DraftParams(n_max=4, n_min=1, p_min=0.25))
NGRAM = BenchConfig("ngram", "ngram")


# ------------------------------------------------------------------ recorded event streams

def recorded(config: str, prompt: Prompt, *, tokens_per_second: float, steps=(), times=(0.0, 0.0, 0.0),
             tokens=(1, 2, 3), rep: int = 0, n_generated: int = 100, reason: str = "length",
             notes=()) -> RunResult:
    """A RunResult made the way run_bench makes it: a GenStats fed step by step
    (record_step, as the engine does), wrapped in the DoneEvent that ends generate()."""
    stats = GenStats(strategy=config, n_prompt=10, n_prompt_eval=10, n_generated=n_generated,
                     notes=list(notes))
    for drafted, accepted in steps:
        stats.record_step(drafted, accepted)
    stats.t_draft, stats.t_verify, stats.t_sample = times
    stats.t_prefill = 0.5
    stats.t_total = 0.5 + n_generated / tokens_per_second  # decode time gives the rate
    done = DoneEvent(stats, reason, "text of " + prompt.id, tuple(tokens))
    return RunResult.from_done(config, prompt, rep, done)


P1 = Prompt("p1", "A", "first")
P2 = Prompt("p2", "A", "second")
P3 = Prompt("p3", "B", "third")


@pytest.fixture
def results() -> list[RunResult]:
    """Plain at 100, 50, 200 tok/s; draft at 200, 200, 100 -> per-prompt ratios 2, 4, 0.5;
    ngram at 100, 50, 200 (ratios 1, 1, 1) with output identical to plain's."""
    return [
        recorded("plain", P1, tokens_per_second=100.0, steps=[(0, 0)] * 3, times=(0.0, 0.75, 0.25),
                 tokens=(1, 2, 3, 4)),
        recorded("plain", P2, tokens_per_second=50.0, tokens=(5, 6, 7)),
        recorded("plain", P3, tokens_per_second=200.0, tokens=(1, 2, 3)),
        recorded("draft", P1, tokens_per_second=200.0, steps=[(4, 4), (4, 2), (4, 0), (0, 0)],
                 times=(1.0, 2.0, 1.0), tokens=(1, 2, 3, 4)),
        recorded("draft", P2, tokens_per_second=200.0, steps=[(3, 3), (2, 1)],
                 times=(0.5, 0.25, 0.25), tokens=(5, 9, 7)),  # differs at index 1
        recorded("draft", P3, tokens_per_second=100.0, steps=[(4, 1)],
                 times=(0.25, 0.5, 0.25), tokens=(1, 2)),  # a prefix: differs at index 2
        recorded("ngram", P1, tokens_per_second=100.0, tokens=(1, 2, 3, 4)),
        recorded("ngram", P2, tokens_per_second=50.0, tokens=(5, 6, 7)),
        recorded("ngram", P3, tokens_per_second=200.0, tokens=(1, 2, 3)),
    ]


def test_run_result_from_done_copies_the_stream():
    r = recorded("draft", P1, tokens_per_second=80.0, steps=[(3, 2), (0, 0), (2, 2)], times=(0.1, 0.2, 0.3),
                 tokens=(7, 8), n_generated=40, reason="eos")
    assert (r.config, r.prompt_id, r.category, r.rep) == ("draft", "p1", "A", 0)
    # ended at end-of-text: counted as llama-server counts it, 41 tokens in the 0.5 s
    assert r.n_generated == 40 and r.tokens_per_second == pytest.approx(82.0)
    assert r.tokens_per_second_own == pytest.approx(80.0)
    assert r.t_decode == pytest.approx(0.5) and r.t_e2e == pytest.approx(1.0)
    assert r.step_s == pytest.approx(0.5 / 3)
    assert (r.drafted, r.accepted, r.n_steps, r.n_steps_drafted) == (5, 4, 3, 2)
    assert r.drafted_at == [2, 2, 1] and r.accepted_at == [2, 2, 0]
    assert (r.t_draft, r.t_verify, r.t_sample) == (0.1, 0.2, 0.3)
    assert r.reason == "eos" and r.tokens == [7, 8] and r.text == "text of p1"


def test_cells_exist_per_category_and_overall(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM])
    assert report.categories == ["A", "B"]
    assert [(c.config, c.category) for c in report.cells] == [
        (n, cat) for n in ("plain", "draft", "ngram") for cat in ("A", "B", rep.OVERALL)]
    assert report.cell("draft", "A").runs == 2 and report.cell("draft").runs == 3
    assert report.cell("missing") is None
    assert report.configs[1]["name"] == "draft" and report.configs[1]["n_max"] == 4
    assert report.configs[1]["p_min"] == 0.25 and report.configs[1]["strategy"] == "draft"


def test_median_tokens_per_second(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM])
    assert report.cell("plain").tokens_per_second == pytest.approx(100.0)  # median of 100, 50, 200
    assert report.cell("plain", "A").tokens_per_second == pytest.approx(75.0)  # median of 100, 50
    assert report.cell("plain", "B").tokens_per_second == pytest.approx(200.0)
    assert report.cell("draft").tokens_per_second == pytest.approx(200.0)
    assert report.cell("draft", "B").tokens_per_second == pytest.approx(100.0)


def test_speedup_is_the_median_of_per_prompt_ratios_with_quartile_spread(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM])
    overall = report.cell("draft")
    # ratios 2, 4, 0.5: sorted 0.5, 2, 4
    assert overall.speedup == pytest.approx(2.0)
    assert overall.speedup_lo == pytest.approx(1.25)  # 0.5 + (2 - 0.5) * 0.5
    assert overall.speedup_hi == pytest.approx(3.0)  # 2 + (4 - 2) * 0.5
    # not the ratio of medians (200 / 100 = 2 here too) nor the mean ratio (2.17)
    a = report.cell("draft", "A")
    assert (a.speedup, a.speedup_lo, a.speedup_hi) == pytest.approx((3.0, 2.5, 3.5))
    b = report.cell("draft", "B")
    assert (b.speedup, b.speedup_lo, b.speedup_hi) == pytest.approx((0.5, 0.5, 0.5))
    for cat in ("A", "B", rep.OVERALL):
        plain = report.cell("plain", cat)
        assert (plain.speedup, plain.speedup_lo, plain.speedup_hi) == (1.0, 1.0, 1.0)
        assert report.cell("ngram", cat).speedup == pytest.approx(1.0)


def test_speedup_differs_from_the_ratio_of_medians():
    prompts = [Prompt(f"q{i}", "c", "x") for i in range(4)]
    plain_rates, draft_rates = [10.0, 20.0, 40.0, 80.0], [40.0, 20.0, 20.0, 40.0]  # ratios 4, 1, .5, .5
    results = [recorded("plain", p, tokens_per_second=t) for p, t in zip(prompts, plain_rates)]
    results += [recorded("draft", p, tokens_per_second=t) for p, t in zip(prompts, draft_rates)]
    cell = rep.aggregate(results, [PLAIN, DRAFT]).cell("draft")
    assert cell.speedup == pytest.approx(0.75)  # median of 0.5, 0.5, 1, 4
    assert cell.speedup_lo == pytest.approx(0.5)  # position 0.75 between 0.5 and 0.5
    assert cell.speedup_hi == pytest.approx(1.75)  # position 2.25: 1 + (4 - 1) * 0.25
    assert cell.tokens_per_second == pytest.approx(30.0)  # median of 20, 20, 40, 40


def test_ratios_pair_runs_of_the_same_repetition():
    results = [
        recorded("plain", P1, tokens_per_second=100.0, rep=0),
        recorded("plain", P1, tokens_per_second=50.0, rep=1),
        recorded("draft", P1, tokens_per_second=100.0, rep=0),  # 1.0
        recorded("draft", P1, tokens_per_second=100.0, rep=1),  # 2.0
    ]
    cell = rep.aggregate(results, [PLAIN, DRAFT]).cell("draft")
    assert cell.speedup == pytest.approx(1.5)
    assert (cell.speedup_lo, cell.speedup_hi) == pytest.approx((1.25, 1.75))
    assert cell.runs == 2 and cell.compared == 2


def test_acceptance_rate_mean_accepted_length_and_positions(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM])
    c = report.cell("draft")
    # drafted 12 + 5 + 4 = 21, accepted 6 + 4 + 1 = 11, drafted steps 3 + 2 + 1 = 6
    assert c.acceptance_rate == pytest.approx(11 / 21)
    assert c.mean_accepted_length == pytest.approx((11 + 6) / 6)
    # drafted_at: p1 [3,3,3,3] + p2 [2,2,1] + p3 [1,1,1,1]; accepted_at: [2,2,1,1] + [2,1,1] + [1,0,0,0]
    assert c.acceptance_by_position == pytest.approx([5 / 6, 3 / 6, 2 / 5, 1 / 4])
    a = report.cell("draft", "A")
    assert a.acceptance_rate == pytest.approx(10 / 17)
    assert a.mean_accepted_length == pytest.approx((10 + 5) / 5)
    assert a.acceptance_by_position == pytest.approx([4 / 5, 3 / 5, 2 / 4, 1 / 3])
    b = report.cell("draft", "B")
    assert (b.acceptance_rate, b.mean_accepted_length) == pytest.approx((0.25, 2.0))
    assert b.acceptance_by_position == pytest.approx([1.0, 0.0, 0.0, 0.0])
    plain = report.cell("plain")  # steps without drafts: nothing to divide by
    assert (plain.acceptance_rate, plain.mean_accepted_length, plain.acceptance_by_position) == (0.0, 0.0, [])


def test_time_shares(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM])
    c = report.cell("draft")  # draft 1.75, verify 2.75, sample 1.5 of 6.0 seconds
    assert c.draft_share == pytest.approx(1.75 / 6)
    assert c.verify_share == pytest.approx(2.75 / 6)
    b = report.cell("draft", "B")
    assert (b.draft_share, b.verify_share) == pytest.approx((0.25, 0.5))
    plain = report.cell("plain")
    assert (plain.draft_share, plain.verify_share) == pytest.approx((0.0, 0.75))
    assert (report.cell("ngram").draft_share, report.cell("ngram").verify_share) == (0.0, 0.0)  # no time


def test_greedy_output_equality_and_mismatch_messages(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM])
    c = report.cell("draft")
    assert (c.identical, c.compared) == (1, 3)
    assert c.mismatches == ["p2 (rep 0): differs at token 1", "p3 (rep 0): differs at token 2"]
    assert (report.cell("draft", "A").identical, report.cell("draft", "A").compared) == (1, 2)
    assert report.cell("draft", "B").mismatches == ["p3 (rep 0): differs at token 2"]
    n = report.cell("ngram")
    assert (n.identical, n.compared, n.mismatches) == (3, 3, [])
    plain = report.cell("plain")
    assert (plain.identical, plain.compared, plain.mismatches) == (0, 0, [])
    sampled = rep.aggregate(results, [PLAIN, DRAFT, NGRAM], greedy=False).cell("draft")
    assert (sampled.identical, sampled.compared, sampled.mismatches) == (0, 0, [])


def test_first_difference():
    assert rep.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert rep.first_difference([], []) is None
    assert rep.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert rep.first_difference([9], [1]) == 0
    assert rep.first_difference([1, 2], [1, 2, 3]) == 2
    assert rep.first_difference([1, 2, 3], [1]) == 1


def test_partial_results_without_a_plain_counterpart():
    """An interrupted run: draft ran on p2 but plain did not; the run counts, no ratio for it."""
    results = [recorded("plain", P1, tokens_per_second=100.0),
               recorded("draft", P1, tokens_per_second=150.0),
               recorded("draft", P2, tokens_per_second=400.0)]
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM], partial=True, meta={"k": "v"})
    c = report.cell("draft")
    assert c.runs == 2 and c.tokens_per_second == pytest.approx(275.0)
    assert c.speedup == pytest.approx(1.5) and (c.identical, c.compared) == (1, 1)
    assert report.cell("ngram") is None  # never ran: no cell
    assert report.partial and report.to_dict()["partial"] is True and report.meta == {"k": "v"}
    # only draft ran at all: no reference, no speedups
    alone = rep.aggregate(results[2:], [PLAIN, DRAFT])
    assert alone.cell("draft").speedup is None and alone.cell("draft").compared == 0
    assert rep.best(alone) is None
    assert tune.choose(alone)["overall"] is None
    assert rep.aggregate([], [PLAIN, DRAFT]).cells == []


def test_zero_rate_plain_run_gives_no_ratio():
    results = [recorded("plain", P1, tokens_per_second=100.0, n_generated=0),  # 0 tok/s
               recorded("draft", P1, tokens_per_second=100.0)]
    assert results[0].tokens_per_second == 0.0
    assert rep.aggregate(results, [PLAIN, DRAFT]).cell("draft").speedup is None


def test_best_and_choose(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM])
    assert rep.best(report).config == "draft"  # 2.0 overall
    assert rep.best(report, "A").config == "draft"  # 3.0
    assert rep.best(report, "B").config == "plain"  # draft 0.5, ngram ties plain at 1.0: plain first
    assert rep.best(report, "nope") is None
    # 2 prompts in A and 1 in B, and a 25th percentile of 1.25 overall: too little evidence
    chosen = tune.choose(report)
    assert chosen["partial"] is False and chosen["overall"] is None
    assert chosen["by_category"] == {"A": None, "B": None}
    assert "at least 3 prompts per category" in chosen["rule"]


def _wide(ratios_a, ratios_b) -> list[RunResult]:
    """Plain at 100 tok/s and draft at 100 x ratio on three or more prompts per category."""
    out = []
    for cat, ratios in (("A", ratios_a), ("B", ratios_b)):
        for i, r in enumerate(ratios):
            p = Prompt(f"{cat}{i}", cat, "x")
            out += [recorded("plain", p, tokens_per_second=100.0),
                    recorded("draft", p, tokens_per_second=100.0 * r),
                    recorded("ngram", p, tokens_per_second=100.0 * (2.0 - r))]
    return out


def test_choose_needs_a_gain_beyond_the_spread():
    report = rep.aggregate(_wide([1.3, 1.2, 1.4], [1.1, 1.2, 1.25]), [PLAIN, DRAFT, NGRAM])
    chosen = tune.choose(report)
    assert chosen["overall"] == {"config": "draft", "strategy": "draft", "n_max": 4, "n_min": 1,
                                 "p_min": 0.25, "speedup": pytest.approx(1.225),
                                 "speedup_lo": pytest.approx(1.2),
                                 "speedup_hi": pytest.approx(1.2875), "draft_model": None,
                                 "target_ctx": None, "draft_ctx": None}
    assert chosen["by_category"]["A"]["config"] == "draft"
    # a median above 1.0 whose 25th percentile is not: noise, the profile stays
    noisy = rep.aggregate(_wide([1.3, 0.9, 1.2, 0.8], [1.2, 0.85, 1.1, 0.95]),
                          [PLAIN, DRAFT, NGRAM])
    assert rep.best(noisy).config == "draft" and rep.best(noisy).speedup > 1.0
    assert tune.choose(noisy)["overall"] is None
    # one category with only 2 prompts: no overall choice, whatever the gain
    thin = rep.aggregate(_wide([1.5, 1.6, 1.7], [1.5, 1.6]), [PLAIN, DRAFT, NGRAM])
    assert tune.choose(thin)["overall"] is None
    assert tune.choose(thin)["by_category"]["A"]["config"] == "draft"


def test_report_serialises_to_json(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM], meta={"target": "t.gguf"})
    doc = json.loads(json.dumps(report.to_dict()))
    assert set(doc) == {"meta", "partial", "configs", "categories", "cells", "load", "verdict",
                        "load_warning"}
    cell = next(c for c in doc["cells"] if c["config"] == "draft" and c["category"] == "overall")
    assert cell["speedup"] == pytest.approx(2.0) and cell["compared"] == 3
    assert cell["acceptance_by_position"] == pytest.approx([5 / 6, 3 / 6, 2 / 5, 1 / 4])


def test_markdown(results):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM], meta={"target": "t.gguf"})
    md = rep.to_markdown(report)
    assert md.startswith("# spec-bench report\n") and "Partial" not in md
    assert "| target | t.gguf |" in md
    assert "| category | plain | draft | ngram |" in md
    overall = next(line for line in md.splitlines() if line.startswith("| **overall**"))
    assert "2.00x [1.25-3.00] 200.0 tok/s" in overall and "1.00x [1.00-1.00] 100.0 tok/s" in overall
    draft_row = next(line for line in md.splitlines() if line.startswith("| draft |"))
    assert "52.4%" in draft_row and "2.83" in draft_row and "83 50 40 25" in draft_row
    assert "29% / 46%" in draft_row and "1/3" in draft_row
    assert "- draft: p2 (rep 0): differs at token 1" in md
    assert "- draft: p3 (rep 0): differs at token 2" in md
    partial = rep.to_markdown(rep.aggregate(results[:4], [PLAIN, DRAFT, NGRAM], partial=True))
    assert "**Partial results**" in partial
    row_b = next(line for line in partial.splitlines() if line.startswith("| B |"))
    assert row_b.endswith("| - | - |")  # draft and ngram never ran on B


def test_drafter_notes_are_counted_and_reported():
    off = "draft model off: this machine's costs predict {}x at 90% acceptance (needs 1.15x)"
    runs = [recorded("plain", P1, tokens_per_second=10.0), recorded("plain", P2, tokens_per_second=10.0),
            recorded("auto", P1, tokens_per_second=11.0, notes=[off.format("1.05")]),
            recorded("auto", P2, tokens_per_second=12.0, notes=[off.format("1.06")])]
    report = rep.aggregate(runs, [PLAIN, BenchConfig("auto", "auto")])
    # the same decision with refined figures counts once, shown with the latest figures
    assert report.cell("auto").notes == {off.format("1.06"): 2}
    assert report.cell("plain").notes == {}
    md = rep.to_markdown(report)
    assert "## What the drafters decided" in md
    assert f"- auto (2/2 runs): {off.format('1.06')}" in md


def test_csv(results):
    rows = list(csv.DictReader(io.StringIO(rep.to_csv(results))))
    assert len(rows) == len(results)
    assert rows[3]["config"] == "draft" and rows[3]["prompt_id"] == "p1" and rows[3]["category"] == "A"
    assert float(rows[3]["tokens_per_second"]) == pytest.approx(200.0)
    assert (rows[3]["drafted"], rows[3]["accepted"], rows[3]["n_steps"]) == ("12", "6", "4")
    assert rows[3]["reason"] == "length"


def test_svg_is_xml_even_with_markup_in_names():
    """Category names come from user files: `Q&A <short>` must not break the chart."""
    p = Prompt("x", "Q&A <short>", "hi")
    results = [recorded("plain", p, tokens_per_second=10.0), recorded("draft", p, tokens_per_second=25.0)]
    svg = rep.to_svg(rep.aggregate(results, [PLAIN, DRAFT]))
    doc = xml.dom.minidom.parseString(svg)
    titles = [t.firstChild.data for t in doc.getElementsByTagName("title")]
    assert "draft on Q&A <short>: 2.50x" in titles and "plain on overall: 1.00x" in titles
    assert len(doc.getElementsByTagName("rect")) == 2 * 2 + 2  # bars for 2 categories + legend


AUTO = BenchConfig("auto", "auto")


def _issue_run(busy_draft: float | None = None) -> list[RunResult]:
    """The run issue 32 describes: auto 1.02x and the draft model 0.71x of plain, on three
    prompts of two categories; the draft runs of category B measured at `busy_draft`."""
    out = []
    for p in (P1, P2, P3):
        out += [recorded("plain", p, tokens_per_second=100.0),
                recorded("draft", p, tokens_per_second=71.0),
                recorded("auto", p, tokens_per_second=102.0)]
        if p.category == "B":
            out[-2].busy = busy_draft
    return out


def test_the_verdict_line_comes_from_the_run():
    report = rep.aggregate(_issue_run(), [PLAIN, DRAFT, AUTO])
    line = "best here: auto 1.02x of plain; draft model 0.71x: it does not pay on this machine"
    assert rep.verdict(report) == line
    md = rep.to_markdown(report)
    assert md.startswith(f"# spec-bench report\n\n**{line}**\n")  # first, before the tables
    assert report.to_dict()["verdict"] == line
    # nothing beats plain decoding: the verdict says so, with the closest configuration
    slow = [r for r in _issue_run() if r.config != "auto"]
    assert rep.verdict(rep.aggregate(slow, [PLAIN, DRAFT])) == (
        "best here: plain decoding; no configuration beat it (closest: draft 0.71x)")
    # a draft model that pays is said to pay; the best one alone needs no second clause
    fast = [replace(r, tokens_per_second=150.0) if r.config == "draft" else r
            for r in _issue_run()]
    assert rep.verdict(rep.aggregate(fast, [PLAIN, DRAFT, AUTO])) == "best here: draft 1.50x of plain"
    fast = [replace(r, tokens_per_second=101.0) if r.config == "draft" else r
            for r in _issue_run()]
    assert rep.verdict(rep.aggregate(fast, [PLAIN, DRAFT, AUTO])).endswith(
        "; draft model 1.01x: it pays here")
    assert rep.verdict(rep.aggregate(_issue_run()[:1], [PLAIN])).startswith("no verdict")


def test_busy_runs_are_marked_and_their_rows_named():
    """A ratio measured while other processes took the CPU is marked busy wherever it is
    shown (tables, chart, verdict), and the warning names the rows it touched."""
    quiet = rep.aggregate(_issue_run(busy_draft=0.05), [PLAIN, DRAFT, AUTO])
    assert rep.load_warning(quiet) is None and "busy" not in rep.to_markdown(quiet).split(
        "## Acceptance")[0].replace('"busy"', "")
    report = rep.aggregate(_issue_run(busy_draft=0.63), [PLAIN, DRAFT, AUTO])
    assert report.load == {"runs": 9, "busy_runs": 1, "peak": 0.63}
    assert report.cell("draft", "B").busy_runs == 1 and report.cell("draft", "A").busy_runs == 0
    assert rep.ratio_text(report.cell("draft", "B")) == "0.71x busy"
    assert rep.ratio_text(report.cell("draft", "A")) == "0.71x"
    warning = rep.load_warning(report)
    assert warning.startswith("the machine's load changed during the run: 1 of 9 runs")
    assert "up to 63% of the CPU" in warning and "marked busy: B (draft)" in warning
    md = rep.to_markdown(report)
    assert f"**Warning**: {warning}" in md
    row_b = next(line for line in md.splitlines() if line.startswith("| B |"))
    assert "0.71x busy [" in row_b
    assert "busy" in rep.verdict(report)
    # a busy plain run makes the ratios set against it busy too
    runs = _issue_run()
    runs[0].busy = 0.9  # plain on p1
    report = rep.aggregate(runs, [PLAIN, DRAFT, AUTO])
    assert report.cell("draft", "A").busy_runs == 1 and report.cell("auto", "A").busy_runs == 1
    assert "A (draft, auto)" in rep.load_warning(report)
    labels = [t.firstChild.data for t in xml.dom.minidom.parseString(
        rep.to_svg(report)).getElementsByTagName("text")]
    assert "0.71 busy" in labels and "1.02" in labels  # category B's auto: quiet


def test_the_report_header_is_a_table_not_python_data():
    meta = {"target": "t.gguf", "drafts": ["a.gguf", "b.gguf"], "greedy": True, "threads": 2,
            "costs": {"verify_ms": {"plain": {1: 49.53, 2: 60.1}},
                      "drafts": {"a.gguf": {"ms_per_token": 20.0, "relative_to_target": 0.4}}}}
    md = rep.to_markdown(rep.aggregate(_issue_run(), [PLAIN, DRAFT, AUTO], meta=meta))
    assert "{" not in md and "49.53" not in md  # no raw Python data
    for row in ("| setting | value |", "| target | t.gguf |", "| drafts | a.gguf, b.gguf |",
                "| greedy | yes |", "| threads | 2 |", "| plain | 49.5 | 60.1 |",
                "| a.gguf | 20.0 | 0.40 |"):
        assert row in md, row


def test_the_chart_prints_its_values_on_the_bars():
    report = rep.aggregate(_issue_run(), [PLAIN, DRAFT, AUTO])
    doc = xml.dom.minidom.parseString(rep.to_svg(report))
    labels = [t.firstChild.data for t in doc.getElementsByTagName("text")]
    # one per bar: 3 configurations x (2 categories + overall)
    assert labels.count("1.00") == 3 and labels.count("0.71") == 3 and labels.count("1.02") == 3


def test_write_outputs(results, tmp_path):
    report = rep.aggregate(results, [PLAIN, DRAFT, NGRAM], partial=True)
    out = tmp_path / "new" / "dir"
    files = rep.write_outputs(report, results, out)
    assert sorted(f.name for f in files) == ["report.json", "report.md", "runs.csv", "speedup.svg"]
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "runs.csv", "speedup.svg"]
    doc = json.loads((out / "report.json").read_text())
    assert doc["partial"] is True and len(doc["runs"]) == len(results)
    assert doc["runs"][4]["tokens"] == [5, 9, 7]
    xml.dom.minidom.parse(str(out / "speedup.svg"))
    assert "**Partial results**" in (out / "report.md").read_text()


# ------------------------------------------------------------------ workloads

def test_builtin_suite():
    prompts = workloads.builtin()
    cats = {}
    for p in prompts:
        cats.setdefault(p.category, []).append(p)
        assert p.text and p.text == p.text.strip()
    assert len(cats) >= 6 and all(len(v) >= 5 for v in cats.values())
    assert len({p.id for p in prompts}) == len(prompts)
    assert {"code", "json"} <= set(cats)


needs_spec_bench = pytest.mark.skipif(not SPEC_BENCH.exists(), reason="no ../shared/spec_bench")


@needs_spec_bench
def test_spec_bench_reader_on_the_real_file():
    prompts = workloads.read_file(SPEC_BENCH)
    rows = [json.loads(line) for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(prompts) == 240
    cats = {p.category for p in prompts}
    assert len(cats) == 13 and {"writing", "coding", "translation", "summarization", "qa",
                                "math_reasoning", "rag"} <= cats
    for p, row in zip(prompts, rows):
        assert p.id == str(row["question_id"]) and p.category == row["category"]
        assert p.text == row["turns"][0]  # the first turn only
        assert p.system is None
    assert prompts[0].id == "81" and prompts[0].text.startswith("Compose an engaging travel blog post")


@needs_spec_bench
def test_spec_bench_per_category_limit():
    prompts = workloads.select(workloads.read_file(SPEC_BENCH), per_category=3)
    counts = {}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    assert len(counts) == 13 and set(counts.values()) == {3} and len(prompts) == 39
    only = workloads.select(workloads.read_file(SPEC_BENCH), 2, ["qa", "coding"])
    assert [p.category for p in only].count("qa") == 2 and {p.category for p in only} == {"qa", "coding"}


@needs_spec_bench
def test_spec_bench_malformed_line_names_the_line(tmp_path):
    lines = SPEC_BENCH.read_text(encoding="utf-8").splitlines()
    lines[56] = lines[56][:-5]  # line 57: truncated JSON
    bad = tmp_path / "question.jsonl"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(UsageError) as exc:
        workloads.read_file(bad)
    assert f"{bad}:57:" in exc.value.message and "not valid JSON" in exc.value.message
    assert exc.value.hint and "one JSON object per line" in exc.value.hint


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("line, message", [
    ('[1, 2]', "expected a JSON object"),
    ('"just a string"', "expected a JSON object"),
    ('{"category": "qa", "turns": []}', "`turns` must be a non-empty list of strings"),
    ('{"category": "qa", "turns": "hello"}', "`turns` must be a non-empty list of strings"),
    ('{"category": "qa", "turns": [1]}', "`turns` must be a non-empty list of strings"),
    ('{"category": "qa"}', "no prompt"),
    ('{"category": "qa", "prompt": "   "}', "no prompt"),
    ('{"category": "", "prompt": "hi"}', "`category` must be a non-empty string"),
    ('{"category": 3, "prompt": "hi"}', "`category` must be a non-empty string"),
    ('{"question_id": 1, "category": "qa", "turns": ["again"]}', "duplicate id '1' (also on line 1)"),
])
def test_bad_jsonl_lines_name_the_line(tmp_path, line, message):
    good = '{"question_id": 1, "category": "qa", "turns": ["hi", "second turn"]}'
    path = write(tmp_path, "p.jsonl", f"{good}\n\n{line}\n")
    with pytest.raises(UsageError) as exc:
        workloads.read_file(path)
    assert exc.value.message.startswith(f"{path}:3: ") and message in exc.value.message


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_jsonl_file(tmp_path, content):
    path = write(tmp_path, "empty.jsonl", content)
    with pytest.raises(UsageError, match="no prompts found"):
        workloads.read_file(path)


def test_empty_text_file(tmp_path):
    with pytest.raises(UsageError, match="no prompts found"):
        workloads.read_file(write(tmp_path, "empty.txt", "\n \n"))


def test_non_utf8_file(tmp_path):
    path = write(tmp_path, "latin1.jsonl", '{"prompt": "caf'.encode() + b"\xe9" + b'"}\n')
    with pytest.raises(UsageError) as exc:
        workloads.read_file(path)
    assert "is not UTF-8 text (byte 15)" in exc.value.message


def test_unreadable_file(tmp_path):
    with pytest.raises(UsageError, match="cannot read prompts file .*missing.jsonl"):
        workloads.read_file(tmp_path / "missing.jsonl")
    with pytest.raises(UsageError, match="cannot read prompts file"):
        workloads.read_file(tmp_path)  # a directory


def test_plain_jsonl(tmp_path):
    path = write(tmp_path, "mine.jsonl", "\r\n".join([
        '{"prompt": "one", "category": "code", "system": "be brief"}',
        '{"text": "two"}',
        '{"id": "x7", "prompt": "three", "category": "code"}',
        '{"prompt": "four", "text": "ignored"}',
    ]))
    prompts = workloads.read_file(path)
    assert prompts == [Prompt("code-1", "code", "one", "be brief"), Prompt("default-2", "default", "two"),
                       Prompt("x7", "code", "three"), Prompt("default-4", "default", "four")]


def test_jsonl_detected_by_content_and_spec_bench_turns_win(tmp_path):
    path = write(tmp_path, "prompts.dat", '  {"turns": ["first", "second"], "prompt": "other"}\n')
    assert workloads.read_file(path) == [Prompt("default-1", "default", "first")]


def test_text_file(tmp_path):
    path = write(tmp_path, "notes.txt", "first prompt\nstill first\r\n\r\nsecond\n\n\n\n  third  \n")
    prompts = workloads.read_file(path)
    assert prompts == [Prompt("notes-1", "notes", "first prompt\nstill first"),
                       Prompt("notes-2", "notes", "second"), Prompt("notes-3", "notes", "third")]
    assert workloads.parse_text("a\n\nb")[1] == Prompt("text-2", "text", "b")


def test_select():
    prompts = [Prompt(f"{c}{i}", c, "t") for c in ("a", "b", "c") for i in range(3)]
    assert workloads.select(prompts) == prompts
    assert workloads.select(prompts, categories=[]) == prompts
    assert [p.id for p in workloads.select(prompts, 2)] == ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert [p.id for p in workloads.select(prompts, 1, ["c", "a"])] == ["a0", "c0"]
    assert [p.id for p in workloads.select(prompts, None, ["b"])] == ["b0", "b1", "b2"]
    assert workloads.select(prompts, 0) == []


def test_select_unknown_category_lists_the_known_ones():
    prompts = [Prompt("1", "code", "t"), Prompt("2", "qa", "t")]
    with pytest.raises(UsageError) as exc:
        workloads.select(prompts, None, ["code", "nope"])
    assert exc.value.message == "no prompts in category nope"
    assert exc.value.hint == "categories here: code, qa"
    with pytest.raises(UsageError, match="no prompts in categories nope, zz"):
        workloads.select(prompts, None, ["zz", "nope"])


# ------------------------------------------------------------------ sweeps and configurations

def test_parse_sweep_values_and_dedup():
    grid = parse_sweep(["draft-max=2, 4,8,4,2", "p-min=0,0.5,0.50,0.8", "DRAFT_MIN=1"])
    assert grid == {"draft-max": [2, 4, 8], "p-min": [0.0, 0.5, 0.8], "draft-min": [1]}
    assert isinstance(grid["p-min"][0], float)
    assert parse_sweep([]) == {}
    assert parse_sweep(["draft-max=0,64", "p-min=0,1"]) == {"draft-max": [0, 64], "p-min": [0.0, 1.0]}
    assert parse_sweep(["flash-attn=on,off", "kv-type=q8_0"]) == {"flash-attn": ["on", "off"],
                                                                   "kv-type": ["q8_0"]}
    # a repeated key adds to the grid instead of silently replacing the first values
    assert parse_sweep(["draft-max=2,4", "draft-max=4,8"]) == {"draft-max": [2, 4, 8]}


@pytest.mark.parametrize("spec, message", [
    ("speed=2", "unknown sweep key 'speed'"),
    ("draft-max", "bad --sweep 'draft-max'"),
    ("draft-max=", "bad --sweep 'draft-max='"),
    ("draft-max=  ", "bad --sweep"),
    ("draft-max=two", "--sweep draft-max: 'two' is not a valid int"),
    ("draft-max=2.5", "--sweep draft-max: '2.5' is not a valid int"),
    ("draft-max=2,,4", "--sweep draft-max: '' is not a valid int"),
    ("p-min=abc", "--sweep p-min: 'abc' is not a valid float"),
    ("draft-max=100", "--sweep draft-max: 100 is out of range 0..64"),
    ("draft-max=-1", "--sweep draft-max: -1 is out of range 0..64"),
    ("draft-min=65", "out of range 0..64"),
    ("p-min=1.5", "--sweep p-min: 1.5 is out of range 0.0..1.0"),
    ("p-min=-0.1", "out of range"),
    ("p-min=nan", "out of range"),
    ("p-min=inf", "out of range"),
    ("threads=0", "--sweep threads: 0 is out of range 1..512"),
    ("flash-attn=maybe", "--sweep flash-attn: 'maybe' is not one of auto, on, off"),
])
def test_parse_sweep_rejects(spec, message):
    with pytest.raises(UsageError) as exc:
        parse_sweep(["draft-max=2", spec])
    assert message in exc.value.message
    if message.startswith("unknown"):
        assert exc.value.hint == "sweep keys: " + ", ".join(SWEEP_KEYS)
    if message.startswith("bad"):
        assert "KEY=V1,V2" in exc.value.hint


def test_build_configs_plain_first_then_each_strategy_at_each_point():
    base = DraftParams(n_max=6, n_min=2, p_min=0.4)
    configs = build_configs(["draft", "ngram"], base, parse_sweep(["draft-max=2,8", "p-min=0,0.5"]))
    names = [c.name for c in configs]
    assert names == ["plain",
                     "draft max=2 pmin=0.0", "draft max=2 pmin=0.5", "draft max=8 pmin=0.0", "draft max=8 pmin=0.5",
                     "ngram max=2 pmin=0.0", "ngram max=2 pmin=0.5", "ngram max=8 pmin=0.0", "ngram max=8 pmin=0.5"]
    assert configs[0].is_plain and not any(c.is_plain for c in configs[1:])
    assert len(set(names)) == len(names)
    d = {c.name: c for c in configs}
    assert d["draft max=2 pmin=0.0"].draft == DraftParams(n_max=2, n_min=2, p_min=0.0)
    assert d["draft max=8 pmin=0.5"].draft == DraftParams(n_max=8, n_min=2, p_min=0.5)
    assert d["ngram max=2 pmin=0.5"].strategy == "ngram"


def test_build_configs_without_a_grid_and_clamping():
    base = DraftParams(n_max=4, n_min=3, p_min=0.5)
    configs = build_configs(["none", "draft", "hybrid", "auto"], base, {})
    assert [c.name for c in configs] == ["plain", "draft", "hybrid", "auto"]
    assert all(c.draft == base for c in configs[1:])
    clamped = build_configs(["draft"], base, parse_sweep(["draft-max=2"]))
    assert clamped[1].draft == DraftParams(n_max=2, n_min=2, p_min=0.5)  # draft-min clamped to max
    assert [c.name for c in build_configs([], base, {})] == ["plain"]
    # a strategy named twice is one configuration (two with one name would merge in the report)
    assert [c.name for c in build_configs(["draft", "ngram", "draft"], base, {})] == ["plain", "draft", "ngram"]


def test_build_configs_context_sweeps_give_plain_variants():
    configs = build_configs(["ngram"], DraftParams(), parse_sweep(["n-batch=64,128", "draft-max=2"]),
                            ctx=ContextParams(n_ctx=1024))
    assert [c.name for c in configs] == ["plain", "plain n-batch=64", "plain n-batch=128",
                                         "ngram n-batch=64 max=2", "ngram n-batch=128 max=2"]
    assert configs[0].target_ctx is None
    assert configs[1].target_ctx.n_batch == 64 and configs[1].target_ctx.n_ctx == 1024
    assert configs[4].target_ctx.n_batch == 128 and configs[4].draft.n_max == 2


def test_build_configs_unknown_strategy():
    with pytest.raises(UsageError, match="unknown strategy 'fast'") as exc:
        build_configs(["draft", "fast"], DraftParams(), {})
    assert "none, draft, ngram, hybrid, auto" in exc.value.hint


# ------------------------------------------------------------------ plan and run_bench

def test_plan_runs_everything_once_and_rotates_configs():
    prompts = [Prompt(f"p{i}", "c", "t") for i in range(5)]
    configs = [PLAIN, DRAFT, NGRAM]
    order = plan(prompts, configs, reps=2)
    keys = [(rep_, p.id, c.name) for rep_, p, c in order]
    assert len(keys) == 2 * 5 * 3 and len(set(keys)) == len(keys)
    assert set(keys) == {(r, p.id, c.name) for r in range(2) for p in prompts for c in configs}
    # repetitions in order, prompts in order within each, all configs of a prompt together
    groups = [order[i:i + 3] for i in range(0, len(order), 3)]
    names = [c.name for c in configs]
    for g, group in enumerate(groups):
        rep_, i = divmod(g, 5)
        assert {(r, p.id) for r, p, _ in group} == {(rep_, f"p{i}")}
        shift = (i + rep_) % 3
        assert [c.name for _, _, c in group] == names[shift:] + names[:shift]
    firsts = [group[0][2].name for group in groups]
    assert firsts[:4] == ["plain", "draft", "ngram", "plain"]
    # shifts 0,1,2,0,1 then 1,2,0,1,2: each configuration leads a group 3 or 4 times of 10
    assert {n: firsts.count(n) for n in names} == {"plain": 3, "draft": 4, "ngram": 3}
    assert plan([], configs, 3) == [] and plan(prompts, configs, 0) == []


class ScriptedSession:
    """Stands in for PairSession: records the calls, yields one DoneEvent per generation."""

    class options:
        target_ctx = ContextParams(n_ctx=512)
        draft_ctx = None

    def __init__(self):
        self.tokenized, self.generated, self.configured = [], [], []

    def prompt_tokens(self, msgs):
        self.tokenized.append(msgs)
        return [len(m["content"]) for m in msgs]

    def configure(self, target_ctx, draft_ctx, draft_model=None):
        self.configured.append((target_ctx, draft_ctx, draft_model))

    def generate(self, tokens, gen, strategy, draft):
        self.generated.append((tuple(tokens), gen.max_tokens, strategy, draft))
        stats = GenStats(strategy=strategy, n_generated=gen.max_tokens, t_total=1.0)
        stats.record_step(2 if strategy != "none" else 0, 1 if strategy != "none" else 0)
        yield "a token event"
        yield DoneEvent(stats, "length", "out", tuple(range(gen.max_tokens)))


def test_run_bench_warms_up_then_runs_the_plan():
    session = ScriptedSession()
    prompts = [Prompt("a", "c1", "hello", system="sys"), Prompt("b", "c2", "hi")]
    configs = [PLAIN, DRAFT, NGRAM]
    events = list(run_bench(session, prompts, configs, GenParams(max_tokens=40), reps=2))
    assert events[0].done == 0 and events[0].result is None and events[0].total == 12
    assert session.generated[0] == ((3, 5), 16, "none", PLAIN.draft)  # warm-up: plain, short
    assert [e.done for e in events[1:]] == list(range(1, 13)) and {e.total for e in events} == {12}
    got = [(e.result.rep, e.result.prompt_id, e.result.config) for e in events[1:]]
    assert got == [(r, p.id, c.name) for r, p, c in plan(prompts, configs, 2)]
    assert all(e.result.n_generated == 40 and e.result.reason == "length" for e in events[1:])
    assert events[2].result.category == "c1" and events[2].result.drafted == 2
    # each prompt is tokenized once, with its system prompt
    assert session.tokenized == [[{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}],
                                 [{"role": "user", "content": "hi"}]]
    assert [g[2] for g in session.generated[1:4]] == ["none", "draft", "ngram"]
    assert session.generated[2][3] == DRAFT.draft
    assert session.configured[1] == (session.options.target_ctx, session.options.target_ctx, None)


def test_run_bench_stops_when_asked_and_without_warmup():
    session = ScriptedSession()
    prompts = [Prompt("a", "c", "x"), Prompt("b", "c", "y")]
    seen = []

    def should_stop():
        return len(seen) >= 2

    for ev in run_bench(session, prompts, [PLAIN, DRAFT], GenParams(max_tokens=8), warmup=False,
                        should_stop=should_stop):
        seen.append(ev)
    assert [e.done for e in seen] == [1, 2] and all(e.result is not None for e in seen)
    assert len(session.generated) == 2 and {e.total for e in seen} == {4}


# ------------------------------------------------------------------ tuned settings

def test_tuned_round_trip(tmp_path):
    chosen = tune.choose(rep.aggregate(_wide([1.3, 1.2, 1.4], [1.1, 1.2, 1.25]),
                                       [PLAIN, DRAFT, NGRAM]))
    path = tmp_path / "home" / "tuned" / "k.json"
    tuned_file.save(path, chosen, {"target": "t.gguf", "threads": 2})
    loaded = tuned_file.load(path)
    assert {k: loaded[k] for k in chosen} == json.loads(json.dumps(chosen))
    assert loaded["meta"] == {"target": "t.gguf", "threads": 2} and loaded["when"]
    assert loaded["overall"]["strategy"] == "draft" and loaded["overall"]["n_max"] == 4
    assert [p.name for p in path.parent.iterdir()] == ["k.json"]  # no temporary file left


@pytest.mark.parametrize("content", [
    "", "{not json", "[1, 2]", "null", '{"overall": null}', '{"overall": {"config": "x"}}',
    '{"by_category": {}}', b"\xff\xfe garbage",
])
def test_tuned_corrupt_file_loads_as_none(tmp_path, content):
    path = write(tmp_path, "t.json", content)
    assert tuned_file.load(path) is None


def test_tuned_missing_file_loads_as_none(tmp_path):
    assert tuned_file.load(tmp_path / "nope.json") is None
    assert tuned_file.load(tmp_path) is None  # a directory


def test_tuned_path_depends_on_pair_files_and_threads(tmp_path):
    target = write(tmp_path, "target.gguf", b"t" * 10)
    draft = write(tmp_path, "draft.gguf", b"d" * 10)
    home = tmp_path / "home"
    p = tuned_file.tuned_path(home, target, draft)
    assert p.parent == home / "tuned" and p.suffix == ".json" and len(p.stem) == 16
    assert tuned_file.tuned_path(home, target, draft) == p  # stable
    assert tuned_file.tuned_path(home, target, draft, 0) == p
    # "all cores" and the explicit core count are the same setting
    import os

    assert tuned_file.tuned_path(home, target, draft, os.cpu_count()) == p
    assert tuned_file.tuned_path(home, target, draft, os.cpu_count() + 1) != p
    others = {
        tuned_file.tuned_path(home, target, draft, os.cpu_count() + 2),
        tuned_file.tuned_path(home, target, draft, os.cpu_count() + 4),
        tuned_file.tuned_path(home, target, None),
        tuned_file.tuned_path(home, draft, target),
        tuned_file.tuned_path(home, target, write(tmp_path, "draft2.gguf", b"d" * 10)),  # another draft
    }
    bigger = tmp_path / "b"
    bigger.mkdir()
    shutil.copy(target, bigger / "target.gguf")
    (bigger / "draft.gguf").write_bytes(b"d" * 11)  # same name, other size: another file
    others.add(tuned_file.tuned_path(home, bigger / "target.gguf", bigger / "draft.gguf"))
    assert p not in others and len(others) == 6
    # same names and sizes in another folder: the same pair
    (bigger / "draft.gguf").write_bytes(b"d" * 10)
    assert tuned_file.tuned_path(home, bigger / "target.gguf", bigger / "draft.gguf") == p
    assert tuned_file.tuned_path(tmp_path / "elsewhere", target, draft).name == p.name


def test_group_mt_bench_merges_and_interleaves_the_eight_categories():
    from tandem.bench import workloads as w

    if not SPEC_BENCH.exists():
        pytest.skip("shared/spec_bench is not beside this checkout")
    prompts = w.read_file(SPEC_BENCH)
    grouped = w.select(w.group_mt_bench(prompts), per_category=8)
    mt = [p for p in grouped if p.category == "mt-bench"]
    assert len(mt) == 8
    # one of each original category first
    originals = {p.id: p.category for p in prompts}
    assert sorted(originals[p.id] for p in mt) == sorted(w.MT_BENCH)
    assert {p.category for p in grouped} == {"mt-bench", "translation", "summarization", "qa",
                                             "math_reasoning", "rag"}


def test_tuned_file_on_a_full_disk_leaves_nothing_behind(tmp_path, monkeypatch):
    """(spec-bench --tune with one prompt never tunes any more, so the CLI matrix cannot reach
    this write: it is checked here.)"""
    import errno

    real = Path.write_text

    def full(self, data, *a, **kw):
        real(self, "", *a, **kw)  # created, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full)
    path = tmp_path / "tuned" / "k.json"
    with pytest.raises(OSError) as err:
        tuned_file.save(path, {"overall": None}, {})
    assert err.value.errno == errno.ENOSPC
    assert list(path.parent.iterdir()) == []


def test_spec_bench_eta_from_the_runs_so_far():
    from tandem.commands.bench import eta_text

    assert eta_text(0, 20, 0.0) == ""  # nothing measured yet: no guess
    assert eta_text(2, 20, 20.0) == "about 3 min left"  # 10 s a run, 18 to go
    assert eta_text(10, 20, 50.0) == "about 50 s left"
    assert eta_text(19, 20, 19.0) == "about 5 s left"
    assert eta_text(1, 1000, 30.0) == "about 8.3 h left"
    assert eta_text(20, 20, 99.0) == "done"
