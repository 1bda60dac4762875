"""What the HTTP side hands the scheduler (serve/scheduler.py: Scheduler.submit): a
GenerationJob, one request's answer, or a CallJob, one plain call on the pair. What comes
back goes to the job's own sink (serve/job_events.py)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence, Union

if TYPE_CHECKING:
    from tandem.engine.drafting.drafters import DraftParams
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.pair import Pair
    from tandem.serve.job_events import JobEvent


@dataclass(eq=False)
class GenerationJob:
    """One request's generation. `sink(event)` receives its events (serve/job_events.py:
    Prefilled, a Text per released piece, then one end), called from the scheduler's threads."""

    make: Callable[[Pair], tuple[Sequence[int], GenParams]]  # see scheduler.prepare()
    sink: Callable[[JobEvent], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    # an editor's stopping rules (serve.llama_api.Limiter): the text passes through it, and the
    # answer ends where it says, as if it had finished (Done, reason "limit")
    limit: object = None
    # a short answer (INTERACTIVE_TOKENS): queued first, and the kept slot may take it
    interactive: bool = False
    slot: int | None = None  # the slot that ran it, of several (the request's log line)
    # its drafting (the request's `strategy` and `speculative` settings); None: the server's
    strategy: str | None = None
    draft: DraftParams | None = None


@dataclass(eq=False)
class CallJob:
    """One call on the pair where the scheduler runs it, between answers (a remote pair's
    tokenizer, whose worker takes one call at a time). `sink(event)` gets its value as
    Returned, or Refused, Failed or Dropped."""

    call: Callable[[Pair], object]
    sink: Callable[[JobEvent], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    interactive: ClassVar[bool] = False  # queued behind short answers, never on the kept slot


Job = Union[GenerationJob, CallJob]
