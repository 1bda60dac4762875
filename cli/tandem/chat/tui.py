"""The chat's terminal view (Rich): a pure `render(state)` of the live answer + throughput panel,
and a small `ChatView` object the chat loop talks to by verbs.

`LiveState` holds what the panel shows and is updated from engine events (`apply`), with
timestamps passed in, so a recorded event sequence renders the same panel every time.

Over 400 lines because this is the one chat module allowed to import Rich, so the live
state, its pure rendering and the view object stay together rather than spread Rich imports.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from tandem.chat.transcript import open_fence
from tandem.engine.loop.events import DoneEvent, PrefillEvent, StepEvent, TokenEvent
from tandem.engine.loop.stats import GenStats
from tandem.machine.load import FRESH_S, LoadMeter, busy, busy_text, same_load

BLOCKS = " ▁▂▃▄▅▆▇█"
RATE_WINDOW = 1.0  # seconds of tokens behind the "now" rate
NARROW = 60  # below this width the panel drops its box and its labels get short
DRAFT_STYLE = "bold green"  # accepted draft tokens with --show-draft (bold survives NO_COLOR)
TAIL_CHARS = 6000  # the live view renders only the end of a long answer
# "vs plain" compares with plain decoding measured in similar conditions, or not at all: this
# answer's own plain steps (auto decodes plainly where drafting does not pay; the fallback
# guard does too), once there are this many...
MIN_PLAIN_STEPS = 8
# ...else a plain measurement (the start-up probe, a plain turn) at most this old and taken
# at the same load (machine/load.py)
PLAIN_FRESH_S = FRESH_S


class Comparison(NamedTuple):
    """This answer against plain decoding: the ratio, the plain tok/s, what that rate is,
    and the load when the machine was busy while both were measured (only this answer's
    own plain steps are compared on a busy machine, and the ratio then says so)."""

    speedup: float
    plain: float
    what: str
    busy: float | None = None


@dataclass
class LiveState:
    """What the live view shows for the answer being generated."""

    strategy: str = ""  # the session's (chat sets it and n_max from its settings)
    n_max: int = 0  # draft length of the session settings
    show_draft: bool = False
    plain_rate: float | None = None  # measured plain decoding tok/s for this pair, this machine
    plain_source: str = ""
    plain_at: float | None = None  # when it was measured (the view's clock); None: unknown
    plain_busy: float | None = None  # share of the CPU other processes took meanwhile
    busy: float | None = None  # the same during this answer so far (set by the view)
    parts: list[tuple[str, bool]] = field(default_factory=list)  # (text, from_draft)
    steps: GenStats = field(default_factory=GenStats)  # tokens, drafts, acceptance so far
    draft_len: int | None = None  # draft length asked of the drafter at the latest step
    prefill_done: int = 0
    prefill_total: int = 0
    n_prompt: int = 0
    t_start: float | None = None  # when the prompt was evaluated (decoding started)
    now: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # token arrival times
    status: str = "prefill"  # prefill | generating | done | interrupted
    reason: str = ""
    final: GenStats | None = None  # exact statistics once the engine reports them
    # this answer's steps: all of them, and the plain ones (no draft, no draft model run),
    # as (steps or tokens, seconds of draft + verify + sample)
    step_tokens: int = 0
    step_time: float = 0.0
    plain_steps: int = 0
    plain_time: float = 0.0

    # ----- updates -----
    def apply(self, ev, now: float) -> None:
        self.now = now
        self.steps.observe(ev)
        if isinstance(ev, PrefillEvent):
            self.n_prompt = ev.n_prompt
            if ev.total:
                self.prefill_done, self.prefill_total = ev.done, ev.total
            if ev.done >= ev.total and self.t_start is None and self.status == "prefill":
                self.t_start = now
                self.status = "generating"
        elif isinstance(ev, TokenEvent):
            if self.t_start is None:
                self.t_start, self.status = now, "generating"
            if ev.text:
                self.parts.append((ev.text, ev.from_draft))
            if ev.token >= 0:
                self.recent.append(now)
        elif isinstance(ev, StepEvent):
            if ev.n_max > 0:  # steps capped to 0 by max_tokens or the context say nothing
                self.draft_len = ev.n_max
            took = ev.t_draft + ev.t_verify + ev.t_sample
            self.step_tokens += ev.accepted + 1
            self.step_time += took
            # a step with no draft whose drafter did not run a model either: a plain step
            if ev.drafted == 0 and ev.t_draft <= 0.25 * ev.t_verify:
                self.plain_steps += 1
                self.plain_time += took
        elif isinstance(ev, DoneEvent):
            self.final = ev.stats
            self.reason = ev.reason
            self.status = "done"

    # ----- derived numbers -----
    @property
    def n_tokens(self) -> int:
        return self.steps.n_generated

    @property
    def text(self) -> str:
        return "".join(p for p, _ in self.parts)

    @property
    def elapsed(self) -> float:
        return max(self.now - self.t_start, 0.0) if self.t_start is not None else 0.0

    @property
    def avg_rate(self) -> float:
        if self.final is not None and self.final.tokens_per_second > 0:
            return self.final.tokens_per_second
        return self.n_tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def current_rate(self) -> float:
        if self.status != "generating":
            return self.avg_rate
        window = min(RATE_WINDOW, self.elapsed)
        if window <= 0:
            return 0.0
        n = sum(1 for t in self.recent if t > self.now - window)
        return n / window

    @property
    def drafted(self) -> int:
        return self.steps.drafted

    @property
    def accepted(self) -> int:
        return self.steps.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.steps.acceptance_rate

    @property
    def mean_accepted_length(self) -> float:
        return self.steps.mean_accepted_length

    @property
    def by_position(self) -> list[float]:
        return self.steps.acceptance_by_position

    def comparison(self) -> Comparison | None:
        """This answer against plain decoding measured in the same conditions: its own plain
        steps (on a busy machine too, and then marked busy), else a plain measurement at most
        PLAIN_FRESH_S old taken at the same load; None when there is neither (no ratio is
        better than one against a stale or differently loaded rate)."""
        if (self.plain_steps >= MIN_PLAIN_STEPS and self.plain_time > 0 and self.step_time > 0):
            plain = self.plain_steps / self.plain_time
            return Comparison((self.step_tokens / self.step_time) / plain, plain,
                              f"{self.plain_steps} plain steps of this answer",
                              self.busy if busy(self.busy) else None)
        if self._recent_plain() and same_load(self.busy, self.plain_busy):
            age = self.now - self.plain_at
            source = f"{self.plain_source}, " if self.plain_source else ""
            return Comparison(self.avg_rate / self.plain_rate, self.plain_rate,
                              f"{source}{age:.0f} s ago")
        return None

    def _recent_plain(self) -> bool:
        return bool(self.plain_rate and self.plain_at is not None and self.avg_rate > 0
                    and 0 <= self.now - self.plain_at <= PLAIN_FRESH_S)

    def no_comparison(self, narrow: bool = False) -> str:
        """Why there is no ratio (when comparison() is None)."""
        if self._recent_plain():  # recent, but measured at another load
            if narrow:
                return "vs plain: not comparable (busy)"
            def pct(share):
                return "?" if share is None else f"{share:.0%}"

            return (f"vs plain: not comparable, the load differs (other processes: "
                    f"{pct(self.busy)} of the CPU now, {pct(self.plain_busy)} at the plain "
                    "measurement)")
        if self.plain_rate:
            return (f"vs plain: no recent measurement (the last is over {PLAIN_FRESH_S:.0f} s "
                    "old)" if not narrow else "vs plain: none recent")
        return "speedup: no plain rate measured yet"

    @property
    def speedup(self) -> float | None:
        cmp = self.comparison()
        return cmp[0] if cmp else None


# ----- pure rendering -----
def render(state: LiveState, width: int | None = None, height: int | None = None) -> RenderableType:
    """The live view: the end of the answer so far, then the throughput panel.

    `height` bounds the whole view (the answer shows its last lines), so a live display never
    scrolls; None shows the whole answer.
    """
    panel = render_panel(state, width)
    panel_lines = _panel_height(state, width)
    answer_lines = None if height is None else max(height - panel_lines - 1, 0)
    if not state.parts:
        if state.status == "prefill":
            return Group(_prefill_line(state), panel)
        return panel
    return Group(AnswerTail(state, answer_lines), panel)


def render_answer(state: LiveState) -> RenderableType:
    """The finished answer: markdown, or plain text with accepted draft tokens coloured."""
    if state.show_draft:
        return draft_text(state.parts)
    return Markdown(state.text)


def draft_text(parts: Iterable[tuple[str, bool]]) -> Text:
    text = Text()
    for piece, from_draft in parts:
        text.append(piece, style=DRAFT_STYLE if from_draft else None)
    return text


def sparkline(values: list[float]) -> str:
    return "".join(BLOCKS[min(int(round(v * (len(BLOCKS) - 1))), len(BLOCKS) - 1)] for v in values)


def _fmt_rate(r: float) -> str:
    return f"{r:.0f}" if r >= 100 else f"{r:.1f}"


def panel_lines(state: LiveState, width: int | None = None) -> list[Text]:
    """The panel's content, one Text per line (also used for the summary after an answer)."""
    narrow = width is not None and width < NARROW
    lines: list[Text] = []
    rate = Text()
    if state.status == "generating":
        rate.append(f"{_fmt_rate(state.current_rate)} tok/s", style="bold")
        rate.append(" now · " if not narrow else " now, ")
        rate.append(f"{_fmt_rate(state.avg_rate)} avg")
    else:
        rate.append(f"{_fmt_rate(state.avg_rate)} tok/s", style="bold")
        rate.append(f" · {state.n_tokens} tokens")
    lines.append(rate)
    speed = Text()
    cmp = state.comparison()
    if state.strategy == "none":
        speed.append("plain decoding (no drafts)")
    elif cmp is not None and cmp.busy is not None:
        speed.append(f"busy: {cmp.speedup:.2f}×", style="bold")
        speed.append(f" {cmp.what}" if narrow else
                     f" {cmp.what} ({_fmt_rate(cmp.plain)} tok/s; {busy_text(cmp.busy)})")
    elif cmp is not None:
        speed.append(f"{cmp.speedup:.2f}×", style="bold")
        if narrow:
            speed.append(f" vs plain {_fmt_rate(cmp.plain)} (measured)")
        else:
            speed.append(f" vs plain {_fmt_rate(cmp.plain)} tok/s (measured here: {cmp.what})")
    else:
        speed.append(state.no_comparison(narrow))
    lines.append(speed)
    draft_len = state.draft_len if state.draft_len is not None else state.n_max
    if state.strategy != "none":
        acc = Text()
        limit = step_limit_label(state.strategy)
        if narrow:
            acc.append(f"acc {100 * state.acceptance_rate:.0f}% · len "
                       f"{state.mean_accepted_length:.2f} · {limit} ≤ {draft_len}")
        else:
            acc.append(f"accepted {100 * state.acceptance_rate:.0f}%", style="bold")
            acc.append(f" ({state.accepted}/{state.drafted} drafted)"
                       f" · mean accepted length {state.mean_accepted_length:.2f}"
                       f" · {limit} ≤ {draft_len}")
        lines.append(acc)
        pos = Text()
        rates = state.by_position
        if rates:
            pos.append("by position " if not narrow else "pos ")
            pos.append(sparkline(rates), style="cyan")
            if not narrow:
                pos.append("  " + " ".join(f"{i + 1}:{100 * r:.0f}%" for i, r in enumerate(rates)))
        else:
            pos.append("by position: no drafts yet")
        lines.append(pos)
        sources = sources_text(state.steps.by_source, narrow)
        if sources:
            lines.append(Text(sources))
    # the drafter's decisions (e.g. auto turning the draft model off), once the answer is done
    for note in (state.final.notes if state.final is not None else []):
        lines.append(Text(note, style="dim"))
    return lines


