"""The scheduler of one Pair's slots, fed by a bounded queue, and the engine thread that runs
them.

One thread, the engine's, owns the pair's contexts and every generation in flight: each
round it places the waiting requests free slots may take, then steps every live generation
once (engine/loop/step_loop.py: their decodes in one batch per context). A request goes to
the free slot whose cache shares most of its prompt (llama-server's slot similarity),
restoring a conversation from the RAM prompt cache where that shares more, and the idle
slots' conversations go to that cache (llama-server's --cache-idle-slots). With one slot
(--parallel 1, a pair on RPC servers) a generation runs to its end in its round, both
models' KV caches reused by prefix from one request to the next. A short request (an
editor's keystroke, a title: INTERACTIVE_TOKENS or fewer) waits ahead of long ones and may
take the slot kept for them when every other slot is busy; its prompt's chunks ride between
the other slots' steps. The HTTP side only queues jobs and reads what they produce
(serve/job_events.py); a job's output goes to its own sink only, so answers cannot mix. A
job whose `cancel` is set (its client went away, the server stops) ends at its next event,
that is within one step.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from tandem.chat.answer import Answer
from tandem.config.schema import SERVE_MAX_TOKENS
from tandem.engine.backend.context_params import common_prefix
from tandem.engine.backend.sequences import BatchFigures
from tandem.engine.loop.step_loop import StepLoop
from tandem.engine.pair import Pair
from tandem.engine.slot_plan import SlotPlan
from tandem.engine.loop.sampling import SamplingParams
from tandem.engine.loop.speculative import GenParams
from tandem.errors import TandemError
from tandem.serve import prompt
from tandem.serve.answer_run import AnswerRun
from tandem.serve.answer_run import deliver as _deliver
from tandem.serve.job_events import Cancelled, Done, Dropped, Failed, JobEvent, Refused, Returned
from tandem.serve.jobs import CallJob, GenerationJob, Job
from tandem.serve.metrics import ServeMetrics
from tandem.serve.prompt import PromptBudget
from tandem.serve.prompt_cache import PromptCache

# an answer of at most this many tokens is interactive (an editor's completion, a chat UI's
# title): it is placed before longer ones and may take the slot kept for such requests
INTERACTIVE_TOKENS = 128
# a free slot is chosen for sharing a prompt's prefix when it shares at least this part of
# it (llama-server's --slot-prompt-similarity); else the slot used least recently
SLOT_SIMILARITY = 0.1


class QueueFull(Exception):
    """Every place in the queue is taken: the client should retry later."""


@dataclass(eq=False)
class SlotState:
    """A slot as the scheduler sees it (and /slots shows it): its sequences (None: the
    pair's only one), whether it is kept for short requests, and what it runs."""

    index: int
    slot: object = None  # engine.pair.Slot
    reserved: bool = False
    job: Job | None = None
    task: int = -1
    n_ctx: int = 0
    n_predict: int = 0
    n_decoded: int = 0
    used: float = 0.0  # time.monotonic() of its latest request

    @property
    def cached(self) -> Sequence[int]:
        return self.slot.target.tokens if self.slot is not None else ()


class Scheduler:
    def __init__(self, pair: Pair, *, strategy: str | None = None, draft=None,
                 record: bool = True, queue_size: int = 8, plan: SlotPlan | None = None,
                 cache_ram_mib: float = 0.0):
        """`plan`: the pair's slots as commands/compose.py planned them, the first
        plan.regular for any request and the kept ones beyond for short requests (None:
        every slot for any request). `cache_ram_mib`: the RAM prompt cache's bound (0: none)."""
        self.pair = pair
        self.strategy = strategy
        self.draft = draft
        self.record = record
        self._capacity = max(1, queue_size)
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        # the engine thread: it owns the pair's contexts and runs every generation in flight
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        pair_slots = list(getattr(pair, "slots", None) or ())
        n = len(pair_slots)
        if plan is not None and n != (plan.total if plan.total > 1 else 0):
            raise ValueError(f"the pair holds {n} slots, the plan {plan.total}")
        regular = n if plan is None else plan.regular
        self.slots = [SlotState(i, s, reserved=i >= regular, n_ctx=s.target.n_ctx)
                      for i, s in enumerate(pair_slots)] or [SlotState(0, n_ctx=pair.n_ctx)]
        self.prompt_cache = PromptCache(int(cache_ram_mib * 2 ** 20)) if n else None
        self.steps = StepLoop(getattr(pair, "batcher", None) if n else None)
        self.served = self.cancelled = self.tasks = 0
        self.metrics = ServeMetrics()  # every answer's figures (GET /metrics)
        self.last_cancel: dict | None = None  # how far the last cancelled answer went

    @property
    def parallel(self) -> int:
        """Slots any request may take (the banner's and /props' figure)."""
        return sum(not s.reserved for s in self.slots)

    @property
    def batches(self) -> BatchFigures | None:
        """The slots' shared decodes so far (None: one sequence, no batches)."""
        batcher = getattr(self.pair, "batcher", None)
        return batcher.figures if batcher is not None and len(self.slots) > 1 else None

    @property
    def busy(self) -> bool:
        return self.processing > 0

    @property
    def processing(self) -> int:
        return sum(s.job is not None for s in self.slots)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def capacity(self) -> int:
        return self._capacity

    def stopping(self) -> bool:
        """The server stops: no request is taken, every answer ends at its next event."""
        return self._stopping.is_set()

    def start(self) -> None:
        if self._thread.ident is None:  # (a relay() may have started it)
            self._thread.start()

    def relay(self, work: Callable[[Pair], Iterator]) -> Iterator:
        """`work(pair)`'s items, worked out on the engine thread and handed over as they come
        (serve's warm-up): every llama.cpp call on the contexts stays on that one thread, as a
        second thread's decodes would start a second OpenMP team and slow every decode after
        (docs/benchmarks-log.md section 17). Its failure is raised here."""
        items: queue.Queue = queue.Queue()
        ends: queue.Queue = queue.Queue()
        over = object()

        def run(pair):
            try:
                for item in work(pair):
                    items.put(item)
            finally:
                items.put(over)

        self.start()
        self.submit(CallJob(run, ends.put))
        while True:
            try:
                item = items.get(timeout=0.2)  # (a timeout: Ctrl-C reaches this thread)
            except queue.Empty:
                if ends.empty():
                    continue
                item = over  # never ran: dropped by a stop
            if item is over:
                break
            yield item
        end = ends.get()
        if isinstance(end, (Refused, Failed)):
            raise end.error

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping.is_set():
                raise QueueFull("the server is stopping")
            if len(self._waiting) >= self._capacity:
                raise QueueFull(f"{self.capacity} requests are already waiting")
            if job.interactive:  # ahead of every long one, behind the short ones waiting
                at = next((i for i, j in enumerate(self._waiting) if not j.interactive),
                          len(self._waiting))
                self._waiting.insert(at, job)
            else:
                self._waiting.append(job)
            self._cond.notify_all()

    def halt(self) -> None:
        """Take no more requests, cut every answer at its next event (a stream still ends
        with its last chunks); returns at once (stop() also ends the threads)."""
        with self._cond:
            self._stopping.set()
            waiting, self._waiting = list(self._waiting), deque()
            for state in self.slots:
                if state.job is not None:
                    state.job.cancel.set()
            self._cond.notify_all()
        for job in waiting:
            job.cancel.set()
            _deliver(job, Dropped())

    def stop(self, wait_s: float = 30.0) -> None:
        self.halt()
        if self._thread.is_alive():
            self._thread.join(wait_s)

    def slot_states(self) -> list[dict]:
        """The slots in llama-server's /slots fields, with tandem's `reserved`."""
        out = []
        for s in self.slots:
            job = s.job
            out.append({"id": s.index, "id_task": s.task, "n_ctx": s.n_ctx,
                        "speculative": (self.strategy or "none") != "none",
                        "is_processing": job is not None, "reserved": s.reserved,
                        "n_cached": len(s.cached), "params": {"n_predict": s.n_predict},
                        "next_token": [{"has_next_token": job is not None,
                                        "n_remain": max(s.n_predict - s.n_decoded, 0)
                                        if job is not None else -1,
                                        "n_decoded": s.n_decoded}]})
        return out

    # -- the scheduler

    def _free_for(self, job: Job) -> list[SlotState]:
        return [s for s in self.slots if s.job is None and (job.interactive or not s.reserved)]

    def _next(self) -> tuple[Job, list[SlotState]] | None:
        """Under the lock: the first waiting job a free slot may take, and those slots."""
        for job in self._waiting:
            free = self._free_for(job)
            if free:
                self._waiting.remove(job)
                return job, free
        return None

    def _loop(self) -> None:
        """The engine thread: each round takes the waiting jobs free slots may take, then
        steps every generation in flight once (engine/loop/step_loop.py). Once stopping, the
        generations end at their next event, each delivering its end."""
        steps = self.steps
        while steps.live or not self._stopping.is_set():
            try:
                while self._start_next():
                    pass
                if steps.live:
                    steps.step()
                    continue
            except Exception:  # noqa: BLE001 - a bug: reported, and the engine lives on
                print("tandem serve: the engine loop failed:", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
                continue
            with self._cond:
                if not self._stopping.is_set() and not self._startable():
                    self._cond.wait(0.5)

    def _startable(self) -> bool:
        """Under the lock: a waiting job a free slot may take."""
        return any(self._free_for(job) for job in self._waiting)

    def _start_next(self) -> bool:
        """Start the first waiting job a free slot may take: its generation joins the next
        round (its slot the free one whose cache shares most of its prompt); False: none."""
        with self._cond:
            if self._stopping.is_set():
                return False
            picked = self._next()
            if picked is None:
                return False
            job, free = picked
            state = free[0]
            state.job = job  # held while the request is prepared
        if job.cancel.is_set():
            self.cancelled += 1
            self._release(state)
            _deliver(job, Dropped())
            return True
        prepared = self._prepare(job)
        if prepared is None:
            self._release(state)
            return True
        try:
            self._place_and_add(job, state, prepared)
        except Exception as exc:  # noqa: BLE001 - a bug: reported, and the engine lives on
            print("tandem serve: starting a request failed:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            for held in self.slots:  # the slot it was placed on
                if held.job is job:
                    self._release(held)
            _deliver(job, Failed(exc))
        return True

    def _place_and_add(self, job: GenerationJob, state: SlotState, prepared) -> None:
        """The job's generation, on the free slot that suits its prompt best, joins the
        engine loop (its first step: the next round)."""
        if state.slot is not None:
            with self._cond:  # the best free slot for this prompt, now that it is known
                self._release_locked(state)
                free = self._free_for(job) or [state]
                state = self._choose(free, prepared[0])
                state.job = job
            self._place(state, prepared[0])
        self._begin(state, job, prepared)
        tokens, gen = prepared
        answer = Answer(self.pair, tokens, gen, job.strategy or self.strategy,
                        job.draft or self.draft, record=self.record, slot=state.slot)
        self.steps.add(AnswerRun(job, answer, state, self._stopping.is_set,
                                 self._finish).generation())

    def _prepare(self, job: Job):
        """(prompt tokens, GenParams) of a job, or None once its answer (a call's value, a
        refusal) was delivered."""
        try:
            if isinstance(job, CallJob):
                _deliver(job, Returned(job.call(self.pair)))
                return None
            return job.make(self.pair)
        except TandemError as exc:
            _deliver(job, Refused(exc))
        except Exception as exc:  # noqa: BLE001 - a bug: reported, and the thread lives on
            print("tandem serve: preparing a request failed:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            _deliver(job, Failed(exc))
        return None

    def _choose(self, free: list[SlotState], tokens: Sequence[int]) -> SlotState:
        """The free slot whose cache shares most of the prompt, where that is at least
        SLOT_SIMILARITY of it; else the one used least recently (llama-server's rule)."""
        best = max(free, key=lambda s: (common_prefix(s.cached, tokens), -s.used))
        if common_prefix(best.cached, tokens) >= SLOT_SIMILARITY * len(tokens) > 0:
            return best
        return min(free, key=lambda s: s.used)

    def _place(self, state: SlotState, tokens: Sequence[int]) -> None:
        """Before a slot takes a prompt: its conversation to the RAM cache unless the prompt
        continues it, a cached one the prompt continues further put back, and the idle slots
        emptied into the cache but one the prompt borrows a prefix from (PromptCache.clear)."""
        cache, slot = self.prompt_cache, state.slot
        if cache is None:
            return
        shared, entry = common_prefix(state.cached, tokens), cache.best(tokens)
        if len(state.cached) > shared and shared < 0.5 * len(state.cached):
            cache.keep(slot)
        if entry is not None and entry.shared(tokens) > shared:
            cache.restore(entry, slot)
        lender = slot.target.lender(tokens)[0]
        with self._cond:
            idle = [s.slot for s in self.slots if s.job is None and s.slot.target is not lender]
        cache.clear(idle)

    def _begin(self, state: SlotState, job: GenerationJob, prepared) -> None:
        self.tasks += 1
        state.task, state.n_decoded = self.tasks, 0
        state.n_predict = prepared[1].max_tokens
        state.used = time.monotonic()
        job.slot = state.index if state.slot is not None else None  # (one slot: not said)

    def _release(self, state: SlotState) -> None:
        with self._cond:
            self._release_locked(state)

    def _release_locked(self, state: SlotState) -> None:
        state.job = None
        self._cond.notify_all()

    def _finish(self, run: AnswerRun, end: JobEvent) -> None:
        """An answer's end: counted, its slot freed, then its end delivered (a client that
        has its answer finds the slot free: /health, /metrics, its next request)."""
        stats = run.answer.stats
        if stats is not None and isinstance(end, (Done, Cancelled)):
            self.metrics.add(stats)
        if isinstance(end, Cancelled):
            self.cancelled += 1
            self.last_cancel = {"generated": stats.n_generated, "prompt_tokens": stats.n_prompt}
        else:
            self.served += 1
        self._release(run.state)
        _deliver(run.job, end)


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
    in the scheduler: for a pair whose tokenizer is elsewhere (RemotePair's worker, one
    call at a time over its pipe). A local pair's prompt is tokenized by the HTTP side
    beforehand (serve/prompt.py), so that no request's preparation delays the one being
    generated. The prompt goes through the same Pair.prompt_tokens as run and chat."""
    budget = budget or PromptBudget(pair.n_ctx)
    local = pair.tokenizes_aside  # a remote pair's worker tokenizes the prompt whole
    tokens, prediction = prompt.request_tokens(pair, req, budget, local=local)
    return tokens, gen_params(req, defaults, prediction)
