"""One request's answer as a generation of the engine loop (engine/loop/step_loop.py).

Its events become what the request's sink gets (serve/job_events.py): Prefilled once the
prompt is evaluated, a Text per released piece, then one end. A cancel (the client went away,
the server stops) or an editor's stopping rule ends it at an event, where both KV caches are
consistent: a step yields its tokens then a StepEvent, the prompt one event per batch, so a
cancel takes effect within one step. Everything here runs on the engine loop's thread.
"""
from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING, Callable

from tandem.engine.loop.events import PrefillEvent, TokenEvent
from tandem.engine.loop.step_loop import Generation
from tandem.errors import TandemError
from tandem.serve import responses
from tandem.serve.job_events import Cancelled, Done, Failed, JobEvent, Prefilled, Refused, Text

if TYPE_CHECKING:
    from tandem.chat.answer import Answer


class AnswerRun:
    """`job`'s `answer` on the slot `state` (the scheduler's SlotState, whose n_decoded it
    counts); `stopping()`: the server stops; `finish(run, end)`: once, with the job event
    that ends it (the scheduler frees the slot, counts it and delivers it)."""

    def __init__(self, job, answer: Answer, state, stopping: Callable[[], bool],
                 finish: Callable[[AnswerRun, JobEvent], None]):
        self.job, self.answer, self.state = job, answer, state
        self._stopping, self._finish = stopping, finish
        self._end: JobEvent = Done(answer)

    def generation(self) -> Generation:
        return Generation(self.answer.events(), self.on_event, self.on_end, self.stop_waiting)

    def stop_waiting(self) -> bool:
        """Cancelled while its decode waits (a prompt evaluated in pieces): it ends there."""
        if self.job.cancel.is_set() or self._stopping():
            self._end = Cancelled(self.answer)
            return True
        return False

    def on_event(self, ev) -> bool:
        job, limit = self.job, self.job.limit
        if isinstance(ev, TokenEvent) and ev.text:
            self.state.n_decoded += 1
            text = limit.feed(ev.text) if limit else responses.Piece(ev.text, ev.from_draft)
            if text:
                deliver(job, Text(text))
            if limit is not None and limit.stopped:
                return False
        elif isinstance(ev, PrefillEvent) and ev.done >= ev.total:
            if limit is not None:
                limit.start()
            deliver(job, Prefilled(ev.done))
        if job.cancel.is_set() or self._stopping():
            self._end = Cancelled(self.answer)
            return False
        return True

    def on_end(self, error: Exception | None) -> None:
        end = self._end
        if isinstance(error, TandemError):  # the request's own fault (e.g. a prompt too long)
            end = Refused(error)
        elif error is not None:  # a bug: reported, and the engine lives on
            print("tandem serve: generation failed:", file=sys.stderr)
            traceback.print_exception(error, file=sys.stderr)
            end = Failed(error)
        limit, answer = self.job.limit, self.answer
        if limit is not None and isinstance(end, Done):
            tail = limit.flush()
            if tail:
                deliver(self.job, Text(tail))
            if limit.stopped:  # the rule's end, not an interruption
                answer.text, answer.reason = limit.text, "limit"
        self._finish(self, end)


def deliver(job, event: JobEvent) -> None:
    try:
        job.sink(event)
    except Exception:  # noqa: BLE001 - a closed event loop (shutdown) must not kill the engine
        pass
