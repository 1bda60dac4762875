"""What describes a llama.cpp context, without llama.cpp: its parameters (ContextParams),
exact mode's changes to them, the logits-row limits, and the token-prefix comparison the
contexts and the loop share. engine/backend/llama.py builds contexts from these; everything that only
names or compares them imports this module, so it loads without the compiled binding."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

from tandem.config.schema import FIELDS_BY_KEY, MAX_DRAFT
from tandem.engine.backend.memory import MAX_COPIES

if TYPE_CHECKING:
    from tandem.engine.backend.decode_requests import Steps

# Rows of logits one decode may ask for: a verify batch of up to 64 drafts + the last token.
# llama.cpp reserves compute memory for n_outputs_max rows (default: n_batch, ~300 MiB with
# a 152k vocabulary); capping it keeps the reservation to what verification can use.
MAX_OUTPUTS = MAX_DRAFT + 1

# Largest batch whose logits equal single-token decoding's bit for bit on llama.cpp's CPU
# kernels (unrepacked weights, flash attention, q8_0 KV): measured identical for 1..7 rows,
# up to 0.57 apart from 8 rows on. In exact mode, verify batches of a target with any layer
# on the CPU stay within it (drafts <= 6). GPU kernels were not measured here: a target fully
# on the GPU keeps the profile's draft length, and the run's notes say exactness is unverified.
EXACT_BATCH = 7

# Tokens of a verify batch a hybrid model's context can undo from llama.cpp's snapshots
# (n_rs_seq; each costs one more copy of the recurrent state): auto's longest drafts (16
# tokens, costs.MAX_BATCH - 1); the session asks for more when --draft-max does.
ROLLBACK_TOKENS = 16

# Which rows of one sequence's tokens in a batch want logits (Context.decode_batch): none (a
# prompt chunk), the last (a draft model's step) or every one (a verify batch)
NONE, LAST, ALL = 0, 1, 2


@dataclass(frozen=True)
class ContextParams:
    # the settings' defaults (config.schema), whoever builds a context without Settings
    n_ctx: int = FIELDS_BY_KEY["n_ctx"].default
    n_batch: int = FIELDS_BY_KEY["n_batch"].default
    n_ubatch: int = FIELDS_BY_KEY["n_ubatch"].default
    n_threads: int = FIELDS_BY_KEY["n_threads"].default  # 0: all physical cores
    n_threads_batch: int = FIELDS_BY_KEY["n_threads_batch"].default
    # "on" keeps batched and single-token attention identical on CPU
    flash_attn: str = FIELDS_BY_KEY["flash_attn"].default
    type_k: str = FIELDS_BY_KEY["type_k"].default
    type_v: str = FIELDS_BY_KEY["type_v"].default
    n_outputs_max: int = MAX_OUTPUTS
    # exact mode: verify batches stay within EXACT_BATCH rows on CPU kernels (see above)
    exact: bool = False
    # sequences one context holds (Context.decode_batch); out of repr, which names cost
    # files: every context that is costed holds one
    n_seq_max: int = field(default=1, repr=False)
    # one KV cache all sequences share (llama-server's default with several slots): the
    # session sizes it for every slot (engine/backend/sequences.py); out of repr
    kv_unified: bool = field(default=False, repr=False)
    # the snapshots a hybrid model's context keeps (ROLLBACK_TOKENS); out of repr, which
    # names cost files: the timings do not depend on it
    rollback: int = field(default=ROLLBACK_TOKENS, repr=False)
    # saved copies of a hybrid or recurrent model's state (--ctx-checkpoints); out of repr
    checkpoints: int = field(default=MAX_COPIES, repr=False)


def exact_context(ctx: ContextParams) -> ContextParams:
    """What exact mode needs of the target's context on llama.cpp's CPU kernels: flash
    attention on (without it, 2+ rows take other matmul kernels) and a q8_0 KV cache (with
    f16, single-token flash attention switches to a split-KV kernel at 512 cached tokens);
    verify batches then stay within EXACT_BATCH rows."""
    return replace(ctx, flash_attn="on", type_k="q8_0", type_v="q8_0", exact=True)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share.

    Slices are compared in C: the whole shorter length first (a cache and the tokens that
    extend it), else a binary search for the first difference (a draft cache after a
    rejection), never a Python loop over the whole context, which would run every step."""
    a = a if type(a) is list else list(a)
    b = b if type(b) is list else list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], and the first difference is below hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def prefill_in_chunks(ctx, tokens: Sequence[int], decode_chunk,
                      progress=None) -> Steps[int]:
    """Make `ctx` (a Context, or one sequence of a shared one) hold exactly `tokens`: moved
    runs (ctx.reuse) and the common prefix kept, the rest decoded n_batch tokens at a time
    by `decode_chunk(chunk)` (steps: engine/backend/decode_requests.py); returns how many
    tokens ctx evaluated (ctx.n_decoded's growth)."""
    before = ctx.n_decoded
    ctx.reuse(tokens)
    keep = common_prefix(ctx.tokens, tokens)
    ctx.truncate(keep)
    todo = list(tokens[keep:])
    for start in range(0, len(todo), ctx.n_batch):
        chunk = todo[start:start + ctx.n_batch]
        yield from decode_chunk(chunk)
        if progress is not None:
            progress(start + len(chunk), len(todo))
    return ctx.n_decoded - before


def default_threads() -> int:
    """llama.cpp's thread count when none is given: every core."""
    return max(1, os.cpu_count() or 1)
