"""Scripted stand-ins for engine.llama's Model and Context, for driving the real generate()
and drafters with logits chosen by the test and costs on a simulated clock.

A ScriptedContext answers decode() with `logits_fn(prefix)` for each requested row, keeps the
token list as the real Context does, enforces the same limits (context size, n_batch for
all-logits batches) and, given a FakeClock, advances it by a scripted cost per call, so the
cost model, adaptive lengths and the fallback guard see exactly the timings the test wants.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from tandem.engine.backend.decode_requests import DecodesAtOnce
from tandem.engine.backend.llama import MAX_OUTPUTS, common_prefix
from tandem.errors import ContextOverflowError

NEG = -1e4  # a logit whose probability is 0 in float64


class FakeClock:
    """Replaces time.perf_counter: only the scripted contexts move it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedModel:
    def __init__(self, n_vocab: int, pieces: Sequence[bytes] | None = None,
                 eog: Sequence[int] = ()):
        self.n_vocab = n_vocab
        self._pieces = list(pieces) if pieces is not None else [bytes([65 + i % 26]) for i in range(n_vocab)]
        self._eog = set(eog)
        self.path = "scripted.gguf"

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def piece(self, token: int) -> bytes:
        return self._pieces[token]

    # what a grammar reads (engine/constrain/grammar.py): the bytes, and a byte tokenizer
    def vocab_bytes(self) -> tuple[list[bytes], list[bool]]:
        return list(self._pieces), [t in self._eog for t in range(self.n_vocab)]

    def eog_tokens(self) -> list[int]:
        return sorted(self._eog)

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False):
        by_piece = {p: i for i, p in enumerate(self._pieces) if i not in self._eog}
        return [by_piece[bytes([b])] for b in text.encode("utf-8")]


@dataclass(frozen=True)
class _Params:
    n_outputs_max: int = MAX_OUTPUTS
    exact: bool = False


class ScriptedContext(DecodesAtOnce):
    """`logits_fn(prefix) -> logits of the token after prefix`; `cost(n_tokens) -> seconds`."""

    def __init__(self, model: ScriptedModel, logits_fn: Callable[[list[int]], np.ndarray],
                 n_ctx: int = 4096, n_batch: int = 512, clock: FakeClock | None = None,
                 cost: Callable[[int], float] | None = None, verify_limit: int | None = None):
        self.model = model
        self.logits_fn = logits_fn
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.params = _Params()
        self.verify_limit = verify_limit or min(MAX_OUTPUTS, n_batch)
        self.notes: list[str] = []
        self.memory_note = None  # attention memory: drafts are never capped by it
        self.clock = clock
        self.cost = cost or (lambda n: 0.0)
        self.tokens: list[int] = []
        self.n_decoded = 0
        self.n_threads = 1  # Context's decoding thread count (set_threads changes it)
        self.max_logit_rows = 0
        self.batches: list[int] = []  # size of every decode call

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    def decode(self, tokens: Sequence[int], all_logits: bool = False,
               checkpoint: bool = False) -> np.ndarray:
        n = len(tokens)
        if len(self.tokens) + n > self.n_ctx:
            raise ContextOverflowError("scripted context overflow", None)
        if all_logits and n > self.n_batch:
            raise ValueError("all_logits decode is limited to n_batch and n_outputs_max rows")
        first = len(self.tokens)
        self.tokens.extend(tokens)
        self.n_decoded += n
        self.batches.append(n)
        if self.clock is not None:
            self.clock.advance(self.cost(n))
        rows = range(first, first + n) if all_logits else [first + n - 1]
        self.max_logit_rows = max(self.max_logit_rows, len(rows))
        return np.stack([np.asarray(self.logits_fn(self.tokens[:i + 1]), dtype=np.float32)
                         for i in rows])

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def checkpoint(self) -> None:
        pass  # attention memory: truncate() goes back anywhere (Context.checkpoint)

    def copy_marks(self, n: int, start: int = 0) -> tuple[int, ...]:
        return ()  # attention memory keeps no copies (Context.copy_marks)

    def reuse(self, tokens: Sequence[int]) -> int:
        return 0  # a scripted context never moves cached runs (Context.reuse)

    def prefill(self, tokens: Sequence[int], progress=None) -> int:
        keep = common_prefix(self.tokens, tokens)
        self.truncate(keep)
        todo = list(tokens[keep:])
        for start in range(0, len(todo), self.n_batch):
            self.decode(todo[start:start + self.n_batch])
        return len(todo)

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        self.prefill(tokens[:-1])
        return self.decode(tokens[-1:])[0]


def logits_of(probs: Sequence[float], n_vocab: int) -> np.ndarray:
    """Logits whose softmax (temperature 1) is `probs` on the first ids, 0 elsewhere."""
    out = np.full(n_vocab, NEG, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    out[:len(p)] = np.where(p > 0, np.log(np.maximum(p, 1e-300)), NEG)
    return out


def one_hot(token: int, n_vocab: int, margin: float = 10.0) -> np.ndarray:
    out = np.zeros(n_vocab, dtype=np.float64)
    out[token] = margin
    return out
