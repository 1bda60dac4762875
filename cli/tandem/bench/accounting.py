"""One way to count a request's work, for tandem and llama-server alike (issue 25).

The two tools split a request differently. llama-server evaluates the whole prompt in its
prompt time (its first token's logits come from that batch) and counts end-of-text in
`predicted_n`; tandem's prefill stops one prompt token short, so its decode time holds the
step that evaluates that token, and its own tokens/s leaves end-of-text out (it is not
text). Compared as each tool reports it, tandem pays for one step it is not credited with:
on "Guten Morgen" tandem made 5 steps in 177 ms (35.4 ms a step) and llama-server 4 in 149
ms (37.25 ms a step), yet they reported 22.6 and 26.9 tok/s.

So both are reported three ways, all computed here and nowhere else (spec-bench's runner and
report, scripts/bench_peer.py):
- end to end: prompt + decode time, the same work on both sides whatever the split;
- time per decode step: decode time / the steps it holds;
- decode tok/s with end-of-text counted as llama-server counts it (a predicted token).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counted:
    tokens: int  # predicted tokens, end-of-text included (llama-server's predicted_n)
    steps: int  # decode steps: target evaluations after the prompt phase
    t_prompt: float  # seconds
    t_decode: float

    @property
    def t_e2e(self) -> float:
        return self.t_prompt + self.t_decode

    @property
    def step_s(self) -> float:
        return self.t_decode / self.steps if self.steps > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.t_decode if self.t_decode > 0 else 0.0


def tandem_counts(n_generated: int, eos: bool, n_steps: int, t_prefill: float,
                  t_decode: float) -> Counted:
    """tandem's statistics (GenStats): end-of-text is a predicted token when it ended the
    answer; every verify batch after the prefill is a decode step."""
    return Counted(n_generated + (1 if eos else 0), n_steps, t_prefill, t_decode)


def server_counts(predicted_n: int, predicted_ms: float, prompt_ms: float,
                  draft_accepted: int = 0) -> Counted:
    """llama-server's `timings`: predicted_n already counts end-of-text; each step yields
    one token plus the drafts it accepted."""
    return Counted(predicted_n, max(predicted_n - draft_accepted, 0), prompt_ms / 1000.0,
                   predicted_ms / 1000.0)


def response_counts(resp: dict) -> Counted | None:
    """A server's answer (its JSON object) counted as above: tandem serve's by its verify
    steps (the `tandem` object it adds; end-of-text when the answer stopped there),
    llama-server's by its `timings`. None where it has no timings."""
    t = resp.get("timings") or {}
    if not t:
        return None
    predicted_n = int(t.get("predicted_n") or 0)
    prompt_ms, predicted_ms = float(t.get("prompt_ms") or 0), float(t.get("predicted_ms") or 0)
    own = resp.get("tandem")
    if own is None:
        return server_counts(predicted_n, predicted_ms, prompt_ms,
                             int(t.get("draft_n_accepted") or 0))
    finish = ((resp.get("choices") or [{}])[0].get("finish_reason")
              or resp.get("finish_reason"))
    return tandem_counts(predicted_n, finish in ("stop", "tool_calls"),
                         int(own.get("verify_steps") or 0), prompt_ms / 1000, predicted_ms / 1000)
