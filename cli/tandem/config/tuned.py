"""Tuned settings: the one format. spec-bench --tune writes the fastest convincing
configuration for a pair of model files on this machine; run, chat and hw read it as the
`tuned` source, keyed by the files, the machine and the thread count."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

from tandem.config.files import Located, SettingsFileError, read_settings
from tandem.config.schema import FIELDS_BY_KEY, broken_rules
from tandem.fsutil import atomic_write_text, machine_key, sweep_stale_tmp

TUNED_DIR = "tuned"
SPEC_KEYS = ("strategy", "n_max", "n_min", "p_min")
# spec-bench's context fields (named as the settings) whose YAML places the schema gives;
# n_ctx is left out on purpose: spec-bench measures speed, the context size is the user's need
CTX_KEYS = ("n_batch", "n_ubatch", "n_threads", "n_threads_batch", "flash_attn", "type_k",
            "type_v")


def tuned_path(home: Path, target: Path, draft: Path | None, threads: int = 0) -> Path:
    """<home>/tuned/<key>.json, the key hashing this machine, the threads and the files."""
    # 0 means "all cores": key on the count actually used, so a result tuned with -t 2
    # applies to a plain `tandem run` on a 2-core machine
    parts: list[object] = [threads if threads > 0 else max(1, os.cpu_count() or 1)]
    for p in (target, draft):
        if p is not None:
            p = Path(p)
            parts += [p.name, p.stat().st_size if p.exists() else "?"]
    return Path(home) / TUNED_DIR / f"{machine_key(*parts)}.json"


def save(path: Path, tuned: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Write spec-bench's choice (tandem.bench.tune.choose) with what it was measured on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**tuned, "meta": dict(meta), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    sweep_stale_tmp(path.parent)
    atomic_write_text(path, json.dumps(data, indent=1))


def load(path: Path) -> dict | None:
    """The file's content, or None when it is missing, unreadable or has no choice in it."""
    return _read(path)[0]


def _read(path: Path) -> tuple[dict | None, str]:
    """(content, "") or (None, why it cannot be used)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        return None, f"cannot read: {exc.strerror or exc}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError:
        return None, "not valid JSON"
    overall = data.get("overall") if isinstance(data, dict) else None
    if not isinstance(overall, dict) or "strategy" not in overall:
        return None, "not a spec-bench --tune result"
    return data, ""


def tuned_values(home: Path, models: tuple[Any, Any] | None, threads: int
                 ) -> tuple[dict[str, Located], Path | None, list[str]]:
    """The tuned source for these model files: ({key: Located}, file, warnings). A broken
    file is skipped with a warning: a stale tuning result must never stop `tandem run`."""
    if models is None or not (Path(home) / TUNED_DIR).is_dir() or not all(
            isinstance(m, (str, os.PathLike)) for m in models if m is not None):
        return {}, None, []  # nothing tuned yet, or catalog entries rather than files
    path = tuned_path(home, models[0], models[1], threads)
    sweep_stale_tmp(path.parent)  # left by processes killed mid-write
    if not path.is_file():
        return {}, None, []
    data, problem = _read(path)
    try:
        values = read_settings(_sections(data["overall"]), path) if data else {}
    except SettingsFileError as exc:
        problem = exc.message
    if not problem:
        # values valid alone but not together (n_min 9 > n_max 3) once stopped every run of
        # the pair with a hint about flags the user never passed
        plain = {k: v.value for k, v in values.items()}
        problem = "; ".join(f"{r.key} {r.problem(plain)}" for r in broken_rules(plain))
    if problem:
        return {}, None, [f"ignored tuned settings {path}: {problem}"]
    return {k: Located(v.value, str(path), None) for k, v in values.items()}, path, []


def _sections(overall: Mapping[str, Any]) -> dict[str, Any]:
    """spec-bench's winning configuration as setting sections."""
    out: dict[str, Any] = {}
    spec = {k: overall[k] for k in SPEC_KEYS if k in overall}
    if spec:
        out["speculative"] = spec
    ctx = overall.get("target_ctx")
    for key in CTX_KEYS:
        path = FIELDS_BY_KEY[key].path
        if isinstance(ctx, Mapping) and ctx.get(key) is not None:
            node = out
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = ctx[key]
    return out
