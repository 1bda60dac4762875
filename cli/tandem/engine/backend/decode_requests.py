"""How a generation asks for a decode without owning the contexts it decodes on.

generate() and the drafters decode through `decode_steps()` / `prefill_steps()`: generators
that return the rows (`rows = yield from ctx.decode_steps(tokens)`). On a whole Context they
decode at once and never suspend, so run, chat and spec-bench see plain event iterators. On one
sequence of a shared context (engine/backend/sequences.py) they yield a DecodeRequest, which
passes up through every wrapping generator to the engine loop (engine/loop/step_loop.py): it
gathers every live generation's request into one batch per context, decodes, fills `rows`, and
resumes each. A generation is thus a resumable step machine, and one thread runs them all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Sequence, TypeVar

import numpy as np

from tandem.engine.backend.context_params import ALL, LAST

T = TypeVar("T")
# a generation's decodes as steps: yields DecodeRequests, returns T
Steps = Generator["DecodeRequest", None, T]


@dataclass(eq=False, slots=True)
class DecodeRequest:
    """One sequence's decode, waiting for its batch: `view` (a SeqContext), its tokens, where
    they go and which rows want logits (context_params ALL, LAST, NONE). The loop sets `rows` (a view
    into llama.cpp's buffer, valid until that context's next batch) or `error`, then `done`."""

    view: Any
    tokens: Sequence[int]
    want: int
    start: int  # the position of its first token in the view's sequence
    rows: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False
    ran: int = 0  # tokens of it decoded already: a prompt chunk run in pieces (prompt_share.py)

    @property
    def outputs(self) -> int:
        return len(self.tokens) if self.want == ALL else (1 if self.want == LAST else 0)


def run_now(steps: Steps[T]) -> T:
    """Run `steps` to their end, each decode alone and at once: for a caller that owns the
    contexts (the engine loop's own thread between rounds, a calibration, a test)."""
    try:
        request = next(steps)
        while True:
            request.view.run_alone(request)
            request = next(steps)
    except StopIteration as stop:
        return stop.value


def at_once(value: T) -> Steps[T]:
    """Steps that need no decode: `value`, without suspending."""
    return value
    yield  # noqa: unreachable - makes this a generator


class DecodesAtOnce:
    """decode_steps()/prefill_steps() of a context whose decode() and prefill() run when
    called (a whole Context, a test's scripted one): steps that never suspend."""

    def decode_steps(self, tokens: Sequence[int], all_logits: bool = False,
                     checkpoint: bool = False) -> Steps[np.ndarray]:
        return self.decode(tokens, all_logits, checkpoint)
        yield  # noqa: unreachable - makes this a generator

    def prefill_steps(self, tokens: Sequence[int]) -> Steps[int]:
        return self.prefill(tokens)
        yield  # noqa: unreachable - makes this a generator
