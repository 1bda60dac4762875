"""What paid for this pair on this machine, kept between requests (issue 25).

`auto` learns, per draft source and match length and for the draft model, how often each
draft position is accepted, and how noisy this machine's verify timings are. A new request
(a first chat turn, the next `tandem run`) starts from that instead of from the priors, so it
does not pay again for the probes that found out. The file sits beside the pair's cost cache
(`$TANDEM_HOME/costs/<key>.knowledge.json`, the same key: machine, context settings, models).

It is untrusted input: read with a size bound, a version field (other versions are ignored),
ignored when older than the cost cache's MAX_AGE_S or dated in the future, and every value
checked (acceptances finite in [0, 1], counts and lengths bounded, keys known); an entry that
fails is dropped, a file that fails as a whole is ignored, and nothing here raises. Written
through fsutil.atomic_write_text.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from tandem.engine.costs import MAX_AGE_S, MAX_BATCH
from tandem.fsutil import atomic_write_text

VERSION = 1
MAX_BYTES = 64 * 1024  # a full file is ~5 KiB: anything larger is not ours
MAX_COUNT = 1_000_000  # verdicts counted per entry (more says nothing new)
MAX_LEN = MAX_BATCH - 1  # positions kept per entry: the longest draft
FUTURE_SLACK_S = 300  # clocks of one machine agree; a file from the future is not trusted
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
        """The kept knowledge, or None (absent, unreadable, another version, stale, or not
        this format). `sources` and `buckets` are the keys the caller knows."""
        try:
            if not path.is_file() or path.stat().st_size > MAX_BYTES:
                return None
            with open(path, "rb") as f:
                data = json.loads(f.read(MAX_BYTES + 1).decode("utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        return cls.from_dict(data, set(sources), set(buckets), time.time() if now is None else now)

    @classmethod
    def from_dict(cls, data, sources: set[str], buckets: set[int],
                  now: float) -> "Knowledge | None":
        if not isinstance(data, dict) or data.get("version") != VERSION:
            return None
        when = data.get("when")
        if not _number(when) or not 0 < when <= now + FUTURE_SLACK_S or now - when > MAX_AGE_S:
            return None
        out = cls(when=float(when))
        entries = data.get("sources")
        for e in entries if isinstance(entries, list) else []:
            if not isinstance(e, dict) or e.get("source") not in sources:
                continue
            b = e.get("bucket")
            rec = _record(e)
            if type(b) is int and b in buckets and rec is not None:
                out.sources[(e["source"], b)] = rec
        model = data.get("model")
        if isinstance(model, dict):
            out.model = _record(model)
        noise = data.get("noise")
        for k, v in (noise.items() if isinstance(noise, dict) else ()):
            try:
                n = int(k)
            except (TypeError, ValueError):
                continue
            if 1 <= n <= MAX_BATCH and _number(v) and 0.0 <= v <= 1.0:
                out.noise[n] = float(v)
        return out


def _number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _record(e: dict) -> Record | None:
    accept, n = e.get("accept"), e.get("n")
    if (not isinstance(accept, list) or not 1 <= len(accept) <= MAX_LEN
            or not all(_number(a) and 0.0 <= a <= 1.0 for a in accept)
            or type(n) is not int or not 0 < n <= MAX_COUNT):
        return None
    return Record([float(a) for a in accept], n)
