"""`auto`: hybrid drafting tuned to this machine, as one named drafter.

Zero-cost drafts come from suffix indexes (engine/drafting/suffix.py) over what was already said: the
current prompt and output (prompt lookup, the conversation so far in a chat), files the user
named, and earlier answers of this pair (engine/drafting/history.py). Of the sources that match the
context's ending, the longest match wins (equal lengths: prompt, then file, then history);
its draft length is chosen from the acceptance measured for that source at that match length
and this machine's costs (adaptive.py), so a source or match length that does not pay is not
used. The draft model drafts otherwise, where the calibrated costs predict it can pay at all,
and auto falls back to plain decoding while speculation measures slower. The decisions and
the costs used are its notes.
"""
from __future__ import annotations

from typing import Sequence

from tandem.engine.drafting.adaptive import (AcceptanceTracker, FallbackGuard, LengthController,
                                             ProbeBudget, model_draft_gain)
from tandem.engine.tuning.costs import MAX_BATCH, CostModel
from tandem.engine.backend.decode_requests import Steps
from tandem.engine.drafting.drafters import (Draft, DraftModelDrafter, DraftParams, StepSources,
                                             Stepped)
from tandem.engine.drafting.hybrid import HybridDrafter, HybridPolicy
from tandem.engine.loop.events import StepEvent
from tandem.engine.drafting.history import Library
from tandem.engine.tuning.knowledge import MODEL, Knowledge
from tandem.engine.drafting.suffix import MAX_MATCH, SuffixIndex

# the draft model is used only where the calibrated costs predict at least this speedup at
# this acceptance per position: measured overheads (syncs, sampling) eat a gain this small
AUTO_MODEL_GAIN = 1.15
AUTO_MODEL_ACCEPT = 0.9
AUTO_NGRAM_CAP = MAX_BATCH - 1  # within the verify limit (exact mode on a CPU: EXACT_BATCH - 1)
# Shortest match each source drafts from, and its prior acceptance: the prompt is small and
# about this very request; files and earlier answers are larger, so a 2-token match there is
# mostly chance and starts lower (the measured acceptance soon replaces any prior)
# A prediction (Predicted Outputs: the answer the client expects) is the answer itself until
# the answer departs from it, so it starts highest and goes first
MIN_MATCH = {"prediction": 2, "prompt": 2, "file": 3, "history": 3}
PRIOR = {"prediction": 0.8, "prompt": 0.6, "file": 0.5, "history": 0.5}
ORDER = ("prediction", "prompt", "file", "history")  # equal match lengths: the nearer first
# the prediction is indexed behind the prompt's last tokens, so that the answer's very first
# step matches its start (the context then ends with exactly those tokens)
PREDICTION_ANCHOR = 4
# The prompt is drafted by copying its latest match (prompt lookup): in a chat the latest
# version of an answer predicts its next rewrite better than a vote of every earlier version
# (replayed code-editing turns: 2.78 vs 2.76 tokens per step). Files and history vote.
LATEST = ("prompt",)
# acceptance is tracked per match length, 8 and longer together (replayed code-editing turns:
# 2.54 tokens per step, against 2.49 with coarser groups 2, 3, 4, 5-7, 8-15, 16+)
BUCKETS = (2, 3, 4, 5, 6, 7, 8)


def bucket(match: int) -> int:
    return max(b for b in BUCKETS if b <= max(match, BUCKETS[0]))


