"""spec-bench's multi-turn workloads: conversations measured turn by turn.

Each conversation is run turn by turn, every configuration on the same prompt (rotated, as
single prompts are), and the next turn's context holds plain decoding's answer (greedy, so
every lossless configuration's). Turns are reported apart: `<set> t1` (nothing said yet),
`<set> t2+` (the earlier answers are in the context) and `<set> fresh`: after all
conversations, a new session asks to change an earlier answer without quoting it, with the
answers of every conversation before it as the pair's history (engine/drafting/history.py), as a
user's store would hold them. No other run sees any history: each gets an empty library.

The sets: the built-in code-editing conversations (data/conversations.yaml; `code-edit`, and
`holdout` for those never tuned on) and Spec-Bench's two-turn MT-bench rows (`mt-bench`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import yaml

from tandem.bench.runner import BenchConfig, BenchProgress, RunResult, measured_run
from tandem.bench import workloads
from tandem.bench.workloads import Prompt
from tandem.engine.drafting.history import Library
from tandem.engine.loop.speculative import GenParams
from tandem.errors import UsageError

CONVERSATIONS = Path(__file__).resolve().parents[1] / "data" / "conversations.yaml"


@dataclass(frozen=True)
class Conversation:
    id: str
    group: str  # code-edit | holdout | mt-bench: the report's category prefix
    turns: tuple[str, ...]
    fresh: str | None = None  # a later session's request to change an earlier answer


def builtin_conversations() -> list[Conversation]:
    data = yaml.safe_load(CONVERSATIONS.read_text(encoding="utf-8"))
    return [Conversation(c["id"], "holdout" if c.get("split") == "holdout" else "code-edit",
                         tuple(t.strip() for t in c["turns"]), (c.get("fresh") or "").strip() or None)
            for c in data["conversations"]]


def spec_bench_conversations(path: Path) -> list[Conversation]:
    """The rows of a Spec-Bench JSONL with two or more turns (its MT-bench questions)."""
    out = [Conversation(p.id, "mt-bench", p.turns) for p in workloads.read_file(path)
           if len(p.turns) >= 2]
    if not out:
        raise UsageError(f"{path} has no rows with two or more turns",
                         "Spec-Bench's question.jsonl has 40 two-turn MT-bench rows")
    return out


def select(convs: Sequence[Conversation], per_group: int | None) -> list[Conversation]:
    counts: dict[str, int] = {}
    out = []
    for c in convs:
        if per_group is not None and counts.get(c.group, 0) >= per_group:
            continue
        counts[c.group] = counts.get(c.group, 0) + 1
        out.append(c)
    return out


def count_runs(convs: Sequence[Conversation], configs: Sequence[BenchConfig]) -> int:
    return sum(len(c.turns) + (c.fresh is not None) for c in convs) * len(configs)


def run_conversations(session, convs: Sequence[Conversation], configs: Sequence[BenchConfig],
                      gen: GenParams, should_stop: Callable[[], bool] | None = None,
                      prompts: dict[str, list[int]] | None = None) -> Iterator[BenchProgress]:
    """Yield a BenchProgress after each run (see the module docstring for the order).
    `prompts`, when given, receives each turn's prompt tokens by prompt id (to classify
    divergences from plain decoding afterwards)."""
    total = count_runs(convs, configs)
    plain = next((c.name for c in configs if c.is_plain), configs[0].name)
    answers: list[tuple[int, ...]] = []  # every answer so far: the fresh sessions' history
    done_runs = 0
    order = 0

    def measure(tokens, pid, category, text, history):
        nonlocal done_runs, order
        if prompts is not None:
            prompts[pid] = list(tokens)
        shift = order % len(configs)
        order += 1
        out = {}
        for config in list(configs[shift:]) + list(configs[:shift]):
            if should_stop is not None and should_stop():
                return None
            library = Library(None, remember=False)
            for a in history:
                library.history.add(a)
            session.library = library
            done, busy = measured_run(session, tokens, config, gen)
            done_runs += 1
            out[config.name] = (done, BenchProgress(done_runs, total, RunResult.from_done(
                config.name, Prompt(pid, category, text), 0, done, busy)))
        return out

    for conv in convs:
        msgs: list[dict] = []
        for i, text in enumerate(conv.turns):
            msgs = msgs + [{"role": "user", "content": text}]
            category = f"{conv.group} {'t1' if i == 0 else ('t2' if conv.group == 'mt-bench' else 't2+')}"
            runs = measure(session.prompt_tokens(msgs), f"{conv.id}#{i + 1}", category, text, ())
            if runs is None:
                return
            for _, ev in runs.values():
                yield ev
            done = runs[plain][0]
            answers.append(done.tokens)
            msgs = msgs + [{"role": "assistant", "content": done.text}]
    for conv in convs:
        if conv.fresh is None:
            continue
        tokens = session.prompt_tokens([{"role": "user", "content": conv.fresh}])
        runs = measure(tokens, f"{conv.id}#fresh", f"{conv.group} fresh", conv.fresh, answers)
        if runs is None:
            return
        for _, ev in runs.values():
            yield ev
