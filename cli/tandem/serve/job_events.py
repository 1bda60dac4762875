"""What the scheduler (serve/scheduler.py) tells one request's sink, one event a call, from
the scheduler's threads; the HTTP side (request_flow.py, completion_flow.py, chat_bridge.py,
server_state.py) dispatches on their types.

A GenerationJob's sink gets, in order: Prefilled once the prompt is evaluated, a Text per
piece of text released, then exactly one end: Done, Refused, Failed, Cancelled or Dropped.
A CallJob's sink (one plain call on the pair: serve/jobs.py) gets exactly one of Returned,
Refused, Failed or Dropped."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from tandem.chat.answer import Answer
    from tandem.errors import TandemError


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The prompt is evaluated (`n` tokens): the answer's text follows."""

    n: int


@dataclass(frozen=True, slots=True)
class Text:
    """A piece of the answer's text as released: a responses.Piece (it says whether its
    token was an accepted draft), or what an editor's stopping rules let through."""

    piece: str


@dataclass(frozen=True, slots=True)
class Done:
    """The answer, whole: its text, reason and stats (chat.answer.Answer)."""

    answer: Answer


@dataclass(frozen=True, slots=True)
class Refused:
    """The request's own fault (a prompt too long, a bad grammar) or the RPC server gone:
    a TandemError with its message and hint."""

    error: TandemError


@dataclass(frozen=True, slots=True)
class Failed:
    """A bug, logged on stderr with its traceback; the scheduler lives on."""

    error: Exception


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The answer cut at an event (its client went away, or the server stops): what it
    had generated so far, reason "interrupted"."""

    answer: Answer


@dataclass(frozen=True, slots=True)
class Dropped:
    """Cancelled before it began: the server stops (or its client went away) while the job
    waited. A client still waiting for it sees the server's stop."""


@dataclass(frozen=True, slots=True)
class Returned:
    """A call's value: what the call on the pair returned."""

    value: object


# the events that end a job: after one, its sink gets nothing more
END = (Done, Refused, Failed, Cancelled, Dropped, Returned)
JobEvent = Union[Prefilled, Text, Done, Refused, Failed, Cancelled, Dropped, Returned]
