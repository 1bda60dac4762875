"""Greedy decoding replayed offline: a drafter over a known output, each step priced by
scripted verify costs.

Greedy output does not depend on the drafter, so which drafted tokens the target accepts is a
function of plain decoding's output: the longest prefix of the draft that the output continues
with. This replays generate()'s step loop (engine/loop/speculative.py: the room a step has, the
draft cut at min(n_max, room), every step observed by the drafter) without a model, and prices
each step with `verify_cost(batch)`; what the drafter observes as the verify time may differ
(`seen`: timing noise). Predictions, not measurements: spec-bench measures. Used by
scripts/ngram_replay.py, scripts/history_replay.py and tests/test_auto_decisions.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.engine.loop.events import StepEvent
from tandem.engine.loop.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Step:
    """One replayed draft -> verify round."""

    index: int
    pos: int  # output tokens before this step
    k_cap: int  # draft length asked of the drafter: min(n_max, room)
    drafted: int
    accepted: int
    seconds: float  # what the step is charged: its verify batch's cost plus the overhead

    @property
    def produced(self) -> int:
        """Output tokens this step gives: the accepted drafts and the target's own token."""
        return self.accepted + 1


@dataclass(frozen=True)
class Replay:
    steps: tuple[Step, ...]

    @property
    def tokens(self) -> int:
        return sum(s.produced for s in self.steps)

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def lengths(self) -> dict[int, int]:
        """Steps by draft length."""
        out: dict[int, int] = {}
        for s in self.steps:
            out[s.drafted] = out.get(s.drafted, 0) + 1
        return out


def accepted_prefix(draft: Sequence[int], output: Sequence[int], pos: int) -> int:
    """How many of `draft` greedy verification accepts at output position `pos`."""
    n = 0
    while n < len(draft) and pos + n < len(output) and draft[n] == output[pos + n]:
        n += 1
    return n


def replay(drafter, output: Sequence[int], verify_cost: Callable[[int], float], *,
           prompt: Sequence[int] = (), limit: int = 16, overhead: float = 0.0,
           seen: Callable[[int, int], float] | None = None, oracle: bool = False,
           sampling: SamplingParams = GREEDY, rng=None) -> Replay:
    """Greedy decoding of `output` after `prompt` with `drafter` (the Drafter protocol:
    prefill, propose, observe, n_max). A step drafts up to `limit` tokens (a verify batch of
    limit + 1) and never past the output's end; it is charged `verify_cost(batch) +
    overhead`, and the drafter observes `seen(batch, step)` (default: the charged cost) as
    its verify time and `overhead` as its sampling time. `oracle`: only the accepted drafts
    are verified (a bound: a drafter that knew the output)."""
    tokens = list(prompt)
    drafter.prefill(tokens)
    steps: list[Step] = []
    pos = 0
    while pos < len(output):
        room = min(limit, len(output) - pos - 1)
        k_cap = min(drafter.n_max, room)
        draft = list(drafter.propose(tokens, room, sampling, rng, False).tokens[:k_cap]) \
            if k_cap > 0 else []
        accepted = accepted_prefix(draft, output, pos)
        if oracle:
            draft = draft[:accepted]
        batch = len(draft) + 1
        cost = verify_cost(batch)
        observed = cost if seen is None else seen(batch, len(steps))
        drafter.observe(StepEvent(len(steps), len(draft), accepted, k_cap, 0.0, observed,
                                  overhead))
        steps.append(Step(len(steps), pos, k_cap, len(draft), accepted, cost + overhead))
        tokens += output[pos:pos + accepted + 1]
        pos += accepted + 1
    return Replay(tuple(steps))
