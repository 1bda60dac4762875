"""Prompt-lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the
context's last n tokens. Costs no model; strong when the output copies the input.

The index maps each n-gram to the position right after its latest occurrence and is updated
incrementally as tokens are appended, so a lookup never rescans the context.
"""
from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """N-grams of `shortest`..`longest` tokens, each to the position after its latest
    occurrence."""

    def __init__(self, shortest: int, longest: int):
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram sizes need 1 <= shortest <= longest, got {shortest}..{longest}")
        self.shortest, self.longest = shortest, longest
        self._tables: dict[int, dict[tuple, int]] = {n: {} for n in range(shortest, longest + 1)}
        self._tokens: list[int] = []
        self._indexed = 0  # n-grams ending before this position are in the tables

    def sync(self, tokens: Sequence[int]) -> None:
        """Follow `tokens`: extend the index, or rebuild it if the history was rewritten."""
        n_old = len(self._tokens)
        if len(tokens) < n_old or (n_old and tokens[n_old - 1] != self._tokens[-1]):
            self.__init__(self.shortest, self.longest)
            n_old = 0
        self._tokens.extend(tokens[n_old:])
        # index n-grams ending at positions < len-1: the last one is the lookup key itself
        toks = self._tokens
        for end in range(self._indexed, len(toks) - 1):
            for n in range(self.shortest, min(self.longest, end + 1) + 1):
                self._tables[n][tuple(toks[end - n + 1:end + 1])] = end + 1
        self._indexed = max(self._indexed, len(toks) - 1)

    def lookup(self, k: int, extra: Sequence[int] = ()) -> tuple[list[int], int]:
        """Up to k tokens continuing the longest matching suffix, and that match's length.

        `extra`: tokens after the indexed ones that are not committed yet (a partial draft);
        the suffix is taken over tokens + extra, continuations come from indexed history.
        """
        toks = self._tokens + list(extra) if extra else self._tokens
        for n in range(min(self.longest, len(toks)), self.shortest - 1, -1):
            start = self._tables[n].get(tuple(toks[len(toks) - n:]))
            if start is not None:
                cont = toks[start:start + k]
                if cont:
                    return list(cont), n
        return [], 0
