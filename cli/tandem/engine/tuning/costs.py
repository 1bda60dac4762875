"""Cost model as data: seconds for a plain target token, a verify batch of n tokens and a draft
token, for one pair on one machine. Calibrated by timing real decodes, cached as JSON, and
refined online from each step's timings. Adaptive draft length, `auto` and spec-bench's
predictions read it.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Sequence

import msgspec

from tandem.fsutil import atomic_write_text, sweep_stale_tmp
from tandem.statefile import Damaged, check_time, read_state

MAX_BATCH = 17  # verify batches of 1 (plain) .. 17 (16 drafts + the last token)
DRAFT_PROBE_TOKENS = 8  # single-token draft decodes timed by calibrate()
# Cached costs are a guess about this machine: older than MAX_AGE_S, or DISAGREE times off
# what is measured now, they are measured again (a calibration taken while something else had
# the cores once recorded 3.59 s per token for a 0.074 s step and slowed every later run)
MAX_AGE_S = 7 * 24 * 3600
DISAGREE = 2.5
# The relative spread of a verify timing where nothing measured it (a cost file from before
# spreads were kept, a guessed curve): about the median spread of the batch costs issue 25
# measured on a steep host (2 rows 1.75-2.07, 3 rows 2.4-2.6, 4 rows 2.8-3.1, 8 rows 6.8-8.1
# plain steps: 18%, 8%, 11%, 19%)
UNKNOWN_SPREAD = 0.15
SPREAD_WEIGHT = 0.2  # the observed noise's moving average (as observe_verify's own)
# a verify batch has at most 65 rows (the contexts' logits cap), but a served batch holds
# every slot's rows (engine/backend/sequences.py): its timings are kept at its total size
MAX_CACHED_BATCH = 4096
# a measurement during which other processes used more than this share of the CPU was taken
# on a busy machine (cpu_snapshot/others_share; pricing.py, machine/load.py)
BUSY_SHARE = 0.25


@dataclass
class CostModel:
    verify: dict[int, float] = field(default_factory=dict)  # batch size -> seconds
    draft_token: float = 0.0  # seconds per draft-model token (0: unknown)
    source: str = "default"
    when: float = 0.0  # time.time() of the calibration (0: unknown)
    busy: float | None = None  # share of the CPU other processes used while it was measured
    # batch size -> relative spread of its timing: (slowest - fastest) / fastest over the
    # calibration's repetitions, then a moving average of |observed / expected - 1| per step.
    # auto's margin over plain decoding is made of it (adaptive.LengthController.margin)
    spread: dict[int, float] = field(default_factory=dict)

    @property
    def plain(self) -> float:
        return self.verify_cost(1)

    def verify_cost(self, n: int) -> float:
        """Seconds to verify a batch of n tokens; interpolated between measured sizes."""
        if n in self.verify:
            return self.verify[n]
        if not self.verify:
            return 0.1 * (1 + 0.15 * (n - 1))  # a guess until something is measured
        sizes = sorted(self.verify)
        lo = max((s for s in sizes if s < n), default=None)
        hi = min((s for s in sizes if s > n), default=None)
        if lo is None:
            return self.verify[hi] * n / hi if n < hi else self.verify[hi]
        if hi is None:  # extrapolate with the last slope, never below the largest measured
            slope = ((self.verify[lo] - self.verify[sizes[0]]) / (lo - sizes[0])
                     if lo != sizes[0] else self.verify[lo] * 0.1)
            return self.verify[lo] + max(slope, 0.0) * (n - lo)
        w = (n - lo) / (hi - lo)
        return self.verify[lo] * (1 - w) + self.verify[hi] * w

    shared = False  # the costs of one sequence of a shared batch (BatchCosts)

    def rows(self, n: int) -> int:
        """The tokens of the llama_decode a verify batch of n went into: n (BatchCosts: with
        the other sequences' rows)."""
        return n

    def company(self) -> int:
        """Other generations in progress beside this one's (BatchCosts: the slots that share
        its batches now, prompts included); alone, 0."""
        return 0

    def timing(self, seconds: float) -> float:
        """A verify decode's own seconds, from the `seconds` its step measured (BatchCosts:
        the shared llama_decode's time, without the wait for the batch to form)."""
        return seconds

    def attributed(self, n: int, seconds: float) -> float:
        """The part of a step's `seconds` that is this sequence's (BatchCosts: its share of
        a shared batch's time, as verify_cost prices it); alone, all of it."""
        return seconds

    def spread_of(self, n: int) -> float:
        """Relative spread of a verify batch of n tokens: measured, else the larger of the
        nearest measured sizes' (an interpolated cost is no surer than its neighbours), else
        UNKNOWN_SPREAD."""
        if n in self.spread:
            return self.spread[n]
        if not self.spread:
            return UNKNOWN_SPREAD
        sizes = sorted(self.spread)
        lo = max((s for s in sizes if s < n), default=sizes[0])
        hi = min((s for s in sizes if s > n), default=sizes[-1])
        return max(self.spread[lo], self.spread[hi])

    def copy(self) -> "CostModel":
        return CostModel(dict(self.verify), self.draft_token, self.source, self.when, self.busy,
                         dict(self.spread))

    def scale(self, factor: float) -> None:
        """Every cost times `factor`: cached absolute timings made to agree with measured ones
        while keeping the curve's shape (entries never measured again stay consistent)."""
        self.verify = {n: v * factor for n, v in self.verify.items()}
        self.draft_token *= factor

    def expired(self, now: float | None = None) -> bool:
        return self.when <= 0 or (now or time.time()) - self.when > MAX_AGE_S

    def describe(self) -> str:
        """When and under what load the figures were taken (for the run's notes)."""
        if self.when <= 0:
            return f"costs: {self.source}"
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.when))
        busy = "" if self.busy is None else f", other processes {self.busy:.0%} of the CPU then"
        return f"costs: {self.source} {stamp}{busy}"

    def observe_verify(self, n: int, seconds: float, weight: float = 0.2) -> None:
        old = self.verify.get(n)
        if old is not None and old > 0 and seconds > 0:
            # the timing's own noise, as it shows now (a busy machine widens it, and with it
            # the margin auto asks of a draft)
            dev = abs(seconds / old - 1.0)
            prev = self.spread.get(n)
            self.spread[n] = (dev if prev is None
                              else (1 - SPREAD_WEIGHT) * prev + SPREAD_WEIGHT * dev)
        self.verify[n] = seconds if old is None else (1 - weight) * old + weight * seconds

    def observe_draft(self, n_tokens: int, seconds: float, weight: float = 0.2) -> None:
        if n_tokens <= 0:
            return
        per = seconds / n_tokens
        self.draft_token = per if self.draft_token <= 0 else (1 - weight) * self.draft_token + weight * per

    def expected_rate(self, k: int, accept: Sequence[float], draft_cost: float | None = None) -> float:
        """Expected tokens per second when drafting k tokens with conditional acceptance
        accept[i] = P(position i accepted | positions < i accepted)."""
        tokens, reach = 1.0, 1.0
        for i in range(k):
            reach *= accept[i] if i < len(accept) else accept[-1]
            tokens += reach
        per_draft = self.draft_token if draft_cost is None else draft_cost
        cost = k * per_draft + self.verify_cost(k + 1)
        return tokens / cost if cost > 0 else 0.0

    def plausible(self) -> bool:
        """False for a curve no quiet machine produces: a batch of n tokens measured cheaper
        than 80% of a single token (the calibration ran while something else had the cores)."""
        if not self.verify or any(v <= 0 for v in self.verify.values()):
            return False
        one = self.verify.get(1)
        return one is None or all(v >= 0.8 * one for n, v in self.verify.items() if n > 1)

    def to_json(self) -> str:
        return json.dumps({"verify": {str(k): v for k, v in sorted(self.verify.items())},
                           "draft_token": self.draft_token, "source": self.source,
                           "when": self.when, "busy": self.busy}, indent=1)

    @classmethod
    def from_file(cls, f: "_CostFile") -> "CostModel":
        return cls(verify={int(k): v for k, v in f.verify.items()}, draft_token=f.draft_token,
                   source=f.source[:200], when=f.when, busy=f.busy)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_tmp(path.parent)
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> "CostModel | None":
        """The cached model, or None (calibrate again). A file that is there but invalid is
        said once and removed (statefile's policy), so that the next calibration replaces it
        whatever happens. The file is untrusted input: a `when` of 1e300 or a batch size of 0
        once broke every run."""
        sweep_stale_tmp(path.parent)

        def remove() -> str:
            with contextlib.suppress(OSError):
                path.unlink()
            return "measuring them again"

        f = read_state(path, _CostFile, "the cached costs", remove, check=_check_cost_file)
        return None if f is None else cls.from_file(f)


