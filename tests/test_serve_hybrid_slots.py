"""`tandem serve --parallel 4` on hybrid targets and MTP heads (issue 53): the tiny LFM2, the
tiny Qwen3.5 replica (gated delta-net layers, one attention layer in four, an MTP layer) and
the tiny MTP model take four slots; four streamed requests of mixed kinds (chat, JSON schema, tool call, /infill) sent
together each equal the same request alone under every strategy; a cancelled answer frees its
slot and the next request there answers as alone; a conversation evicted to the RAM cache
and continued answers as it does on a fresh server."""
from __future__ import annotations

import pytest

from engine_helpers import assert_same_as_plain
from serve_helpers import Server
from tandem.engine.backend.context_params import ContextParams
from tandem.engine.loop.speculative import GenParams
from tandem.engine.pair import PairSession, SessionOptions
from tandem.engine.slot_plan import SlotPlan
from tandem.serve.job_events import Cancelled, Done
from tandem.serve.scheduler import Scheduler
from test_serve_parallel import (LONG, REQUESTS, Job, assert_each_as_alone, at_once,
                                 prompt_of, streamed)


@pytest.fixture(scope="module")
def fim_hybrids(tmp_path_factory):
    """The tiny LFM2 and Qwen3.5 replica with the FIM pair's vocabulary (tokens for /infill),
    each with a draft: the same weights with the draft's noise (the replica's without its MTP
    layer, as tiny_qwen35_models writes its draft)."""
    from make_tiny_models import (DRAFT_NOISE, DRAFT_SEED, _printable_mask, add_noise,
                                  fim_vocab, write_gguf)
    from tiny_mtp_models import MTP_SEED, _glm4moe_hparams, glm4moe_mtp_weights
    from tiny_qwen35_models import QWEN35_SEED, TRUNK_LAYERS, _hparams, qwen35_weights
    from tiny_recurrent_models import HYBRID_SEED, _lfm2_hparams, lfm2_weights

    out = tmp_path_factory.mktemp("fim-hybrids")
    vocab = fim_vocab()
    printable = _printable_mask(vocab[0])
    lfm2 = lfm2_weights(len(vocab[0]), printable, HYBRID_SEED)
    qwen = qwen35_weights(len(vocab[0]), printable, QWEN35_SEED)
    trunk = {n: a for n, a in qwen.items() if not n.startswith(f"blk.{TRUNK_LAYERS}.")}
    mtp = glm4moe_mtp_weights(len(vocab[0]), printable, MTP_SEED)
    return {
        "mtp": write_gguf(out / "mtp.gguf", "glm4moe", "fim-mtp", mtp, vocab, _glm4moe_hparams),
        "lfm2": write_gguf(out / "lfm2.gguf", "lfm2", "fim-lfm2", lfm2, vocab, _lfm2_hparams),
        "lfm2_draft": write_gguf(out / "lfm2_draft.gguf", "lfm2", "fim-lfm2-draft",
                                 add_noise(lfm2, DRAFT_NOISE, DRAFT_SEED), vocab,
                                 _lfm2_hparams),
        "qwen35": write_gguf(out / "qwen35.gguf", "qwen35", "fim-qwen35", qwen, vocab,
                             _hparams(1)),
        "qwen35_draft": write_gguf(out / "qwen35_draft.gguf", "qwen35", "fim-qwen35-draft",
                                   add_noise(trunk, DRAFT_NOISE, DRAFT_SEED), vocab,
                                   _hparams(0)),
    }


@pytest.mark.parametrize("model,strategy", [
    ("lfm2", "auto"), ("lfm2", "ngram"), ("lfm2", "draft"),
    ("qwen35", "auto"), ("qwen35", "ngram"), ("qwen35", "draft"), ("qwen35", "mtp"),
    ("mtp", "auto"), ("mtp", "mtp"), ("mtp", "ngram")])
def test_four_mixed_streams_on_a_hybrid_each_equal_alone(fim_hybrids, model, strategy,
                                                         tmp_path):
    """(The tiny MTP model, an attention one, serves its heads in four slots too; auto with
    no draft model drafts with the heads where they pay.)"""
    draft = fim_hybrids.get(f"{model}_draft")  # (the MTP model has none)
    draft_args = ["-md", str(draft)] if draft is not None and strategy != "mtp" else []
    srv = Server(["-m", str(fim_hybrids[model]), *draft_args, "-t", "1", "--parallel", "4",
                  "--strategy", strategy, "--no-history", "-c", "1024"], tmp_path)
    try:
        status, props, _ = srv.raw("GET", "/props")
        assert status == 200 and props["total_slots"] == 4, props
        alone = [streamed(srv, p, b) for p, b in REQUESTS]
        assert all(pieces and ids for pieces, ids in alone)
        got = at_once(srv, 180)
        assert_each_as_alone(fim_hybrids[model], REQUESTS, alone, got)
        assert not any("one slot" in line for line in srv.log), srv.log
    finally:
        srv.stop()


