"""Statistics of one generation: drafted, accepted, per-position acceptance, time split.

GenStats.observe folds generate()'s events into them: the engine, the chat's partial answers
and the live view all count through it, so their figures cannot drift apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from typing import Callable, Sequence

from tandem.config.schema import DRAFT_SOURCES
from tandem.engine.loop.events import PrefillEvent, StepEvent, TokenEvent


@dataclass
class GenStats:
    strategy: str = "none"
    n_prompt: int = 0  # prompt tokens
    n_prompt_eval: int = 0  # prompt tokens actually evaluated (the rest came from the KV cache)
    n_generated: int = 0
    n_steps: int = 0  # target verify batches
    n_steps_drafted: int = 0  # verify batches that carried at least one draft token
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # drafts that reached position i
    accepted_at: list[int] = field(default_factory=list)  # drafts accepted at position i
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_sample: float = 0.0
    t_total: float = 0.0
    n_threads: int | None = None  # the target's CPU threads when the answer ended
    notes: list[str] = field(default_factory=list)  # the drafter's decisions (e.g. model off)
    # source -> [drafted, accepted]: which drafts came from the model, the prompt, a file or
    # earlier answers (config.schema.DRAFT_SOURCES), where the drafter says
    by_source: dict[str, list[int]] = field(default_factory=dict)
    # Predicted Outputs: the prediction's tokens that appear in the answer, in order, and
    # the rest of them (OpenAI's accepted/rejected_prediction_tokens); None: no prediction
    prediction: tuple[int, int] | None = None

    def __post_init__(self):
        # accepted drafts emitted in the step under way (its TokenEvents precede its StepEvent)
        self._step_accepted = 0

    def observe(self, ev) -> None:
        """Count one event of generate(). A step's accepted drafts are its TokenEvents marked
        from_draft: drafts accepted but cut by EOS or a stop string never reached the output."""
        if isinstance(ev, TokenEvent):
            if ev.token >= 0:  # -1: text held back by a stop string, released at the end
                self.n_generated += 1
                self._step_accepted += ev.from_draft
        elif isinstance(ev, StepEvent):
            self.record_step(ev.drafted, self._step_accepted)
            for source, drafted, accepted in ev.sources:
                self.add_source(source, drafted, accepted)
            self._step_accepted = 0
            self.t_draft += ev.t_draft
            self.t_verify += ev.t_verify
            self.t_sample += ev.t_sample
        elif isinstance(ev, PrefillEvent):
            self.n_prompt, self.n_prompt_eval = ev.n_prompt, ev.done

    def count_prediction(self, prediction: Sequence[int], answer: Sequence[int],
                         piece: Callable[[int], bytes]) -> None:
        """How much of the prediction (if any) the answer used, from both token lists'
        bytes (prediction_usage): OpenAI's accepted/rejected_prediction_tokens."""
        if prediction:
            self.prediction = prediction_usage([piece(t) for t in prediction],
                                               [piece(t) for t in answer])

    def add(self, other: GenStats) -> None:
        """Add another generation's counts and times (a chat's turns, summed)."""
        for name in ("n_prompt", "n_prompt_eval", "n_generated", "n_steps", "n_steps_drafted",
                     "drafted", "accepted", "t_prefill", "t_draft", "t_verify", "t_sample",
                     "t_total"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for source, (d, a) in other.by_source.items():
            self.add_source(source, d, a)
        for i, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at)):
            if i == len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += d
            self.accepted_at[i] += a

    def add_source(self, source: str, drafted: int, accepted: int) -> None:
        counts = self.by_source.setdefault(source, [0, 0])
        counts[0] += drafted
        counts[1] += accepted

    def record_step(self, drafted: int, accepted: int) -> None:
        self.n_steps += 1
        if not drafted:  # a plain step: nothing else to count
            return
        self.n_steps_drafted += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def sources_text(self) -> str:
        """`prompt 4/4 · history 3/8`: accepted/drafted per draft source; empty while only one
        kind of drafter proposed anything (nothing to tell apart)."""
        seen = [s for s in DRAFT_SOURCES if self.by_source.get(s, [0, 0])[0] > 0]
        if not seen or seen == ["model"]:
            return ""
        return " · ".join(f"{s} {self.by_source[s][1]}/{self.by_source[s][0]}" for s in seen)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens each drafted verify batch yields: accepted drafts + the target's own token."""
        if not self.n_steps_drafted:
            return 0.0
        return (self.accepted + self.n_steps_drafted) / self.n_steps_drafted

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def t_decode(self) -> float:
        return max(self.t_total - self.t_prefill, 0.0)

    @property
    def tokens_per_second(self) -> float:
        return self.n_generated / self.t_decode if self.t_decode > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.n_prompt_eval / self.t_prefill if self.t_prefill > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_second=self.tokens_per_second,
            t_decode=self.t_decode,
        )
        return out

    def summary(self) -> str:
        line = (f"{self.n_generated} tokens, {self.tokens_per_second:.1f} tok/s "
                f"(prompt {self.n_prompt} tok, {self.t_prefill:.2f}s"
                + (f", {self.n_threads} thread{'s' * (self.n_threads != 1)})"
                   if self.n_threads else ")"))
        if self.drafted:
            line += (f" | {self.strategy}: accepted {self.accepted}/{self.drafted} "
                     f"({100 * self.acceptance_rate:.1f}%), mean accepted length "
                     f"{self.mean_accepted_length:.2f}")
        t = self.t_draft + self.t_verify + self.t_sample
        if t > 0:
            line += (f" | time: draft {100 * self.t_draft / t:.0f}% verify "
                     f"{100 * self.t_verify / t:.0f}% sample {100 * self.t_sample / t:.0f}%")
        if self.sources_text():
            line += f" | drafts from {self.sources_text()}"
        if self.prediction is not None:
            used, unused = self.prediction
            line += f" | prediction: {used} of {used + unused} tokens in the answer"
        for note in self.notes:
            line += f" | {note}"
        return line