class BatchCosts(CostModel):
    """The cost model as one sequence of a shared batch sees it (serve --parallel; o: the
    other sequences' tokens in its latest llama_decode). Its plain step is its share of the
    batch's, raw(o + 1) / (o + 1), and a draft of k tokens adds what its rows add to the
    batch, raw(o + 1 + k) - raw(o + 1): drafts pay where their accepted tokens per second
    added beat the batch's own rate. On a flat curve (a GPU) rows are nearly free and drafts
    stay long; on a steep one (this CPU) they shrink as the batch grows. The curve and its
    noise are the session's (shared dicts): a batch's timing refines it at rows(n)."""

    def __init__(self, base: CostModel, others: Callable[[], int],
                 decode_s: Callable[[], float] = lambda: 0.0,
                 company: Callable[[], int] = lambda: 0):
        """`others()`, `decode_s()`: the sequence's latest llama_decode's other tokens and
        own seconds (engine/backend/sequences.SeqContext's); `company()`: the other
        generations in progress (StepBatcher.members less this one)."""
        super().__init__(base.verify, base.draft_token, base.source, base.when, base.busy,
                         base.spread)
        self._others, self._decode_s, self._company = others, decode_s, company

    shared = True

    def rows(self, n: int) -> int:
        return n + self._others()

    def company(self) -> int:
        return self._company()

    def timing(self, seconds: float) -> float:
        return self._decode_s() or seconds

    def verify_cost(self, n: int) -> float:
        o = self._others()
        if o <= 0:
            return super().verify_cost(n)
        one = super().verify_cost(o + 1)
        return one / (o + 1) + super().verify_cost(o + n) - one

    def spread_of(self, n: int) -> float:
        return super().spread_of(self.rows(n))

    def attributed(self, n: int, seconds: float) -> float:
        whole = super().verify_cost(self.rows(n))
        return seconds * self.verify_cost(n) / whole if whole > 0 else seconds


