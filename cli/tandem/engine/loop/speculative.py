"""generate(): the one decoding loop behind run, chat and spec-bench.

Each step: the drafter proposes up to its own n_max; the target decodes [last, d1..dk] in one
batch with logits on every row; drafts are accepted until the first mismatch, where the
target's own token is kept (plus a bonus token when all are accepted); rejected positions
are removed from the KV cache. Greedy verification is exact match against the target's argmax;
with temperature > 0, speculative sampling (accept with min(1, p/q), else resample from
norm(max(0, p - q))) keeps the output distribution exactly the target's.

Under a grammar (GenParams.constraint) every row is sampled from the grammar-masked target
distribution, a draft is cut at its first token the grammar refuses (never verified), and the
grammar's forced tokens start the step's draft when there are any (free), the drafter's
proposal continuing them in the same batch.
The grammar commits exactly the decided tokens, row by row, so a rejection needs no rollback.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Iterator, Sequence

import numpy as np

from tandem.config.schema import check_max_tokens, check_prompt
from tandem.engine.backend.context_params import common_prefix
from tandem.engine.backend.decode_requests import DecodeRequest, Steps
from tandem.engine.drafting.drafters import Draft, Drafter, recent
from tandem.engine.loop.events import DoneEvent, PrefillEvent, StepEvent, TokenEvent
from tandem.engine.loop.sampling import (Dist, SamplingParams, distribution, greedy_token,
                                         infill_pick, penalized, residual)
from tandem.engine.loop.stats import GenStats
from tandem.engine.loop.textstream import TextStream
from tandem.engine.tuning.threads import NO_THREADS, Threads
from tandem.errors import ContextOverflowError, UsageError

if TYPE_CHECKING:
    from tandem.engine.backend.surface import DecodingSurface
    from tandem.engine.constrain.grammar import Constraint, GrammarState

VERIFY_RULES = ("rejection", "match")
_NO_DRAFT = Draft()  # a plain step's draft, shared: generate() never modifies a draft


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    # "rejection": speculative sampling (exact, accepts more at temperature > 0);
    # "match": llama.cpp's rule, greedy drafts accepted when the target samples the same token.
    verify: str = "rejection"
    ignore_eos: bool = False
    constraint: Constraint | None = None  # a grammar the output must match
    # the expected answer's tokens (Predicted Outputs): auto drafts from them, and the
    # statistics count how much of them the answer used
    prediction: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_tokens != 0:  # 0: evaluate the prompt only (an editor's warm-up)
            check_max_tokens(self.max_tokens)
        if self.verify not in VERIFY_RULES:
            raise UsageError(f"unknown verify rule {self.verify!r}", "use rejection or match")


def generate(target: DecodingSurface, prompt: Sequence[int], drafter: Drafter,
             params: GenParams = GenParams(), threads: Threads = NO_THREADS) -> Iterator:
    """Yield PrefillEvent, then TokenEvent/StepEvent as tokens are decided, then DoneEvent.
    Each StepEvent carries the drafter's split of its drafts by source (`step_sources`), and
    the DoneEvent its statistics with the context's and the drafter's notes; nothing changes
    an event once it is yielded; on a slot also the DecodeRequests the engine loop batches
    (engine/backend/decode_requests.py). `threads`: the session's thread count (tuning/
    threads.py), told each verify's time once its logits were read (it may probe others)"""
    _check_fits(prompt, target)
    sp = params.sampling
    rng = np.random.default_rng(sp.seed)
    sample_drafts = not sp.greedy and params.verify == "rejection"
    stats = GenStats(strategy=drafter.name, n_prompt=len(prompt), notes=list(target.notes))
    model = target.model
    text = TextStream(params.stop)
    tokens = list(prompt)
    verify_room, grammar = target.verify_limit - 1, _grammar(params.constraint, model)
    pick = _infill_picker(model, sp)
    if drafter.n_max > verify_room:
        stats.notes.append(_cap_note(target, verify_room))
    t_start = time.perf_counter()

    # The last prompt token goes into the first verify batch, so prefill stops one short.
    evaluated = yield from _prefill(target, drafter, tokens)
    stats.n_prompt_eval = evaluated + 1
    stats.t_prefill = time.perf_counter() - t_start
    yield PrefillEvent(evaluated, evaluated, len(prompt))

    reason, step = "length", 0
    # looked up once: these run once a token
    is_eog, piece, feed, stop_at_eog = model.is_eog, model.piece, text.feed, not params.ignore_eos
    while reason == "length" and stats.n_generated < params.max_tokens:
        if len(tokens) >= target.n_ctx:
            reason = "context"
            break
        # a step yields up to k + 1 tokens: keep them within the context (plain decoding stops
        # at n_ctx tokens, so must speculation), within max_tokens and one verify batch
        room = min(verify_room, target.n_ctx - len(tokens) - 1,
                   params.max_tokens - stats.n_generated - 1)
        if grammar is not None and grammar.stopped:  # complete: only the end may follow
            reason = "eos"
            break
        t0 = time.perf_counter()
        draft, k_cap, n_forced = yield from _draft(drafter, grammar, tokens, room, sp, rng,
                                                   sample_drafts)
        t1 = time.perf_counter()
        if len(target.tokens) != len(tokens) - 1:  # only if someone else used this context
            yield from target.prefill_steps(tokens[:-1])
        rows = yield from target.decode_steps([tokens[-1]] + draft.tokens, all_logits=True)
        t2 = time.perf_counter()
        new, n_acc = (_verify(rows, draft, tokens, sp, params.verify, rng, model.n_vocab, pick)
                      if grammar is None else _verify_constrained(
                          rows, draft, tokens, sp, params.verify, rng, model.n_vocab, grammar))
        t3 = time.perf_counter()
        # keep the KV of last + accepted drafts; the new target token is evaluated next step
        target.truncate(len(tokens) + n_acc)
        threads.observe(len(draft.tokens) + 1, t2 - t1)
        step_event = StepEvent(step, len(draft.tokens), n_acc, k_cap, t1 - t0, t2 - t1, t3 - t2,
                               forced=n_forced)
        _observe(drafter, step_event)
        for i, tok in enumerate(new):
            if is_eog(tok) and stop_at_eog:
                reason = "eos"
                break
            tokens.append(tok)
            token_event = TokenEvent(tok, feed(piece(tok)), i < n_acc, step)
            stats.observe(token_event)
            yield token_event
            if text.stopped:
                reason = "stop"
                break
            if stats.n_generated >= params.max_tokens:
                break
        # the statistics count the accepted drafts that reached the output (TokenEvents
        # from_draft), not those cut by EOS or a stop string; the drafter saw the full verdict
        stats.observe(step_event)
        yield step_event
        step += 1
    tail = text.flush()
    if tail:
        yield TokenEvent(-1, tail, False, step)
    stats.t_total, stats.n_threads = time.perf_counter() - t_start, target.n_threads
    stats.notes += [*drafter.notes, *threads.notes]  # read last: noted as they go
    stats.count_prediction(params.prediction, tokens[len(prompt):], piece)
    yield DoneEvent(stats, reason, text.text, tuple(tokens[len(prompt):]),
                    None if grammar is None else reason == "eos" or grammar.accepting)


