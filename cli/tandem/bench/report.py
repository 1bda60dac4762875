"""Aggregate bench runs: per category and overall, speedups against plain decoding measured
in the same run (prompt by prompt), spread, acceptance, time split, output equality, validity.

Over 400 lines because the aggregation and its renderings (Markdown, CSV, SVG) read the same
cells: a column added to one is added to the others here."""
from __future__ import annotations

import csv
import io
import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from tandem.bench.runner import BenchConfig, RunResult, first_difference  # noqa: F401 (re-exported)
from tandem.bench.verdict import OVERALL, load_warning, ratio_text, verdict
from tandem.fsutil import atomic_write_text
from tandem.machine.load import busy

# In fast mode a greedy divergence whose two tokens' logits (plain decoding's, at that
# position) are closer than this is a near-tie flip: batched and single-token kernels round
# differently, on the 1.5B target by up to 0.69 for any logit and 0.31 for the winning one
# (scripts/batch_invariance.py, docs/benchmarks.md), so gaps under their sum can flip. Wider
# gaps are bugs.
NEAR_TIE_GAP = 1.0
INVALID_LISTED = 20  # invalid outputs named per cell (the count covers them all)


@dataclass
class Cell:
    """One configuration on one category (or overall)."""

    config: str
    category: str
    runs: int
    tokens_per_second: float  # median over runs
    speedup: float | None  # median of per-prompt ratios to plain (same prompt, same rep)
    speedup_lo: float | None  # spread: 25th..75th percentile of those ratios
    speedup_hi: float | None
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_by_position: list[float]
    draft_share: float  # of draft + verify + sample time
    verify_share: float
    identical: int  # runs whose greedy output equals plain decoding's
    compared: int
    near_ties: int = 0  # fast mode: divergences at a near tie (counted apart from mismatches)
    tokens_per_step: float = 0.0  # generated tokens per target verify batch
    drafted_per_step: float = 0.0
    mismatches: list[str] = field(default_factory=list)
    notes: dict[str, int] = field(default_factory=dict)  # drafter note -> runs that gave it
    prompts: int = 0  # distinct prompts behind the runs
    # verify steps by draft length: steps_by_drafted[k] = steps that carried k drafts
    steps_by_drafted: list[int] = field(default_factory=list)
    # the same work counted on both sides (bench/accounting.py): median per-prompt ratio of
    # plain's end-to-end time (prompt + decode) to this configuration's, and the median time
    # per decode step
    e2e_speedup: float | None = None
    step_ms: float = 0.0
    busy_runs: int = 0  # runs measured on a busy machine (or their plain run): marked busy
    # under a constraint: outputs that validate, of those checked (bench/structured_workload.py),
    # and the first few that did not ("prompt: why")
    valid: int = 0
    checked: int = 0
    invalid: list[str] = field(default_factory=list)


@dataclass
class Report:
    configs: list[dict]
    categories: list[str]
    cells: list[Cell]
    partial: bool = False
    meta: dict = field(default_factory=dict)
    # the load over the runs: {"runs", "busy_runs", "peak": the largest share other processes
    load: dict = field(default_factory=dict)  # took of the CPU during a run (None: unknown)}

    def cell(self, config: str, category: str = OVERALL) -> Cell | None:
        return next((c for c in self.cells if c.config == config and c.category == category), None)

    def to_dict(self) -> dict:
        return {"meta": self.meta, "partial": self.partial, "configs": self.configs,
                "categories": self.categories, "cells": [asdict(c) for c in self.cells],
                "load": self.load, "verdict": verdict(self), "load_warning": load_warning(self)}


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def aggregate(results: Sequence[RunResult], configs: Sequence[BenchConfig], greedy: bool = True,
              partial: bool = False, meta: dict | None = None, exact: bool = False) -> Report:
    """`exact`: every greedy divergence is a mismatch (exact mode promises identity); else
    divergences at a near tie (see NEAR_TIE_GAP) are counted as such."""
    plain_name = next((c.name for c in configs if c.is_plain), None)
    plain = {(r.prompt_id, r.rep): r for r in results if r.config == plain_name}
    categories = sorted({r.category for r in results})
    cells = []
    for config in configs:
        mine = [r for r in results if r.config == config.name]
        for category in categories + [OVERALL]:
            runs = [r for r in mine if category == OVERALL or r.category == category]
            if runs:
                cells.append(_cell(config, category, runs, plain, greedy, config.name == plain_name,
                                   exact))
    shares = [r.busy for r in results if r.busy is not None]
    load = {"runs": len(results), "busy_runs": sum(1 for r in results if busy(r.busy)),
            "peak": max(shares) if shares else None}
    return Report([c.to_dict() for c in configs], categories, cells, partial, meta or {}, load)


