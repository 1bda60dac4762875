"""tandem against llama-server, side by side: one prompt through one configuration (Row), and
what a run's rows say per configuration (Summary: per-prompt ratios to llama-server with its
defaults, their median, geometric mean and range, end to end and per decode step, acceptance,
outputs equal to the baseline's), as Markdown tables. Data in, text out; nothing printed.

The rows come from tandem.bench.peer_runs (scripts/bench_peer.py and its kin); each ratio is
taken within one prompt, so a machine that drifts between prompts favours no configuration.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.llama_server import BASELINE


@dataclass
class Row:
    """One prompt through one configuration."""
    prompt_id: str
    category: str
    config: str
    kind: str  # "server" | "tandem"
    tok_s: float = 0.0  # decode tok/s, end-of-text counted as llama-server counts it
    n_generated: int = 0
    drafted: int = 0
    accepted: int = 0
    text: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)  # strategy, notes, prompt tokens, ...
    e2e_s: float = 0.0  # prompt + decode seconds
    step_ms: float = 0.0  # decode time per decode step

    @property
    def ok(self) -> bool:
        return self.error is None and self.tok_s > 0


@dataclass
class Summary:
    config: str
    n: int  # prompts with a ratio
    median: float
    geomean: float
    lo: float
    hi: float
    median_tok_s: float
    acceptance: float | None  # accepted / drafted over all prompts, None when nothing drafted
    same: int  # greedy outputs equal to the baseline's text
    compared: int  # prompts where both texts exist
    e2e: float = float("nan")  # median ratio of the baseline's end-to-end time to this one's
    per_step: float = float("nan")  # median ratio of the baseline's time per step to this one's


def same_text(a: str, b: str) -> bool:
    """Greedy outputs agree when their texts match after stripping surrounding whitespace."""
    return a.strip() == b.strip()


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(rows: list[Row], configs: list[str], baseline: str = BASELINE) -> dict[str, Summary]:
    """Per configuration: per-prompt ratios of decode tok/s to the baseline's on the same
    prompt (median, geometric mean, range), acceptance, and outputs equal to the baseline's."""
    base = {r.prompt_id: r for r in rows if r.config == baseline}
    out: dict[str, Summary] = {}
    for config in configs:
        mine = [r for r in rows if r.config == config]
        ratios, speeds, same, compared = [], [], 0, 0
        e2e, per_step = [], []
        drafted = accepted = 0
        for r in mine:
            b = base.get(r.prompt_id)
            if r.ok:
                speeds.append(r.tok_s)
                drafted += r.drafted
                accepted += r.accepted
            if b is None or b.error is not None or r.error is not None:
                continue
            compared += 1
            same += same_text(r.text, b.text)
            if r.ok and b.ok:
                ratios.append(r.tok_s / b.tok_s)
                if r.e2e_s > 0 and b.e2e_s > 0:
                    e2e.append(b.e2e_s / r.e2e_s)
                if r.step_ms > 0 and b.step_ms > 0:
                    per_step.append(b.step_ms / r.step_ms)
        nan = float("nan")
        out[config] = Summary(
            config=config, n=len(ratios),
            median=statistics.median(ratios) if ratios else nan,
            geomean=geomean(ratios),
            lo=min(ratios) if ratios else nan, hi=max(ratios) if ratios else nan,
            median_tok_s=statistics.median(speeds) if speeds else nan,
            acceptance=accepted / drafted if drafted else None,
            same=same, compared=compared,
            e2e=statistics.median(e2e) if e2e else nan,
            per_step=statistics.median(per_step) if per_step else nan)
    return out


def _f(x: float, fmt: str = "{:.2f}") -> str:
    return "" if x is None or math.isnan(x) else fmt.format(x)


def render_table(title: str, summaries: dict[str, Summary], baseline: str = BASELINE) -> str:
    """Markdown table of one category's summaries, in the order given."""
    n_prompts = max((s.compared for s in summaries.values()), default=0)
    lines = [f"### {title} ({n_prompts} prompt{'s' if n_prompts != 1 else ''})", "",
             f"| configuration | median ratio to {baseline} | geomean | range | end to end "
             f"| per step | median tok/s | acceptance | same output as {baseline} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries.values():
        rng = f"{_f(s.lo)}-{_f(s.hi)}" if s.n else ""
        acc = f"{100 * s.acceptance:.1f}%" if s.acceptance is not None else ""
        lines.append(f"| {s.config} | {_f(s.median)} | {_f(s.geomean)} | {rng} | {_f(s.e2e)} | "
                     f"{_f(s.per_step)} | {_f(s.median_tok_s, '{:.1f}')} | {acc} | "
                     f"{s.same}/{s.compared} |")
    return "\n".join(lines)


def render_overview(per_category: dict[str, dict[str, Summary]], configs: list[str]) -> str:
    """One line per configuration, one column per category: the median ratio to plain."""
    cats = list(per_category)
    lines = ["| configuration | " + " | ".join(cats) + " |",
             "|---|" + "---|" * len(cats)]
    for c in configs:
        cells = [_f(per_category[cat][c].median) if c in per_category[cat] else "" for cat in cats]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(rows: list[Row], configs: list[str], categories: list[str]) -> str:
    parts, per_cat = [], {}
    for cat in categories:
        cat_rows = [r for r in rows if r.category == cat]
        if not cat_rows:
            continue
        per_cat[cat] = summarize(cat_rows, configs)
        parts.append(render_table(cat, per_cat[cat]))
    if len(per_cat) > 1:
        parts.append("### median ratio to plain, per category\n\n"
                     + render_overview(per_cat, configs))
    return "\n\n".join(parts)


def pool(files: list[Path]) -> str:
    """One report over several --out files (runs at different times): each prompt's ratio is
    still taken within its own run."""
    rows: list[Row] = []
    names: list[str] = []
    for i, f in enumerate(files):
        for d in json.loads(Path(f).read_text(encoding="utf-8"))["rows"]:
            r = Row(**d)
            r.prompt_id = f"{i + 1}:{r.prompt_id}"  # a prompt run twice pairs within its run
            rows.append(r)
            if r.config not in names:
                names.append(r.config)
    categories = list(dict.fromkeys(r.category for r in rows))
    return (f"# pooled: {len(files)} runs ({', '.join(str(f) for f in files)})\n\n"
            + report(rows, names, categories))
