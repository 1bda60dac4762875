"""`GET /metrics`: what the server has done, in Prometheus' text format, under llama-server's
names (`llamacpp:*`, tools/server/server-task.cpp `to_metrics`) so dashboards built for it read
tandem too, plus tandem's own speculative counters per draft source (`tandem:*`).

The scheduler adds each finished answer's GenStats (served or cancelled: its tokens were
evaluated either way); the route renders a snapshot. Counters only grow; the gauges are read
when asked.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tandem.engine.backend.sequences import BatchFigures
from tandem.engine.loop.stats import GenStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ServeMetrics:
    prompt_tokens: int = 0  # evaluated (the cached ones are prompt_cached)
    prompt_cached: int = 0
    prompt_seconds: float = 0.0
    predicted: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0  # the target's verify batches (llama-server: decodes, drafts aside)
    n_tokens_max: int = 0  # the longest sequence, prompt + answer
    drafted: int = 0
    accepted: int = 0
    drafted_steps: int = 0  # verify batches that carried a draft
    accepted_at: list[int] = field(default_factory=list)  # accepted drafts per position
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> drafted, accepted
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, stats: GenStats) -> None:
        """One answer's figures (called from the scheduler)."""
        with self._lock:
            self.prompt_tokens += stats.n_prompt_eval
            self.prompt_cached += max(stats.n_prompt - stats.n_prompt_eval, 0)
            self.prompt_seconds += stats.t_prefill
            self.predicted += stats.n_generated
            self.predicted_seconds += stats.t_decode
            self.n_decode += stats.n_steps
            self.n_tokens_max = max(self.n_tokens_max, stats.n_prompt + stats.n_generated)
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            self.drafted_steps += stats.n_steps_drafted
            for i, n in enumerate(stats.accepted_at):
                if i == len(self.accepted_at):
                    self.accepted_at.append(0)
                self.accepted_at[i] += n
            for source, (drafted, accepted) in stats.by_source.items():
                counts = self.by_source.setdefault(source, [0, 0])
                counts[0] += drafted
                counts[1] += accepted

    def prometheus(self, processing: int, deferred: int,
                   batches: BatchFigures | None = None) -> str:
        """The text a scraper reads; `processing` and `deferred`: requests generating now and
        waiting in the queue; `batches`: the slots' shared decodes (None: one sequence)."""
        busy = (batches.busy / batches.steps if batches is not None and batches.steps
                else 1.0 if self.n_decode else 0.0)
        with self._lock:
            counters = [
                ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", self.prompt_tokens),
                ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", self.prompt_cached),
                ("prompt_seconds_total", "Total time spent processing prompts", self.prompt_seconds),
                ("tokens_predicted_total", "Number of generation tokens processed", self.predicted),
                ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predicted_seconds),
                ("n_decode_total", "Total number of the target's verify batches (one per step)", self.n_decode),
                ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.n_tokens_max),
                ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", self.drafted),
                ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", self.accepted),
                ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", self.drafted_steps),
            ]
            gauges = [
                ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
                 self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0),
                ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
                 self.predicted / self.predicted_seconds if self.predicted_seconds > 0 else 0.0),
                ("requests_processing", "Number of requests processing", processing),
                ("requests_deferred", "Number of requests deferred", deferred),
                ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
                 busy),
            ]
            lines: list[str] = []
            for kind, items in (("counter", counters), ("gauge", gauges)):
                for name, help_text, value in items:
                    lines += [f"# HELP llamacpp:{name} {help_text}",
                              f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
            if self.accepted_at:
                name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
                lines += [f"# HELP {name} Accepted tokens per draft position",
                          f"# TYPE {name} counter"]
                lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(self.accepted_at)]
            for what, col in (("draft", 0), ("accepted", 1)):
                name = f"tandem:spec_decode_{what}_tokens_by_source_total"
                lines += [f"# HELP {name} Speculative: {what} tokens per draft source "
                          "(model, prompt, file, history, prediction, grammar)",
                          f"# TYPE {name} counter"]
                lines += [f'{name}{{source="{s}"}} {c[col]}'
                          for s, c in sorted(self.by_source.items())]
            if batches is not None:
                for name, help_text, value in (
                        ("batch_decode_calls_total", "llama_decode calls of the slots' batches, "
                         "both models", batches.calls),
                        ("batch_decode_tokens_total", "Tokens in those calls", batches.tokens),
                        ("batch_decode_seconds_total", "Seconds inside those calls",
                         batches.seconds)):
                    lines += [f"# HELP tandem:{name} {help_text}",
                              f"# TYPE tandem:{name} counter", f"tandem:{name} {value}"]
            return "\n".join(lines) + "\n"
