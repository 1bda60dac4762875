"""The chat session core: history, chat template, KV reuse across turns, slash commands.

It yields data (engine events plus `Notice`) and never prints; `tandem.commands.chat` drives it and
`tandem.chat.tui` shows it. Each turn's prompt is the whole conversation rendered with the GGUF chat
template; because it extends the previous turn's tokens, the engine's prefix reuse
(Context.prefill) evaluates only the new tokens, on the target and, where the turn's drafter
uses it, on the draft model.

Over 400 lines because the conversation's state (turns, the files in its context, the plain
measurements) and the slash commands that read and change it are one object, ChatSession.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

from tandem.chat import transcript
from tandem.chat.answer import Answer
from tandem.chat.transcript import Turn
from tandem.engine.loop.events import DoneEvent
from tandem.engine.loop.sampling import SamplingParams
from tandem.config.schema import FIELDS_BY_KEY, STRATEGIES, check_strategy
from tandem.engine.pair import Pair
from tandem.engine.drafting.drafters import DraftParams
from tandem.engine.drafting.history import read_context_file
from tandem.engine.prompt_files import check_files_fit, with_files
from tandem.engine.loop.speculative import GenParams
from tandem.engine.loop.stats import GenStats
from tandem.errors import ContextOverflowError, UsageError
from tandem.chat.speed import PlainMeasure, vs_plain
from tandem.machine.load import LoadMeter

PLAIN_PROBE_PROMPT = "Write a short Python function that adds two numbers."

_DRAFT = FIELDS_BY_KEY["n_max"]  # /draft takes the values --draft-max takes

# name, argument, description: the /help table (the view decides how to show it)
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("help", "", "show this help"),
    ("stats", "", "statistics of this session"),
    ("strategy", "NAME", "drafting strategy: " + " | ".join(STRATEGIES)),
    ("draft", "N", "draft length: most tokens drafted per step "
                   f"({int(_DRAFT.lo)}..{int(_DRAFT.hi)})"),
    ("temp", "X", "sampling temperature (0: greedy)"),
    ("max-tokens", "N", "most tokens per answer"),
    ("system", "TEXT", "set the system prompt (no text: clear it)"),
    ("add", "FILE", "put a text file in the context: the model reads it, auto drafts from it"),
    ("reset", "", "forget the conversation (keeps the system prompt)"),
    ("save", "FILE", "save the conversation: .json as JSON, anything else as markdown"),
    ("exit", "", "leave (also /quit, Ctrl-D)"),
)
ALIASES = {"quit": "exit", "q": "exit", "?": "help", "h": "help"}


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not an error (e.g. turns dropped to fit)."""

    kind: str  # "dropped" | "context-full" | "incomplete"
    message: str
    dropped_turns: int = 0


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


@dataclass(frozen=True)
class CommandResult:
    """What a slash command did, as data: `action` tells the view how to show it."""

    action: str  # help | stats | set | reset | saved | exit
    message: str = ""
    data: dict = field(default_factory=dict)


