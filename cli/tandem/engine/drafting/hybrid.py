"""hybrid: zero-cost tokens (n-grams, or auto's suffix indexes) on a long match, else the draft
model, whose early stop zero-cost tokens continue; the shape `auto` (engine/drafting/auto.py)
configures for a machine, with lengths chosen per step and a fallback to plain."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

from tandem.engine.drafting.adaptive import AcceptanceTracker, FallbackGuard, LengthController, ProbeBudget
from tandem.engine.backend.decode_requests import Steps
from tandem.engine.drafting.drafters import (Draft, DraftModelDrafter, DraftParams, StepSources,
                                             Stepped)
from tandem.engine.drafting.ngram import NgramIndex
from tandem.engine.loop.events import StepEvent
from tandem.engine.tuning.costs import DISAGREE, CostModel


class ZeroCostSources(Protocol):
    """The drafts a HybridDrafter tries before its draft model: tokens that cost no model
    time (the hybrid's n-grams: NgramSources; auto's suffix indexes: AutoDrafter)."""

    def read_prompt(self, prompt: Sequence[int]) -> None: ...

    def pick(self, tokens: Sequence[int], k: int) -> tuple[list[int], str,
                                                          LengthController | None]:
        """Up to k tokens to follow `tokens`, their source, and the length controller that
        chose them (fed back after the step); no tokens: the draft model drafts."""

    def continue_draft(self, tokens: Sequence[int], drafted: list[int],
                       k: int) -> tuple[list[int], int]:
        """Up to k tokens after a model draft that stopped early, and their match length."""

    def split(self, draft: Draft, step: StepEvent) -> StepSources:
        """The step's drafts by source; () where they are not told apart."""


class NgramSources:
    """Prompt lookup over n-grams of 2..ngram_n tokens; with `adaptive`, a length controller
    per match length (a 4-token match predicts far better than a 2-token one)."""

    def __init__(self, costs: CostModel, n_max: int, budget: ProbeBudget | None,
                 min_match: int, ngram_n: int, adaptive: bool):
        self.min_match, self.adaptive = min_match, adaptive
        self.index = NgramIndex(min(2, ngram_n), ngram_n)
        # n-gram drafts cost no model time, so their probes are cheap: probe often
        self.lengths = {
            n: LengthController(costs, 1, n_max, False, probe_every=4, probe_len=1,
                                max_probe_every=32,
                                tracker=AcceptanceTracker(n_max, prior=0.6), budget=budget)
            for n in range(min(min_match, ngram_n), ngram_n + 1)}

    def read_prompt(self, prompt: Sequence[int]) -> None:
        self.index.sync(prompt)

    def pick(self, tokens, k):
        idx = self.index
        idx.sync(tokens)
        cont, match = idx.lookup(k)
        if match < self.min_match or not cont:
            return [], "prompt", None
        if not self.adaptive:
            return cont, "prompt", None
        ctl = self.lengths[min(match, idx.longest)]
        return cont[:ctl.choose(len(cont))], "prompt", ctl

    def continue_draft(self, tokens, drafted, k):
        # the index follows `tokens` already: pick() synced it
        return self.index.lookup(k, extra=drafted)

    def split(self, draft: Draft, step: StepEvent) -> StepSources:
        # the model's tokens come first in a draft, the n-grams' after them (continue_draft)
        n_model = min(draft.n_model, step.drafted)
        parts = (("model", n_model, min(step.accepted, n_model)),
                 ("prompt", step.drafted - n_model, max(step.accepted - n_model, 0)))
        return tuple(p for p in parts if p[1] > 0)


@dataclass(frozen=True)
class HybridPolicy:
    """How a HybridDrafter chooses between its sources (the strategies' shape, not a setting):
    `ngram_match`, the shortest match its zero-cost tokens need; `ngram_n`, its n-grams'
    longest n; `ngram_cap`, their longest draft (None: the draft model's n_max); `adaptive`,
    lengths chosen per step from measured acceptance and costs; `guard`, speculation switched
    off where it measures slower than plain."""

    name: str = "hybrid"
    ngram_match: int = 3
    ngram_n: int = 4
    ngram_cap: int | None = None
    adaptive: bool = False
    guard: bool = False


