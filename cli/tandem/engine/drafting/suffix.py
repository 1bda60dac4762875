"""A suffix index over token sequences: where has the context's current ending been seen before,
and what most often followed it. Drafts from what was already said cost no model.

Layout: all indexed tokens in one flat array (documents separated by SEP), and for each key
size n in KEY_SIZES a hash chain, as zlib finds matches: `_head[n][hash of an n-gram]` is the
position right after its latest occurrence and `_prev[n][p]` the one before that. A lookup
walks the chain of the context's last KEY_SIZES[-1] (else fewer) tokens, measures each
occurrence's true match length by comparing backwards (so hash collisions cost nothing but
time, and matches longer than the key are found without a table per length), keeps the
occurrences with the longest match, then extends the draft token by token with the
continuation most of those occurrences share: the greedy path of a suffix tree weighted by
counts (SuffixDecoding), or a plain copy when one occurrence is left (prompt lookup).

Memory is about 2 dict entries and 2 array slots per token (docs/benchmarks.md has the
measured figures); no per-length tables, no tuples kept.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np

SEP = -1  # between documents: no match or continuation crosses it
KEY_SIZES = (2, 4)  # hash-chain key lengths; longer matches are measured, not keyed
MAX_MATCH = 32  # backward comparison stops here: longer matches are no better predictors
MAX_CANDIDATES = 24  # chain entries examined per lookup (most recent first)
BULK = 64  # from this many new positions on, numpy indexes them in bulk
_MASK = (1 << 64) - 1


class SuffixIndex:
    """Token documents, indexed incrementally. `sync` follows one growing sequence (the
    current prompt and output); `add` appends whole documents (history, files)."""

    def __init__(self):
        self.tokens = array("i")
        self._head: dict[int, dict[int, int]] = {n: {} for n in KEY_SIZES}
        self._prev: dict[int, array] = {n: array("i") for n in KEY_SIZES}
        self._indexed = 0  # keys ending before this position are in the chains
        self._synced = 0  # tokens of the followed sequence (sync) held at the end
        self.documents = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """A whole document: indexed at once, never continued."""
        self.add_many([tokens])

    def add_many(self, documents: Sequence[Sequence[int]]) -> None:
        """Several documents, indexed in one pass (a history loaded from disk)."""
        for tokens in documents:
            if not tokens:
                continue
            if self.tokens:
                self.tokens.append(SEP)
            self.tokens.extend(tokens)
            self.documents += 1
        self._index(len(self.tokens))
        self._synced = 0

    def sync(self, tokens: Sequence[int]) -> None:
        """Follow `tokens` (one growing sequence, this index's only content): extend, or start
        over when it was rewritten (a new request whose prompt does not extend the last)."""
        n_old = self._synced
        if n_old != len(self.tokens) or len(tokens) < n_old or (
                n_old and tokens[n_old - 1] != self.tokens[-1]):
            self.__init__()
            n_old = 0
        self.tokens.extend(tokens[n_old:])
        self._synced = len(self.tokens)
        self.documents = 1
        # the last token is the lookup key itself: what follows it is not known yet
        self._index(len(self.tokens) - 1)

    def _index(self, end: int) -> None:
        """Chain the keys ending at positions _indexed+1..end, in bulk: numpy hashes every
        n-gram at once and links equal ones within the chunk; only each key's first and last
        occurrence touch the Python dict (a 100k-token history loads in a fraction of a
        second, where a loop per token took seconds)."""
        start = self._indexed + 1
        if end < start:
            return
        if end - start < BULK:
            self._index_few(start, end)
            return
        lo = max(start - KEY_SIZES[-1], 0)
        chunk = np.asarray(self.tokens[lo:end], dtype=np.int64)
        for n in KEY_SIZES:
            prev = self._prev[n]
            first = max(start, n)
            if len(prev) < first:
                prev.extend([-1] * (first - len(prev)))
            if end < first:
                continue
            # the n-gram ending at position p-1 (continued at p), for p in first..end
            pos = np.arange(first, end + 1)
            grams = np.stack([chunk[pos - n + j - lo] for j in range(n)])
            keys = _hash(grams)
            links = np.full(len(pos), -1, dtype=np.int64)
            ok = np.flatnonzero((grams != SEP).all(axis=0))
            if len(ok):
                order = ok[np.argsort(keys[ok], kind="stable")]
                ks = keys[order]
                same = ks[1:] == ks[:-1]
                links[order[1:][same]] = pos[order[:-1][same]]
                heads = self._head[n]
                firsts = order[np.concatenate(([True], ~same))]
                links[firsts] = [heads.get(k, -1) for k in keys[firsts].tolist()]
                lasts = order[np.concatenate((~same, [True]))]
            # link before publish: another slot's drafter may match() meanwhile, and a head
            # published before its chain exists sent it to prev[p] past the end (IndexError)
            prev.frombytes(links.astype(np.int32).tobytes())
            if len(ok):
                heads.update(zip(keys[lasts].tolist(), pos[lasts].tolist()))
        self._indexed = max(self._indexed, end)

    def _index_few(self, start: int, end: int) -> None:
        """_index for a few positions (a decode step's new tokens): the same chains, one
        key at a time in Python, where numpy's per-call cost would dominate (~0.3 ms)."""
        toks = self.tokens
        for n in KEY_SIZES:
            prev, heads = self._prev[n], self._head[n]
            first = max(start, n)
            if len(prev) < first:
                prev.extend([-1] * (first - len(prev)))
            for q in range(first, end + 1):
                gram = toks[q - n:q]
                if SEP in gram:
                    prev.append(-1)
                    continue
                key = _hash_one(gram)
                prev.append(heads.get(key, -1))
                heads[key] = q
        self._indexed = max(self._indexed, end)

    def match(self, suffix: Sequence[int], min_match: int = 1) -> tuple[list[int], int]:
        """Positions right after the latest occurrences of the longest suffix of `suffix`
        found here (at least min_match tokens), most recent first, and that length."""
        toks = self.tokens
        best: list[int] = []
        best_len = 0
        for n in reversed(KEY_SIZES):
            if len(suffix) < n:
                continue
            p = self._head[n].get(_hash_one(suffix[len(suffix) - n:]), -1)
            prev = self._prev[n]
            seen = 0
            while p >= 0 and seen < MAX_CANDIDATES:
                seen += 1
                length = _common_suffix(toks, p, suffix)
                if length >= n:  # not a hash collision
                    if length > best_len:
                        best, best_len = [p], length
                    elif length == best_len:
                        best.append(p)
                p = prev[p]
            if best:
                break
        if best_len < min_match:
            return [], 0
        return best, best_len

    def draft(self, suffix: Sequence[int], k: int, min_match: int = 1,
              latest: bool = False) -> tuple[list[int], int]:
        """Up to k tokens continuing the longest match of `suffix`, each the continuation most
        of the matched occurrences share (ties: the most recent), and the match length.
        `latest`: copy what followed the most recent occurrence only (prompt lookup)."""
        starts, length = self.match(suffix, min_match)
        if not starts or k <= 0:
            return [], length
        if latest:
            starts = starts[:1]
        toks, end = self.tokens, len(self.tokens)
        # the followed sequence's own tail: its last occurrence continues into tokens not
        # indexed yet (they are what is being predicted), so it stops at the end
        out: list[int] = []
        live = starts
        while len(out) < k and live:
            votes: dict[int, int] = {}
            for p in live:
                q = p + len(out)
                if q < end and toks[q] != SEP:
                    t = toks[q]
                    votes[t] = votes.get(t, 0) + 1
            if not votes:
                break
            # max keeps the first of equal counts: live is ordered most recent first
            tok = max(votes, key=votes.__getitem__)
            out.append(tok)
            live = [p for p in live if p + len(out) - 1 < end and toks[p + len(out) - 1] == tok]
        return out, length

    def memory_bytes(self) -> int:
        """Approximate memory held (arrays and hash tables), for the docs' measurement."""
        import sys

        size = self.tokens.itemsize * len(self.tokens)
        for n in KEY_SIZES:
            size += self._prev[n].itemsize * len(self._prev[n]) + sys.getsizeof(self._head[n])
            # each entry's int key and value objects (small ints are shared, most are not)
            size += 2 * 32 * len(self._head[n])
        return size


def _hash(grams: np.ndarray) -> np.ndarray:
    """One 64-bit key per column of `grams` (n rows of token ids); a collision only costs a
    backward comparison that finds it (match() checks every candidate's true length)."""
    h = np.zeros(grams.shape[1], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for row in grams:
            h = h * np.uint64(1_000_003) + (row + 2).astype(np.uint64)
    return h


def _hash_one(gram: Sequence[int]) -> int:
    """_hash of one n-gram, in Python integers (the same 64-bit wrap-around)."""
    h = 0
    for t in gram:
        h = (h * 1_000_003 + int(t) + 2) & _MASK
    return h


def _common_suffix(toks: array, p: int, suffix: Sequence[int]) -> int:
    """How many tokens before position p equal the end of `suffix` (up to MAX_MATCH)."""
    n = 0
    limit = min(MAX_MATCH, p, len(suffix))
    while n < limit and toks[p - 1 - n] == suffix[len(suffix) - 1 - n]:
        n += 1
    return n
