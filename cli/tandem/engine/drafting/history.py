"""What was already said, kept for drafting: earlier answers of a pair on disk, and the files the
user names, each as a SuffixIndex the `auto` drafter looks up (engine/drafting/auto.py).

On disk: one JSON file per target model under <tandem_home>/history/, keyed by the target
file's name and size (token ids only mean something to that tokenizer), holding the answers'
token ids, oldest first. It is bounded (HISTORY_MAX_TOKENS tokens and HISTORY_MAX_ENTRIES
answers: the oldest go first), rewritten whole through a temporary file and os.replace (a
crash mid-write leaves the previous file, never half of one), and only ever read from the
TANDEM_HOME it was written in. Two processes answering at the same moment: the later write
wins, so one answer may be missing from the history, never the file itself. `history: off`
(config), TANDEM_HISTORY=off or --no-history neither reads nor writes it.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Sequence

import msgspec

from tandem.engine.drafting.suffix import SuffixIndex
from tandem.fsutil import (
    TEXT_INPUT_MAX_BYTES,
    atomic_write_text,
    decode_text,
    read_input_file,
    sweep_stale_tmp,
)
from tandem.statefile import Damaged, file_key, in_future, load_state, warn_damaged

HISTORY_DIR = "history"
HISTORY_MAX_TOKENS = 100_000  # ~0.6 MB of JSON, ~25 MB of index in memory (docs/benchmarks.md)
HISTORY_MAX_ENTRIES = 500
HISTORY_MIN_TOKENS = 8  # shorter answers predict nothing worth a file write
CONTEXT_FILE_MAX_BYTES = TEXT_INPUT_MAX_BYTES
FORMAT = 1


def history_dir(home: Path) -> Path:
    return Path(home) / HISTORY_DIR


def history_key(target: Path) -> str:
    """The history file's name for this target model: its file name and size."""
    target = Path(target)
    size = target.stat().st_size if target.exists() else 0
    return hashlib.sha256(f"{target.name}|{size}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class HistoryInfo:
    """What one history file holds (for `tandem history`)."""

    path: Path
    target: str
    entries: int
    tokens: int
    bytes: int
    newest: float  # time.time() of the latest answer (0: unknown)


# An entry's `time` must be a plausible clock reading: after 2000-01-01 and not in the future
# (statefile's one clock rule); 1e300 or NaN there once made every `tandem history` fail
TIME_MIN = 946_684_800.0
TOKEN_ID_MAX = 1 << 31  # llama_token is int32; larger ids overflowed in ctypes


class _Entry(msgspec.Struct):
    time: Annotated[float, msgspec.Meta(ge=TIME_MIN)]  # NaN fails the bound
    tokens: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_MAX)]],
                      msgspec.Meta(min_length=1)]


class _HistoryFile(msgspec.Struct):
    """The file as HistoryStore writes it; entries are checked one by one (valid_entry)."""

    entries: list[Any]
    target: Any = "?"


def valid_entry(e, n_vocab: int | None = None, now: float | None = None) -> bool:
    """One history entry as tandem writes it: {"time": finite clock reading, "tokens": a list
    of token ids in [0, n_vocab)} (n_vocab None: the vocabulary is not known here, so only
    what any llama token can be)."""
    return _problem(e, n_vocab, now) is None


def _problem(e, n_vocab: int | None, now: float | None) -> str | None:
    """What is wrong with one entry, for the warning; None if nothing."""
    try:
        entry = msgspec.convert(e, _Entry)
    except msgspec.ValidationError:
        return "bad token ids, times or types"
    if in_future(entry.time, now):
        return "dated in the future"
    if n_vocab is not None and max(entry.tokens) >= n_vocab:
        return "token ids outside the vocabulary"
    return None


def _read(path: Path, n_vocab: int | None = None) -> tuple[list[dict], dict, str, Any]:
    """(valid entries, {what is wrong: how many entries}, why the whole file is damaged or "",
    the target it names) of one history file; a missing file is an empty, clean one."""
    try:
        f = load_state(path, _HistoryFile)
    except Damaged as exc:
        return [], {}, str(exc), "?"
    except OSError as exc:
        return [], {}, f"unreadable: {exc.strerror or exc}", "?"
    if f is None:
        return [], {}, "", "?"
    now = time.time()
    good, problems = [], {}
    for e in f.entries:
        problem = _problem(e, n_vocab, now)
        if problem is None:
            good.append({"time": float(e["time"]), "tokens": e["tokens"]})
        else:
            problems[problem] = problems.get(problem, 0) + 1
    return good, problems, "", f.target


def read_entries(path: Path, n_vocab: int | None = None) -> tuple[list[dict], int, bool]:
    """(valid entries, how many were dropped, whether the file was unreadable as a whole) of
    one history file; a missing file is an empty, clean one."""
    good, problems, broken, _ = _read(path, n_vocab)
    return good, sum(problems.values()), bool(broken)


def _damage(problems: dict, broken: str) -> tuple[str, str]:
    """What a damaged history is called in its warning, and why."""
    if broken:
        return "the answer history", broken
    n = sum(problems.values())
    return (f"{n} invalid entr{'y' if n == 1 else 'ies'} of the answer history",
            "; ".join(f"{k}: {v}" for k, v in problems.items()))


