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