def _check_fits(prompt: Sequence[int], target: DecodingSurface) -> None:
    check_prompt(prompt)
    if len(prompt) >= target.n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(prompt)} tokens but the context holds {target.n_ctx}",
            "shorten the prompt or raise --ctx-size")


def _grammar(constraint: Constraint | None, model) -> GrammarState | None:
    if constraint is None:
        return None
    from tandem.engine.constrain.grammar import GrammarState

    return GrammarState(constraint, model)


def _draft(drafter: Drafter, grammar: GrammarState | None, tokens: list[int], room: int,
           sp: SamplingParams, rng: np.random.Generator,
           sample: bool) -> Steps[tuple[Draft, int, int]]:
    """This step's draft, the length asked for, and how many of its first tokens the grammar
    forced: free drafts wherever the drafter would speculate at all (not under `none`), which
    the drafter continues in the same batch (the value after a forced key). What the drafter
    proposes is cut at the first token the grammar refuses."""
    k_cap = min(drafter.n_max, room)
    if k_cap <= 0:
        return _NO_DRAFT, k_cap, 0
    forced = grammar.forced()[:room] if grammar is not None else []
    n_forced = len(forced)
    if n_forced >= room:
        return Draft(forced, [None] * n_forced if sample else None,
                     source="grammar"), n_forced, n_forced
    draft = yield from drafter.propose_steps(tokens + forced if forced else tokens,
                                             room - n_forced, sp, rng, sample)
    k_cap = min(drafter.n_max, room - n_forced)
    if grammar is not None and draft.tokens:
        k_cap = min(k_cap, grammar.valid_prefix(forced + draft.tokens[:k_cap]) - n_forced)
    if not forced:
        if len(draft.tokens) > k_cap:
            draft = Draft(draft.tokens[:k_cap], draft.dists[:k_cap] if draft.dists else None,
                          n_model=draft.n_model, source=draft.source)
        return draft, k_cap, 0
    own = draft.tokens[:k_cap]
    dists = None
    if sample:  # forced tokens are point masses; the drafter's keep their q (or none)
        dists = [None] * n_forced + (list(draft.dists[:k_cap]) if draft.dists
                                     else [None] * len(own))
    return Draft(forced + own, dists, source="grammar"), n_forced + len(own), n_forced


