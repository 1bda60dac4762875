"""Benchmark prompts: the built-in suite, Spec-Bench JSONL, plain JSONL, text files, stdin."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import yaml

from tandem.errors import UsageError

BUILTIN = Path(__file__).resolve().parents[1] / "data" / "workloads.yaml"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    system: str | None = None
    # every turn of a multi-turn row (text is the first; --multi-turn measures the others)
    turns: tuple[str, ...] = field(default=(), compare=False)
    # a structured task's constraint (bench/structured_workload.py Structure)
    structure: object | None = field(default=None, compare=False)


def builtin() -> list[Prompt]:
    data = yaml.safe_load(BUILTIN.read_text(encoding="utf-8"))
    out = []
    for category, items in data["categories"].items():
        for i, text in enumerate(items):
            out.append(Prompt(f"{category}-{i + 1}", category, text.strip()))
    return out


def read_file(path: Path) -> list[Prompt]:
    """Spec-Bench JSONL (question_id, category, turns), plain JSONL (prompt/text, category),
    or a text file (prompts separated by blank lines; the category is the file's stem)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read prompts file {path}: {exc.strerror or exc}",
                         "check the path and its permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text (byte {exc.start})",
                         "convert it to UTF-8 first, e.g. with iconv") from None
    if path.suffix in (".jsonl", ".json") or text.lstrip().startswith("{"):
        return parse_jsonl(text.splitlines(), str(path))
    return parse_text(text, path.stem)


_JSONL_HINT = ('one JSON object per line, e.g. {"category": "qa", "turns": ["..."]} or '
               '{"prompt": "...", "category": "qa"}')


def parse_jsonl(lines: Iterable[str], name: str) -> list[Prompt]:
    out = []
    seen: dict[str, int] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{name}:{no}: not valid JSON ({exc.msg})", _JSONL_HINT) from None
        except RecursionError:
            raise UsageError(f"{name}:{no}: JSON nested too deeply", _JSONL_HINT) from None
        if not isinstance(obj, dict):
            raise UsageError(f"{name}:{no}: expected a JSON object", _JSONL_HINT)
        turns = obj.get("turns")
        if turns is not None:
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise UsageError(f"{name}:{no}: `turns` must be a non-empty list of strings",
                                 _JSONL_HINT)
            text = turns[0]  # Spec-Bench: the first turn is the benchmark prompt
        else:
            text = obj.get("prompt", obj.get("text"))
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"{name}:{no}: no prompt (`turns`, `prompt` or `text`)", _JSONL_HINT)
        category = obj.get("category", "default")
        if not isinstance(category, str) or not category:
            raise UsageError(f"{name}:{no}: `category` must be a non-empty string", _JSONL_HINT)
        system = obj.get("system")
        if system is not None and not isinstance(system, str):
            raise UsageError(f"{name}:{no}: `system` must be a string", _JSONL_HINT)
        qid = str(obj.get("question_id", obj.get("id", f"{category}-{no}")))
        if qid in seen:
            raise UsageError(f"{name}:{no}: duplicate id {qid!r} (also on line {seen[qid]})",
                             "give every prompt its own question_id")
        seen[qid] = no
        out.append(Prompt(qid, category, text, system, tuple(turns or ())))
    if not out:
        raise UsageError(f"{name}: no prompts found", "the file is empty")
    return out


def parse_text(text: str, category: str = "text") -> list[Prompt]:
    blocks = [b.strip() for b in text.replace("\r\n", "\n").split("\n\n") if b.strip()]
    if not blocks:
        raise UsageError("no prompts found in the text", "separate prompts with blank lines")
    return [Prompt(f"{category}-{i + 1}", category, b) for i, b in enumerate(blocks)]


MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def group_mt_bench(prompts: list[Prompt]) -> list[Prompt]:
    """Spec-Bench reports its eight MT-bench categories as one, "mt-bench"; interleave them
    (one of each first) so a per-category limit still samples every kind."""
    from dataclasses import replace
    from itertools import zip_longest

    groups = [[p for p in prompts if p.category == c] for c in MT_BENCH]
    mixed = [p for row in zip_longest(*groups) for p in row if p is not None]
    rest = [p for p in prompts if p.category not in MT_BENCH]
    return [replace(p, category="mt-bench") for p in mixed] + rest


def select(prompts: list[Prompt], per_category: int | None = None,
           categories: Iterable[str] | None = None) -> list[Prompt]:
    wanted = set(categories) if categories else None
    if wanted:
        known = {p.category for p in prompts}
        missing = wanted - known
        if missing:
            raise UsageError(f"no prompts in categor{'y' if len(missing) == 1 else 'ies'} "
                             f"{', '.join(sorted(missing))}",
                             f"categories here: {', '.join(sorted(known))}")
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        if wanted and p.category not in wanted:
            continue
        if per_category is not None and counts.get(p.category, 0) >= per_category:
            continue
        counts[p.category] = counts.get(p.category, 0) + 1
        out.append(p)
    return out
