"""Token sampling in numpy, shared by the target and the drafts.

Speculative sampling needs the full filtered distributions p (target) and q (draft), so the
sampler chain is ours rather than llama.cpp's: the same pipeline (repetition penalty, top-k,
top-p, min-p, temperature, as llama.cpp orders them) is applied to both models' logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from tandem.errors import UsageError


@dataclass(frozen=True)
class Limit:
    """The values a sampling knob takes, stated once for SamplingParams, the CLI's flags and
    the API's fields (each words the error with its own name for the knob)."""

    lo: float
    hi: float
    open_lo: bool = False
    open_hi: bool = False
    hint: str = ""

    def problem(self, value: float) -> str | None:
        """None if `value` is allowed, else what is wrong ("must be >= 0")."""
        if not math.isfinite(value):
            return "must be a finite number"
        if value < self.lo or (self.open_lo and value == self.lo):
            return f"must be {'>' if self.open_lo else '>='} {self.lo:g}"
        if value > self.hi or (self.open_hi and value == self.hi):
            return f"must be {'<' if self.open_hi else '<='} {self.hi:g}"
        return None


LIMITS = {
    "temperature": Limit(0.0, 100.0, hint="use 0 for greedy"),
    "top_k": Limit(0, (1 << 31) - 1, hint="use 0 to turn it off"),
    "top_p": Limit(0.0, 1.0, open_lo=True, hint="use 1.0 to turn it off"),
    "min_p": Limit(0.0, 1.0, open_hi=True, hint="use 0 to turn it off"),
    "repeat_penalty": Limit(0.0, 100.0, open_lo=True, hint="use 1.0 to turn it off"),
}
# one seed rule for the CLI and the API: llama.cpp's -1 is a random seed, other negatives
# are refused, and a seed is below 2^64
RANDOM_SEED = -1
SEED = Limit(RANDOM_SEED, (1 << 64) - 1, hint="omit the seed (or pass -1) for a random one")
_NAMES = {"temperature": "temperature", "top_k": "top-k", "top_p": "top-p", "min_p": "min-p",
          "repeat_penalty": "repeat penalty"}


def seed_value(seed: int | None) -> int | None:
    """A checked seed as SamplingParams takes it: None for a random one."""
    return None if seed is None or seed == RANDOM_SEED else seed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # <= 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64
    seed: int | None = None
    # llama.cpp's `infill` sampler (the editors send it): decide by infill_pick, a greedy rule
    infill: bool = False

    def __post_init__(self):
        for key, limit in LIMITS.items():
            value = getattr(self, key)
            problem = limit.problem(value)
            if problem:
                raise UsageError(f"{_NAMES[key]} {problem}, got {value}", limit.hint)
        if self.seed is not None and SEED.problem(self.seed):
            raise UsageError(f"seed {SEED.problem(self.seed)}, got {self.seed}", SEED.hint)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.infill


@dataclass
class Dist:
    """A distribution over token ids. Sparse: probabilities `probs` over the ids `ids`. Dense
    (`ids` None, when no filter truncates the vocabulary): probs[i] is token i's probability,
    kept as float32 so a kept q costs what one logits row costs; arithmetic is float64."""

    ids: np.ndarray | None
    probs: np.ndarray

    @property
    def top(self) -> float:
        """The largest probability (what a p_min threshold compares with)."""
        top = float(self.probs.max())
        return top / self._total() if self.ids is None else top

    def prob(self, token: int) -> float:
        if self.ids is None:
            return float(self.probs[token]) / self._total() if 0 <= token < len(self.probs) else 0.0
        hit = np.nonzero(self.ids == token)[0]
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def sample(self, rng: np.random.Generator) -> int:
        idx = _pick(self.probs, rng)
        return idx if self.ids is None else int(self.ids[idx])

    def dense(self, n_vocab: int) -> np.ndarray:
        out = np.zeros(n_vocab, dtype=np.float64)
        if self.ids is None:
            out[:len(self.probs)] = self.probs / self._total()
        else:
            out[self.ids] = self.probs
        return out

    def _total(self) -> float:
        # float32 storage rounds the sum away from exactly 1: normalise in float64 on use
        total = getattr(self, "_sum", None)
        if total is None:
            total = self._sum = float(self.probs.sum(dtype=np.float64))
        return total


def _pick(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs, dtype=np.float64)
    idx = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(idx, len(probs) - 1)


def penalized(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """Logits after llama.cpp's repetition penalty (a copy only when it applies)."""
    if params.repeat_penalty == 1.0 or not history or params.repeat_last_n == 0:
        return logits
    recent = history[-params.repeat_last_n:] if params.repeat_last_n > 0 else history
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    out = np.array(logits, dtype=np.float32, copy=True)
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / params.repeat_penalty, vals * params.repeat_penalty)
    return out