def step_limit_label(strategy: str) -> str:
    """What limits a step's draft under `strategy` (the panel's per-step figure): auto and
    hybrid draft past the model's length from the n-gram sources, whose cap it is."""
    return {"draft": "model draft", "ngram": "n-gram draft"}.get(strategy, "n-gram draft")


def sources_text(by_source: dict[str, list[int]], narrow: bool = False) -> str:
    """Where the drafts came from (GenStats.sources_text), labelled for the panel."""
    text = GenStats(by_source=by_source).sources_text()
    return text and ("from " if narrow else "drafts accepted/drafted from: ") + text


def summary_line(state: LiveState, width: int | None = None) -> str:
    """One line after an answer: rate, speedup against the measured plain rate, acceptance."""
    parts = [f"{_fmt_rate(state.avg_rate)} tok/s", f"{state.n_tokens} tokens"]
    cmp = state.comparison()
    if state.strategy == "none":
        parts.append("plain decoding")
    elif cmp is not None and cmp.busy is not None:
        parts.append(f"busy: {cmp.speedup:.2f}× {cmp.what} ({busy_text(cmp.busy)})")
    elif cmp is not None:
        parts.append(f"{cmp.speedup:.2f}× vs plain {_fmt_rate(cmp.plain)} tok/s "
                     f"(measured: {cmp.what})")
    if state.strategy != "none" and state.drafted:
        parts.append(f"accepted {100 * state.acceptance_rate:.0f}% "
                     f"({state.accepted}/{state.drafted})")
        parts.append(f"mean accepted length {state.mean_accepted_length:.2f}")
        parts.append(f"by position {sparkline(state.by_position)}")
        sources = sources_text(state.steps.by_source, narrow=True)
        if sources:
            parts.append(sources)
    if state.reason and state.reason != "eos":
        parts.append(f"stopped: {state.reason}")
    elif state.status == "interrupted":
        parts.append("stopped: Ctrl-C")
    return (" · " if width is None or width >= NARROW else "\n").join(parts)