# a replaced span is compared byte by byte only up to this many byte pairs (difflib is
# quadratic there); a larger one counts as not used
MAX_INNER_PAIRS = 4_000_000


def prediction_usage(prediction: Sequence[bytes], answer: Sequence[bytes]) -> tuple[int, int]:
    """(the answer's tokens that copy the prediction, the prediction's tokens it did not use),
    given each token's bytes. Compared as text, lines first then the bytes of changed lines,
    so a token the model spelt differently (another tokenization of the same text) still
    counts: an answer equal to its prediction has used all of it, and all its tokens are."""
    p, a = b"".join(prediction), b"".join(answer)
    used_p, used_a = bytearray(len(p)), bytearray(len(a))
    p_lines, a_lines = p.splitlines(keepends=True), a.splitlines(keepends=True)
    p_at, a_at = _offsets(p_lines), _offsets(a_lines)
    lines = SequenceMatcher(None, p_lines, a_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in lines.get_opcodes():
        ps, pe, as_, ae = p_at[i1], p_at[i2], a_at[j1], a_at[j2]
        if tag == "equal":
            used_p[ps:pe] = b"\1" * (pe - ps)
            used_a[as_:ae] = b"\1" * (ae - as_)
        elif tag == "replace" and (pe - ps) * (ae - as_) <= MAX_INNER_PAIRS:
            inner = SequenceMatcher(None, p[ps:pe], a[as_:ae], autojunk=False)
            for m in inner.get_matching_blocks():
                used_p[ps + m.a:ps + m.a + m.size] = b"\1" * m.size
                used_a[as_ + m.b:as_ + m.b + m.size] = b"\1" * m.size
    used = _whole(prediction, used_p)
    return _whole(answer, used_a), len(prediction) - used


def _offsets(lines: Sequence[bytes]) -> list[int]:
    out = [0]
    for line in lines:
        out.append(out[-1] + len(line))
    return out


def _whole(tokens: Sequence[bytes], used: bytearray) -> int:
    """Tokens whose bytes are all marked used (a token of no bytes is not counted)."""
    n, at = 0, 0
    for piece in tokens:
        end = at + len(piece)
        if piece and all(used[at:end]):
            n += 1
        at = end
    return n
