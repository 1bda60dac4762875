"""--predict: the acceptance measured here, priced with another machine's cost figures.

Per configuration, the measured tokens per verify step are combined with the profile's
verify-batch cost ratios (batch of k vs one token) and draft cost ratio (draft token vs target
token): speedup = tokens per step / mean step cost, where each measured step is priced at its
own length (k x draft ratio + verify ratio(k + 1)). Pricing the mean draft length instead
would be wrong wherever plain and long-draft steps mix, since the verify curve is not linear.
Always reported as a prediction, never as a measurement.
"""
from __future__ import annotations

import re
from typing import Mapping

from tandem.bench.report import OVERALL, Report
from tandem.engine.costs import CostModel
from tandem.errors import UsageError


def model_size(name: str) -> str | None:
    """'qwen2.5-coder-0.5b-instruct-q4_k_m.gguf' -> '0.5b'"""
    m = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)b(?![a-z])", name.lower())
    return f"{m.group(1)}b" if m else None


def draft_ratio_for(cost: Mapping, target: str, draft: str) -> float | None:
    """The profile's draft ratio, else decode_ms[draft size] / decode_ms[target size]."""
    if cost.get("draft_ratio") is not None:
        return float(cost["draft_ratio"])
    decode = cost.get("decode_ms") or {}
    t, d = model_size(target), model_size(draft)
    if t in decode and d in decode and decode[t] > 0:
        return float(decode[d]) / float(decode[t])
    return None


def mean_step_cost(steps_by_drafted, curve: CostModel, per_draft: float) -> float:
    """The mean cost of the measured steps, each priced at its own draft length."""
    hist = (steps_by_drafted if isinstance(steps_by_drafted, dict)
            else dict(enumerate(steps_by_drafted)))
    total = sum(hist.values())
    if total <= 0:
        return 0.0
    return sum(n * (k * per_draft + curve.verify_cost(k + 1)) for k, n in hist.items() if n) / total


def _all_at_mean(drafted_per_step: float) -> dict:
    # a cell without its step histogram (an older report): every step at the mean length
    return {drafted_per_step: 1}


def predict(report: Report, cost: Mapping, target: str = "", draft: str = "") -> dict:
    ratios = {int(k): float(v) for k, v in (cost.get("verify_ratio") or {}).items()}
    curve = CostModel(verify={1: 1.0, **ratios})
    found = draft_ratio_for(cost, target, draft)
    if found is None:
        raise UsageError("this profile has no draft cost for this pair",
                         "its cost section needs draft_ratio, or decode_ms for both model sizes")
    draft_ratio = found
    strategies = {c["name"]: c["strategy"] for c in report.configs}
    out = {}
    for cell in report.cells:
        if cell.category != OVERALL or strategies.get(cell.config) == "none":
            continue
        per_draft = 0.0 if strategies.get(cell.config) == "ngram" else draft_ratio
        # hybrid/auto drafts are priced as draft-model tokens: an upper bound on their cost
        hist = cell.steps_by_drafted or _all_at_mean(cell.drafted_per_step)
        step_cost = mean_step_cost(hist, curve, per_draft)
        out[cell.config] = round(cell.tokens_per_step / step_cost, 3) if step_cost > 0 else 0.0
    basis = (f"verify ratios {ratios or 'none'}, draft ratio {draft_ratio:.3f}; "
             "hybrid/auto drafts priced as draft-model tokens (an upper bound on their cost)")
    return {"speedup": out, "basis": basis, "source": cost.get("source", "")}