def plain_banner(measure) -> str:
    """The chat header's plain rate (a conversation.PlainMeasure), with the rule the panel
    compares by, so a header figure beside "no recent measurement" does not contradict it."""
    rate = f"plain decoding measured here: {_fmt_rate(measure.rate)} tok/s ({measure.source}"
    if busy(measure.busy):
        return (f"{rate}, while {busy_text(measure.busy)}); answers are compared only with "
                "plain decoding measured at the same load")
    return (f"{rate}); answers are compared with it for {PLAIN_FRESH_S:.0f} s, at the same "
            "load")


def vs_plain_text(vs: dict) -> str:
    """/stats' speculative turns against plain decoding (ChatSession.vs_plain): a ratio only
    over the turns that had a plain measurement at the same load within PLAIN_FRESH_S."""
    n, of = vs["compared"], vs["speculative"]
    rule = (f"a plain measurement under {PLAIN_FRESH_S:.0f} s old, taken at the same load "
            "(/strategy none for a plain turn)")
    busy_note = (f"; {vs['busy']} of them ran while the machine was busy"
                 if vs.get("busy") else "")
    if vs.get("ratio") is None:
        return f"not compared: none of {of} turns had {rule}{busy_note}"
    return f"{vs['ratio']:.2f}× vs plain over {n} of {of} turns (those with {rule}){busy_note}"


