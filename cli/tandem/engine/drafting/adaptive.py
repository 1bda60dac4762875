"""Adaptive draft length and the measured fallback to plain decoding.

Rule: keep, per draft position i, the acceptance rate a_i conditional on reaching i (an
exponential moving average over recent steps). Drafting k tokens then yields on average
1 + a_0 + a_0 a_1 + ... tokens for k * c_draft + c_verify(k + 1) seconds, with the costs
measured on this machine (CostModel). Each step drafts the k in {0, n_min..n_max} that
maximises tokens per second among those that beat plain decoding by the spread of the
measured costs (LengthController); k = 0 is a plain step. Every so often a plain-looking
choice is overridden by a short probe so that the acceptance estimates stay current; probes
are priced and paid from the request's ProbeBudget (2% of its plain time), and so are the
drafts that acceptance kept from earlier requests chooses until this request confirms it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.tuning.costs import MAX_BATCH, CostModel


@dataclass
class AcceptanceTracker:
    n_max: int = 16
    prior: float = 0.7
    weight: float = 0.15
    accept: list[float] = field(default_factory=list)
    steps: int = 0
    deepest: int = 0  # positions < deepest have been reached at least once
    start_steps: int = 0  # verdicts it started with (kept from earlier requests)

    def __post_init__(self):
        if not self.accept:
            self.accept = [self.prior] * max(self.n_max, 1)

    def update(self, drafted: int, accepted: int) -> None:
        """Positions 0..accepted were reached; all but a rejection at `accepted` succeeded."""
        if drafted <= 0:
            return
        self.steps += 1
        reached = min(drafted, accepted + 1, len(self.accept))
        for i in range(reached):
            hit = 1.0 if i < accepted else 0.0
            self.accept[i] = (1 - self.weight) * self.accept[i] + self.weight * hit
        self.deepest = max(self.deepest, reached)
        # positions never reached follow the deepest measured one: a source that keeps being
        # right (a copied passage) may then try longer drafts instead of being held at the prior
        for i in range(self.deepest, len(self.accept)):
            self.accept[i] = self.accept[self.deepest - 1]


# A probe is worth its price only if the draft could pay at the acceptance a good source
# reaches (prompt lookup on summarization accepted 86%, docs/benchmarks.md section 0; the
# draft model's 90% is auto's bar for it too): below that, no acceptance it could measure
# would make drafting pay, and the probe would only cost
PROBE_ACCEPT = 0.9
# An estimate is trusted to choose drafts that pay once it has seen this many verdicts; before,
# every draft is a probe. Verdicts kept from earlier requests (engine/tuning/knowledge.py) count, but
# the drafts they choose are paid as probes until this many of the request's own drafts in a
# row were accepted in full
MIN_EVIDENCE = 3
# Speculation's net cost may reach this share of the plain time of the tokens produced
# (ProbeBudget): where nothing pays, auto stays within it of plain decoding
PROBE_SHARE = 0.02


@dataclass
class ProbeBudget:
    """The request's ledger of what speculation cost against plain decoding.

    Every token produced earns `share` of its plain step's time; every speculative step is
    charged what it cost beyond producing its tokens plainly (`time - tokens * plain`: a
    step that gained pays in). A probe, any draft chosen without a trusted estimate, is made
    only when the balance covers its worst case (nothing accepted), so the drafts taken to
    learn never cost, in all, more than `share` of the request's plain time."""

    share: float = PROBE_SHARE
    balance: float = 0.0  # seconds
    probes: int = 0
    refused: int = 0  # probes the balance did not cover

    def earn(self, tokens: int, plain: float) -> None:
        self.balance += self.share * tokens * plain

    def settle(self, seconds: float, tokens: int, plain: float) -> None:
        self.balance -= seconds - tokens * plain


