"""How busy this machine is while something is measured, and when two measurements may be
compared: the load check the cost calibration uses (engine/tuning/costs.py: the share of the CPU
other processes took, from /proc; unknown where there is none) applied to any interval.

A speed ratio ("1.10x vs plain") means something only when both speeds were measured under
the same load: a plain rate measured on a quiet machine against an answer slowed by another
program once gave "speculative 0.12x". `same_load` is the rule chat and spec-bench apply."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.tuning.costs import BUSY_SHARE, cpu_snapshot, others_share

__all__ = ["BUSY_SHARE", "FRESH_S", "LoadMeter", "busy", "same_load", "busy_text"]

# a plain measurement older than this is not "the same conditions" either: a shared
# machine's load changes within a minute (issue 25: 2.64x, then 0.45x a minute later)
FRESH_S = 30.0


@dataclass
class LoadMeter:
    """The share of the CPU other processes used since start() (None: unknown, or too
    short an interval to tell)."""

    _start: tuple[int, int, int] | None = None

    def start(self) -> "LoadMeter":
        self._start = cpu_snapshot()
        return self

    def share(self) -> float | None:
        return others_share(self._start, cpu_snapshot())


def busy(share: float | None) -> bool:
    """Measured while other processes took more than BUSY_SHARE of the CPU."""
    return share is not None and share > BUSY_SHARE


def same_load(a: float | None, b: float | None) -> bool:
    """Two measurements taken under comparable load: neither of them busy (unknown counts
    as quiet, as the calibration counts it: there is no /proc to say otherwise)."""
    return not busy(a) and not busy(b)


def busy_text(share: float | None) -> str:
    """'other processes used 53% of the CPU' (empty when unknown)."""
    return "" if share is None else f"other processes used {share:.0%} of the CPU"