def _observe(drafter: Drafter, step_event: StepEvent) -> None:
    """Tell the drafter its step's verdict and fill in the step's sources. The grammar's
    forced tokens were not the drafter's: it learns only from its own drafts (StepEvent.forced
    says where they start), and a step of forced tokens alone is not its step at all."""
    f = step_event.forced
    grammar = (("grammar", f, min(step_event.accepted, f)),) if f else ()
    if f and step_event.drafted == f:
        step_event.sources = grammar
        return
    drafter.observe(step_event)
    step_event.sources = grammar + drafter.step_sources  # known once the drafter observed


def _cap_note(target: DecodingSurface, n_max: int) -> str:
    if target.memory_note:  # the model's memory rolls back no further
        return target.memory_note
    if target.verify_limit >= min(target.n_batch, target.params.n_outputs_max):
        return (f"drafts capped at {n_max}: a verify batch of {n_max + 1} tokens fills the "
                f"batch size (n_batch {target.n_batch})")
    return (f"drafts capped at {n_max}: exact mode; larger verify batches are not "
            "bit-identical to single-token decoding (measured on llama.cpp's CPU kernels)")


def _prefill(target: DecodingSurface, drafter: Drafter,
             tokens: Sequence[int]) -> Generator[PrefillEvent | DecodeRequest, None, int]:
    """Evaluate the prompt but its last token on the target, n_batch tokens at a time with a
    PrefillEvent each, then let the drafter read it; returns how many the target evaluated.
    Only what is past the target's cached prefix is evaluated (a chat's earlier turns). A
    context that keeps copies of its state (Context.copy_marks) stops at its marks to save one:
    a next prompt that differs a little before this one's end (a keystroke) comes back there."""
    body = tokens[:-1]
    target.reuse(body)  # cached runs that moved (cache reuse, when the context has it on)
    keep = common_prefix(target.tokens, body)
    total = len(body) - keep
    yield PrefillEvent(0, total, len(tokens))
    marks = set(target.copy_marks(len(body), keep))
    ends = {min(end, len(body)) for end in range(keep + target.n_batch,
                                                 len(body) + target.n_batch, target.n_batch)}
    done = 0
    for end in sorted(ends | marks):
        done += yield from target.prefill_steps(body[:end])
        if end in marks:
            target.checkpoint()
        if done < total:  # the last one waits for the drafter: the prompt phase ends there
            yield PrefillEvent(done, total, len(tokens))
    yield from target.prefill_steps(body)  # an empty body, or one held already: truncates
    if done:  # where a later prompt that shares this one may come back to (a recurrent state)
        target.checkpoint()
    yield from drafter.prefill_steps(tokens)
    return done


def _infill_picker(model, sp: SamplingParams):
    """The greedy rule of llama.cpp's infill sampler for this model (sampling.infill_pick),
    or None where the request did not ask for it."""
    if not sp.infill:
        return None
    eog = model.eog_tokens()
    eot = eog[0] if eog else -1
    is_eog, piece = model.is_eog, model.piece
    return lambda row, hist: infill_pick(row, hist, sp, is_eog, piece, eot)


