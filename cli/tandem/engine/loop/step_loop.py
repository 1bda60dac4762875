"""The engine loop's rounds: every generation in flight, stepped by one thread.

A generation is the iterator a slot's answer is (Pair.generate over a Slot): its events, with
a DecodeRequest wherever it waits for a decode (engine/backend/decode_requests.py). Each round
(step()) resumes every generation whose decode ran, and starts the new ones, each until it
asks for its next decode or ends; then one batch per context runs those decodes
(StepBatcher.run: the draft model's first). So no thread per slot and no lock: the contexts,
the slots and every generation belong to the thread that calls step() (serve's engine thread,
serve/scheduler.py), as llama-server's update_slots() owns its slots.

A generation on a whole Context (one slot, a pair on RPC servers) never asks for a decode: its
first resumption runs it to its end, its events delivered as they come.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from tandem.engine.backend.decode_requests import DecodeRequest

if TYPE_CHECKING:
    from tandem.engine.backend.sequences import StepBatcher


@dataclass(eq=False)
class Generation:
    """One generation in flight: `events` (the answer's iterator), `on_event(event)` for each
    event it yields (False: end it there, at that event: a cancel, an editor's limit), and
    `on_end(error)` once when it is over (None, or the exception it raised)."""

    events: Iterator
    on_event: Callable[[object], bool]
    on_end: Callable[[Exception | None], None]
    # asked each round while it waits for its decode (a prompt's pieces may take many rounds:
    # prompt_share.py): True ends it there
    stop_waiting: Callable[[], bool] = lambda: False
    waiting: DecodeRequest | None = None
    started: bool = False


class StepLoop:
    def __init__(self, batcher: StepBatcher | None = None):
        """`batcher`: the shared contexts' (None: one sequence, whose decodes run at once)."""
        self.batcher = batcher
        self.live: list[Generation] = []

    def add(self, generation: Generation) -> None:
        """Start `generation` in the next round."""
        self.live.append(generation)
        self._count()

    def step(self) -> None:
        """One round. The generations a batch served go first, then the new ones: a new one
        may run llama.cpp calls of its own at its start (a first request's calibration), which
        must not overwrite rows another has yet to read."""
        served = [g for g in self.live if g.waiting is not None and g.waiting.done]
        for g in served + [g for g in self.live if not g.started]:
            self._advance(g)
        for g in [g for g in self.live if g.waiting is not None and not g.waiting.done
                  and g.stop_waiting()]:
            self._end(g, None)
        waiting = [g.waiting for g in self.live if g.waiting is not None and not g.waiting.done]
        if waiting:
            if self.batcher is None:
                raise RuntimeError("a decode request without shared contexts")
            self.batcher.run(waiting)

    def stop_all(self) -> None:
        """End every generation where it is (the server stops): each one's on_end(None)."""
        for g in list(self.live):
            self._end(g, None)

    def _advance(self, g: Generation) -> None:
        g.started, g.waiting = True, None
        error: Exception | None = None
        try:
            for item in g.events:
                if type(item) is DecodeRequest:
                    g.waiting = item
                    return
                if not g.on_event(item):
                    break
        except Exception as exc:  # noqa: BLE001 - the generation's own failure, its caller's to report
            error = exc
        self._end(g, error)

    def _end(self, g: Generation, error: Exception | None) -> None:
        self.live.remove(g)
        self._count()
        try:
            g.events.close()  # its finally blocks: the partial answer, the drafter's notes
        except Exception as exc:  # noqa: BLE001 - reported as the generation's failure
            error = error or exc
        g.on_end(error)

    def _count(self) -> None:
        if self.batcher is not None:
            self.batcher.members = len(self.live)
