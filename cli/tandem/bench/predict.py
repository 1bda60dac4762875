"""--predict: the acceptance measured here, priced with another machine's cost figures.

Per configuration, the measured tokens per verify step are combined with the profile's
verify-batch cost ratios (batch of k vs one token) and draft cost ratio (draft token vs target
token): speedup = tokens per step / mean step cost, where each measured step is priced at its
own length (k x draft ratio + verify ratio(k + 1)). Pricing the mean draft length instead
would be wrong wherever plain and long-draft steps mix, since the verify curve is not linear.
Always reported as a prediction, never as a measurement. The cost figures come from a
hardware profile, or from a costs file measured on a machine (costs_from_file): `tandem hw
costs` writes one (bench/hw_costs.py), and scripts/gpu_check.py's JSON holds the same sections.
Its seq_batch curve (N sequences' plain steps in one decode) adds the aggregate throughput
of N plain sequences; steps of several speculating sequences are not priced: their
drafts' batched cost and the scheduler's mix of step lengths are not measured yet.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping

from tandem.bench.report import OVERALL, Report
from tandem.engine.tuning.costs import CostModel
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
    result = {"speedup": out, "basis": basis, "source": cost.get("source", "")}
    seq = cost.get("seq_plain_ratio") or {}
    if seq:  # N tokens a step at the cost of one decode of N rows
        result["concurrency"] = {n: round(n / r, 3) for n, r in sorted(seq.items())}
        result["basis"] += ("; plain decoding of N sequences at once: aggregate tokens/s "
                            + ", ".join(f"{g:.2f}x at N={n}" for n, g in
                                        result["concurrency"].items())
                            + " (speculating sequences at once are not priced)")
    return result


_COSTS_HINT = "pass the JSON file that `tandem hw costs --out FILE` wrote"


def _shape_for(shapes: Mapping, name: str, fallback) -> str:
    """A shape of the costs file: `name` itself (`tandem hw costs` keys shapes by file name),
    else the size in a model file's name."""
    measured_ok = {k for k, v in shapes.items() if isinstance(v, Mapping) and "verify" in v}
    for key in (name, model_size(name) if name else None, fallback):
        if isinstance(key, str) and key in measured_ok:
            return key
    raise UsageError(f"the costs file has no measured shape for {name or 'the pair'!r}",
                     f"measured shapes: {', '.join(sorted(map(str, measured_ok))) or 'none'}")


def _positive(value, what: str, zero_ok: bool = False) -> float:
    """A finite number > 0 (>= 0 with zero_ok) from the costs file, else a UsageError: a zero
    cost once divided by zero, a string once raised TypeError."""
    import math

    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        raise UsageError(f"the costs file's {what} must be a finite number "
                         f"{'>= 0' if zero_ok else '> 0'}, got {str(value)[:40]!r}",
                         _COSTS_HINT)
    return float(value)


def _seq_plain(section, shape: str) -> dict[int, float]:
    """The seq_batch curve of `shape` for plain steps (one row per sequence): {N: the cost of
    N sequences' rows in one decode, against one sequence's}; {} where the file has none (an
    older file, or the section erred)."""
    entry = section.get(shape) if isinstance(section, Mapping) else None
    ratio = entry.get("ratio") if isinstance(entry, Mapping) else None
    if not isinstance(ratio, Mapping):
        return {}
    plain = ratio.get("1")
    if not isinstance(plain, Mapping):
        raise UsageError(f"the costs file's seq_batch of {shape!r} has no plain-step curve",
                         _COSTS_HINT)
    return _curve(plain, "seq_batch ratio", "sequences", 256)


def _curve(raw: Mapping, what: str, unit: str, most: int, skip: int = 0) -> dict[int, float]:
    """{count: figure} of a costs file's curve: each key a whole count 1..most, each figure
    (for counts above `skip`) a number > 0."""
    out = {}
    for k, v in raw.items():
        n = int(k) if isinstance(k, str) and k.isdigit() else 0
        if not 1 <= n <= most:
            raise UsageError(f"the costs file's {what} key {str(k)[:20]!r} is not a count of "
                             f"{unit} 1..{most}", _COSTS_HINT)
        if n > skip:
            out[n] = _positive(v, f"{what} for {n} {unit}")
    return out


def costs_from_file(data: Mapping, target: str = "", draft: str = "") -> dict:
    """The cost figures predict() reads, from a costs file (`tandem hw costs`, or
    scripts/gpu_check.py's JSON, which holds the same sections): the verify curve of
    the target's shape (k-token batch against one token) and the draft's token cost (its
    decode plus the host's draft_top, against the target's decode), and where the file has
    it the target shape's seq_batch curve of plain steps (seq_plain_ratio). `target` /
    `draft`: shape names or model file names (matched by name, else by size); default: the
    pair the file names. Every figure is checked: the file may be anything a user passes."""
    shapes = data.get("shapes") if isinstance(data, Mapping) else None
    if not isinstance(shapes, Mapping) or data.get("schema") != 1:
        raise UsageError("this is not a costs file (schema 1, with a shapes section)",
                         _COSTS_HINT)
    pair = data.get("pair") if isinstance(data.get("pair"), Mapping) else {}
    t = _shape_for(shapes, target, pair.get("target_shape"))
    d = _shape_for(shapes, draft, pair.get("draft_shape"))
    ts, ds = shapes[t], shapes[d]
    raw = ts["verify"].get("ratio") if isinstance(ts["verify"], Mapping) else None
    if not isinstance(raw, Mapping):
        raise UsageError(f"the costs file's shape {t!r} has no verify ratios", _COSTS_HINT)
    ratios = _curve(raw, "verify ratio", "tokens", 65, skip=1)  # 1 token: 1.0 by definition
    t_ms = _positive(ts.get("decode_ms"), f"decode_ms of {t}")
    draft_ms = _positive(ds.get("decode_ms"), f"decode_ms of {d}") + _positive(
        ds.get("host_draft_top_us", 0.0), f"host_draft_top_us of {d}", zero_ok=True) / 1000
    seq = _seq_plain(data.get("seq_batch"), t)
    env = data.get("environment") if isinstance(data.get("environment"), Mapping) else {}
    gpus = env.get("gpus") if isinstance(env.get("gpus"), list) else []
    where = ", ".join(map(str, gpus)) or str(data.get("backend", ""))
    made_by = str(data.get("source") or "gpu_check")[:40]  # gpu_check's files name no source
    synthetic = "synthetic " if made_by == "gpu_check" else ""
    return {"verify_ratio": ratios, "draft_ratio": draft_ms / t_ms,
            "decode_ms": {t: t_ms, d: ds["decode_ms"]}, "seq_plain_ratio": seq,
            "source": f"{made_by} on {where}: {synthetic}{t} target, {d} draft "
                      f"({str(data.get('started', ''))[:40]})"}


def load_costs_file(path, target: str = "", draft: str = "") -> dict:
    """costs_from_file() of a JSON file, with a usage error for what cannot be read."""
    try:
        data = json.loads(Path(path).read_text())
    except RecursionError:
        raise UsageError(f"the costs file {path} is nested too deeply", _COSTS_HINT) from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the costs file {path}: {exc}",
                         _COSTS_HINT) from None
    return costs_from_file(data, target, draft)
