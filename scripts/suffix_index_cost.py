#!/usr/bin/env python3
"""Memory and time of the suffix index (tandem.engine.drafting.suffix) per token, measured here.

    .venv/bin/python scripts/suffix_index_cost.py [--tokens 100000]

The tokens are a synthetic stream shaped like answers: Zipf-distributed ids over a 150k
vocabulary, with a third of each document copied from earlier ones (so chains and matches
are exercised as in a history). Prints indexing time per token, memory per token (tracemalloc)
and lookup time per drafted step (a draft of up to 16 tokens after a match).
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from tandem.engine.drafting.suffix import SuffixIndex


def documents(n_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    docs: list[list[int]] = []
    total = 0
    while total < n_tokens:
        n = int(rng.integers(100, 400))
        doc = [int(t) for t in (rng.zipf(1.3, n) % 150_000)]
        if docs:  # a third copied from an earlier answer, as edits of it are
            src = docs[int(rng.integers(len(docs)))]
            a = int(rng.integers(max(len(src) - n // 3, 1)))
            doc[n // 3: n // 3 + n // 3] = src[a:a + n // 3]
        docs.append(doc)
        total += len(doc)
    return docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--lookups", type=int, default=5000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    docs = documents(args.tokens, rng)
    n = sum(map(len, docs))
    t0 = time.perf_counter()
    idx = SuffixIndex()
    idx.add_many(docs)  # a history loaded from disk
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    one = SuffixIndex()
    for d in docs:  # answers added one by one, as a session gives them
        one.add(d)
    t_each = time.perf_counter() - t0
    del one
    tracemalloc.start()  # a second build: tracing slows allocation, so it is not timed
    again = SuffixIndex()
    again.add_many(docs)
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del again
    queries = []
    for _ in range(args.lookups):
        d = docs[int(rng.integers(len(docs)))]
        at = int(rng.integers(8, len(d)))
        queries.append(d[max(at - 32, 0):at])
    t0 = time.perf_counter()
    hits = 0
    for q in queries:
        cont, _ = idx.draft(q, 16)
        hits += bool(cont)
    t_lookup = time.perf_counter() - t0
    print(f"tokens indexed: {n} in {len(docs)} documents")
    print(f"index time: {1e6 * t_build / n:.2f} us per token loading all at once "
          f"({t_build:.2f} s), {1e6 * t_each / n:.2f} us per token one document at a time")
    print(f"memory: {mem / n:.0f} bytes per token ({mem / 2**20:.1f} MiB)")
    print(f"lookup + draft of up to 16 tokens: {1e6 * t_lookup / len(queries):.1f} us per step "
          f"({hits}/{len(queries)} matched)")


if __name__ == "__main__":
    main()
