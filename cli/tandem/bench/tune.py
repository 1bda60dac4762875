"""--tune's choice: the fastest configuration that convinced, overall and per category (the
file format and where run and chat find it: tandem.config.tuned)."""
from __future__ import annotations

from tandem.bench.report import OVERALL, Report

# --tune replaces the profile's choice only on evidence: every category measured on at least
# MIN_PROMPTS prompts, and a gain that exceeds the measured spread (the 25th percentile of the
# per-prompt ratios to plain decoding is above 1.0, so most prompts gained, not just the median)
MIN_PROMPTS = 3
RULE = (f"a configuration replaces the profile's choice only if at least {MIN_PROMPTS} prompts "
        "per category were measured and the 25th percentile of its per-prompt speedups is "
        "above 1.00x (the gain exceeds the spread)")


def _convincing(report: Report, config: str, category: str) -> bool:
    cell = report.cell(config, category)
    if cell is None or cell.speedup_lo is None or cell.speedup_lo <= 1.0:
        return False
    cats = report.categories if category == OVERALL else [category]
    return all((report.cell(config, c) or cell).prompts >= MIN_PROMPTS for c in cats)


def choose(report: Report) -> dict:
    """Best convincing configuration overall and per category (None: keep the profile's),
    with the speedups that justify them."""
    configs = {c["name"]: c for c in report.configs}

    def entry(category: str) -> dict | None:
        cells = [c for c in report.cells if c.category == category and c.speedup is not None
                 and configs[c.config]["strategy"] != "none"
                 and _convincing(report, c.config, category)]
        if not cells:
            return None
        cell = max(cells, key=lambda c: (c.speedup, c.runs))
        cfg = configs[cell.config]
        return {"config": cell.config, "strategy": cfg["strategy"], "n_max": cfg["n_max"],
                "n_min": cfg["n_min"], "p_min": cfg["p_min"], "speedup": cell.speedup,
                "speedup_lo": cell.speedup_lo, "speedup_hi": cell.speedup_hi,
                "draft_model": cfg.get("draft_model"), "target_ctx": cfg.get("target_ctx"),
                "draft_ctx": cfg.get("draft_ctx")}

    return {"overall": entry(OVERALL),
            "by_category": {c: entry(c) for c in report.categories},
            "partial": report.partial, "rule": RULE}
