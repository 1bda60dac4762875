"""Tuned settings: the fastest configuration measured by spec-bench, per pair and machine,
saved where run, chat and strategy `auto` find it."""
from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path

from tandem.bench.report import OVERALL, Report
from tandem.engine.llama import default_threads
from tandem.fsutil import atomic_write_text


def machine_pair_key(target: Path, draft: Path | None, threads: int = 0) -> str:
    # 0 means "all cores": key on the count actually used, so a result tuned with -t 2
    # applies to a plain `tandem run` on a 2-core machine
    threads = threads if threads > 0 else default_threads()
    parts = [platform.node(), platform.machine(), str(threads)]
    for p in (target, draft):
        if p is not None:
            p = Path(p)
            parts += [p.name, str(p.stat().st_size) if p.exists() else "?"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def tuned_dir(home: Path) -> Path:
    return home / "tuned"


def tuned_path(home: Path, target: Path, draft: Path | None, threads: int = 0) -> Path:
    return tuned_dir(home) / f"{machine_pair_key(target, draft, threads)}.json"


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


def save(path: Path, tuned: dict, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**tuned, "meta": meta, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    atomic_write_text(path, json.dumps(data, indent=1), path.with_suffix(".tmp"))


def load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    overall = data.get("overall") if isinstance(data, dict) else None
    if not isinstance(overall, dict) or "strategy" not in overall:
        return None
    return data
