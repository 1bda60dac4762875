"""How many CPU threads llama.cpp gets: the count that is fastest now (issue 32).

llama.cpp's threads meet at a barrier after every operation of a decode, so a step lasts as
long as its slowest thread, and one core that another program keeps busy stalls them all: on
this project's 2-core machine, while another llama.cpp program decoded, 2 threads made 1.0-2.5
tok/s where 1 thread made 15.5. So when the user did not fix a count, the session

1. times a plain step at each candidate count (`ThreadTuner.probe`: one-token decodes,
   interleaved, three rounds at most, a candidate that is clearly slower not timed again) and
   moves from the count in use only at a clear margin (every sample of it slower than every
   sample of the other by MARGIN, or one sample SURE times slower), so noise on a quiet
   machine keeps today's count; where other processes keep the machine busy, by the samples'
   means (BUSY_MARGIN), since a stalling count's occasional fast sample says little there.
   At the first request, the probe is skipped when other
   processes used under BUSY_CORES of the CPU while the models loaded;
2. then watches the verify time of every step (`observe`, normalised to a plain step): steps
   well above the reference of the chosen count (a program started computing) or, with fewer
   threads than the default, well below it (one stopped) start a new probe;
3. and every `check_every` steps and at each later request's start looks at the share of
   the CPU other processes used since the last look (ThreadControl reads /proc then, never
   per step): with the default count, a
   busy machine starts a probe; with fewer threads, cores free again do (without /proc: a
   probe), each probe that changes nothing doubling the interval up to CHECK_MAX.

`ThreadTuner` holds the decisions and receives every timing and load figure as an argument
(no clock, no /proc): tests drive it with scripted costs. `ThreadControl` applies them to a
session's contexts: it times the probe's decodes, reads the load at those moments only, and
gets each step's verify time from generate(), which measures it anyway. The probe's decodes
are truncated away: the KV cache and the logits the loop still reads are unchanged. Exact
mode's logits do not depend on the count (tests/test_threads_real.py); fast mode's f16 flash
attention rounds differently at another count past 512 cached tokens, as its batches do.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

# a smaller (or larger) count replaces the one in use only when every timed plain step of
# the one in use is this much slower than every one of the other (three rounds each)
MARGIN = 1.25
# ... or when its one sample of the first round is this much slower (a stalled barrier
# cost 12-24x in this project's runs: a second round would only pay for it again)
SURE = 4.0
# ... and on a busy machine, when the mean of its timed plain steps is this much above the
# other's: a count that stalls at its barriers has a fast sample now and then beside
# seconds-long ones, and one lucky sample kept the losing count (issue 51). Up to
# BUSY_ROUNDS samples each, fewer once the one in use is BUSY_CLEAR times slower
BUSY_MARGIN = 1.15
BUSY_ROUNDS = 6
BUSY_CLEAR = 1.5
# after the first round a candidate this much slower than the best is not timed again, and
# the ones below it (fewer threads than a count that is already worse) are not tried
DROP = 1.5
# steps after a probe whose fastest sets the reference of the chosen count (capped at
# REF_CAP times the probe's own timing: a machine that got busy right after the probe)
SETTLE = 4
REF_CAP = 1.5
WEIGHT = 0.2  # the moving average of normalised step times
JUMP = 1.6  # average and last step this far above the reference: probe again
CALM = 0.8  # fewer threads than the default and the average this far below it: probe again
CHECK_EVERY = 64  # steps between looks at the machine's load
CHECK_MAX = 1024  # the interval doubles after each probe of a check that changed nothing
BUSY_CORES = 0.5  # other processes using this many cores' worth make the machine busy
# a verify batch of n rows costs about 1 + ROW_COST (n - 1) plain steps on a CPU (issue 25's
# hosts: 0.33-0.9): only to compare steps of different sizes with one reference, within JUMP
ROW_COST = 0.5


def candidates(default: int) -> tuple[int, ...]:
    """The counts a probe tries, largest first: the default, one and two fewer (a core or two
    taken), then halvings down to 1. 2 -> (2, 1); 8 -> (8, 7, 6, 4, 2, 1)."""
    counts = {default, default - 1, default - 2, 1}
    n = default // 2
    while n >= 1:
        counts.add(n)
        n //= 2
    return tuple(sorted((c for c in counts if c >= 1), reverse=True))


class ThreadTuner:
    """The thread count's decisions. `default`: the count llama.cpp would use (all cores);
    `current` starts there. Timings are seconds of one decode; `others`: the share (0..1) of
    the machine's CPU that other processes used since the last look, None when unknown."""

    def __init__(self, default: int, counts: Sequence[int] | None = None):
        self.default = max(1, default)
        self.counts = tuple(counts) if counts else candidates(self.default)
        self.current = self.default
        self.steps = 0  # steps observed, over all requests
        self.ref: float | None = None  # normalised step time of `current` (None: settling)
        self.avg = 0.0
        self._settle: list[float] = []
        self._probe_ref: float | None = None  # the probe's own timing of `current`
        self._due: str | None = "start"  # why a probe is wanted (None: it is not)
        self._busy = False  # other processes used BUSY_CORES or more at the latest look
        self.check_every = CHECK_EVERY
        self._next_check = CHECK_EVERY
        # what the latest probe found: {count: [seconds, ...]}, and every change of count
        self.last_times: dict[int, list[float]] = {}
        self.changes: list[tuple[int, int, int, str]] = []  # (step, from, to, why)

    @property
    def active(self) -> bool:
        return len(self.counts) > 1

    @property
    def due(self) -> str | None:
        """Why a probe is wanted now: start, slower, faster, check; None: it is not."""
        return self._due

    # ------------------------------------------------------------------ per step

    def observe(self, rows: int, seconds: float) -> bool:
        """One step's verify time (a batch of `rows` tokens): True when a probe or a load
        check is due now. A few float operations: it runs every step."""
        self.steps += 1
        x = seconds / (1.0 + ROW_COST * (rows - 1))
        if self.ref is None:
            self._settle.append(x)
            if len(self._settle) >= SETTLE:
                ref = min(self._settle)
                if self._probe_ref is not None:
                    ref = min(ref, REF_CAP * self._probe_ref)
                self.ref = self.avg = ref
        else:
            self.avg += WEIGHT * (x - self.avg)
            # steps slower: a program started computing, and only fewer threads can help (with
            # none fewer left, a probe only paid for stalled decodes of more: issue 51)
            if self.avg > JUMP * self.ref and x > JUMP * self.ref and \
                    self.current > self.counts[-1]:
                self._due = "slower"
            elif self.current < self.default and self.avg < CALM * self.ref:
                self._due = "faster"
        if self.steps >= self._next_check and self._due is None:
            self._due = "check"
        return self._due is not None

    # ------------------------------------------------------------------ when due

    def want_probe(self, others: float | None) -> bool:
        """Whether the due probe is worth its decodes, given the load since the last look: a
        start or a check on a quiet machine keeps the default; a check while other processes
        still fill the cores given up keeps the smaller count. A step-time jump always
        probes. When not, the request is dropped (and the next check scheduled)."""
        why = self._due
        self._busy = others is not None and others * self.default >= BUSY_CORES
        if why == "check" and others is None and self.current == self.default:
            self.skip()  # no load to read: with every thread, the step times alone decide
            return False
        if why in ("start", "check") and others is not None:
            busy = others * self.default
            given_up = self.default - self.current
            if given_up == 0:
                worth = busy >= BUSY_CORES
            else:
                worth = busy <= given_up - BUSY_CORES
            if not worth:
                self.skip()
                return False
        return why is not None

    def look(self) -> None:
        """A load check now, unless a probe is due anyway (a request's start: the machine
        may have changed while the session was idle)."""
        if self._due is None:
            self._due = "check"

    def skip(self) -> None:
        """Drop the due probe (nothing to gain, or no room to decode); next look later."""
        why, self._due = self._due, None
        self._next_check = self.steps + self.check_every
        if why == "start":
            self._rebase(None)

    def probe(self, time_decode: Callable[[int], float]) -> int:
        """Time a plain step at the candidate counts (`time_decode(count) -> seconds`, which
        leaves llama.cpp at that count) and choose; returns the count to use from now on."""
        why, self._due = self._due or "asked", None
        cur = self.current
        times: dict[int, list[float]] = {c: [] for c in self.counts}
        timed: list[int] = []
        best = float("inf")
        # a busy machine's first samples may be lucky ones: only a stall rules a count out
        drop = SURE if self._busy else DROP
        # steps got slower: the counts above the one in use would only contend more
        counts = [c for c in self.counts if c <= cur] if why == "slower" else self.counts
        for c in counts:  # round one, largest first
            t = time_decode(c)
            times[c].append(t)
            timed.append(c)
            if t > drop * best:
                break  # fewer threads than a count that is already clearly worse: not tried
            best = min(best, t)
        if cur not in timed:
            times[cur].append(time_decode(cur))
            timed.append(cur)
        fastest = min(timed, key=lambda c: times[c][0])
        sure = fastest != cur and times[cur][0] > SURE * times[fastest][0]
        again = [c for c in timed if times[c][0] <= drop * times[fastest][0] or c == cur]
        chosen = cur
        if sure:
            chosen = fastest
        elif len(again) > 1 and self._busy:
            chosen = _busy_rounds(times, again, cur, time_decode)
        elif len(again) > 1:
            for c in reversed(again):  # round two, smallest first (drift favours none)
                times[c].append(time_decode(c))
            fastest = min(again, key=lambda c: _median(times[c]))
            if fastest != cur and min(times[cur]) > MARGIN * max(times[fastest]):
                for c in (cur, fastest):  # round three before leaving the count in use:
                    times[c].append(time_decode(c))  # a burst of noise rarely lasts it
                if min(times[cur]) > MARGIN * max(times[fastest]):
                    chosen = fastest
        self.last_times = {c: v for c, v in times.items() if v}
        if chosen != cur:
            self.changes.append((self.steps, cur, chosen, why))
            self.check_every = CHECK_EVERY
        elif why == "check":
            self.check_every = min(2 * self.check_every, CHECK_MAX)
        self.current = chosen
        self._next_check = self.steps + self.check_every
        self._rebase(min(times[chosen]))
        return chosen

    def _rebase(self, probe_ref: float | None) -> None:
        """Steps from now on set the reference of the count in use."""
        self.ref, self._settle, self._probe_ref = None, [], probe_ref

    def slowdown(self, a: int, b: int) -> float | None:
        """How many times slower count `a` was than count `b` in the latest probe."""
        ta, tb = self.last_times.get(a), self.last_times.get(b)
        if not ta or not tb:
            return None
        return _median(ta) / _median(tb)


