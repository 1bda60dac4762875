"""The backend's several-sequence decode (Context.decode_batch, seq_rm): rows of several
sequences in one llama_decode, each sequence's logits those it gets alone, each rolled back
on its own; a context of one sequence is made as before."""
from __future__ import annotations

import numpy as np
import pytest

from tandem.engine.backend.context_params import ALL, LAST, NONE
from tandem.engine.backend.llama import Context, ContextParams, Model

PROMPTS = {0: [5, 17, 99, 3, 42, 7], 1: [8, 8, 8, 120, 64], 2: [200, 2, 41, 41, 9, 10, 11]}
STEP = {0: [12, 13], 1: [77], 2: [4, 5, 6]}
# How far a row's logits may move with its batch's shape: up to 2.4e-3 here on an AVX-512 host
# (2026-12-04, AMD EPYC; under 1e-3 on earlier hosts). A row that read another sequence's
# cells (sequence 0's prompt before sequence 1's or 2's) moves by 10.6 to 11.2.
ATOL = 1e-2


@pytest.fixture(scope="module")
def model(tiny_models):
    m = Model(tiny_models["target"])
    yield m
    m.close()


def alone(model, tokens) -> np.ndarray:
    """Every row's logits of `tokens`' last len(STEP) rows, decoded on their own."""
    ctx = Context(model, ContextParams(n_ctx=256, n_threads=1))
    try:
        return np.array(ctx.decode(tokens, all_logits=True))
    finally:
        ctx.close()


def test_rows_of_several_sequences_match_each_sequence_decoded_alone(model):
    ctx = Context(model, ContextParams(n_ctx=1024, n_threads=1, n_seq_max=4))
    try:
        assert ctx.n_seq_max == 4 and ctx.n_ctx_seq * 4 <= ctx.n_ctx
        last = np.array(ctx.decode_batch([(s, 0, p, LAST) for s, p in PROMPTS.items()]))
        assert last.shape == (3, model.n_vocab)
        rows = np.array(ctx.decode_batch([(s, len(PROMPTS[s]), STEP[s], ALL) for s in STEP]))
        assert rows.shape == (sum(map(len, STEP.values())), model.n_vocab)
        at = 0
        for seq, step in STEP.items():
            want = alone(model, PROMPTS[seq] + step)
            np.testing.assert_allclose(last[seq], want[len(PROMPTS[seq]) - 1], atol=ATOL)
            np.testing.assert_allclose(rows[at:at + len(step)], want[len(PROMPTS[seq]):],
                                       atol=ATOL)
            at += len(step)
        # one sequence rolled back and decoded again; the others keep what they hold
        ctx.seq_rm(2, len(PROMPTS[2]))
        again = np.array(ctx.decode_batch([(2, len(PROMPTS[2]), STEP[2][:1], ALL),
                                           (1, len(PROMPTS[1]) + 1, [78], ALL)]))
        np.testing.assert_allclose(again[0], alone(model, PROMPTS[2] + STEP[2][:1])[-1],
                                   atol=ATOL)
        np.testing.assert_allclose(again[1], alone(model, PROMPTS[1] + STEP[1] + [78])[-1],
                                   atol=ATOL)
        # a prompt chunk asks for no rows
        assert ctx.decode_batch([(3, 0, [1, 2, 3], NONE)]).shape[0] == 0
    finally:
        ctx.close()


def test_bad_sequence_ids_and_batches_are_refused_before_decoding(model):
    ctx = Context(model, ContextParams(n_ctx=512, n_threads=1, n_seq_max=2))
    try:
        with pytest.raises(ValueError, match="ids go from 0 to 1"):
            ctx.decode_batch([(2, 0, [1], ALL)])
        with pytest.raises(ValueError, match="at least one token"):
            ctx.decode_batch([(0, 0, [1], ALL), (1, 0, [], ALL)])
        with pytest.raises(ValueError, match="ids go from 0 to 1"):  # after a good entry
            ctx.decode_batch([(1, 0, [7, 8], ALL), (5, 0, [1], ALL)])
        with pytest.raises(ValueError, match="n_batch"):
            ctx.decode_batch([(1, 0, [7] * (ctx.n_batch + 1), NONE)])
        assert ctx.n_decoded == 0
        # the refusals left the batch's sequence ids as they were: this decode is sequence
        # 0's, so sequence 1 still starts at position 0
        assert ctx.decode([9]).shape == (1, model.n_vocab) and ctx.tokens == [9]
        row = np.array(ctx.decode_batch([(1, 0, [7, 8], LAST)]))
        np.testing.assert_allclose(row[0], alone(model, [7, 8])[-1], atol=ATOL)
    finally:
        ctx.close()


def test_one_sequence_is_the_default_and_keeps_cost_file_names(model):
    params = ContextParams(n_ctx=256, n_threads=1)
    assert "n_seq_max" not in repr(params)  # pricing.py names cost files by this repr
    ctx = Context(model, params)
    try:
        assert ctx.n_seq_max == 1 and ctx.n_ctx_seq == ctx.n_ctx
    finally:
        ctx.close()