@dataclass
class LengthController:
    """Decision rule: with c(n) the measured seconds of a verify batch of n tokens, d the
    seconds of a draft token (0 for zero-cost drafts), a_i the acceptance of position i and
    s(n) the relative spread of c(n) (CostModel.spread_of), a draft of k tokens is expected to
    yield E(k) = 1 + a_0 + a_0 a_1 + ... tokens for C(k) = k d + c(k + 1) seconds, and is used
    only where

        E(k) / C(k) >= (1 + s(k + 1) + s(1)) / c(1)

    (it beats plain decoding by the spread of the two timings it is compared with: their
    ratio is uncertain by up to the sum); of those, the k with the highest E(k) / C(k).
    None qualifying: a plain step. Every so often (an interval that doubles while probes
    keep confirming plain decoding) a probe drafts a k that could pay at PROBE_ACCEPT and
    whose worst case, k d + c(k + 1) - c(1), the request's ProbeBudget covers (of those,
    the best rate at PROBE_ACCEPT; none: no probe). Until the tracker has MIN_EVIDENCE
    verdicts its estimates are a prior, and every draft is such a probe. Verdicts kept from
    earlier requests inform it, but until this request confirms them (`on_trial`) it drafts
    only a k whose worst case the budget covers, as a probe."""

    costs: CostModel
    n_min: int  # the range it chooses in (the draft's, or 1..a source's cap)
    n_max: int
    uses_model: bool = True  # drafting costs draft-model decodes (else: free, n-gram)
    probe_every: int = 12  # after this many plain choices, draft anyway to re-measure
    probe_len: int = 2  # the shortest probe (a shorter one that cannot pay is never made)
    max_probe_every: int = 256  # probes that keep confirming "plain" back off up to this
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    budget: ProbeBudget | None = None  # None: probes are not priced (a bare controller)
    _plain_run: int = 0
    _interval: int = 0  # current probe interval (0: not started, use probe_every)
    last_was_probe: bool = False  # the latest choice drafted only to re-measure acceptance
    _confirmed_from: int = 0  # tracker steps after this request's latest failed trial (on_trial)

    def margin(self, k: int) -> float:
        """How much faster than plain a draft of k must be expected to be: the relative
        spread of the two measured timings compared, c(k + 1) and c(1)."""
        return self.costs.spread_of(k + 1) + self.costs.spread_of(1)

    def _draft_cost(self) -> float | None:
        return None if self.uses_model else 0.0

    def pays(self, k: int, accept) -> bool:
        plain = self.costs.plain
        if plain <= 0:
            return False
        rate = self.costs.expected_rate(k, accept, self._draft_cost())
        return rate * plain >= 1.0 + self.margin(k)

    def probe_length(self, cap: int) -> int:
        """The probe to make: of the drafts (from probe_len on) that could pay at
        PROBE_ACCEPT and whose worst case the budget covers, the one with the best rate at
        that acceptance (on a flat curve a longer probe costs nothing more and measures more
        positions; on a steep one the budget allows the short ones first); 0: none."""
        best_k, best = 0, 0.0
        for k in range(max(self.n_min, self.probe_len, 1), cap + 1):
            if not self.pays(k, [PROBE_ACCEPT] * k):
                continue
            if self.budget is not None and self.worst_loss(k) > self.budget.balance:
                continue
            rate = self.costs.expected_rate(k, [PROBE_ACCEPT] * k, self._draft_cost())
            if rate > best * 1.0001:
                best_k, best = k, rate
        return best_k

    def worst_loss(self, k: int) -> float:
        """Seconds a draft of k loses against a plain step when nothing is accepted."""
        per = self.costs.draft_token if self.uses_model else 0.0
        return k * per + self.costs.verify_cost(k + 1) - self.costs.plain

    @property
    def informed(self) -> bool:
        return self.tracker.steps >= MIN_EVIDENCE

    @property
    def on_trial(self) -> bool:
        """Informed by verdicts kept from earlier requests, not yet confirmed by MIN_EVIDENCE
        of this request's drafts accepted in full in a row: kept verdicts are per source and
        match length, not per kind of prompt (copies of a summary, then math), so they may
        choose k, but each draft is a probe paid from the budget."""
        t = self.tracker
        return (self.budget is not None and t.start_steps > 0
                and t.steps - max(t.start_steps, self._confirmed_from) < MIN_EVIDENCE)

    def choose(self, cap: int) -> int:
        cap = min(cap, self.n_max)
        self.last_was_probe = False
        if cap <= 0:
            return 0
        best_k, best = 0, 0.0
        trial = self.on_trial
        if self.informed or self.budget is None:
            for k in range(max(self.n_min, 1), cap + 1):
                if not self.pays(k, self.tracker.accept):
                    continue
                if trial and self.worst_loss(k) > self.budget.balance:
                    continue
                rate = self.costs.expected_rate(k, self.tracker.accept, self._draft_cost())
                if rate > best * 1.0001:
                    best_k, best = k, rate
        if best_k:
            self._plain_run = 0
            self._interval = 0
            if trial:
                self.last_was_probe = True
                self.budget.probes += 1
            return best_k
        self._plain_run += 1
        interval = self._interval or self.probe_every
        spaced = self.informed or self.budget is None
        if spaced and self._plain_run < interval:
            return 0
        # a probe: uninformed estimates are probed whenever the budget allows; informed ones
        # that keep confirming plain decoding are probed less and less often
        k = self.probe_length(cap)
        if k <= 0:
            if self.budget is not None:
                self.budget.refused += 1
            return 0
        self._plain_run = 0
        if spaced:
            self._interval = min(interval * 2, self.max_probe_every)
        self.last_was_probe = True
        if self.budget is not None:
            self.budget.probes += 1
        return k

    def feedback(self, drafted: int, accepted: int) -> None:
        """The verdict on this controller's latest draft. A probe whose drafts were all
        accepted brings the probe interval back to its start: the source may have become
        good again (a new passage to copy, a draft model back in step), and doubled
        intervals would otherwise leave it unused for hundreds of tokens."""
        trial = self.on_trial
        self.tracker.update(drafted, accepted)
        if trial and 0 < drafted and accepted < drafted:
            # a trial falling short restarts the count: the EMA would mix a kept 0.98 with this
            # request's 1 of 3 into an estimate that still drafts, unbudgeted (simulated flat
            # host, restated math after summarization: 1.04x plain without the restart)
            self._confirmed_from = self.tracker.steps
        if self.last_was_probe and drafted > 0 and accepted >= drafted:
            self._interval = 0


