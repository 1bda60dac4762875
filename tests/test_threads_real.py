"""The real default pair under a changing thread count (engine/tuning/threads.py): exact mode's
promise holds when the count changes between steps, and its logits do not depend on it."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from tandem.engine.loop.events import DoneEvent  # noqa: E402
from tandem.engine.backend.llama import Context, ContextParams, exact_context  # noqa: E402
from tandem.engine.pair import PairSession, SessionOptions  # noqa: E402
from tandem.engine.loop.speculative import GenParams  # noqa: E402
from tandem.engine.tuning.threads import ThreadTuner  # noqa: E402

pytestmark = pytest.mark.slow


def test_exact_mode_logits_do_not_depend_on_the_thread_count(real_pair):
    """1 and 2 threads, fresh and switched on the live context, past the 512-token point:
    the same logits bit for bit (exact mode's configuration)."""
    from tandem.engine.backend.llama import Model

    model = Model(real_pair[0], repack=False)
    try:
        text = " ".join(f"item {i} costs {i * 7 % 13} dollars;" for i in range(120))
        tokens = model.tokenize(text, add_special=True, parse_special=False)[:700]
        rows = {}
        for threads in (1, 2):
            ctx = Context(model, exact_context(ContextParams(n_ctx=1024, n_threads=threads)))
            try:
                ctx.prefill(tokens[:-3])
                rows[threads] = [np.array(ctx.decode([t])[0]) for t in tokens[-3:]]
                ctx.truncate(len(tokens) - 3)
                ctx.set_threads(3 - threads)
                rows[f"{threads}->{3 - threads}"] = [np.array(ctx.decode([t])[0])
                                                     for t in tokens[-3:]]
            finally:
                ctx.close()
        for key, got in rows.items():
            assert all(np.array_equal(a, b) for a, b in zip(got, rows[2])), key
    finally:
        model.close()


class Flipper(ThreadTuner):
    """A tuner that probes after every step and always switches to the other count."""

    def observe(self, rows, seconds):
        self.steps += 1
        self._due = "check"
        return True

    def want_probe(self, others):
        return True

    def probe(self, time_decode):
        self._due = None
        for n in self.counts:
            time_decode(n)
        self.current = 3 - self.current
        return self.current


def test_exact_output_is_unchanged_when_threads_change_between_steps(real_pair):
    target, draft = real_pair
    prompt_text = "Write a Python function that checks whether a number is prime."
    gen = GenParams(max_tokens=32)
    outputs = {}
    for name, strategy in (("plain", "none"), ("flipped", "draft")):
        opts = SessionOptions(strategy=strategy, repack=False, adapt_threads=name == "flipped",
                              target_ctx=exact_context(ContextParams(n_ctx=1024)))
        with PairSession(target, draft, opts) as s:
            if name == "flipped":
                s.threads.tuner = Flipper(2, (2, 1))
                s.threads._load = lambda: 0.9
            prompt = s.prompt_tokens([{"role": "user", "content": prompt_text}])
            done = [ev for ev in s.generate(prompt, gen) if isinstance(ev, DoneEvent)][0]
            outputs[name] = done.tokens
            if name == "flipped":
                assert done.stats.n_steps > 5 and s.threads.tuner.steps == done.stats.n_steps
    assert outputs["flipped"] == outputs["plain"]