def parse_command(line: str) -> Command | None:
    """`/name arg...` -> Command; None for ordinary text (and for `//...`, an escaped slash)."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name = name.strip().lower()
    name = ALIASES.get(name, name)
    if name not in {c[0] for c in COMMANDS}:
        shown = f"/{name}" if name else "/"
        raise UsageError(f"unknown command {shown}",
                         "type /help for the commands; start a message with // to send a "
                         "line that begins with /")
    return Command(name, arg.strip())


def message_text(line: str) -> str:
    """The text a typed line sends: `//x` sends `/x`."""
    text = line.strip()
    return text[1:] if text.startswith("//") else text


def _parse_int(arg: str, what: str, lo: int, hi: int) -> int:
    try:
        value = int(arg)
    except ValueError:
        message = f"{what} needs a whole number, got {arg!r}" if arg else f"{what} needs a number"
        raise UsageError(message, f"for example: /{what} {lo if lo > 0 else 1}") from None
    if not lo <= value <= hi:
        raise UsageError(f"{what} must be in {lo}..{hi}, got {value}", None)
    return value


class ChatSession:
    """A conversation with a loaded PairSession."""

    def __init__(self, pair: Pair, *, system: str | None = None,
                 gen: GenParams = GenParams(), strategy: str | None = None,
                 draft: DraftParams | None = None, raw: bool = False,
                 reserve: int | None = None, files: Sequence[tuple[str, str]] = ()):
        self.pair = pair
        self.system = system or None
        self.gen = gen
        self.strategy = strategy or pair.options.strategy
        self.draft = draft or pair.options.draft
        self.raw = raw
        self._reserve = reserve
        self.turns: list[Turn] = []  # the whole conversation (what /save writes)
        # files the model reads (--context-file, /add): (name, text, tokens), before the first
        # message in the context, so older turns drop and the files stay
        self.files: list[tuple[str, str, int]] = []
        self.context_start = 0  # turns before this index were dropped from the context
        self.dropped_turns = 0
        self._plain_tokens = 0  # plain-decoding tokens measured on this machine, this pair
        self._plain_time = 0.0
        self.plain_source = ""  # how the plain rate was measured
        # the plain measurements, latest last: an answer is compared with the latest one
        # only while it is recent and was taken at the same load (machine/load.py)
        self.plain_log: list[PlainMeasure] = []
        for name, text in files:
            self.add_file(name, text)

    # ----- state -----
    @property
    def n_ctx(self) -> int:
        return self.pair.n_ctx

    @property
    def latest_plain(self) -> PlainMeasure | None:
        return self.plain_log[-1] if self.plain_log else None

    @property
    def plain_rate(self) -> float | None:
        """Plain (non-speculative) decoding tok/s measured in this session, if any."""
        return self._plain_tokens / self._plain_time if self._plain_time > 0 else None

    @property
    def reserve(self) -> int:
        """Context kept free for the answer when deciding which turns to drop."""
        if self._reserve is not None:
            return self._reserve
        return max(1, min(self.gen.max_tokens, self.n_ctx // 4))

    def messages(self, user: str | None = None) -> list[dict]:
        """Chat messages of the turns still in the context, plus `user` if given."""
        return self._messages(self.context_start, user)

    def _messages(self, start: int, user: str | None) -> list[dict]:
        out = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns[start:]:
            out.append({"role": "user", "content": t.user})
            out.append({"role": "assistant", "content": t.assistant})
        if user is not None:
            out.append({"role": "user", "content": user})
        first = next((m for m in out if m["role"] == "user"), None)
        if first is not None and self.files:
            first["content"] = with_files(first["content"], [(n, t) for n, t, _ in self.files])
        return out

    def add_file(self, name: str, text: str) -> int:
        """Put a file in the context (the model reads it) and among auto's draft sources; its
        tokens. UsageError, and nothing added, when the files leave no room for a message."""
        n = len(self.pair.tokenize(text))
        self.files.append((name, text, n))
        try:
            tokens = self.pair.prompt_tokens(self._messages(len(self.turns), "?"), raw=self.raw)
            check_files_fit(len(tokens), self.n_ctx, 1, self._file_sizes())
        except BaseException:
            self.files.pop()
            raise
        self.pair.add_context_file(name, text)
        return n

    def _file_sizes(self) -> list[tuple[str, int]]:
        return [(name, n) for name, _, n in self.files]

    def _turn_gen(self):
        """This turn's generation parameters: with --seed, each turn draws from its own
        stream (seed + turn number), so turns are reproducible without repeating one another."""
        seed = self.gen.sampling.seed
        if seed is None:
            return self.gen
        return replace(self.gen, sampling=replace(self.gen.sampling, seed=seed + len(self.turns)))

    # ----- a turn -----
    def send(self, text: str) -> Iterator:
        """Answer `text`: yields Notice, PrefillEvent, TokenEvent, StepEvent and DoneEvent.

        Closing the iterator early (Ctrl-C) keeps the partial answer as the turn's answer, with
        reason "interrupted"; the KV caches stay consistent because generation only ever stops
        at a yield.
        """
        if not text.strip():
            raise UsageError("the message is empty", "type some text, or /help for commands")
        tokens, dropped = self._fit(text)
        if dropped:
            kept = len(self.turns) - self.context_start
            yield Notice("dropped",
                         f"context full: dropped the {_plural(dropped, 'oldest turn')} "
                         f"({kept} kept, prompt {len(tokens)} of {self.n_ctx} tokens)", dropped)
        turn = Turn(user=text, strategy=self.strategy, started=time.perf_counter())
        answer = Answer(self.pair, tokens, self._turn_gen(), self.strategy, self.draft)
        stream = answer.events()
        load = LoadMeter().start()
        try:
            yield from stream
        finally:
            stream.close()
            turn.assistant, turn.reason, turn.stats = answer.text, answer.reason, answer.stats
            turn.busy = load.share()
            if not answer.failed:  # an error: the message is not part of the conversation
                self.turns.append(turn)
                self._learn_plain(turn)
        done = answer.done
        if done is not None and done.reason == "context":
            yield Notice("context-full",
                         f"the context ({self.n_ctx} tokens) is full: the answer was cut; "
                         "the oldest turns will be dropped on the next message")
        if done is not None and done.complete is False and done.reason == "length":  # a cut JSON
            yield Notice("incomplete", "the answer stopped at the token limit before the grammar "
                         "was complete: it does not match the grammar (raise /max-tokens)")

    def _fit(self, text: str) -> tuple[list[int], int]:
        """Tokens of the next prompt, dropping the oldest turns until it fits with room."""
        start = self.context_start
        while True:
            tokens = self.pair.prompt_tokens(self._messages(start, text), raw=self.raw)
            if len(tokens) + self.reserve <= self.n_ctx:
                break
            if start >= len(self.turns):
                if len(tokens) < self.n_ctx:
                    break  # fits, with less room for the answer than we would like
                check_files_fit(len(tokens), self.n_ctx, 1, self._file_sizes())
                raise ContextOverflowError(
                    f"this message needs {len(tokens)} tokens but the context holds {self.n_ctx}",
                    "send a shorter message, or restart with a larger --ctx-size")
            start += 1
        dropped = start - self.context_start
        self.context_start = start
        self.dropped_turns += dropped
        return tokens, dropped

    def _learn_plain(self, turn: Turn) -> None:
        st = turn.stats
        if turn.strategy == "none" and st is not None and st.n_generated >= 8 and st.t_decode > 0:
            self._add_plain(st.n_generated, st.t_decode, "plain turns of this chat", turn.busy)

    def _add_plain(self, n: int, seconds: float, source: str, load: float | None) -> None:
        self._plain_tokens += n
        self._plain_time += seconds
        self.plain_log.append(PlainMeasure(n / seconds, source, time.perf_counter(), load))
        if source not in self.plain_source:
            self.plain_source = f"{self.plain_source} + {source}" if self.plain_source else source

    def measure_plain(self, max_tokens: int = 16) -> float | None:
        """Measure plain decoding on this machine with this pair: a short greedy generation.

        The conversation and the draft's KV cache are untouched; the target's cache is reused
        by prefix as usual, so the next turn re-evaluates what the probe displaced.
        """
        if max_tokens <= 0:
            return self.plain_rate
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": PLAIN_PROBE_PROMPT}]
        tokens = self.pair.prompt_tokens(msgs, raw=self.raw)
        if len(tokens) + max_tokens >= self.n_ctx:
            return self.plain_rate
        gen = GenParams(max_tokens=max_tokens, sampling=SamplingParams(), ignore_eos=True)
        done = None
        load = LoadMeter().start()
        for ev in self.pair.generate(tokens, gen, strategy="none", record=False):
            if isinstance(ev, DoneEvent):
                done = ev
        if done is not None and done.stats.n_generated and done.stats.t_decode > 0:
            self._add_plain(done.stats.n_generated, done.stats.t_decode,
                            f"{done.stats.n_generated}-token plain probe", load.share())
        return self.plain_rate

    def vs_plain(self) -> dict:
        return vs_plain(self.plain_log, self.turns)

    # ----- slash commands -----
    def command(self, line: str) -> CommandResult | None:
        """Run a slash command; None when `line` is not one. Bad input raises UsageError."""
        cmd = parse_command(line)
        if cmd is None:
            return None
        return getattr(self, "_cmd_" + cmd.name.replace("-", "_"))(cmd.arg)

    def _cmd_help(self, arg: str) -> CommandResult:
        return CommandResult("help", "commands", {"commands": COMMANDS})

    def _cmd_stats(self, arg: str) -> CommandResult:
        return CommandResult("stats", "session statistics", self.session_stats())

    def _cmd_exit(self, arg: str) -> CommandResult:
        return CommandResult("exit")

    def _cmd_strategy(self, arg: str) -> CommandResult:
        name = arg.lower()
        if not name:
            return CommandResult("set", f"strategy is {self.strategy} "
                                        f"(choose from {', '.join(STRATEGIES)})")
        check_strategy(name)
        self.pair.check_drafter(name, self.draft)  # raises UsageError if it cannot work here
        self.strategy = name
        return CommandResult("set", f"strategy: {name}", {"strategy": name})

    def _cmd_draft(self, arg: str) -> CommandResult:
        if not arg:
            return CommandResult("set", f"draft length is {self.draft.n_max} "
                                        f"(/draft N with N in {int(_DRAFT.lo)}..{int(_DRAFT.hi)})")
        # the flag's range (config.schema): 0 drafts nothing, as --draft-max 0 does
        n = _parse_int(arg, "draft", int(_DRAFT.lo), int(_DRAFT.hi))
        if n < self.draft.n_min:
            raise UsageError(f"draft must be >= the draft minimum ({self.draft.n_min}), got {n}",
                             "restart with a smaller --draft-min")
        self.draft = replace(self.draft, n_max=n)
        note = "" if self.strategy != "none" else " (strategy is none: /strategy draft to use it)"
        return CommandResult("set", f"draft length: {n}{note}", {"draft": n})

    def _cmd_temp(self, arg: str) -> CommandResult:
        if not arg:
            return CommandResult("set", f"temperature is {self.gen.sampling.temperature:g}")
        try:
            value = float(arg)
        except ValueError:
            raise UsageError(f"temp needs a number, got {arg!r}",
                             "for example: /temp 0.7") from None
        if not math.isfinite(value):
            raise UsageError(f"temp must be a finite number, got {arg!r}", "for example: /temp 0.7")
        sampling = replace(self.gen.sampling, temperature=value)  # validates (>= 0)
        self.gen = replace(self.gen, sampling=sampling)
        return CommandResult("set", f"temperature: {value:g}" + (" (greedy)" if value == 0 else ""),
                             {"temp": value})

    def _cmd_max_tokens(self, arg: str) -> CommandResult:
        if not arg:
            return CommandResult("set", f"max tokens is {self.gen.max_tokens}")
        n = _parse_int(arg, "max-tokens", 1, 10_000_000)
        self.gen = replace(self.gen, max_tokens=n)
        return CommandResult("set", f"max tokens: {n}", {"max_tokens": n})

    def _cmd_system(self, arg: str) -> CommandResult:
        self.system = arg or None
        msg = f"system prompt set ({len(arg)} characters)" if arg else "system prompt cleared"
        return CommandResult("set", msg + "; it applies from the next message",
                             {"system": self.system})

    def _cmd_add(self, arg: str) -> CommandResult:
        if not arg:
            raise UsageError("/add needs a file name", "for example: /add src/app.py")
        path = Path(arg).expanduser()
        n = self.add_file(arg, read_context_file(path))
        note = "" if self.strategy == "auto" else " (auto drafts from it: /strategy auto)"
        return CommandResult("set", f"added {path.name} ({n} tokens): the model reads it from "
                             f"the next message{note}", {"file": str(path), "tokens": n})

    def _cmd_reset(self, arg: str) -> CommandResult:
        n = len(self.turns)
        self.reset()
        return CommandResult("reset", f"conversation reset ({_plural(n, 'turn')} forgotten)")

    def _cmd_save(self, arg: str) -> CommandResult:
        if not arg:
            raise UsageError("/save needs a file name",
                             "for example: /save chat.md or /save chat.json")
        path = self.save(Path(arg).expanduser())
        return CommandResult("saved", f"saved {_plural(len(self.turns), 'turn')} to {path}",
                             {"path": str(path)})

    def reset(self) -> None:
        self.turns.clear()
        self.context_start = 0
        self.dropped_turns = 0

    # ----- statistics and saving -----
    def session_stats(self) -> dict:
        total = GenStats(strategy=self.strategy)  # the speculative turns, summed
        for t in self.turns:
            if t.stats is not None and t.strategy != "none":
                total.add(t.stats)
        n_all = sum(t.stats.n_generated for t in self.turns if t.stats)
        t_all = sum(t.stats.t_decode for t in self.turns if t.stats)
        last = self.turns[-1].stats if self.turns else None
        return {
            "turns": len(self.turns),
            "turns_in_context": len(self.turns) - self.context_start,
            "dropped_turns": self.dropped_turns,
            "context_used": len(self.pair.cached_tokens),
            "n_ctx": self.n_ctx,
            "strategy": self.strategy,
            "draft_max": self.draft.n_max,
            "temperature": self.gen.sampling.temperature,
            "max_tokens": self.gen.max_tokens,
            "system": self.system,
            "tokens": n_all,
            "tokens_per_second": n_all / t_all if t_all > 0 else 0.0,
            "speculative_tokens_per_second": total.tokens_per_second,
            "vs_plain": self.vs_plain(),
            "drafted": total.drafted,
            "accepted": total.accepted,
            "acceptance_rate": total.acceptance_rate,
            "by_source": {k: list(v) for k, v in total.by_source.items()},
            "context_files": list(self.pair.context_files),  # auto's, --draft-from's too
            "files_in_prompt": [name for name, _, _ in self.files],
            "mean_accepted_length": total.mean_accepted_length,
            "acceptance_by_position": total.acceptance_by_position,
            "plain_tokens_per_second": self.plain_rate,
            "plain_source": self.plain_source,
            "plain_busy": self.latest_plain.busy if self.latest_plain else None,
            "last_prompt_tokens": last.n_prompt if last else 0,
            "last_prompt_evaluated": last.n_prompt_eval if last else 0,
        }

    def to_dict(self) -> dict:
        return transcript.to_dict(self.turns, **self._transcript_meta(),
                                  plain_rate=self.plain_rate)

    def save(self, path: Path) -> Path:
        return transcript.save(path, self.turns, **self._transcript_meta(),
                               plain_rate=self.plain_rate)

    def _transcript_meta(self) -> dict:
        draft = self.pair.draft_path
        return {"system": self.system, "target": self.pair.target_path.name,
                "draft": draft.name if draft else None}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