@dataclass
class FallbackGuard:
    """Measured, per request: if speculative steps deliver fewer tokens per second than plain
    steps, decode plainly for a while (doubling each time), then probe speculation again.
    Once speculation measures clearly faster again (`recover`), the back-off starts over, so
    a slump late in a request is not punished for one early on."""

    margin: float = 0.98
    recover: float = 1.05
    min_spec_steps: int = 4
    initial_backoff: int = 16
    max_backoff: int = 256
    weight: float = 0.25
    plain_rate: float = 0.0
    spec_rate: float = 0.0
    backoff: int = 0  # the next fallback's length (0: initial_backoff)
    _spec_steps: int = 0
    _plain_left: int = 0
    fallbacks: int = 0

    def want_plain(self) -> bool:
        if self._plain_left > 0:
            self._plain_left -= 1
            return True
        if self.plain_rate <= 0 and self._spec_steps >= self.min_spec_steps:
            # nothing to compare with yet: one plain step measures what speculation must beat
            return True
        return False

    def observe(self, produced: int, seconds: float, speculative: bool) -> None:
        if seconds <= 0:
            return
        rate = produced / seconds
        if not speculative:
            self.plain_rate = rate if self.plain_rate == 0 else _ema(self.plain_rate, rate, self.weight)
            return
        self.spec_rate = rate if self._spec_steps == 0 else _ema(self.spec_rate, rate, self.weight)
        self._spec_steps += 1
        if self._spec_steps < self.min_spec_steps or self.plain_rate <= 0:
            return
        if self.spec_rate < self.margin * self.plain_rate:
            self.fallbacks += 1
            self._plain_left = self.backoff or self.initial_backoff
            self.backoff = min(self._plain_left * 2, self.max_backoff)
            self._spec_steps = 0
        elif self.spec_rate >= self.recover * self.plain_rate:
            self.backoff = 0


def _ema(old: float, new: float, w: float) -> float:
    return (1 - w) * old + w * new


def model_draft_gain(costs: CostModel, n_max: int, accept: float = 0.9) -> float:
    """Best predicted speedup of draft-model drafting over plain decoding at a steady `accept`
    rate per position, from this machine's measured costs (1.0: cannot pay at all)."""
    if costs.plain <= 0 or costs.draft_token <= 0:
        return 1.0
    plain_rate = 1.0 / costs.plain
    best = max((costs.expected_rate(k, [accept] * k) for k in range(1, max(n_max, 1) + 1)),
               default=0.0)
    return max(best / plain_rate, 1.0) if best > 0 else 1.0


def longest_paying(costs: CostModel, accept: float = 0.9, cap: int = MAX_BATCH - 1) -> int:
    """The longest free (n-gram) draft, up to `cap`, that the length controller finds paying
    at a steady `accept` per position with these costs (0: none; a BatchCosts prices it for
    the batch it joins)."""
    ctl = LengthController(costs, 1, cap, uses_model=False)
    return max((k for k in range(1, cap + 1) if ctl.pays(k, [accept] * k)), default=0)
