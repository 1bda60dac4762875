"""Configurations to benchmark: plain decoding, strategies, and --sweep KEY=V1,V2 grids.

SWEEP_KEYS is the one table of sweep keys: parsing, the configurations and spec-bench's --help
all read it. The module imports the engine only when it builds configurations, so the CLI can
read the table for its help without loading llama.cpp.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

from tandem.config.schema import FLASH_ATTN, KV_TYPES, check_strategy
from tandem.errors import UsageError

if TYPE_CHECKING:
    from tandem.bench.runner import BenchConfig
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.drafting.drafters import DraftParams

# key -> (where, field, parser, allowed: (lo, hi) or a tuple of choices)
# where: "draft" = DraftParams; "ctx" = both contexts; "target"/"draftctx" = one context.
SWEEP_KEYS = {
    "draft-max": ("draft", "n_max", int, (0, 64)),
    "draft-min": ("draft", "n_min", int, (0, 64)),
    "p-min": ("draft", "p_min", float, (0.0, 1.0)),
    "n-batch": ("ctx", "n_batch", int, (1, 8192)),
    "n-ubatch": ("ctx", "n_ubatch", int, (1, 8192)),
    "threads": ("target", "n_threads", int, (1, 512)),
    "threads-draft": ("draftctx", "n_threads", int, (1, 512)),
    "flash-attn": ("ctx", "flash_attn", str, FLASH_ATTN),
    "kv-type": ("ctx", "kv_type", str, KV_TYPES),
}


def allowed_text(values) -> str:
    """A sweep key's choices (a|b) or range (lo..hi)."""
    if isinstance(values[0], str):
        return "values among " + "|".join(values)
    return f"numbers in {values[0]}..{values[1]}"


def sweep_help() -> str:
    """--sweep's help, from SWEEP_KEYS: every key with its range or choices."""
    def allowed(values) -> str:
        return "|".join(values) if isinstance(values[0], str) else f"{values[0]}..{values[1]}"

    keys = ", ".join(f"{key} ({allowed(spec[3])})" for key, spec in SWEEP_KEYS.items())
    return f"KEY=V1,V2 grid (repeatable); keys: {keys}."


def parse_sweep(specs: Sequence[str]) -> dict[str, list]:
    """['draft-max=2,4,8', 'p-min=0,0.5'] -> {'draft-max': [2, 4, 8], 'p-min': [0.0, 0.5]}"""
    grid: dict[str, list] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().lower().replace("_", "-")
        if not sep or not values.strip():
            raise UsageError(f"bad --sweep {spec!r}", "write KEY=V1,V2,..., e.g. --sweep draft-max=2,4,8")
        if key not in SWEEP_KEYS:
            raise UsageError(f"unknown sweep key {key!r}", f"sweep keys: {', '.join(SWEEP_KEYS)}")
        _, _, parse, allowed = SWEEP_KEYS[key]
        parsed = grid.setdefault(key, [])  # a repeated key adds its values
        for raw in values.split(","):
            raw = raw.strip()
            try:
                v = parse(raw)
            except ValueError:
                raise UsageError(f"--sweep {key}: {raw!r} is not a valid {parse.__name__}",
                                 f"write {key}=V1,V2,... with {allowed_text(allowed)}") from None
            if parse is str:
                if v not in allowed:
                    raise UsageError(f"--sweep {key}: {v!r} is not one of {', '.join(allowed)}",
                                     f"write {key}=V1,V2,... with {allowed_text(allowed)}")
            elif not allowed[0] <= v <= allowed[1]:
                raise UsageError(f"--sweep {key}: {v} is out of range {allowed[0]}..{allowed[1]}",
                                 f"write {key}=V1,V2,... with {allowed_text(allowed)}")
            if v not in parsed:
                parsed.append(v)
    return grid


def _apply_ctx(params: ContextParams, field: str, value) -> ContextParams:
    if field == "kv_type":
        return replace(params, type_k=value, type_v=value)
    if field == "n_threads":
        return replace(params, n_threads=value, n_threads_batch=value)
    return replace(params, **{field: value})


def build_configs(strategies: Sequence[str], base: DraftParams, grid: dict[str, list],
                  drafts: Sequence[str] = (), ctx: ContextParams | None = None,
                  draft_ctx: ContextParams | None = None) -> list[BenchConfig]:
    """Plain first (the reference), then each strategy x draft model x grid point.

    Context keys (batch sizes, threads, flash attention, KV type) also give plain decoding
    its own variants, since they change the plain rate too. `ctx`: the session's (default:
    ContextParams())."""
    from tandem.bench.runner import BenchConfig
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.drafting.drafters import DraftParams

    ctx = ctx if ctx is not None else ContextParams()
    for s in strategies:
        check_strategy(s)
    keys = list(grid)
    points = [dict(zip(keys, p)) for p in itertools.product(*(grid[k] for k in keys))] or [{}]
    draft_labels: list[str | None] = list(drafts) or [None]
    # the reference: plain decoding with the session's own settings
    configs: list[BenchConfig] = [BenchConfig("plain", "none", base)]
    seen_plain = {""}
    for strategy in dict.fromkeys(["none"] + [s for s in strategies if s != "none"]):
        for point in points:
            params = {"n_max": base.n_max, "n_min": base.n_min, "p_min": base.p_min}
            tctx, dctx = ctx, draft_ctx or ctx
            for key, value in point.items():
                where, field, _, _ = SWEEP_KEYS[key]
                if where == "draft":
                    params[field] = value
                if where in ("ctx", "target"):
                    tctx = _apply_ctx(tctx, field, value)
                if where in ("ctx", "draftctx"):
                    dctx = _apply_ctx(dctx, field, value)
            params["n_min"] = min(params["n_min"], params["n_max"])
            ctx_label = "".join(f" {k}={v}" for k, v in point.items() if SWEEP_KEYS[k][0] != "draft")
            if strategy == "none":
                if ctx_label in seen_plain:
                    continue
                seen_plain.add(ctx_label)
                configs.append(BenchConfig("plain" + ctx_label, "none", base, None, tctx, dctx))
                continue
            uses_model = strategy != "ngram"
            for label in (draft_labels if uses_model else [None]):
                name = strategy + (f" [{label}]" if label and len(draft_labels) > 1 else "")
                name += "".join(f" {_short(k)}={v}" for k, v in point.items())
                configs.append(BenchConfig(name, strategy, DraftParams(**params), label, tctx, dctx))
    return configs


def _short(key: str) -> str:
    return {"draft-max": "max", "draft-min": "min", "p-min": "pmin"}.get(key, key)