def _cell(config: BenchConfig, category: str, runs: list[RunResult], plain: dict, greedy: bool,
          is_plain: bool, exact: bool = False) -> Cell:
    ratios, identical, compared, mismatches, near_ties = [], 0, 0, [], 0
    e2e = []
    busy_runs = sum(1 for r in runs if busy(r.busy))
    for r in runs:
        base = plain.get((r.prompt_id, r.rep))
        if base is None:
            continue
        if not is_plain and busy(base.busy) and not busy(r.busy):
            busy_runs += 1
        if base.tokens_per_second > 0:
            ratios.append(r.tokens_per_second / base.tokens_per_second)
        # end to end compares the same work only where both evaluated the same prompt tokens
        # (a conversation's turn finds its earlier turns in the KV cache)
        if r.t_e2e > 0 and base.t_e2e > 0 and r.n_prompt_eval == base.n_prompt_eval:
            e2e.append(base.t_e2e / r.t_e2e)
        if greedy and not is_plain:
            compared += 1
            diff = first_difference(base.tokens, r.tokens)
            if diff is None:
                identical += 1
                continue
            where = f"{r.prompt_id} (rep {r.rep}): differs at token {diff}"
            div = r.divergence
            if div is not None:
                where += f", logit gap {div['gap']:.3f} ({div['plain']} vs {div['other']})"
            if not exact and div is not None and abs(div["gap"]) < NEAR_TIE_GAP:
                near_ties += 1
            else:
                mismatches.append(where)
    drafted = sum(r.drafted for r in runs)
    accepted = sum(r.accepted for r in runs)
    steps_drafted = sum(r.n_steps_drafted for r in runs)
    width = max((len(r.drafted_at) for r in runs), default=0)
    d_at = [sum(r.drafted_at[i] for r in runs if i < len(r.drafted_at)) for i in range(width)]
    a_at = [sum(r.accepted_at[i] for r in runs if i < len(r.accepted_at)) for i in range(width)]
    t_all = sum(r.t_draft + r.t_verify + r.t_sample for r in runs) or 1.0
    return Cell(
        config=config.name, category=category, runs=len(runs),
        tokens_per_second=statistics.median(r.tokens_per_second for r in runs),
        speedup=statistics.median(ratios) if ratios else None,
        speedup_lo=_quantile(ratios, 0.25) if ratios else None,
        speedup_hi=_quantile(ratios, 0.75) if ratios else None,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=(accepted + steps_drafted) / steps_drafted if steps_drafted else 0.0,
        acceptance_by_position=[a / d if d else 0.0 for a, d in zip(a_at, d_at)],
        draft_share=sum(r.t_draft for r in runs) / t_all,
        verify_share=sum(r.t_verify for r in runs) / t_all,
        identical=identical, compared=compared, mismatches=mismatches, near_ties=near_ties,
        tokens_per_step=sum(r.n_generated for r in runs) / max(sum(r.n_steps for r in runs), 1),
        drafted_per_step=drafted / max(sum(r.n_steps for r in runs), 1),
        notes=_group_notes(n for r in runs for n in r.notes),
        prompts=len({r.prompt_id for r in runs}),
        steps_by_drafted=_steps_by_drafted(sum(r.n_steps for r in runs), d_at),
        e2e_speedup=statistics.median(e2e) if e2e else None,
        step_ms=1000 * statistics.median(r.step_s for r in runs), busy_runs=busy_runs,
        valid=sum(1 for r in runs if r.valid), checked=sum(1 for r in runs if r.valid is not None),
        invalid=[f"{r.prompt_id} (rep {r.rep}): {r.invalid}" for r in runs
                 if r.valid is False][:INVALID_LISTED])


