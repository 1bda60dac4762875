"""Tuned settings: the fastest configuration measured by spec-bench, per pair and machine,
saved where run, chat and strategy `auto` find it."""
from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path

from tandem.bench.report import OVERALL, Report, best
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


def tuned_path(home: Path, target: Path, draft: Path | None, threads: int = 0) -> Path:
    return home / "tuned" / f"{machine_pair_key(target, draft, threads)}.json"


def choose(report: Report) -> dict:
    """Best configuration overall and per category, with the speedups that justify them."""
    configs = {c["name"]: c for c in report.configs}

    def entry(category: str) -> dict | None:
        cell = best(report, category)
        if cell is None:
            return None
        cfg = configs[cell.config]
        return {"config": cell.config, "strategy": cfg["strategy"], "n_max": cfg["n_max"],
                "n_min": cfg["n_min"], "p_min": cfg["p_min"], "speedup": cell.speedup,
                "draft_model": cfg.get("draft_model"), "target_ctx": cfg.get("target_ctx"),
                "draft_ctx": cfg.get("draft_ctx")}

    return {"overall": entry(OVERALL),
            "by_category": {c: entry(c) for c in report.categories},
            "partial": report.partial}


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