def _busy_rounds(times: dict[int, list[float]], again: Sequence[int], cur: int,
                 time_decode: Callable[[int], float]) -> int:
    """A busy machine's rounds after the first: every count still in question timed again,
    smallest first, BUSY_ROUNDS in all, fewer once the count in use is BUSY_CLEAR times
    slower (each sample of a stalling count costs a stall); it is left only for a mean
    BUSY_MARGIN lower. Means: a stalling count's steps cost what they cost on average, and a
    spike moves a mean of BUSY_ROUNDS by less than the margin. No early stop to keep the
    count in use: a stalling count has runs of lucky samples."""
    for _ in range(2, BUSY_ROUNDS + 1):
        for c in reversed(again):
            times[c].append(time_decode(c))
        fastest = min(again, key=lambda c: _mean(times[c]))
        ratio = _mean(times[cur]) / _mean(times[fastest])
        if ratio > BUSY_CLEAR:
            break
    return fastest if ratio > BUSY_MARGIN else cur


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def cpu_load() -> Callable[[], float | None]:
    """A `load` for ThreadControl: the share of the CPU other processes used since its
    previous call, from /proc (engine/tuning/costs.py); None without /proc or over a window too
    short to tell (the window then runs on to the next call)."""
    from tandem.engine.tuning.costs import cpu_snapshot, others_share

    last = [cpu_snapshot()]

    def load() -> float | None:
        now = cpu_snapshot()
        share = others_share(last[0], now)
        if share is not None or last[0] is None:
            last[0] = now
        return share

    return load


