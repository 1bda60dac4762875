"""A chat's plain-decoding measurements and what an answer may be compared with: a ratio
"vs plain" only against plain decoding measured recently and at the same load
(machine/load.py); chat once divided a slowed session's average by a quiet start-up probe
and said "speculative 0.12x"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tandem.chat.transcript import Turn
from tandem.machine.load import FRESH_S, busy, same_load


@dataclass(frozen=True)
class PlainMeasure:
    """One measurement of plain decoding: tok/s, what it was, when (time.perf_counter) and
    the share of the CPU other processes took meanwhile (machine/load.py; None: unknown)."""

    rate: float
    source: str
    when: float
    busy: float | None = None


def plain_for(log: Sequence[PlainMeasure], turn: Turn) -> PlainMeasure | None:
    """The plain measurement of `log` (oldest first) that `turn` may be compared with: the
    latest one taken before it, at most FRESH_S before it started and at the same load;
    None when there is none."""
    before = [m for m in log if m.when <= turn.started]
    if not before or turn.started - before[-1].when > FRESH_S:
        return None
    latest = before[-1]
    return latest if same_load(latest.busy, turn.busy) else None


def vs_plain(log: Sequence[PlainMeasure], turns: Sequence[Turn]) -> dict:
    """The speculative turns against plain decoding, each against the measurement it may
    be compared with (plain_for): {"ratio": plain time / actual time over those turns, or
    None, "compared": how many, "speculative": of how many, "busy": how many of the
    speculative turns ran while the machine was busy}."""
    spec = [t for t in turns if t.strategy != "none" and t.stats is not None
            and t.stats.n_generated and t.stats.t_decode > 0]
    plain_time = actual = 0.0
    compared = 0
    for t in spec:
        m = plain_for(log, t)
        if m is not None:
            compared += 1
            plain_time += t.stats.n_generated / m.rate
            actual += t.stats.t_decode
    return {"ratio": plain_time / actual if actual > 0 else None, "compared": compared,
            "speculative": len(spec), "busy": sum(1 for t in spec if busy(t.busy))}
