"""spec-bench's conclusions in words, from a report's cells: each ratio as the tables show it
(marked busy when measured on a busy machine), the one-line verdict that comes first, and the
warning that names the rows a busy machine touched. Read by report.py's renderings and by
`tandem spec-bench` itself; it works on report.Report and report.Cell without importing
them (report.py imports this)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.machine.load import BUSY_SHARE

if TYPE_CHECKING:
    from tandem.bench.report import Cell, Report

OVERALL = "overall"


def ratio_text(cell: Cell | None, spec: str = ".2f") -> str:
    """A cell's speedup as the tables show it: "1.02x", "0.06x busy" when some of its runs
    were measured on a busy machine, "-" when there is none."""
    if cell is None or cell.speedup is None:
        return "-"
    return f"{cell.speedup:{spec}}x" + (" busy" if cell.busy_runs else "")


def _plain_names(report: Report) -> set[str]:
    return {c["name"] for c in report.configs if c.get("strategy") == "none"}


def verdict(report: Report) -> str:
    """The run's conclusion in one line, from its overall medians: the best configuration
    against plain decoding, and the draft model's best where it is another one ("best here:
    auto 1.02x of plain; draft model 0.71x: it does not pay on this machine")."""
    plain = _plain_names(report)
    cells = [c for c in report.cells if c.category == OVERALL and c.speedup is not None
             and c.config not in plain]
    if not cells:
        return "no verdict: no speculative configuration was measured against plain decoding"
    top = max(cells, key=lambda c: (c.speedup, c.runs))
    if top.speedup <= 1.0:
        line = (f"best here: plain decoding; no configuration beat it (closest: {top.config} "
                f"{ratio_text(top)})")
    else:
        line = f"best here: {top.config} {ratio_text(top)} of plain"
    by_name = {c["name"]: c for c in report.configs}
    models = [c for c in cells if by_name.get(c.config, {}).get("strategy") == "draft"]
    if models:
        d = max(models, key=lambda c: (c.speedup, c.runs))
        if d is not top:
            label = "draft model" if d.config == "draft" else f"draft model ({d.config})"
            line += f"; {label} {ratio_text(d)}"
            if (d.speedup_hi or d.speedup) < 1.0:
                line += ": it does not pay on this machine"
            elif (d.speedup_lo or d.speedup) > 1.0:
                line += ": it pays here"
            else:
                line += ": no clear gain or loss here"
    if any(c.busy_runs for c in cells):
        line += " (busy: some runs were measured while other processes took the CPU)"
    return ("partial: " if report.partial else "") + line


def load_warning(report: Report) -> str | None:
    """When runs were measured on a busy machine: how busy, and the rows (categories) whose
    ratios it touched, each with its configurations; None on a quiet run."""
    n, runs = report.load.get("busy_runs", 0), report.load.get("runs", 0)
    if not n:
        return None
    plain = _plain_names(report)
    rows: dict[str, list[str]] = {}
    for c in report.cells:
        if c.category != OVERALL and c.busy_runs and c.config not in plain:
            rows.setdefault(c.category, []).append(c.config)
    peak = report.load.get("peak")
    head = ("the machine was busy during the whole run" if n == runs else
            f"the machine's load changed during the run: {n} of {runs} runs were measured "
            "while it was busy")
    where = "; ".join(f"{cat} ({', '.join(names)})" for cat, names in rows.items())
    return (f"{head} (other processes took up to {peak:.0%} of the CPU; a quiet run leaves "
            f"them under {BUSY_SHARE:.0%}): the ratios of these rows are marked busy: "
            f"{where or 'plain decoding only'}. Rerun them on a quiet machine before relying "
            "on them.")