def _steps_by_drafted(n_steps: int, drafted_at: Sequence[int]) -> list[int]:
    """drafted_at[i] counts steps with more than i drafts; the difference of neighbours is the
    number of steps with exactly i + 1 drafts."""
    reach = [n_steps] + list(drafted_at) + [0]
    return [reach[k] - reach[k + 1] for k in range(len(reach) - 1)]


def _group_notes(notes) -> dict[str, int]:
    """Count notes that differ only in their figures (costs are refined run by run) as one,
    shown with the latest figures."""
    latest: dict[str, str] = {}
    counts: dict[str, int] = {}
    for note in notes:
        key = re.sub(r"\d+(\.\d+)?", "#", note)
        latest[key] = note
        counts[key] = counts.get(key, 0) + 1
    return {latest[k]: counts[k] for k in counts}


def best(report: Report, category: str = OVERALL) -> Cell | None:
    """The fastest configuration for a category: highest median speedup (plain counts as 1.0)."""
    cells = [c for c in report.cells if c.category == category and c.speedup is not None]
    return max(cells, key=lambda c: (c.speedup, c.runs)) if cells else None


def to_csv(results: Sequence[RunResult]) -> str:
    buf = io.StringIO()
    cols = ["config", "prompt_id", "category", "rep", "n_generated", "tokens_per_second",
            "t_decode", "drafted", "accepted", "n_steps", "t_draft", "t_verify", "t_sample",
            "reason", "tokens_per_second_own", "t_prefill", "t_e2e", "step_s", "busy", "valid"]
    w = csv.writer(buf)
    w.writerow(cols)
    for r in results:
        w.writerow([getattr(r, c) for c in cols])
    return buf.getvalue()


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# meta entries with a section of their own in the report, not a row of its header
_OWN_SECTIONS = ("costs", "predictions")


def header_rows(meta: dict) -> list[tuple[str, str]]:
    """The report header as (setting, value) rows of readable text: lists joined, the cost
    figures and predictions left to their own tables."""
    rows = []
    for key, value in meta.items():
        if key in _OWN_SECTIONS:
            continue
        if isinstance(value, (list, tuple)):
            value = ", ".join(str(v) for v in value) or "-"
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        rows.append((key.replace("_", " "), str(value)))
    return rows