PLAN = SlotPlan(2, kept=1)
CTX = ContextParams(n_ctx=1024, n_threads=1, n_threads_batch=1)


@pytest.fixture(scope="module", params=[("hybrid", "hybrid_draft", "draft"),
                                        ("qwen35", None, "mtp"), ("mtp", None, "mtp")],
                ids=["lfm2-draft", "qwen35-mtp", "mtp-mtp"])
def hybrid_pair(tiny_models, request):
    """A pair in three sequences (two slots + the kept one) and alone, with its strategy:
    the tiny LFM2 with its draft, the Qwen3.5 replica and the MTP model with their heads."""
    target, draft, strategy = request.param
    t, d = tiny_models[target], tiny_models[draft] if draft else None
    with PairSession(t, d, SessionOptions(strategy=strategy, sequences=PLAN.total,
                                          target_ctx=CTX)) as shared, \
            PairSession(t, d, SessionOptions(strategy=strategy, target_ctx=CTX)) as alone:
        yield shared, alone, strategy


def _alone(session, strategy, prompt, gen):
    scheduler = Scheduler(session, strategy=strategy, record=False)
    scheduler.start()
    try:
        job = Job(prompt, gen)
        scheduler.submit(job.job)
        assert isinstance(job.outcome, Done)
        return job.outcome.answer.generated
    finally:
        scheduler.stop()


def test_a_cancelled_hybrid_answer_frees_its_slot_for_one_that_answers_as_alone(hybrid_pair):
    shared, alone, strategy = hybrid_pair
    scheduler = Scheduler(shared, strategy=strategy, record=False, queue_size=1,
                          plan=PLAN)
    scheduler.start()
    try:
        a, b = (Job(prompt_of(shared, t), LONG) for t in ("first", "second"))
        scheduler.submit(a.job)
        assert a.started.wait(60)
        scheduler.submit(b.job)
        assert b.started.wait(60)
        gen = GenParams(max_tokens=24, ignore_eos=True)
        waiting = Job(prompt_of(shared, "third"), gen)
        scheduler.submit(waiting.job)
        a.job.cancel.set()  # mid-answer: its slot's state goes back from its own copies
        assert isinstance(a.outcome, Cancelled)
        assert isinstance(waiting.outcome, Done) and waiting.job.slot == a.job.slot
        third = prompt_of(shared, "third")
        assert_same_as_plain(alone.target, third, _alone(alone, strategy, third, gen),
                             waiting.outcome.answer.generated)
        b.job.cancel.set()
        assert isinstance(b.outcome, Cancelled)
    finally:
        scheduler.stop()


def test_a_hybrid_conversation_evicted_to_the_ram_cache_continues_as_on_a_fresh_server(
        hybrid_pair):
    """The RAM cache keeps a hybrid conversation's state: its next turn, in another slot,
    evaluates only what follows the state it put back, and answers as a fresh server."""
    shared, alone, strategy = hybrid_pair
    scheduler = Scheduler(shared, strategy=strategy, record=False, queue_size=4,
                          plan=PLAN, cache_ram_mib=64)
    scheduler.start()
    gen = GenParams(max_tokens=16)

    def chat(*turns):
        return shared.prompt_tokens([{"role": ("user", "assistant")[i % 2], "content": t}
                                     for i, t in enumerate(turns)])
    try:
        def turn(prompt):
            j = Job(prompt, gen)
            scheduler.submit(j.job)
            assert isinstance(j.outcome, Done)
            return j.outcome.answer

        a, b = "tell me about the sea " * 6, "a conversation about the mountains " * 6
        a1 = turn(chat(a))
        b1 = turn(chat(b))
        turn(chat(a, a1.text, "and more"))  # B's slot idle: emptied into the RAM cache
        turn(chat("yet another topic, the stars " * 6))
        figures = scheduler.prompt_cache.figures
        assert figures.kept >= 1
        nxt, restored = chat(b, b1.text, "go on"), figures.restored
        b2 = turn(nxt)
        assert figures.restored == restored + 1  # B's, from the cache
        assert b2.stats.n_prompt_eval <= b2.stats.n_prompt - len(chat(b)) + 1, b2.stats
    finally:
        scheduler.stop()
    assert_same_as_plain(alone.target, nxt, _alone(alone, strategy, nxt, gen), b2.generated)
