"""serve's one engine thread (issue 52): every llama.cpp decode of a served pair runs on
`tandem-engine`, the warm-up's included (Scheduler.relay), and what a relayed piece of work
yields or raises reaches its caller."""
from __future__ import annotations

import queue
import threading

import pytest

from tandem.engine.backend.context_params import ContextParams
from tandem.engine.backend.llama import Context
from tandem.engine.loop.speculative import GenParams
from tandem.engine.pair import PairSession, SessionOptions, warm_up
from tandem.engine.slot_plan import SlotPlan
from tandem.serve.job_events import Done
from tandem.serve.jobs import GenerationJob
from tandem.serve.scheduler import Scheduler


def test_every_decode_of_a_served_pair_runs_on_the_engine_thread(tiny_models, monkeypatch):
    threads: set[str] = set()
    for name in ("decode", "decode_batch"):
        real = getattr(Context, name)

        def record(self, *args, _real=real, **kwargs):
            threads.add(threading.current_thread().name)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(Context, name, record)
    opts = SessionOptions(target_ctx=ContextParams(n_ctx=256, n_threads=1), sequences=3,
                          strategy="auto")
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as session:
        scheduler = Scheduler(session, strategy="auto", plan=SlotPlan(2, 1), record=False)
        steps = list(scheduler.relay(lambda pair: pair.stream(warm_up, "auto")))
        assert [s.what for s in steps if s.seconds is not None] == ["drafting costs"]
        ends: queue.Queue = queue.Queue()

        def sink(event):
            if type(event).__name__ not in ("Prefilled", "Text"):
                ends.put(event)
        for prompt in ([1, 5, 17, 99, 3], [1, 8, 8, 120]):
            scheduler.submit(GenerationJob(
                make=lambda pair, p=prompt: (p, GenParams(max_tokens=8)), sink=sink))
        answers = [ends.get(timeout=120), ends.get(timeout=120)]
        scheduler.stop()
    assert all(isinstance(a, Done) and a.answer.stats.n_generated > 0 for a in answers)
    assert threads == {"tandem-engine"}


def test_a_relayed_failure_is_raised_to_its_caller(tiny_models):
    opts = SessionOptions(target_ctx=ContextParams(n_ctx=128, n_threads=1), strategy="none")
    with PairSession(tiny_models["target"], None, opts) as session:
        scheduler = Scheduler(session, strategy="none")

        def work(pair):
            yield threading.current_thread().name
            raise ValueError("broken")
        got = []
        with pytest.raises(ValueError, match="broken"):
            for item in scheduler.relay(work):
                got.append(item)
        scheduler.stop()
    assert got == ["tandem-engine"]