def render_panel(state: LiveState, width: int | None = None) -> RenderableType:
    lines = panel_lines(state, width)
    if width is not None and width < NARROW:
        return Group(Text("─" * max(width, 1), style="dim"), *lines)
    grid = Table.grid()
    grid.add_column()
    for line in lines:
        grid.add_row(line)
    title = f"tandem · {state.strategy}"
    if state.strategy == "ngram":
        title += f" · n-gram draft ≤ {state.n_max}"
    elif state.strategy != "none":
        title += f" · model draft ≤ {state.n_max}"
    if state.status == "interrupted":
        title += " · stopped"
    return Panel(grid, title=title, title_align="left", border_style="blue", expand=False)


def _panel_height(state: LiveState, width: int | None) -> int:
    n = len(panel_lines(state, width))
    return n + (1 if width is not None and width < NARROW else 2)


def _prefill_line(state: LiveState) -> RenderableType:
    if state.prefill_total <= 0:
        return Spinner("dots", text=Text(" thinking…", style="dim"))
    grid = Table.grid(padding=(0, 1))
    grid.add_column()
    grid.add_column(width=24)
    grid.add_row(Text(f"evaluating prompt {state.prefill_done}/{state.prefill_total} tokens"),
                 ProgressBar(total=state.prefill_total, completed=state.prefill_done, width=24))
    return grid


class AnswerTail:
    """The answer so far, showing only its last `max_lines` lines (all of them if None)."""

    def __init__(self, state: LiveState, max_lines: int | None):
        self.state = state
        self.max_lines = max_lines

    def _renderable(self) -> RenderableType:
        if self.state.show_draft:
            parts, size = [], 0
            for piece, d in reversed(self.state.parts):
                parts.append((piece, d))
                size += len(piece)
                if size > TAIL_CHARS:
                    break
            return draft_text(reversed(parts))
        return Markdown(markdown_tail(self.state.text, TAIL_CHARS))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.max_lines == 0:
            return
        lines = console.render_lines(self._renderable(), options.update(height=None), pad=False)
        if self.max_lines is not None:
            lines = lines[-self.max_lines:]
        for line in lines:
            yield from line
            yield Segment.line()


def markdown_tail(text: str, limit: int) -> str:
    """The end of a markdown text, cut at a line start, reopening a code fence cut in half."""
    if len(text) <= limit:
        return text
    cut = text.find("\n", len(text) - limit)
    if cut < 0:
        return text[-limit:]
    head, tail = text[:cut], text[cut + 1:]
    fence = open_fence(head)
    return f"{fence}\n{tail}" if fence else tail


