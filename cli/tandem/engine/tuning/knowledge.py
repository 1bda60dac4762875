"""What paid for this pair on this machine, kept between requests (issue 25).

`auto` learns, per draft source and match length and for the draft model, how often each
draft position is accepted, and how noisy this machine's verify timings are. A new request
(a first chat turn, the next `tandem run`) starts from that instead of from the priors, so it
does not pay again for the probes that found out. The file sits beside the pair's cost cache
(`$TANDEM_HOME/costs/<key>.knowledge.json`, the same key: machine, context settings, models).

It is untrusted input, read as every state file is (tandem/statefile.py: a size bound,
msgspec, the one clock rule and the one failure policy: damaged or dated in the future, it is
said once, removed, and the run starts from the priors); a file of another version or older
than the cost cache's MAX_AGE_S is ignored without a word; every value is checked
(acceptances finite in [0, 1], counts and lengths bounded, keys known), and an entry that
fails is dropped alone. Nothing here raises. Written through fsutil.atomic_write_text.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable

import msgspec

from tandem.engine.tuning.costs import MAX_AGE_S, MAX_BATCH
from tandem.fsutil import atomic_write_text
from tandem.statefile import check_time, read_state

VERSION = 1
MAX_BYTES = 64 * 1024  # a full file is ~5 KiB: anything larger is not ours
MAX_COUNT = 1_000_000  # verdicts counted per entry (more says nothing new)
MAX_LEN = MAX_BATCH - 1  # positions kept per entry: the longest draft
MODEL = "model"  # the draft model's entry


@dataclass
class Record:
    """Conditional acceptance per draft position and how many verdicts it rests on."""

    accept: list[float]
    n: int


@dataclass
class Knowledge:
    # (source, match-length bucket) -> Record, for zero-cost drafts
    sources: dict[tuple[str, int], Record] = field(default_factory=dict)
    model: Record | None = None  # the draft model's acceptance (None: never measured)
    noise: dict[int, float] = field(default_factory=dict)  # batch size -> relative spread
    when: float = 0.0

    def learn(self, key: tuple[str, int] | str, accept: Iterable[float], n: int) -> None:
        """Keep an estimate that rests on `n` verdicts (counts add up across requests)."""
        if n <= 0:
            return
        old = self.model if key == MODEL else self.sources.get(key)
        total = min((old.n if old else 0) + n, MAX_COUNT)
        rec = Record([float(a) for a in list(accept)[:MAX_LEN]], total)
        if key == MODEL:
            self.model = rec
        else:
            self.sources[key] = rec

    def to_json(self) -> str:
        return json.dumps({
            "version": VERSION, "when": self.when,
            "sources": [{"source": s, "bucket": b, "accept": r.accept, "n": r.n}
                        for (s, b), r in sorted(self.sources.items())],
            "model": None if self.model is None else {"accept": self.model.accept,
                                                      "n": self.model.n},
            "noise": {str(k): v for k, v in sorted(self.noise.items())},
        }, indent=1)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.when = time.time()
        atomic_write_text(path, self.to_json(), path.with_name(f"{path.name}.{os.getpid()}.tmp"))

    @classmethod
    def load(cls, path: Path, sources: Iterable[str], buckets: Iterable[int],
             now: float | None = None) -> "Knowledge | None":
        """The kept knowledge, or None (absent, another version, stale, or damaged: said once
        and removed, statefile's policy). `sources` and `buckets` are the keys the caller
        knows; an entry with another key, or values out of bounds, is dropped alone."""
        def remove() -> str:
            with contextlib.suppress(OSError):
                path.unlink()
            return "starting from the priors"

        now = time.time() if now is None else now
        f = read_state(path, _KnowledgeFile, "the kept knowledge", remove, MAX_BYTES,
                       check=lambda f: check_time(f.when, "`when`", now))
        if f is None or f.version != VERSION or now - f.when > MAX_AGE_S:
            return None
        return cls.from_file(f, set(sources), set(buckets))

    @classmethod
    def from_file(cls, f: "_KnowledgeFile", sources: set[str], buckets: set[int]) -> "Knowledge":
        out = cls(when=f.when)
        for e in f.sources:
            rec = _convert(e, _Source)
            if rec is not None and rec.source in sources and rec.bucket in buckets:
                out.sources[(rec.source, rec.bucket)] = Record(rec.accept, rec.n)
        model = _convert(f.model, Record)
        out.model = model if model is not None and _sound(model) else None
        for k, v in f.noise.items():
            n = int(k) if k.isdigit() else 0
            if 1 <= n <= MAX_BATCH and _convert(v, _Share) is not None:
                out.noise[n] = float(v)
        return out


_Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # NaN and inf fail both bounds
_Accept = Annotated[list[_Share], msgspec.Meta(min_length=1, max_length=MAX_LEN)]
_Count = Annotated[int, msgspec.Meta(gt=0, le=MAX_COUNT)]


class _Source(msgspec.Struct):
    source: str
    bucket: int
    accept: _Accept
    n: _Count


class _KnowledgeFile(msgspec.Struct):
    """The file as to_json writes it; entries are checked one by one (from_file)."""

    version: int
    when: Annotated[float, msgspec.Meta(gt=0)]
    sources: list[Any] = []
    model: Any = None
    noise: dict[str, Any] = {}


def _convert(value, kind):
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return None


def _sound(rec: Record) -> bool:
    return (1 <= len(rec.accept) <= MAX_LEN and 0 < rec.n <= MAX_COUNT
            and all(0.0 <= a <= 1.0 for a in rec.accept))