def greedy_token(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> int:
    # the method, not np.argmax(): the function's dispatch costs more than a small row's scan
    return int(penalized(logits, history, params).argmax())


def distribution(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> Dist:
    """The sampling distribution after penalty, top-k, top-p, min-p and temperature."""
    x = penalized(logits, history, params)
    n = x.shape[0]
    t = max(params.temperature, 1e-6)
    if not 0 < params.top_k < n and params.top_p >= 1.0 and params.min_p <= 0.0:
        # nothing truncates the vocabulary: a dense float32 row instead of ids + probs
        z = x.astype(np.float64)
        p = np.exp((z - z.max()) / t)
        return Dist(ids=None, probs=(p / p.sum()).astype(np.float32))
    if 0 < params.top_k < n:
        ids = np.argpartition(x, -params.top_k)[-params.top_k:]
    else:
        ids = np.arange(n)
    vals = x[ids].astype(np.float64)
    order = np.argsort(-vals, kind="stable")
    ids, vals = ids[order], vals[order]
    if params.top_p < 1.0 or params.min_p > 0.0:
        p = np.exp(vals - vals[0])
        p /= p.sum()
        keep = len(p)
        if params.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(p), params.top_p)) + 1)
        if params.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(p >= params.min_p * p[0]))))
        ids, vals = ids[:keep], vals[:keep]
    p = np.exp((vals - vals[0]) / t)
    return Dist(ids=ids, probs=p / p.sum())


# llama.cpp's infill sampler (llama-sampler.cpp, llama_sampler_infill_apply): its candidates
# when top-k is off (its pairwise prefix merge is quadratic), and its confidence threshold
INFILL_CANDIDATES = 40
INFILL_THOLD = 0.2


def infill_pick(logits: np.ndarray, history: Sequence[int], params: SamplingParams,
                is_eog: Callable[[int], bool], piece: Callable[[int], bytes], eot: int) -> int:
    """The token llama.cpp's sampler chain `top_k, top_p, infill` leaves most probable: of
    the top-k (top-p) candidates, an end of generation when the ends hold over a third of
    the text's probability per candidate (3 p_eog n > p_txt); else, with each candidate that
    is a prefix of another merged into the likelier of the two, `eot` when no text token
    keeps INFILL_THOLD, else the likeliest. llama-server then samples from what is left
    (the chain has no temperature); tandem takes its mode, so the rule stays greedy and
    speculation stays lossless against it."""
    x = penalized(logits, history, params)
    k = min(params.top_k if params.top_k > 0 else INFILL_CANDIDATES, x.shape[0])
    ids = np.argpartition(x, -k)[-k:] if k < x.shape[0] else np.arange(k)
    vals = x[ids].astype(np.float64)
    order = np.argsort(-vals, kind="stable")
    ids, vals = ids[order], vals[order]
    p = np.exp(vals - vals[0])
    p /= p.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), params.top_p)) + 1
        ids, p = ids[:keep], p[:keep] / p[:keep].sum()
    ids = [int(t) for t in ids]
    probs = [float(v) for v in p]
    eog = [is_eog(t) for t in ids]
    p_eog = sum(v for v, e in zip(probs, eog) if e)
    if 3 * p_eog * len(ids) > 1.0 - p_eog:
        return max((v, -i, t) for i, (t, v, e) in enumerate(zip(ids, probs, eog)) if e)[2]
    pieces = [piece(t) for t in ids]
    alive = [True] * len(ids)
    for i0 in range(len(ids)):  # llama.cpp's merge, in its order
        for i1 in range(len(ids)):
            if not alive[i0]:
                break
            if i0 == i1 or not alive[i1]:
                continue
            a, b = pieces[i0], pieces[i1]
            if a and len(a) <= len(b) and b.startswith(a):
                dst, src = (i1, i0) if probs[i1] > probs[i0] else (i0, i1)
                probs[dst] += probs[src]
                probs[src], alive[src] = 0.0, False
    kept = [i for i in range(len(ids)) if alive[i] and (eog[i] or probs[i] >= INFILL_THOLD)]
    if not any(not eog[i] for i in kept):
        return eot
    return ids[max(kept, key=lambda i: (probs[i], -i))]


def draft_top(logits: np.ndarray, history: Sequence[int], params: SamplingParams,
              top_k: int = 10) -> tuple[int, float]:
    """llama.cpp's greedy draft choice: the top token and its probability among the top-k."""
    x = penalized(logits, history, params)
    n = x.shape[0]
    top_k = min(top_k, n)
    n_slices = 64
    if n < 16384 or top_k > n_slices:  # below ~10k entries one partition is cheaper
        cand = np.partition(x, n - top_k)[n - top_k:] if n > top_k else x
        best = int(x.argmax())
    else:
        # partitioning a whole 152k row costs ~0.6 ms per draft token. The top_k largest of
        # the slices' maxima are top_k distinct entries, so every top-k value is >= the least
        # of them (floor): only slices that reach floor, and the short tail, can hold one
        m = n - n % n_slices
        slices = x[:m].reshape(n_slices, -1)
        maxima = slices.max(axis=1)
        floor = np.partition(maxima, n_slices - top_k)[n_slices - top_k]
        near = slices[maxima >= floor]
        cand = np.concatenate((near[near >= floor], x[m:]))
        cand = np.partition(cand, cand.shape[0] - top_k)[-top_k:]
        i = int(maxima.argmax())  # the first slice holding the maximum: argmax's first index
        best = i * slices.shape[1] + int(slices[i].argmax())
        if m < n and x[m:].max() > x[best]:
            best = m + int(x[m:].argmax())
    e = np.exp(cand.astype(np.float64) - float(x[best]))
    return best, float(1.0 / e.sum())


def residual(p: Dist, q: Dist, n_vocab: int) -> Dist:
    """norm(max(0, p - q)): where to resample after a rejected draft token."""
    dp, dq = p.dense(n_vocab), q.dense(n_vocab)
    r = np.maximum(dp - dq, 0.0)
    total = r.sum()
    if total <= 0.0:  # p == q on the support: any sample from p is exact
        return p
    ids = np.nonzero(r)[0]
    return Dist(ids=ids, probs=r[ids] / total)
