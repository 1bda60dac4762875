"""Statistics of one generation: drafted, accepted, per-position acceptance, time split."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    notes: list[str] = field(default_factory=list)  # the drafter's decisions (e.g. model off)

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
                f"(prompt {self.n_prompt} tok, {self.t_prefill:.2f}s)")
        if self.drafted:
            line += (f" | {self.strategy}: accepted {self.accepted}/{self.drafted} "
                     f"({100 * self.acceptance_rate:.1f}%), mean accepted length "
                     f"{self.mean_accepted_length:.2f}")
        t = self.t_draft + self.t_verify + self.t_sample
        if t > 0:
            line += (f" | time: draft {100 * self.t_draft / t:.0f}% verify "
                     f"{100 * self.t_verify / t:.0f}% sample {100 * self.t_sample / t:.0f}%")
        for note in self.notes:
            line += f" | {note}"
        return line