def _cell_text(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: Report) -> str:
    """Over 80 lines because the report is one document read top to bottom: each section's
    table follows its explanation, in the order a reader needs them."""
    lines = ["# spec-bench report", "", f"**{verdict(report)}**", ""]
    if report.partial:
        lines += ["**Partial results**: the run was interrupted.", ""]
    warning = load_warning(report)
    if warning:
        lines += [f"**Warning**: {warning}", ""]
    lines += ["| setting | value |", "|---|---|"]
    lines += [f"| {k} | {_cell_text(v)} |" for k, v in header_rows(report.meta)]
    lines += ["", "Speedup is the median over prompts of decode tokens/s divided by plain "
              "decoding's on the same prompt in the same run; the bracket is its 25th-75th percentile. "
              "Tokens/s count end-of-text as llama-server does (a predicted token). \"busy\": "
              "some of the cell's runs (or plain decoding's on the same prompts) were measured "
              "while other processes took the CPU. \"valid N/M\": under a grammar or schema, the "
              "outputs that validate against it (checked with jsonschema).", ""]
    names = [c["name"] for c in report.configs]
    lines.append("| category | " + " | ".join(names) + " |")
    lines.append("|---" * (len(names) + 1) + "|")
    for category in report.categories + [OVERALL]:
        row = []
        for name in names:
            c = report.cell(name, category)
            row.append("-" if c is None else
                       f"{ratio_text(c)} [{_fmt(c.speedup_lo)}-{_fmt(c.speedup_hi)}] "
                       f"{c.tokens_per_second:.1f} tok/s{valid_text(c)}")
        label = f"**{category}**" if category == OVERALL else category
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += ["", "## End to end (prompt + decode) and per decode step", "",
              "End to end: median per-prompt ratio of plain decoding's prompt + decode time to "
              "the configuration's, over runs that evaluated as many prompt tokens (single "
              "prompts are run cold, as `tandem run`; conversation turns reuse the KV cache, "
              "so their runs rarely qualify: -); per step: median decode time per decode "
              "step.", "",
              "| category | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for category in report.categories + [OVERALL]:
        row = []
        for name in names:
            c = report.cell(name, category)
            row.append("-" if c is None else f"{_fmt(c.e2e_speedup)}x e2e, {c.step_ms:.1f} ms/step")
        label = f"**{category}**" if category == OVERALL else category
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += ["", "## Acceptance and time split (overall)", "",
              "| config | acceptance | mean accepted length | by position | draft / verify time | greedy output = plain |",
              "|---|---|---|---|---|---|"]
    for name in names:
        c = report.cell(name)
        if c is None:
            continue
        pos = " ".join(f"{100 * a:.0f}" for a in c.acceptance_by_position[:8])
        same = f"{c.identical}/{c.compared}" if c.compared else "-"
        if c.compared and c.identical < c.compared:
            same += f" ({c.near_ties} near-tie, {len(c.mismatches)} mismatch)"
        lines.append(f"| {name} | {100 * c.acceptance_rate:.1f}% | {c.mean_accepted_length:.2f} | "
                     f"{pos or '-'} | {100 * c.draft_share:.0f}% / {100 * c.verify_share:.0f}% | {same} |")
    costs = report.meta.get("costs") or {}
    curves = costs.get("verify_ms") or {}
    if curves:
        sizes = sorted({int(n) for curve in curves.values() for n in curve})
        lines += ["", "## Verify-batch cost (ms for a batch of k tokens; k = 1 is a plain step)", "",
                  "| setting | " + " | ".join(str(n) for n in sizes) + " |",
                  "|---" * (len(sizes) + 1) + "|"]
        for name, curve in curves.items():
            row = {int(k): v for k, v in curve.items()}
            lines.append(f"| {name} | " + " | ".join(f"{row[n]:.1f}" if n in row else "-" for n in sizes) + " |")
    drafts = costs.get("drafts") or {}
    if drafts:
        lines += ["", "## Draft-model cost", "",
                  "| draft | ms per token | relative to a target token |", "|---|---|---|"]
        lines += [f"| {_cell_text(name)} | {d.get('ms_per_token', 0):.1f} | "
                  f"{d.get('relative_to_target', 0):.2f} |" for name, d in drafts.items()]
    predictions = report.meta.get("predictions") or {}
    for profile, pred in predictions.items():
        lines += ["", f"## Prediction for profile `{profile}` (a model, not a measurement)", "",
                  pred.get("basis", ""), "", "| config | predicted speedup |", "|---|---|"]
        lines += [f"| {name} | {value:.2f}x |" for name, value in pred["speedup"].items()]
    explanation = explain_drafts(report)
    if explanation:
        lines += ["", "## Choosing a draft", "", explanation]
    notes = [f"- {c.config} ({count}/{c.runs} runs): {note}" for c in report.cells
             if c.category == OVERALL for note, count in c.notes.items()]
    if notes:
        lines += ["", "## What the drafters decided", ""] + notes
    bad = [f"- {c.config}: {x}" for c in report.cells if c.category == OVERALL
           for x in c.invalid]
    if bad:
        lines += ["", "## Outputs that do not validate", "",
                  "Checked with jsonschema against the task's schema (tool calls: against "
                  "the tool's parameters), apart from the grammar that produced them.", ""]
        lines += bad
    mism = [m for c in report.cells if c.category == OVERALL for m in
            (f"{c.config}: {x}" for x in c.mismatches)]
    if mism:
        lines += ["", "## Outputs that differ from plain decoding (mismatches)", "",
                  "Exact mode promises identity; in fast mode these differ at a logit gap of "
                  f"{NEAR_TIE_GAP} or more, which rounding does not explain.", ""]
        lines += [f"- {m}" for m in mism]
    return "\n".join(lines) + "\n"


def valid_text(c: Cell) -> str:
    """", valid 23/24" where the outputs were checked against a schema, else nothing."""
    return f", valid {c.valid}/{c.checked}" if c.checked else ""


def explain_drafts(report: Report) -> str:
    """One or two sentences a user can act on, when several drafts were compared."""
    drafts = (report.meta.get("costs") or {}).get("drafts") or {}
    if len(drafts) < 2:
        return ""
    by_draft: dict[str, Cell] = {}
    for cfg in report.configs:
        label = cfg.get("draft_model")
        cell = report.cell(cfg["name"])
        if label in drafts and cell is not None and cell.speedup is not None:
            if label not in by_draft or cell.speedup > by_draft[label].speedup:
                by_draft[label] = cell
    if len(by_draft) < 2:
        return ""
    ranked = sorted(by_draft.items(), key=lambda kv: kv[1].speedup, reverse=True)
    (a, ca), (b, cb) = ranked[0], ranked[1]
    cost_a, cost_b = drafts[a]["ms_per_token"], drafts[b]["ms_per_token"]
    acc = 100 * (cb.acceptance_rate - ca.acceptance_rate)
    ratio = cost_b / cost_a if cost_a > 0 else float("inf")
    if acc > 0:
        why = (f"{b} accepts {acc:.0f} points more ({100 * cb.acceptance_rate:.0f}% vs "
               f"{100 * ca.acceptance_rate:.0f}%) but costs {ratio:.1f}x per token")
    else:
        why = (f"{a} accepts as much or more ({100 * ca.acceptance_rate:.0f}% vs "
               f"{100 * cb.acceptance_rate:.0f}%) and costs {1 / ratio:.1f}x per token of {b}"
               if ratio > 0 else f"{a} accepts as much or more")
    return (f"{why}; {a} wins on this machine ({ca.speedup:.2f}x vs {cb.speedup:.2f}x over plain "
            f"decoding, best configuration of each).")


def to_svg(report: Report) -> str:
    """A grouped bar chart of speedup by category and configuration (open it in a browser)."""
    names = [c["name"] for c in report.configs]
    cats = report.categories + [OVERALL]
    colors = ["#8c8c8c", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
              "#e377c2", "#17becf", "#bcbd22"]
    grid = [[report.cell(n, c) for n in names] for c in cats]
    vals = [[(cell.speedup if cell and cell.speedup else 0.0) for cell in row] for row in grid]
    top = max([v for row in vals for v in row] + [1.5])
    bar, gap, left, height = 14, 18, 60, 260
    group = bar * len(names) + gap
    width = left + group * len(cats) + 200
    y = lambda v: 55 + height - v / top * height  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 150}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="18" font-size="13">Speedup over plain decoding (measured)</text>']
    for t in range(0, int(top * 2) + 1):
        v = t / 2
        out.append(f'<line x1="{left}" x2="{left + group * len(cats)}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   f'stroke="{"#000" if v == 1 else "#ddd"}"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}x</text>')
    for ci, cat in enumerate(cats):
        x0 = left + ci * group + gap / 2
        for ni, v in enumerate(vals[ci]):
            x = x0 + ni * bar
            out.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar - 2}" height="{y(0) - y(v):.1f}" '
                       f'fill="{colors[ni % len(colors)]}"><title>{_xml(names[ni])} on {_xml(cat)}: {v:.2f}x</title></rect>')
            if v > 0:  # the value on the bar itself, read upwards from its top
                cx, ty = x + (bar - 2) / 2 + 3, y(v) - 3
                label = f"{v:.2f}" + (" busy" if grid[ci][ni].busy_runs else "")
                out.append(f'<text x="{cx:.1f}" y="{ty:.1f}" font-size="9" '
                           f'transform="rotate(-90 {cx:.1f} {ty:.1f})">{label}</text>')
        out.append(f'<text x="{x0 + bar * len(names) / 2:.1f}" y="{height + 73}" text-anchor="end" '
                   f'transform="rotate(-35 {x0 + bar * len(names) / 2:.1f} {height + 73})">{_xml(cat)}</text>')
    for ni, name in enumerate(names):
        ly = 40 + ni * 16
        lx = left + group * len(cats) + 16
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{colors[ni % len(colors)]}"/>'
                   f'<text x="{lx + 14}" y="{ly}">{_xml(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _xml(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_outputs(report: Report, results: Sequence[RunResult], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "report.json": json.dumps({**report.to_dict(), "runs": [asdict(r) for r in results]}, indent=1),
        "runs.csv": to_csv(results),
        "report.md": to_markdown(report),
        "speedup.svg": to_svg(report),
    }
    written = []
    for name, text in files.items():
        path = out_dir / name
        atomic_write_text(path, text, path.with_suffix(path.suffix + ".tmp"))
        written.append(path)
    return written
