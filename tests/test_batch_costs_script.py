"""scripts/batch_costs.py (serve --parallel's batch curve): on the tiny target, the table's
arithmetic (a draft row's cost is the difference of two timings, its units raw(1)); with
scripted timings, auto's longest draft is the length controller's over the curve. Never a
speed."""
from __future__ import annotations

import json

import pytest

from batch_costs import ONE_DRAFTS, curve, figures, layouts, main
from tandem.engine.drafting.adaptive import longest_paying
from tandem.engine.tuning.costs import BatchCosts, CostModel


def test_the_table_on_the_tiny_target(tiny_models, tmp_path, capsys):
    out = tmp_path / "costs.json"
    assert main(["-m", str(tiny_models["target"]), "-t", "1", "--reps", "2", "--ctx", "256",
                 "--prompt-tokens", "48", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["b"] for r in rows] == [1, 2, 4, 8] and doc["raw1_ms"] == rows[0]["raw_ms"]
    assert doc["context"]["n_seq_max"] == 9 and doc["context"]["kv_unified"]
    for r in rows:
        assert r["raw_ms"] == r["every_drafts_ms"]["0"] > 0
        assert r["row_ms"] == pytest.approx(r["one_drafts_ms"]["1"] - r["raw_ms"], abs=1e-3)
        assert r["row_plain"] == pytest.approx(r["row_ms"] / doc["raw1_ms"], abs=1e-3)
        assert r["share_ms"] == pytest.approx(r["raw_ms"] / r["b"], abs=1e-3)
        assert all(r["every_drafts_ratio"][k] == pytest.approx(v / r["raw_ms"], abs=1e-3)
                   for k, v in r["every_drafts_ms"].items())
        assert set(r["longest"]) == {"0.6", "0.8", "0.9"}
        assert all(0 <= k <= 16 for k in r["longest"].values())
    # every layout timed --reps times; b = 1's two families are one layout
    assert all(len(t) == 2 for t in doc["layouts_ms"].values())
    assert len(doc["layouts_ms"]) == 4 * 5 + 4 * 5 - 4
    text = capsys.readouterr().out
    assert text.count("\n| 8 |") == 2 and "raw(b+1) - raw(b)" in text


def steep(layout: tuple[int, ...]) -> float:
    """A CPU-like curve: each row costs 40% of a plain step."""
    return 0.1 * (0.6 + 0.4 * sum(layout))


def test_auto_takes_what_the_controller_takes_over_the_curve():
    every, one = layouts([1, 2, 4, 8])
    times = {lay: [steep(lay), steep(lay) * 1.02] for lay in [*every.values(), *one.values()]}
    doc = figures(times, [1, 2, 4, 8], [0.6, 0.9])
    for r in doc["rows"]:
        b = r["b"]
        verify, spread = curve(times, b)
        # b plain rows, then one sequence drafting k beside b - 1 plain ones
        assert sorted(verify) == [b, *(b + k for k in ONE_DRAFTS)]
        assert verify[b + 2] == pytest.approx(steep((3,) + (1,) * (b - 1)) * 1.01)
        assert spread[b] == pytest.approx(0.01 / 1.01)
        costs = BatchCosts(CostModel(verify=verify, spread=spread), lambda b=b: b - 1)
        assert r["longest"] == {"0.6": longest_paying(costs, 0.6),
                                "0.9": longest_paying(costs, 0.9)}
        assert r["row_plain"] == pytest.approx(0.4)
    longest = [r["longest"]["0.9"] for r in doc["rows"]]
    assert longest == sorted(longest, reverse=True) and longest[0] > longest[-1]