# seconds: a cost above this is not a timing (inf, 1e300); a slow remote step takes seconds
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e6)]


class _CostFile(msgspec.Struct):
    """A cost cache file as to_json writes it (statefile checks it)."""

    verify: dict[str, Annotated[float, msgspec.Meta(gt=0, le=1e6)]] = {}
    draft_token: _Seconds = 0.0
    source: str = "file"
    when: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    busy: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None


def _check_cost_file(f: _CostFile) -> None:
    for k in f.verify:
        if not (k.isdigit() and 1 <= int(k) <= MAX_CACHED_BATCH):
            raise Damaged(f"batch size {k!r} outside 1..{MAX_CACHED_BATCH}")
    check_time(f.when, "`when`")


def cpu_snapshot() -> tuple[int, int, int] | None:
    """(busy jiffies of the whole machine, this process's jiffies, all jiffies) from /proc;
    None where there is no /proc (macOS)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat", encoding="ascii") as f:
            own = f.read().rsplit(")", 1)[1].split()
        idle = vals[3] + vals[4]  # idle + iowait
        return sum(vals) - idle, int(own[11]) + int(own[12]), sum(vals)
    except (OSError, ValueError, IndexError):
        return None


def others_share(before, after, min_jiffies: int = 20) -> float | None:
    """The share of the machine's CPU time that other processes used between two snapshots
    (None when unknown or too short to tell)."""
    if before is None or after is None or after[2] - before[2] < min_jiffies:
        return None
    busy, own, total = (a - b for a, b in zip(after, before))
    return max(busy - own, 0) / total


def load_while(work: Callable[[], float]) -> tuple[float, float | None]:
    """work()'s value, and the share of the CPU other processes used while it ran (None:
    unknown, or too short to tell)."""
    before = cpu_snapshot()
    value = work()
    return value, others_share(before, cpu_snapshot())


def disagreement(target, cached: CostModel, tokens: Sequence[int]) -> float:
    """Measured / cached cost of a plain step and a 4-token verify batch, timed now after
    `tokens` (best of two each), as one factor (their geometric mean); caches restored."""
    sizes = [n for n in (1, 4) if n <= target.verify_limit and n in cached.verify]
    if not sizes:
        return 1.0
    target.prefill(tokens)
    target.checkpoint()  # each timed batch is undone whole (a recurrent state: from a copy)
    base = len(target.tokens)
    filler = list(tokens[-1:]) * max(sizes)
    ratios = []
    for n in sizes:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            target.decode(filler[:n], all_logits=True)
            best = min(best, time.perf_counter() - t0)
            target.truncate(base)
        ratios.append(best / cached.verify[n])
    product = 1.0
    for r in ratios:
        product *= r
    return product ** (1.0 / len(ratios))


def calibrate(target, draft, tokens: Sequence[int], sizes: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 12, 17),
              reps: int = 2) -> CostModel:
    """Time verify batches of each size on the target, and single-token decodes on the draft,
    after `tokens` (a short real prompt), restoring both caches afterwards."""
    model = CostModel(source="calibrated", when=time.time())
    before = cpu_snapshot()
    # only batches generate() may send (n_batch, exact mode's cap): larger ones cannot be
    # decoded with logits on every row, and the curve beyond is extrapolated
    sizes = [n for n in sizes if n <= target.verify_limit] or [1]
    target.prefill(tokens)
    target.checkpoint()  # each timed batch is undone whole (a recurrent state: from a copy)
    base = len(target.tokens)
    filler = list(tokens[-1:]) * max(sizes)
    target.decode(filler[:1])  # warm-up: the first decode of a context pays for allocations
    target.truncate(base)
    slowest: dict[int, float] = {}
    for _ in range(reps):
        for n in sizes:
            t0 = time.perf_counter()
            target.decode(filler[:n], all_logits=True)
            took = time.perf_counter() - t0
            # the best of the repetitions: interference only ever makes a decode slower
            model.verify[n] = min(model.verify.get(n, took), took)
            slowest[n] = max(slowest.get(n, took), took)
            target.truncate(base)
    if reps > 1:  # how far apart the repetitions were: the measurement's own spread
        model.spread = {n: slowest[n] / model.verify[n] - 1.0 for n in sizes
                        if model.verify[n] > 0}
    if draft is not None:
        draft.prefill(tokens)
        draft.checkpoint()
        dbase = len(draft.tokens)
        n = DRAFT_PROBE_TOKENS  # independent of `sizes`, which may be as short as (1,)
        t0 = time.perf_counter()
        for tok in list(tokens[-1:]) * n:
            draft.decode([tok])
        model.draft_token = (time.perf_counter() - t0) / n
        draft.truncate(dbase)
    model.busy = others_share(before, cpu_snapshot())
    return model