class AutoDrafter(Stepped):
    """A HybridDrafter configured for this machine, drafting first from suffix indexes (the
    zero-cost sources it lends the hybrid: the prompt's own, the library's files and history,
    with a length controller per source and match length).

    `costs`: this machine's cost model, refined by the steps; `calibrated`: the calibration
    it started from, which the draft-model decision reads (its draft and verify figures share
    one context, while refinement moves only the verify costs: the draft is not run when off).
    `n_max` is the draft model's longest draft; `library` holds the session's files and
    earlier answers; `notes` are said once, after the decision."""

    name = "auto"

    def __init__(self, model: DraftModelDrafter | None, draft: DraftParams, costs: CostModel, *,
                 verify_limit: int, calibrated: CostModel | None, notes: Sequence[str],
                 library: Library | None, knowledge: Knowledge | None):
        n_max = draft.n_max
        decided: list[str] = []
        if model is not None:
            gain = model_draft_gain(calibrated or costs, n_max, AUTO_MODEL_ACCEPT)
            if gain < AUTO_MODEL_GAIN:
                label, model = model.label, None
                decided.append(f"{label} off: this machine's costs predict {gain:.2f}x at "
                               f"{AUTO_MODEL_ACCEPT:.0%} acceptance "
                               f"(needs {AUTO_MODEL_GAIN:.2f}x)")
        self.model, self.costs, self.library = model, costs, library
        # what speculation cost this request against plain decoding: probes are paid from it
        self.budget = ProbeBudget()
        ngram_cap = min(AUTO_NGRAM_CAP, verify_limit - 1)
        longest = max(n_max, ngram_cap or n_max)  # the hybrid's n_max: its sources' longest
        self.prompt = SuffixIndex()
        self.expected = SuffixIndex()  # the request's prediction (expect())
        self._prediction: Sequence[int] = ()
        # suffix drafts cost no model time, so their probes are cheap: probe often
        self.source_len = {
            (src, b): LengthController(costs, 1, longest, False, probe_every=4,
                                       probe_len=1, max_probe_every=32,
                                       tracker=AcceptanceTracker(longest, prior=PRIOR[src]),
                                       budget=self.budget)
            for src in ORDER for b in BUCKETS}
        policy = HybridPolicy(name=self.name, ngram_match=MIN_MATCH["prompt"],
                              ngram_cap=ngram_cap, adaptive=True, guard=True)
        self.hybrid = HybridDrafter(model, draft, costs, policy, sources=self, budget=self.budget)
        self.n_max = self.hybrid.n_max
        self.notes.extend(decided + [costs.describe()] + list(notes))
        if knowledge is not None:
            self.start_from(knowledge)

    # ----- the Drafter, as the hybrid drafts

    @property
    def notes(self) -> list[str]:
        return self.hybrid.notes  # the hybrid adds its own (costs measured afresh)

    @property
    def step_sources(self) -> StepSources:
        return self.hybrid.step_sources

    @property
    def guard(self) -> FallbackGuard | None:
        return self.hybrid.guard

    @guard.setter
    def guard(self, guard: FallbackGuard | None) -> None:  # None: never fall back to plain
        self.hybrid.guard = guard

    @property
    def _probe(self) -> bool:  # the latest draft was a probe (tests read it by this name)
        return self.hybrid.probing

    def prefill_steps(self, prompt: Sequence[int]) -> Steps[None]:
        return (yield from self.hybrid.prefill_steps(prompt))

    def propose_steps(self, tokens, room, sampling, rng, sample) -> Steps[Draft]:
        return (yield from self.hybrid.propose_steps(tokens, room, sampling, rng, sample))

    def observe(self, step: StepEvent) -> None:
        self.hybrid.observe(step)

    def start_from(self, knowledge: Knowledge) -> None:
        """Start from what earlier requests measured (engine/tuning/knowledge.py): the acceptance of
        each source and match length and of the draft model, as estimates resting on that
        many verdicts, and the verify timings' noise where this calibration has none."""
        kept = [(self.source_len.get(key), rec) for key, rec in knowledge.sources.items()]
        if knowledge.model is not None:
            kept.append((self.hybrid.model_len, knowledge.model))
        verdicts = 0
        for ctl, rec in kept:
            if ctl is not None:
                _seed(ctl.tracker, rec.accept, rec.n)
                verdicts += rec.n
        if verdicts:
            self.notes.append(f"acceptance kept from earlier requests ({verdicts} verdicts)")
        for n, v in knowledge.noise.items():
            self.costs.spread.setdefault(n, v)

    def learnt(self, knowledge: Knowledge) -> None:
        """Add this request's verdicts to `knowledge` (the estimates that moved)."""
        for key, ctl in self.source_len.items():
            t = ctl.tracker
            if t.steps > t.start_steps:
                knowledge.learn(key, t.accept, t.steps - t.start_steps)
        t = self.hybrid.model_len.tracker
        if self.model is not None and t.steps > t.start_steps:
            knowledge.learn(MODEL, t.accept, t.steps - t.start_steps)
        # a spread over 100% says the machine was busy, not more: kept as 100%
        knowledge.noise.update({n: min(v, 1.0) for n, v in self.costs.spread.items()})

    # ----- the hybrid's zero-cost sources (ZeroCostSources)

    def expect(self, prediction: Sequence[int]) -> None:
        """The answer the client expects (GenParams.prediction), drafted from as a source of
        its own; before prefill()."""
        self._prediction = prediction

    def read_prompt(self, prompt: Sequence[int]) -> None:
        self.prompt.sync(prompt)
        if self._prediction:
            self.expected = SuffixIndex()
            self.expected.add([*prompt[-PREDICTION_ANCHOR:], *self._prediction])

    def candidates(self, tokens: Sequence[int], k: int) -> list[tuple[str, list[int], int]]:
        """(source, continuation, match length) of every source matching the context's end,
        best first."""
        self.prompt.sync(tokens)
        suffix = list(tokens[-MAX_MATCH:])
        sources = [("prompt", self.prompt)] + (self.library.sources() if self.library else [])
        if len(self.expected):
            sources.insert(0, ("prediction", self.expected))
        out = []
        for src, idx in sources:
            cont, match = idx.draft(suffix, k, MIN_MATCH[src], latest=src in LATEST)
            if cont:
                out.append((src, cont, match))
        out.sort(key=lambda c: (-c[2], ORDER.index(c[0])))
        return out

    def pick(self, tokens, k) -> tuple[list[int], str, LengthController | None]:
        """The best matching source whose measured acceptance pays for a draft here."""
        for src, cont, match in self.candidates(tokens, k):
            ctl = self.source_len[(src, bucket(match))]
            n = ctl.choose(len(cont))
            if n > 0:
                return cont[:n], src, ctl
        return [], "prompt", None

    def continue_draft(self, tokens, drafted: list[int], k: int) -> tuple[list[int], int]:
        return self.prompt.draft(list(tokens[-MAX_MATCH:]) + drafted, k, MIN_MATCH["prompt"],
                                 latest=True)

    def split(self, draft: Draft, step: StepEvent) -> StepSources:
        n_model = min(draft.n_model, step.drafted)
        rest = step.drafted - n_model
        sources = []
        if n_model:
            sources.append(("model", n_model, min(step.accepted, n_model)))
        if rest:
            sources.append((draft.source, rest, max(step.accepted - n_model, 0)))
        return tuple(sources)


def _seed(tracker: AcceptanceTracker, accept: Sequence[float], n: int) -> None:
    if not accept:
        return
    width = len(tracker.accept)
    tracker.accept = [accept[min(i, len(accept) - 1)] for i in range(width)]
    tracker.deepest = min(len(accept), width)
    tracker.steps = tracker.start_steps = n