class HybridDrafter(Stepped):
    """Zero-cost tokens (`sources`; None: n-grams with a match of at least
    `policy.ngram_match` tokens) when they match, the draft model otherwise; when the model
    stops early (p_min), zero-cost tokens continue its draft.

    `draft.n_max` is the draft model's longest draft and `policy.ngram_cap` the n-gram
    source's (at least n_max: n-gram drafts cost no draft time); the attribute `n_max`, the
    longest draft of either, is what generate() reads.

    With `policy.adaptive`, each source's draft length is chosen per step from its measured
    acceptance and this machine's costs (see adaptive.py), paid from `budget` (None: its own)
    when it probes. With `policy.guard`, speculation that measures slower than plain decoding
    on this request is switched off for a while.
    """

    def __init__(self, model: DraftModelDrafter | None, draft: DraftParams, costs: CostModel,
                 policy: HybridPolicy, *, sources: ZeroCostSources | None,
                 budget: ProbeBudget | None):
        n_min, n_max, adaptive = draft.n_min, draft.n_max, policy.adaptive
        self.name = policy.name
        self.model = model
        self.model_max = n_max
        self.n_max = max(n_max, policy.ngram_cap or n_max)
        self.ngram_match = policy.ngram_match
        self.costs = costs
        self.adaptive = adaptive
        # what speculation cost this request against plain decoding: probes are paid from it
        self.budget = budget if budget is not None else ProbeBudget() if adaptive else None
        self.model_len = LengthController(self.costs, n_min, n_max, True,
                                          tracker=AcceptanceTracker(max(n_max, 1)),
                                          budget=self.budget)
        self.ngram_len: dict[int, LengthController] = {}  # the default n-grams' controllers
        if sources is None:
            sources = NgramSources(self.costs, self.n_max, self.budget, policy.ngram_match,
                                   policy.ngram_n, adaptive)
            self.ngram_len = sources.lengths
        self.sources = sources
        self.step_sources: StepSources = ()  # the latest step's, as the sources tell them
        self.guard = FallbackGuard() if policy.guard else None
        self.notes: list[str] = []  # decisions a report may show (e.g. why the model is off)
        # the request's own first verify timings (batch size, seconds) against the cost
        # model's: far apart, the verify curve is rebuilt from them (see _check_costs)
        self._check: list[tuple[int, float]] | None = [] if adaptive else None
        self._catch_up_token = 0.0  # seconds a token of the draft model's latest catch-up
        self._reference: CostModel | None = None
        self._new_step()

    def _new_step(self) -> None:
        """Forget the latest draft: before each propose(), and after its step is observed
        (generate() skips propose() when no draft fits: that step must not look like this one)."""
        self._last: Draft = Draft()
        self._last_ngram: LengthController | None = None  # chose the zero-cost tokens
        self._model_ran = False  # the draft model was run in the latest propose()
        self._probe = False  # the latest draft was a probe (chosen to measure, not to gain)

    @property
    def probing(self) -> bool:
        """The latest draft was a probe."""
        return self._probe

    def prefill_steps(self, prompt: Sequence[int]) -> Steps[None]:
        """The sources read the prompt, and the draft model too, in the prompt phase as
        llama.cpp's does, except in a shared batch (serve's slots), where every slot would
        wait for it: there its first draft reads what it lacks (DraftModelDrafter.draft), so
        a request the model never drafts for never pays for its prompt."""
        self.sources.read_prompt(prompt)
        if self.model is not None and not self.costs.shared:
            yield from self.model.prefill_steps(prompt)

    def propose_steps(self, tokens, room, sampling, rng, sample) -> Steps[Draft]:
        self._new_step()
        k = min(room, self.n_max)
        if k <= 0 or (self.guard is not None and self.guard.want_plain()):
            return self._last
        cont, source, ctl = self.sources.pick(tokens, k)
        if ctl is not None:
            self._last_ngram, self._probe = ctl, ctl.last_was_probe
        if cont:
            self._last = Draft(cont, [None] * len(cont) if sample else None, n_model=0,
                               source=source)
            return self._last
        return (yield from self.model_draft(tokens, room, sampling, rng, sample))

    def model_draft(self, tokens, room, sampling, rng, sample) -> Steps[Draft]:
        """The draft model's draft (adaptive length), continued with zero-cost tokens
        (continue_draft) when the model stops early."""
        if self.model is None:
            return self._last
        k = self.model_len.choose(room) if self.adaptive else min(room, self.model_max)
        self._probe = self.adaptive and self.model_len.last_was_probe
        lag = len(tokens) - len(self.model.ctx.tokens)
        if self.costs.company() > 0 and (self._probe or lag > self.model_max + 2):
            # beside other sequences a catch-up (the model re-reading what it lacks: the
            # prompt, a plain stretch) stalls every one of them, unpriced: the model drafts
            # there only where it pays and is in step (it catches up once alone)
            k, self._probe = 0, False
        elif self._probe and lag > self.model_max + 2 and not self._catch_up_covered(lag):
            # on a slot the model has not read the prompt (prefill_steps): a probe that must
            # first read it is made only where the probe budget covers that too
            k, self._probe = 0, False
            self.budget.refused += 1
        if k <= 0:
            return self._last
        # a probe after a plain stretch first re-reads the lagged tokens in one batch; that
        # catch-up is timed apart (model.last_sync_s) and never priced as draft tokens
        draft = yield from self.model.draft_steps(tokens, k, sampling, rng, sample)
        self._model_ran = True
        if draft.tokens and len(draft.tokens) < k:
            extra, match = self.sources.continue_draft(tokens, draft.tokens,
                                                        k - len(draft.tokens))
            if extra and match >= self.ngram_match:
                draft = Draft(draft.tokens + extra,
                              (draft.dists or []) + [None] * len(extra) if sample else None,
                              n_model=len(draft.tokens))
        self._last = draft
        return draft

    def _catch_up_covered(self, lag: int) -> bool:
        """In a shared batch, whether the probe budget covers the model reading `lag` tokens
        (at the latest catch-up's seconds a token, else a draft token's: a single-token
        decode, dearer a token than a batch's); elsewhere the model read the prompt in the
        prompt phase and a catch-up is a plain stretch's, the price of the pause."""
        if not self.costs.shared or self.budget is None or not self.model.catches_up:
            return True
        return lag * (self._catch_up_token or self.costs.draft_token) <= self.budget.balance

    def observe(self, step: StepEvent) -> None:
        d = self._last
        # forced tokens included; in a shared batch the timing is the whole batch's
        batch, produced = self.costs.rows(step.drafted + 1), step.accepted + 1
        if step.forced:  # the grammar's tokens went first: only the rest were this drafter's
            step = replace(step, drafted=step.drafted - step.forced,
                           accepted=max(step.accepted - step.forced, 0), forced=0)
        self.step_sources = self.sources.split(d, step)
        t_verify = self.costs.timing(step.t_verify)  # a shared batch's own decode time
        self._check_costs(batch, t_verify)
        self.costs.observe_verify(batch, t_verify)
        model_ran = self._model_ran and self.model is not None
        if model_ran and self.model.last_decodes:
            self.costs.observe_draft(self.model.last_decodes, self.model.last_decode_s)
        n_model = min(d.n_model, step.drafted)
        if n_model:
            self.model_len.feedback(n_model, min(step.accepted, n_model))
        n_ng = step.drafted - n_model
        if n_ng and step.accepted >= n_model and self._last_ngram is not None:
            self._last_ngram.feedback(n_ng, step.accepted - n_model)
        seconds = self.costs.attributed(step.drafted + 1,
                                        step.t_draft + t_verify + step.t_sample)
        if model_ran:
            # re-reading tokens decoded while the model was off is the price of the pause,
            # not of speculation: counted, it would make every resumption look slow
            seconds -= self.model.last_sync_s
        speculative = step.drafted > 0 or model_ran  # the model ran: its cost, drafts or not
        if self.budget is not None:
            plain = self.costs.plain
            self.budget.earn(produced, plain)
            if speculative:
                self.budget.settle(seconds, produced, plain)
            if model_ran and self.costs.shared and self.model.last_sync_tokens:
                # a slot's catch-up reads the prompt too: paid as a probe is (_catch_up_covered)
                self.budget.balance -= self.model.last_sync_s
                if self.model.last_sync_tokens >= self.MIN_CATCH_UP:
                    self._catch_up_token = self.model.last_sync_s / self.model.last_sync_tokens
        # probes are exploration the length controllers pay for knowingly; the guard judges
        # the drafts that were chosen because they were predicted to pay
        if self.guard is not None and not self._probe:
            self.guard.observe(produced, seconds, speculative=speculative)
        self._new_step()

    CHECK_STEPS = 3
    MIN_CATCH_UP = 8  # tokens of a catch-up whose seconds a token are taken as its rate

    def _check_costs(self, n: int, seconds: float) -> None:
        if self._check is None or len(self._check) >= self.CHECK_STEPS or seconds <= 0:
            return
        if not self._check:  # judge against the curve as it was, not as refined since
            self._reference = CostModel(dict(self.costs.verify), self.costs.draft_token)
        self._check.append((n, seconds))
        if len(self._check) < self.CHECK_STEPS:
            return
        ref = self._reference
        ratios = sorted(t / ref.verify_cost(k) for k, t in self._check if ref.verify_cost(k) > 0)
        off = ratios[len(ratios) // 2] if ratios else 1.0
        if not 1 / DISAGREE <= off <= DISAGREE:
            # the cached curve is not this machine now: its shape cannot be trusted either (a
            # busy calibration flattens it, so long drafts look free). Start the verify curve
            # over from this request's own steps; sizes not yet seen are extrapolated from them
            self.costs.verify = {}
            for k, t in self._check[:-1]:  # the latest is observed by the caller
                self.costs.observe_verify(k, t, weight=1.0)
            self.costs.draft_token *= off
            self.notes.append(f"cached costs were {off:.2f}x this request's timings: "
                              "measured afresh")