def load_text(others: float | None) -> str:
    if others is None:
        return "other processes busy"
    return f"other processes used {others:.0%} of the CPU"


class ThreadControl:
    """A session's thread count: the tuner's decisions applied to its contexts.

    `contexts()`: the active (target, draft) contexts, either None; only contexts created
    without a thread count of their own (`params.n_threads == 0`) are changed, so a count the
    user or a sweep set is never touched. `load()`: the share of the CPU other processes used
    since the previous call (None: unknown), called at probe and check time only. `clock`:
    what times the probe's decodes (None: time.perf_counter, looked up when called)."""

    MAX_NOTES = 4  # changes said per request; more are counted

    def __init__(self, tuner: ThreadTuner, contexts: Callable[[], Sequence],
                 load: Callable[[], float | None] = lambda: None,
                 clock: Callable[[], float] | None = None):
        self.tuner = tuner
        self._contexts = contexts
        self._load = load
        self._clock = clock
        self._notes: list[str] = []  # this request's
        self._more = 0
        self._step0 = 0
        self._reason: str | None = None  # why the count in use was chosen
        load()  # the first look: the next one measures from here (while the models load)

    @property
    def active(self) -> bool:
        """Whether a count is chosen for the active target context at all."""
        target = self._contexts()[0]
        return self.tuner.active and target is not None and _adaptive(target)

    def apply(self) -> None:
        """Give the adaptive contexts the count in use (a context just made has the default)."""
        for ctx in self._contexts():
            if ctx is not None and _adaptive(ctx):
                ctx.set_threads(self.tuner.current)

    def begin(self) -> Threads:
        """At the start of a request, before anything decodes (the prompt, a calibration):
        the first request's probe, later ones' load check (a probe only if the load changed
        enough). Returns what generate() is to tell each step (NO_THREADS when nothing is
        chosen for the active target context)."""
        self._notes, self._more = [], 0
        if not self.active:
            return NO_THREADS
        self.apply()
        self._step0 = self.tuner.steps
        self.tuner.look()
        self.maybe_probe()
        if self.tuner.current != self.tuner.default and not self._notes and self._reason:
            self._notes.append(f"threads: {self.tuner.current} of {self.tuner.default}, kept "
                               f"from an earlier request ({self._reason})")
        return self

    def observe(self, rows: int, seconds: float) -> None:
        """One step's verify time (`rows` tokens), and the probe or load check when due. Called
        between steps once the step's logits were read: a probe's decodes replace them."""
        if self.tuner.observe(rows, seconds):
            self.maybe_probe()

    def maybe_probe(self) -> None:
        """The due probe, if the load says it is worth it."""
        target = self._contexts()[0]
        if target is None or len(target.tokens) + 1 >= target.n_ctx:
            self.tuner.skip()  # no room for a probe's decode at the context end
            return
        others = self._load()
        why, before = self.tuner.due, self.tuner.current
        if not self.tuner.want_probe(others):
            return
        target.checkpoint()  # each probe's decode is undone whole (a recurrent state: from a copy)
        base = len(target.tokens)
        token = target.tokens[-1] if target.tokens else 0

        clock = self._clock or time.perf_counter

        def time_decode(n: int) -> float:
            target.set_threads(n)
            t0 = clock()
            target.decode([token], all_logits=True)
            took = clock() - t0
            target.truncate(base)
            return took

        if target.n_decoded == 0:
            time_decode(self.tuner.counts[-1])  # a context's first decode pays allocations
        chosen = self.tuner.probe(time_decode)
        self.apply()
        if chosen != before:
            self._note(before, chosen, others, why)

    def _note(self, before: int, chosen: int, others: float | None, why: str | None) -> None:
        slower = self.tuner.slowdown(before, chosen)
        were = "was" if before == 1 else "were"
        self._reason = (f"{before} {were} {f'{slower:.1f}x ' if slower else ''}slower: "
                        + (load_text(others) if chosen < before else "the machine is quieter"))
        if len(self._notes) >= self.MAX_NOTES:
            self._more += 1
        elif why == "start":
            self._notes.append(f"threads: {chosen} of {self.tuner.default} ({self._reason})")
        else:
            step = self.tuner.steps - self._step0
            self._notes.append(f"threads: {before} -> {chosen} at step {step} ({self._reason})")

    @property
    def notes(self) -> list[str]:
        """What this request's notes say about threads (the count kept, each change)."""
        more = [f"threads: {self._more} more changes"] if self._more else []
        return self._notes + more


class Threads(Protocol):
    """What generate() tells each step and reads at the end (ThreadControl, NO_THREADS)."""

    notes: Sequence[str]

    def observe(self, rows: int, seconds: float) -> None: ...


class _NoThreads:
    """The count is not the engine's to choose: steps are not watched."""

    notes: Sequence[str] = ()

    def observe(self, rows: int, seconds: float) -> None:
        pass


NO_THREADS: Threads = _NoThreads()


def _adaptive(ctx) -> bool:
    return getattr(ctx.params, "n_threads", 0) == 0