# ----- the view object -----
class ChatView:
    """The chat loop talks to this by verbs; it owns the console and the live display."""

    def __init__(self, console: Console | None = None, show_draft: bool = False,
                 live: bool | None = None, clock: Callable[[], float] = time.perf_counter,
                 refresh_per_second: float = 8, load: Callable[[], LoadMeter] = LoadMeter):
        """`load()`: a LoadMeter for each answer (the share of the CPU other processes take
        while it is generated)."""
        self.console = console or Console(highlight=False)
        self.show_draft = show_draft
        self.interactive = self.console.is_terminal if live is None else live
        self.clock = clock
        self.refresh_per_second = refresh_per_second
        self.plain_rate: float | None = None
        self.plain_source = ""
        self.plain_at: float | None = None
        self.plain_busy: float | None = None
        self.state: LiveState | None = None
        self._live: Live | None = None
        self._load_meter = load
        self._load: LoadMeter | None = None

    # --- session ---
    def banner(self, title: str, lines: Iterable[str] = ()) -> None:
        self.console.print(Text(title, style="bold"))
        for line in lines:
            self.console.print(Text(line, style="dim"))

    def loading(self, what: str):
        """A context manager showing progress while `what` happens (a spinner on a terminal)."""
        if self.interactive:
            return self.console.status(Text(what))
        print(what, file=sys.stderr)  # a note, not part of the chat's output on stdout
        return _Nothing()

    def ask(self, prompt: str = ">>> ") -> str:
        """Read one line; EOFError (Ctrl-D) and KeyboardInterrupt (Ctrl-C) propagate."""
        self.console.file.flush()
        if sys.stdin is not None and not sys.stdin.isatty():
            return _read_piped_line(prompt)
        if self.interactive:
            try:
                import readline  # noqa: F401 - line editing and history for input()
            except ImportError:
                pass
        return input(prompt)

    def set_plain_rate(self, rate: float | None, source: str = "",
                       at: float | None = None, load: float | None = None) -> None:
        """The latest plain measurement, when it was taken (this view's clock) and the share
        of the CPU other processes took meanwhile."""
        self.plain_rate, self.plain_source, self.plain_at = rate, source, at
        self.plain_busy = load
        if self.state is not None:
            self.state.plain_rate, self.state.plain_source = rate, source
            self.state.plain_at, self.state.plain_busy = at, load

    # --- an answer ---
    def start_answer(self, strategy: str, n_max: int) -> None:
        self.state = LiveState(strategy=strategy, n_max=n_max, show_draft=self.show_draft,
                               plain_rate=self.plain_rate, plain_source=self.plain_source,
                               plain_at=self.plain_at, plain_busy=self.plain_busy,
                               now=self.clock())
        self._load = self._load_meter().start()
        if self.interactive:
            self._live = Live(console=self.console, transient=True, auto_refresh=True,
                              refresh_per_second=self.refresh_per_second,
                              vertical_overflow="crop", get_renderable=self._frame)
            self._live.start()

    def _frame(self) -> RenderableType:
        st = self.state
        if st is None:
            return Text("")
        if st.status == "generating":
            st.now = self.clock()
            self._measure_load()
        return render(st, self.console.width, self.console.height)

    def _measure_load(self) -> None:
        share = self._load.share() if self._load is not None else None
        if share is not None:  # None: too short an interval to tell yet
            self.state.busy = share

    def event(self, ev) -> None:
        """Any engine event of the answer being generated."""
        if self.state is None:
            return
        self.state.apply(ev, self.clock())
        if not self.interactive and isinstance(ev, TokenEvent) and ev.text:
            self.console.file.write(ev.text)
            self.console.file.flush()

    add_token = event  # a TokenEvent
    step = event  # a StepEvent

    def prefill(self, done: int, total: int, n_prompt: int = 0) -> None:
        self.event(PrefillEvent(done, total, n_prompt))

    def finish(self, interrupted: bool = False) -> None:
        """The answer ended (or was stopped): print it for good, with a one-line summary."""
        st = self.state
        if st is None:
            return
        if interrupted:
            st.status = "interrupted"
        elif st.status == "generating":
            st.status = "done"
        self._measure_load()
        self._stop_live()
        if self.interactive:
            if st.parts:
                self.console.print(render_answer(st))
        elif st.parts and not st.text.endswith("\n"):
            self.console.file.write("\n")
        self.console.print(self.summary(st))
        if interrupted:
            self.console.print(Text("answer stopped (Ctrl-C again or Ctrl-D to exit)",
                                    style="yellow"))
        self.state = None

    def summary(self, st: LiveState) -> Text:
        return Text(summary_line(st, self.console.width), style="dim")

    def _stop_live(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()

    def abort(self) -> None:
        """Tear the live display down (on errors and exit)."""
        self._stop_live()
        self.state = None

    # --- messages ---
    def notice(self, message: str) -> None:
        self._print(Text(message, style="yellow"))

    def info(self, message: str) -> None:
        self._print(Text(message, style="cyan"))

    def error(self, message: str, hint: str | None = None) -> None:
        text = Text("✗ ", style="bold red")
        text.append(message, style="red")
        if hint:
            text.append(f"\n  {hint}", style="dim")
        self._print(text)

    def _print(self, renderable: RenderableType) -> None:
        if self._live is not None:
            self._live.console.print(renderable)  # printed above the live display
        else:
            self.console.print(renderable)

    def show_help(self, commands: Iterable[tuple[str, str, str]]) -> None:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        for name, arg, desc in commands:
            table.add_row(f"/{name}" + (f" {arg}" if arg else ""), desc)
        table.add_row("Ctrl-C", "stop the answer; twice, or Ctrl-D: exit")
        self.console.print(table)

    def show_stats(self, data: dict) -> None:
        rows = [
            ("turns", f"{data['turns']} ({data['turns_in_context']} in context, "
                      f"{data['dropped_turns']} dropped)"),
            ("context", f"{data['context_used']}/{data['n_ctx']} tokens"),
            ("settings", f"strategy {data['strategy']} · draft {data['draft_max']} · "
                         f"temp {data['temperature']:g} · max tokens {data['max_tokens']}"),
            ("generated", f"{data['tokens']} tokens at "
                          f"{_fmt_rate(data['tokens_per_second'])} tok/s"),
        ]
        if data["drafted"]:
            rows.append(("acceptance", f"{100 * data['acceptance_rate']:.1f}% "
                                       f"({data['accepted']}/{data['drafted']}) · mean accepted "
                                       f"length {data['mean_accepted_length']:.2f}"))
            by_pos = data["acceptance_by_position"]
            rows.append(("by position", sparkline(by_pos) + "  " + " ".join(
                f"{i + 1}:{100 * r:.0f}%" for i, r in enumerate(by_pos))))
            sources = sources_text(data.get("by_source") or {}, narrow=True)
            if sources:
                rows.append(("drafts", sources))
        if data.get("context_files"):
            rows.append(("context files", ", ".join(data["context_files"])))
        plain = data.get("plain_tokens_per_second")
        if plain:
            line = f"{_fmt_rate(plain)} tok/s (measured here: {data['plain_source']})"
            if busy(data.get("plain_busy")):
                line += f", the latest while busy ({busy_text(data['plain_busy'])})"
            rows.append(("plain", line))
        else:
            rows.append(("plain", "not measured"))
        vs = data.get("vs_plain") or {}
        if vs.get("speculative"):
            rows.append(("speculative", vs_plain_text(vs)))
        rows.append(("last prompt", f"{data['last_prompt_tokens']} tokens, "
                                    f"{data['last_prompt_evaluated']} evaluated "
                                    "(rest from the KV cache)"))
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)

    def goodbye(self) -> None:
        self.console.print(Text("Bye.", style="dim"))


CHAT_LINE_MAX = 4 << 20  # characters: a message longer than this fits no context


def _read_piped_line(prompt: str) -> str:
    """One line of piped input, read with a bound: `< /dev/zero` (one endless line) once read
    until memory ran out. A longer line ends the chat with an error (the rest of it cannot be
    told apart from the next message)."""
    from tandem.errors import UsageError

    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline(CHAT_LINE_MAX + 1)
    if not line:
        raise EOFError
    if len(line) > CHAT_LINE_MAX:
        raise UsageError(f"a line on stdin is over {CHAT_LINE_MAX >> 20} MiB",
                         "pipe messages of a sensible size, one per line")
    return line.removesuffix("\n")  # as input() does


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def make_console(stderr: bool = False) -> Console:
    """The chat console: Rich honours NO_COLOR and TERM=dumb and detects a non-TTY itself."""
    return Console(highlight=False, file=sys.stderr if stderr else None)
