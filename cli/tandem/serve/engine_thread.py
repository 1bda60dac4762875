"""The engine thread: one Pair, one generation at a time, fed by a bounded queue.

llama.cpp contexts are not shared between generations (both models' KV caches hold one
sequence, reused by prefix from one request to the next), so requests run strictly one after
another in this thread; the HTTP side only queues jobs and reads what they produce. A job's
output goes to its own sink only, so answers cannot mix. A job whose `cancel` is set (its client
went away, the server stops) ends at the engine's next event, that is within one step.
"""
from __future__ import annotations

import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tandem.chat.answer import Answer
from tandem.config.schema import SERVE_MAX_TOKENS
from tandem.engine.loop.events import PrefillEvent, TokenEvent
from tandem.engine.pair import Pair
from tandem.engine.loop.sampling import SamplingParams
from tandem.engine.loop.speculative import GenParams
from tandem.errors import TandemError
from tandem.serve import prompt
from tandem.serve.metrics import ServeMetrics
from tandem.serve.prompt import PromptBudget


class QueueFull(Exception):
    """Every place in the queue is taken: the client should retry later."""


@dataclass
class GenerationJob:
    """One request's generation. `sink(kind, value)` receives, in order: ("prefilled", n) once
    the prompt is evaluated, ("text", str) per released piece of text, then exactly one of ("done", Answer), ("error", TandemError),
    ("failed", Exception) or ("cancelled", None). It is called from the engine thread."""

    make: Callable[[Pair], tuple[Sequence[int], GenParams]] | None  # see prepare()
    sink: Callable[[str, object], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    # an editor's stopping rules (serve.llama_api.Limiter): the text passes through it, and the
    # answer ends where it says, as if it had finished ("done", reason "limit")
    limit: object = None
    # instead of an answer, one call on the pair (a remote pair's tokenizer, between
    # answers): its value is delivered as ("done", value)
    call: Callable[[Pair], object] | None = None


class EngineThread:
    def __init__(self, pair: Pair, *, strategy: str | None = None, draft=None,
                 record: bool = True, queue_size: int = 8):
        self.pair = pair
        self.strategy = strategy
        self.draft = draft
        self.record = record
        self._queue: queue.Queue[GenerationJob | None] = queue.Queue(
            maxsize=max(1, queue_size))
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self.busy = False  # a job is being generated (for /health)
        self.served = 0
        self.cancelled = 0
        self.metrics = ServeMetrics()  # every answer's figures (GET /metrics)
        self.last_cancel: dict | None = None  # how far the last cancelled answer went

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def capacity(self) -> int:
        return self._queue.maxsize

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: GenerationJob) -> None:
        if self._stopping.is_set():
            raise QueueFull("the server is stopping")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.capacity} requests are already waiting") from None

    def stop(self, wait_s: float = 30.0) -> None:
        """Cancel what waits and what runs, then end the thread."""
        self._stopping.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                _deliver(job, "cancelled", None)
        try:
            self._queue.put_nowait(None)
        except queue.Full:  # a submit raced in: the loop sees _stopping anyway
            pass
        if self._thread.is_alive():
            self._thread.join(wait_s)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if job is None:
                break
            self.busy = True
            try:
                self._run(job)
            finally:
                self.busy = False

    def _run(self, job: GenerationJob) -> None:
        if job.cancel.is_set() or self._stopping.is_set():
            self.cancelled += 1
            _deliver(job, "cancelled", None)
            return
        try:
            if job.call is not None:
                _deliver(job, "done", job.call(self.pair))
                return
            tokens, gen = job.make(self.pair)
        except TandemError as exc:
            _deliver(job, "error", exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug: reported, and the thread lives on
            print("tandem serve: preparing a request failed:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            _deliver(job, "failed", exc)
            return
        answer = Answer(self.pair, tokens, gen, self.strategy, self.draft, record=self.record)
        stream = answer.events()
        outcome: tuple[str, object] = ("done", answer)
        limit = job.limit
        try:
            for ev in stream:
                if isinstance(ev, TokenEvent) and ev.text:
                    text = ev.text if limit is None else limit.feed(ev.text)
                    if text:
                        _deliver(job, "text", text)
                    if limit is not None and limit.stopped:
                        break  # closed at a yield: both KV caches stay consistent
                elif isinstance(ev, PrefillEvent) and ev.done >= ev.total:
                    if limit is not None:
                        limit.start()
                    _deliver(job, "prefilled", ev.done)
                # checked after every event: a step yields its tokens then a StepEvent, and
                # the prefill one event per batch, so a cancel takes effect within one step
                if job.cancel.is_set() or self._stopping.is_set():
                    outcome = ("cancelled", answer)
                    break
        except TandemError as exc:  # the request's own fault (e.g. a prompt too long)
            outcome = ("error", exc)
        except Exception as exc:  # noqa: BLE001 - a bug: reported, and the thread lives on
            print("tandem serve: generation failed:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            outcome = ("failed", exc)
        finally:
            stream.close()
        if limit is not None and outcome[0] == "done":
            tail = limit.flush()
            if tail:
                _deliver(job, "text", tail)
            if limit.stopped:  # the rule's end, not an interruption
                answer.text, answer.reason = limit.text, "limit"
        if answer.stats is not None and outcome[0] in ("done", "cancelled"):
            self.metrics.add(answer.stats)
        if outcome[0] == "cancelled":
            self.cancelled += 1
            self.last_cancel = {"generated": answer.stats.n_generated,
                                "prompt_tokens": answer.stats.n_prompt}
        else:
            self.served += 1
        _deliver(job, *outcome)


def _deliver(job: GenerationJob, kind: str, value) -> None:
    try:
        job.sink(kind, value)
    except Exception:  # noqa: BLE001 - a closed event loop (shutdown) must not kill the engine
        pass


@dataclass(frozen=True)
class Defaults:
    """What a request that does not say gets: the server's flags (as `run` takes them)."""

    max_tokens: int = SERVE_MAX_TOKENS
    sampling: SamplingParams = SamplingParams()


def gen_params(req, defaults: Defaults, prediction: Sequence[int] = ()) -> GenParams:
    """A checked request's generation parameters: its own, else the server's defaults.
    `prediction`: the tokens of the request's prediction."""
    d = defaults.sampling

    def pick(value, default):
        return default if value is None else value

    sampling = SamplingParams(
        temperature=pick(req.temperature, d.temperature), top_k=pick(req.top_k, d.top_k),
        top_p=pick(req.top_p, d.top_p), min_p=pick(req.min_p, d.min_p),
        repeat_penalty=pick(req.repeat_penalty, d.repeat_penalty), seed=req.seed,
        infill=req.infill_sampler)
    max_tokens = defaults.max_tokens if req.max_tokens is None else req.max_tokens
    return GenParams(max_tokens=max_tokens, sampling=sampling, stop=req.stop,
                     constraint=req.constraint, prediction=tuple(prediction))


def prepare(pair: Pair, req, defaults: Defaults,
            budget: PromptBudget | None = None) -> tuple[list[int], GenParams]:
    """A checked request (serve.protocol.Request) -> prompt tokens and generation parameters,
    in the engine thread: for a pair whose tokenizer is elsewhere (RemotePair's worker, one
    call at a time over its pipe). A local pair's prompt is tokenized by the HTTP side
    beforehand (serve/prompt.py), so that no request's preparation delays the one being
    generated. The prompt goes through the same Pair.prompt_tokens as run and chat."""
    budget = budget or PromptBudget(pair.n_ctx)
    local = pair.tokenizes_aside  # a remote pair's worker tokenizes the prompt whole
    tokens, prediction = prompt.request_tokens(pair, req, budget, local=local)
    return tokens, gen_params(req, defaults, prediction)