def _verify(rows: np.ndarray, draft: Draft, tokens: list[int], sp: SamplingParams, rule: str,
            rng: np.random.Generator, n_vocab: int, pick=None) -> tuple[list[int], int]:
    """Decide the tokens of this step: accepted drafts, then the target's own token.
    `pick(row, history)`: a greedy rule other than the argmax (_infill_picker)."""
    new: list[int] = []
    if pick is not None:
        for i, d in enumerate(draft.tokens):
            tok = pick(rows[i], recent(tokens, new, sp))
            new.append(tok)
            if tok != d:
                return new, i
        new.append(pick(rows[len(draft.tokens)], recent(tokens, new, sp)))
        return new, len(draft.tokens)
    if sp.greedy and sp.repeat_penalty == 1.0:
        # plain greedy: the argmax of each row's view, no history to penalise, and no row
        # after the first mismatch is scanned (a 152k row costs ~20 us)
        for i, d in enumerate(draft.tokens):
            tok = int(rows[i].argmax())
            new.append(tok)
            if tok != d:
                return new, i
        new.append(int(rows[len(draft.tokens)].argmax()))
        return new, len(draft.tokens)
    for i, d in enumerate(draft.tokens):
        hist = recent(tokens, new, sp)
        if sp.greedy:
            tok = greedy_token(rows[i], hist, sp)
        else:
            p = distribution(rows[i], hist, sp)
            if rule == "rejection":
                q = draft.dists[i] if draft.dists is not None else None
                if q is None:  # deterministic draft token (n-gram): q is a point mass on d
                    if rng.random() < p.prob(d):
                        new.append(d)
                        continue
                    tok = residual(p, _point(d), n_vocab).sample(rng)
                else:
                    qd = q.prob(d)
                    if qd > 0 and rng.random() < min(1.0, p.prob(d) / qd):
                        new.append(d)
                        continue
                    tok = residual(p, q, n_vocab).sample(rng)
                new.append(tok)
                return new, i
            tok = p.sample(rng)
        if tok != d:
            new.append(tok)
            return new, i
        new.append(d)
    hist = recent(tokens, new, sp)
    last = rows[len(draft.tokens)]
    new.append(greedy_token(last, hist, sp) if sp.greedy else distribution(last, hist, sp).sample(rng))
    return new, len(draft.tokens)


def _verify_constrained(rows: np.ndarray, draft: Draft, tokens: list[int], sp: SamplingParams,
                        rule: str, rng: np.random.Generator, n_vocab: int,
                        grammar: GrammarState) -> tuple[list[int], int]:
    """_verify under a grammar: each row's target distribution is the masked one, a sampled
    draft's q is conditioned on the same mask (the draft was cut where the grammar refused
    it, so a kept token was drawn from q given "allowed": rejection sampling between the two
    masked distributions is exact), and each decided token is committed as it is decided."""
    new: list[int] = []
    for i, d in enumerate(draft.tokens):
        hist = recent(tokens, new, sp)
        if sp.greedy:
            tok = grammar.greedy(penalized(rows[i], hist, sp))
        else:
            p = distribution(grammar.masked(rows[i]), hist, sp)
            if rule == "rejection":
                q = draft.dists[i] if draft.dists is not None else None
                if q is None:  # deterministic draft (forced, n-gram): a point mass on d
                    if rng.random() < p.prob(d):
                        grammar.commit(d)
                        new.append(d)
                        continue
                    tok = residual(p, _point(d), n_vocab).sample(rng)
                else:
                    q = grammar.restrict(q)
                    qd = q.prob(d)
                    if qd > 0 and rng.random() < min(1.0, p.prob(d) / qd):
                        grammar.commit(d)
                        new.append(d)
                        continue
                    tok = residual(p, q, n_vocab).sample(rng)
                grammar.commit(tok)
                new.append(tok)
                return new, i
            tok = p.sample(rng)
        grammar.commit(tok)
        new.append(tok)
        if tok != d:
            return new, i
    hist = recent(tokens, new, sp)
    last = rows[len(draft.tokens)]
    tok = (grammar.greedy(penalized(last, hist, sp)) if sp.greedy
           else distribution(grammar.masked(last), hist, sp).sample(rng))
    grammar.commit(tok)
    new.append(tok)
    return new, len(draft.tokens)


def _point(token: int) -> Dist:
    return Dist(ids=np.array([token]), probs=np.array([1.0]))
