"""Configurations to benchmark: plain decoding, strategies, and --sweep KEY=V1,V2 grids."""
from __future__ import annotations

import itertools
from typing import Sequence

from tandem.bench.runner import BenchConfig
from tandem.errors import UsageError
from tandem.session import STRATEGIES, DraftParams

# key -> (DraftParams field, parser, valid range)
SWEEP_KEYS = {
    "draft-max": ("n_max", int, (0, 64)),
    "draft-min": ("n_min", int, (0, 64)),
    "p-min": ("p_min", float, (0.0, 1.0)),
}


def parse_sweep(specs: Sequence[str]) -> dict[str, list]:
    """['draft-max=2,4,8', 'p-min=0,0.5'] -> {'n_max': [2, 4, 8], 'p_min': [0.0, 0.5]}"""
    grid: dict[str, list] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().lower().replace("_", "-")
        if not sep or not values.strip():
            raise UsageError(f"bad --sweep {spec!r}", "write KEY=V1,V2,..., e.g. --sweep draft-max=2,4,8")
        if key not in SWEEP_KEYS:
            raise UsageError(f"unknown sweep key {key!r}", f"sweep keys: {', '.join(SWEEP_KEYS)}")
        field, parse, (lo, hi) = SWEEP_KEYS[key]
        parsed = []
        for raw in values.split(","):
            try:
                v = parse(raw.strip())
            except ValueError:
                raise UsageError(f"--sweep {key}: {raw.strip()!r} is not a valid {parse.__name__}",
                                 None) from None
            if not lo <= v <= hi:
                raise UsageError(f"--sweep {key}: {v} is out of range {lo}..{hi}", None)
            if v not in parsed:
                parsed.append(v)
        grid[field] = parsed
    return grid


def build_configs(strategies: Sequence[str], base: DraftParams, grid: dict[str, list]) -> list[BenchConfig]:
    """Plain first (the reference), then each strategy at each grid point."""
    for s in strategies:
        if s not in STRATEGIES:
            raise UsageError(f"unknown strategy {s!r}", f"choose from: {', '.join(STRATEGIES)}")
    configs = [BenchConfig("plain", "none")]
    fields = list(grid)
    points = list(itertools.product(*(grid[f] for f in fields))) or [()]
    for strategy in strategies:
        if strategy == "none":
            continue
        for point in points:
            values = dict(zip(fields, point))
            params = {"n_max": base.n_max, "n_min": base.n_min, "p_min": base.p_min, **values}
            params["n_min"] = min(params["n_min"], params["n_max"])
            draft = DraftParams(**params)
            label = strategy + "".join(f" {_short(f)}={v}" for f, v in values.items())
            configs.append(BenchConfig(label, strategy, draft))
    return configs


def _short(field: str) -> str:
    return {"n_max": "max", "n_min": "min", "p_min": "pmin"}[field]
