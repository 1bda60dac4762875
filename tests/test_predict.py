"""--predict arithmetic: measured acceptance priced with a profile's cost ratios."""
import pytest
from tandem.bench.predict import draft_ratio_for, model_size, predict
from tandem.bench.report import OVERALL, Cell, Report
from tandem.errors import UsageError


def _cell(config, tokens_per_step, drafted_per_step):
    return Cell(config, OVERALL, 1, 10.0, 1.0, 1.0, 1.0, 0.8, 2.0, [], 0.3, 0.7, 1, 1,
                tokens_per_step=tokens_per_step, drafted_per_step=drafted_per_step)


def test_prediction_prices_steps_with_the_profile_ratios():
    report = Report(configs=[{"name": "plain", "strategy": "none"},
                             {"name": "draft", "strategy": "draft"},
                             {"name": "ngram", "strategy": "ngram"}],
                    categories=[], cells=[_cell("plain", 1, 0), _cell("draft", 3.0, 3.0),
                                          _cell("ngram", 2.0, 1.0)])
    out = predict(report, {"verify_ratio": {2: 1.2, 4: 1.6}, "draft_ratio": 0.1})
    # draft: 3 tokens per step for 3 x 0.1 + r(4) = 1.9 plain-token times
    assert out["speedup"]["draft"] == pytest.approx(3.0 / 1.9, abs=1e-3)
    # ngram drafts are free: 2 tokens for r(2) = 1.2
    assert out["speedup"]["ngram"] == pytest.approx(2.0 / 1.2, abs=1e-3)
    assert "plain" not in out["speedup"]


def test_draft_ratio_from_decode_times_and_sizes():
    cost = {"decode_ms": {"0.5b": 2.0, "32b": 30.0}}
    assert draft_ratio_for(cost, "qwen2.5-32b-instruct-q4_k_m.gguf",
                           "qwen2.5-0.5b-instruct-q4_k_m.gguf") == pytest.approx(2 / 30)
    assert model_size("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "1b"
    with pytest.raises(UsageError, match="no draft cost"):
        predict(Report([], [], []), cost, "target.gguf", "draft.gguf")


def test_mixed_steps_are_priced_each_at_its_own_length():
    """Half plain steps, half 8-draft steps: the mean draft length (4) through the curve would
    price every step as a 5-token batch; each step must be priced at its own length."""
    cell = _cell("draft", 5.0, 4.0)
    cell.steps_by_drafted = [10] + [0] * 7 + [10]  # 10 steps with 0 drafts, 10 with 8
    report = Report(configs=[{"name": "draft", "strategy": "draft"}], categories=[], cells=[cell])
    ratios = {2: 1.1, 5: 1.2, 9: 2.0}
    out = predict(report, {"verify_ratio": ratios, "draft_ratio": 0.1})
    per_step = 0.5 * 1.0 + 0.5 * (8 * 0.1 + 2.0)  # 1.9
    assert out["speedup"]["draft"] == pytest.approx(5.0 / per_step, abs=1e-3)
    at_mean = 4 * 0.1 + 1.2  # what pricing the mean would give: 1.6
    assert abs(out["speedup"]["draft"] - 5.0 / at_mean) > 0.3


def test_step_histogram_from_drafted_at():
    from tandem.bench.report import _steps_by_drafted

    # 10 steps: 4 plain, 3 with 1 draft, 1 with 2, 2 with 3 -> drafted_at = [6, 3, 2]
    assert _steps_by_drafted(10, [6, 3, 2]) == [4, 3, 1, 2]


def _gpu_check(**shapes):
    return {"schema": 1, "backend": "cuda", "started": "2026-12-01T00:00:00",
            "environment": {"gpus": ["NVIDIA H200, 143771 MiB, 580.0"]},
            "pair": {"target_shape": "7b", "draft_shape": "0.5b"},
            "shapes": {name: {"decode_ms": ms, "host_draft_top_us": 50.0,
                              "verify": {"ratio": {"1": 1.0, "2": 1.05, "5": 1.2, "9": 1.6}}}
                       for name, ms in shapes.items()}}


def test_a_costs_file_becomes_the_cost_model_of_the_matching_shapes():
    from tandem.bench.predict import costs_from_file

    data = _gpu_check(**{"0.5b": 1.5, "1.5b": 2.5, "7b": 7.0})
    # model files matched by size: the 1.5B target's own curve and decode time
    costs = costs_from_file(data, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    assert costs["verify_ratio"] == {2: 1.05, 5: 1.2, 9: 1.6}
    # a draft token: its decode plus the host's draft_top, against the target's decode
    assert costs["draft_ratio"] == pytest.approx((1.5 + 0.05) / 2.5)
    assert "1.5b target, 0.5b draft" in costs["source"]
    # names without a measured size fall back to the pair gpu_check measured
    assert costs_from_file(data, "other.gguf", "")["draft_ratio"] == pytest.approx(1.55 / 7.0)
    report = Report(configs=[{"name": "draft", "strategy": "draft"}], categories=[],
                    cells=[_cell("draft", 3.0, 4.0)])
    out = predict(report, costs, "qwen2.5-coder-1.5b.gguf", "qwen2.5-coder-0.5b.gguf")
    assert out["speedup"]["draft"] == pytest.approx(3.0 / (4 * 1.55 / 2.5 + 1.2), abs=1e-3)


def test_a_costs_file_is_refused_where_it_cannot_price():
    from tandem.bench.predict import costs_from_file, load_costs_file

    with pytest.raises(UsageError, match="not a costs file"):
        costs_from_file({"shapes": []})
    data = _gpu_check(**{"0.5b": 1.5})
    data["shapes"]["7b"] = {"error": "RuntimeError: out of memory"}
    with pytest.raises(UsageError, match="no measured shape"):
        costs_from_file(data, "qwen2.5-7b.gguf", "qwen2.5-0.5b.gguf")
    with pytest.raises(UsageError, match="cannot read"):
        load_costs_file("/nonexistent/gc.json")
