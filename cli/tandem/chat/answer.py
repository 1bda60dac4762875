"""One answer of a loaded pair: its events as they come, then its text, reason and statistics,
also when the caller stops early (Ctrl-C in the chat, a client gone in `serve`).

The chat and the server both answer through it, so a stopped answer is counted the same way in
both: the engine's own statistics when it finished, else the partial ones folded from the
events seen (GenStats.observe).
"""
from __future__ import annotations

import time
from typing import Iterator, Sequence

from tandem.engine.loop.events import DoneEvent, PrefillEvent, TokenEvent
from tandem.engine.pair import Pair
from tandem.engine.drafting.drafters import DraftParams
from tandem.engine.loop.speculative import GenParams
from tandem.engine.loop.stats import GenStats


class Answer:
    """`events()` yields the engine's events; once it ends (or is closed) `text`, `reason`
    ("eos", "length", "stop", "context" or "interrupted") and `stats` hold the outcome.
    Generation only ever stops at a yield, so closing early leaves both KV caches consistent."""

    def __init__(self, pair: Pair, tokens: Sequence[int], gen: GenParams,
                 strategy: str | None = None, draft: DraftParams | None = None,
                 record: bool = True, slot=None):
        self.pair = pair
        self.tokens = list(tokens)
        self.gen = gen
        self.strategy = strategy or pair.options.strategy
        self.draft = draft
        self.record = record
        self.slot = slot  # a served answer's slot (engine.pair.Slot); None: the only one
        self.text = ""
        self.reason: str | None = None
        self.stats: GenStats | None = None
        self.done: DoneEvent | None = None
        self.generated: list[int] = []  # the answer's token ids (stopped early: so far)
        self.failed = False  # an exception ended it: not an answer

    def events(self) -> Iterator:
        partial = GenStats(strategy=self.strategy, n_prompt=len(self.tokens))
        pieces: list[str] = []
        inner = None
        t0 = time.perf_counter()
        try:
            inner = self.pair.generate(self.tokens, self.gen, self.strategy, self.draft,
                                       record=self.record, slot=self.slot)
            for ev in inner:
                partial.observe(ev)
                if isinstance(ev, TokenEvent):
                    pieces.append(ev.text)
                    self.generated.append(ev.token)
                elif isinstance(ev, PrefillEvent) and ev.done >= ev.total:
                    partial.t_prefill = time.perf_counter() - t0
                    # the engine evaluates the last prompt token with the first verify batch
                    partial.n_prompt_eval = ev.done + 1
                elif isinstance(ev, DoneEvent):
                    self.done = ev
                yield ev
        except Exception:
            self.failed = True
            raise
        finally:
            if inner is not None:
                inner.close()
            if self.done is not None:
                self.text, self.reason, self.stats = self.done.text, self.done.reason, self.done.stats
                self.generated = list(self.done.tokens)
            else:  # stopped early: keep the partial answer
                partial.t_total = time.perf_counter() - t0
                self.text, self.reason, self.stats = "".join(pieces), "interrupted", partial