class HistoryStore:
    """The on-disk answers of one target model. `n_vocab`: the target's vocabulary size, so
    that token ids a hand-edited or foreign file holds never reach llama_decode."""

    def __init__(self, home: Path, target: Path, max_tokens: int = HISTORY_MAX_TOKENS,
                 max_entries: int = HISTORY_MAX_ENTRIES, n_vocab: int | None = None):
        self.path = history_dir(home) / f"{history_key(target)}.json"
        self.target = Path(target).name
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self.n_vocab = n_vocab
        self._checked = False

    def load(self) -> list[list[int]]:
        """The stored answers, oldest first; a missing or unreadable file is no history."""
        return [e["tokens"] for e in self._entries()]

    def _entries(self) -> list[dict]:
        """The valid entries. The file is untrusted input: what fails the checks is dropped
        with one warning, and the file is rewritten without it at once (never carried on)."""
        if not self._checked:
            sweep_stale_tmp(self.path.parent)  # left by processes killed mid-write
        entries, problems, broken, _ = _read(self.path, self.n_vocab)
        if (problems or broken) and not self._checked:
            what, why = _damage(problems, broken)
            key = file_key(self.path, what)
            try:
                self._write(entries)
                done = "the file was rewritten without " + ("it" if broken else "them")
            except OSError as exc:  # a read-only home: the bad entries are still never used
                done = f"they are ignored (cannot rewrite it: {exc.strerror or exc})"
            warn_damaged(self.path, what, why, done, key)
        self._checked = True
        return entries

    def _write(self, entries: list[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_tmp(self.path.parent)
        text = json.dumps({"format": FORMAT, "target": self.target, "entries": entries},
                          separators=(",", ":"), allow_nan=False)
        atomic_write_text(self.path, text)

    def append(self, tokens: Sequence[int]) -> bool:
        """Add one answer (read, append, trim, replace); False when it is too short to keep.
        An answer equal to a stored one moves to the end instead of being stored twice."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < HISTORY_MIN_TOKENS:
            return False
        entries = [e for e in self._entries() if e["tokens"] != tokens]
        entries.append({"time": time.time(), "tokens": tokens})
        self._write(trim(entries, self.max_tokens, self.max_entries))
        return True


def trim(entries: list[dict], max_tokens: int, max_entries: int) -> list[dict]:
    """The newest entries within both bounds (a single answer over max_tokens keeps its end)."""
    out: list[dict] = []
    total = 0
    for e in reversed(entries):
        if len(out) >= max_entries or total >= max_tokens:
            break
        room = max_tokens - total
        if len(e["tokens"]) > room:
            e = {**e, "tokens": e["tokens"][-room:]}
        out.append(e)
        total += len(e["tokens"])
    return list(reversed(out))


def list_histories(home: Path) -> list[HistoryInfo]:
    """Every history file under `home`, with what it holds: valid entries only (checked as
    when they are used, except against a vocabulary), with one warning per damaged file.
    Nothing is rewritten here: showing is read-only."""
    out = []
    folder = history_dir(home)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        entries, problems, broken, target = _read(path)
        target = "? (unreadable)" if broken else str(target)[:200]
        if problems or broken:
            warn_damaged(path, *_damage(problems, broken),
                         "the next run of its model drops " + ("it" if broken else "them"))
        out.append(HistoryInfo(path, target, len(entries),
                               sum(len(e["tokens"]) for e in entries), size,
                               max((e["time"] for e in entries), default=0.0)))
    return out


def clear_histories(home: Path) -> int:
    """Delete every history file (and stray temporary files) under `home`; how many."""
    folder = history_dir(home)
    n = 0
    for path in list(folder.iterdir()) if folder.is_dir() else []:
        if path.is_file() and (path.suffix in (".json", ".tmp")):
            path.unlink()
            n += path.suffix == ".json"
    return n


def read_context_file(path: Path) -> str:
    """A file the user names for drafting (--context-file, chat /add): a regular file of UTF-8
    text, at most CONTEXT_FILE_MAX_BYTES, checked before a byte is read (a FIFO blocked
    forever, /dev/zero was read until memory ran out)."""
    path = Path(path).expanduser()
    raw = read_input_file(path, "context file", CONTEXT_FILE_MAX_BYTES)
    return decode_text(raw, f"context file {path}",
                       "name text files: source code, notes, documents",
                       "convert it first, e.g. with iconv")


class Library:
    """The session-wide draft sources besides the prompt: files the user named and earlier
    answers (from disk, plus this session's). `store` None: nothing is read or written;
    `remember` False: answers are not added at all (spec-bench decides what history holds)."""

    def __init__(self, store: HistoryStore | None = None, remember: bool = True):
        self.store = store
        self.remember = remember
        self.files = SuffixIndex()
        self.history = SuffixIndex()
        self.file_names: list[str] = []
        if store is not None:
            self.history.add_many(store.load())

    def add_file(self, name: str, tokens: Sequence[int]) -> None:
        self.files.add(tokens)
        self.file_names.append(name)

    def record(self, tokens: Sequence[int]) -> None:
        """An answer just given: drafted from for the rest of the session, and kept on disk
        when the store is on. A failed write costs only the next session's drafts."""
        if not self.remember or len(tokens) < HISTORY_MIN_TOKENS:
            return
        self.history.add(tokens)
        if self.store is not None:
            try:
                self.store.append(tokens)
            except OSError:
                pass

    def sources(self) -> list[tuple[str, SuffixIndex]]:
        return [(name, idx) for name, idx in (("file", self.files), ("history", self.history))
                if len(idx)]
