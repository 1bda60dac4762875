"""The target's own MTP heads as a draft source (issue 42), on the tiny glm4moe model whose
head copies its trunk's last layer (scripts/tiny_mtp_models.py): greedy output equal to plain
decoding (exact mode bit for bit), drafts accepted, the distribution kept at T > 0, and the
refusals: a model without heads, a library without the staging calls."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from engine_helpers import assert_same_first_tokens, run, sampled_first_tokens, session_done  # noqa: E402
from tandem.engine.backend import llama as backend  # noqa: E402
from tandem.engine.backend import model as model_module  # noqa: E402
from tandem.engine.backend import mtp as heads  # noqa: E402
from tandem.engine.backend.context_params import ContextParams  # noqa: E402
from tandem.engine.backend.llama import Context, Model  # noqa: E402
from tandem.engine.backend.mtp import use_mtp  # noqa: E402
from tandem.engine.drafting.drafters import DraftParams, NoDrafter  # noqa: E402
from tandem.engine.drafting.mtp import MtpDrafter  # noqa: E402
from tandem.errors import ModelError  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model(tiny_models):
    m = Model(tiny_models["mtp"], load_mtp=True)
    yield m
    m.close()


def ctx(model, **kw):
    return Context(model, ContextParams(n_ctx=512, n_threads=1, **kw))


def test_the_model_has_one_head_loaded(model, tiny_models):
    assert model.n_layer_nextn == 1 and model.mtp_loaded
    assert model.n_layer == 2  # the trunk: llama.cpp counts the nextn block apart
    plain = Model(tiny_models["mtp"])  # without load_mtp: no head to draft with
    assert plain.n_layer_nextn == 1 and not plain.mtp_loaded
    plain.close()


def test_the_memory_plan_counts_the_heads_block(tiny_models):
    """block_count counts the nextn block: its weights and one layer of KV (the heads'
    context's) are planned with the trunk's."""
    from tandem.machine.fit import model_shape

    shape = model_shape(tiny_models["mtp"])
    assert shape.n_layer == 3 and len(shape.layer_bytes) == 3 and all(shape.n_head_kv)


def test_the_staging_calls_are_the_bindings_own():
    """llama_cpp.llama_cpp_ext binds the hidden-row calls by their plain, Itanium and MSVC
    names; tandem spells no mangled name of its own."""
    import re
    from pathlib import Path

    from llama_cpp import llama_cpp_ext

    assert heads.staging_calls() is llama_cpp_ext
    pkg = Path(heads.__file__).parents[2]
    mangled = [(p.name, m) for p in pkg.rglob("*.py")
               for m in re.findall(r"\b_Z\d+\w+", p.read_text(encoding="utf-8"))]
    assert mangled == [], mangled


def test_greedy_mtp_equals_plain_and_its_drafts_are_accepted(model):
    c = ctx(model)
    prompt = model.tokenize(PROMPT, add_special=True)
    plain, _ = run(c, prompt, NoDrafter(), max_tokens=80, ignore_eos=True)
    head = use_mtp(c, True)
    drafter = MtpDrafter(head, DraftParams(n_max=4, n_min=0, p_min=0.0))
    spec, steps = run(c, prompt, drafter, max_tokens=80, ignore_eos=True)
    assert spec.tokens == plain.tokens
    # the head copies the trunk's last layer: most of its drafts are the target's tokens
    assert spec.stats.drafted > 40 and spec.stats.accepted > spec.stats.drafted // 2, spec.stats
    assert head.n == len(c.tokens)  # the head's cache follows the target's
    # a second answer on the same context (the prompt's prefix reused, the rest rolled back)
    again, _ = run(c, prompt, drafter, max_tokens=80, ignore_eos=True)
    assert again.tokens == plain.tokens and again.stats.accepted == spec.stats.accepted
    c.close()


def test_a_head_that_missed_decodes_brings_the_target_back(model):
    """Off, the target decodes without it; on again, the target goes back to where the head
    stopped (the next prompt re-reads the rest) and the drafts are as before."""
    c = ctx(model)
    prompt = model.tokenize(PROMPT, add_special=True)
    head = use_mtp(c, True)
    drafter = MtpDrafter(head, DraftParams(n_max=4, n_min=0, p_min=0.0))
    first, _ = run(c, prompt, drafter, max_tokens=40, ignore_eos=True)
    held = head.n
    assert use_mtp(c, False) is None
    run(c, prompt + list(first.tokens), NoDrafter(), max_tokens=20, ignore_eos=True)
    assert len(c.tokens) > held == head.n
    assert use_mtp(c, True) is head and len(c.tokens) == held
    again, _ = run(c, prompt, drafter, max_tokens=40, ignore_eos=True)
    assert again.tokens == first.tokens and again.stats.accepted == first.stats.accepted
    c.close()


class Recorder:
    """A follower of a Context's decodes that notes what it is told."""

    following = True

    def __init__(self):
        self.calls = []

    def decoded(self, tokens, pos0):
        self.calls.append(("decoded", list(tokens), pos0))

    def truncated(self, n):
        self.calls.append(("truncated", n))

    def set_threads(self, n):
        self.calls.append(("threads", n))

    def close(self):
        self.calls.append(("close",))


def test_a_follower_hears_every_decode_rollback_and_thread_count(tiny_models):
    """Context's one hook for what follows its decodes (the head is one): each llama_decode's
    tokens at their positions while it follows (a long batch chunk by chunk), every
    rollback, the thread count, closed first; off, rollbacks only, and cache reuse runs
    again, telling it where the moved positions start."""
    m = Model(tiny_models["target"])
    c = Context(m, ContextParams(n_ctx=256, n_batch=8, n_threads=1))
    rec = c.follower = Recorder()
    prompt = list(range(10, 30))
    c.decode(prompt)
    assert rec.calls == [("decoded", prompt[:8], 0), ("decoded", prompt[8:16], 8),
                         ("decoded", prompt[16:], 16)]
    c.truncate(12)
    c.set_threads(2)
    c.reuse_min = 4
    assert c.reuse(prompt[:3] + prompt[5:12]) == 0  # no moved runs while it follows
    rec.following = False
    c.decode([7])
    assert rec.calls[3:] == [("truncated", 12), ("threads", 2)]
    assert c.reuse(prompt[:3] + prompt[5:12]) == 7  # prompt[5:12] moved to position 3
    assert rec.calls[5:] == [("truncated", 3)] and c.tokens == prompt[:3] + prompt[5:12]
    c.close()
    assert rec.calls[-1] == ("close",) and c.follower is None
    m.close()


def test_sampled_mtp_drafts_keep_the_targets_distribution(model):
    """Positions 0 and 1 at T=1 with top-k 8, plain against mtp (independent seeds),
    chi-square per position; 1500 samples a side."""
    c = ctx(model)
    prompt = model.tokenize(PROMPT, add_special=True)
    n = 1500
    plain, _, _ = sampled_first_tokens(c, prompt, NoDrafter(), range(n))
    drafter = MtpDrafter(use_mtp(c, True), DraftParams(n_max=4, n_min=0, p_min=0.0))
    spec, drafted, rejected = sampled_first_tokens(c, prompt, drafter, range(10**6, 10**6 + n))
    assert drafted >= 2 * n and rejected > n // 10, (drafted, rejected)
    assert_same_first_tokens(plain, spec, "mtp")
    c.close()


def test_a_library_without_the_staging_calls_is_a_clear_error(monkeypatch, tiny_models):
    """No crash: with a libllama that lacks one of the calls (llama_cpp_ext then fails to
    import), --strategy mtp fails with the version and a hint before the model loads, and so
    does a head asked of a model loaded with its heads, before any MTP context exists; a
    binding without llama_cpp_ext is the same error."""
    from types import SimpleNamespace

    import llama_cpp.llama_cpp as binding
    from tandem.engine.pair import PairSession, SessionOptions

    monkeypatch.setattr(heads, "_ext", None)
    monkeypatch.delitem(sys.modules, "llama_cpp.llama_cpp_ext", raising=False)  # imported again:
    monkeypatch.setattr(binding, "_lib", SimpleNamespace())  # a library exporting none
    with pytest.raises(ModelError) as err:
        PairSession(tiny_models["mtp"], None, SessionOptions(strategy="mtp"))
    assert backend.LLAMA_CPP_VERSION in err.value.message
    assert "llama_set_embeddings_nextn" in err.value.message and err.value.hint
    monkeypatch.undo()  # the real library again: the model loads with its heads
    m = Model(tiny_models["mtp"], load_mtp=True)
    c = ctx(m)
    monkeypatch.setattr(heads, "_ext", None)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp_ext", None)  # no such module
    with pytest.raises(ModelError, match="staging calls"):
        use_mtp(c, True)
    assert c.follower is None
    c.close()
    m.close()


# ----- the command line


@pytest.fixture(scope="module")
def mtp_cli(tiny_models, tmp_path_factory):
    """`tandem run --json -m MODEL` (the target alone); returns (answer, stats, stderr)."""
    base = tmp_path_factory.mktemp("mtp-cli")

    def go(*args, strategy: str, model: str = "mtp", rc: int = 0):
        env = {**os.environ, "TANDEM_HOME": str(base / strategy), "NO_COLOR": "1"}
        cmd = [sys.executable, "-m", "tandem", "run", "-m", str(tiny_models[model]),
               "--strategy", strategy, "-n", "80", "--temp", "0", "--draft-p-min", "0",
               "--draft-max", "4", "-t", "1", "--json", "--no-history", *args, PROMPT]
        res = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
        assert res.returncode == rc, res.stderr.decode()
        if rc:
            return None, None, res.stderr.decode()
        out = json.loads(res.stdout)
        return out["text"], out["stats"], res.stderr.decode()

    return go


@pytest.mark.parametrize("mode", [(), ("--exact",)], ids=["fast", "exact"])
def test_tandem_run_mtp_and_auto_equal_none(mtp_cli, mode):
    plain, _, _ = mtp_cli(*mode, strategy="none")
    answer, stats, _ = mtp_cli(*mode, strategy="mtp")
    assert answer == plain
    assert stats["strategy"] == "mtp" and stats["accepted"] > 0, stats
    answer, stats, _ = mtp_cli(*mode, strategy="auto")  # its heads loaded: off, they cost a step
    assert answer == plain and stats["strategy"] == "auto", stats


def test_mtp_on_a_model_without_heads_is_a_usage_error_with_a_hint(mtp_cli):
    _, _, err = mtp_cli(strategy="mtp", model="target", rc=2)
    assert "Error: strategy 'mtp' needs a model with MTP heads" in err
    assert "target.gguf has none" in err and "Hint:" in err and "Traceback" not in err


def test_the_head_reads_the_targets_hidden_rows(model):
    """The rows the engine carries to the head matter: with them zeroed the head's first
    draft token differs somewhere (its weights mix HEAD_H_GAIN of the row in)."""
    c = ctx(model)
    head = use_mtp(c, True)
    tokens = model.tokenize(PROMPT, add_special=True)
    c.prefill(tokens[:-1])
    real = head.start(tokens[-1])
    head.end()
    head._pending = np.zeros_like(head._pending)
    zeroed = head.start(tokens[-1])
    head.end()
    assert not np.array_equal(real, zeroed)
    c.close()


# ----- through PairSession: the target alone, strategies switched, a grammar's forced tokens


@pytest.fixture(scope="module")
def session(tiny_models):
    from tandem.engine.backend.llama import exact_context
    from tandem.engine.pair import PairSession, SessionOptions

    opts = SessionOptions(strategy="mtp", draft=DraftParams(n_max=4, n_min=0, p_min=0.0),
                          target_ctx=exact_context(ContextParams(n_ctx=512, n_threads=1)),
                          repack=False)
    with PairSession(tiny_models["mtp"], None, opts) as s:
        s.pricing.keep_knowledge = False
        yield s


def test_the_session_switches_between_mtp_and_plain_and_keeps_the_output(session):
    from tandem.engine.loop.speculative import GenParams

    gen = GenParams(max_tokens=60, ignore_eos=True)
    prompt = session.tokenize(PROMPT, add_special=True)
    plain = session_done(session, prompt, gen, "none")
    spec = session_done(session, prompt, gen, "mtp")
    again = session_done(session, prompt, gen, "none")  # the heads stop following: plain costs
    assert spec.tokens == plain.tokens == again.tokens and spec.stats.accepted > 0
    assert not session.target_ctx.follower.following
    for strategy in ("ngram", "auto"):  # the other target-alone strategies still run
        assert session_done(session, prompt, gen, strategy).tokens == plain.tokens, strategy


def test_a_grammars_forced_tokens_go_first_and_the_head_drafts_after_them(session):
    from tandem.engine.constrain.grammar import Constraint
    from tandem.engine.loop.speculative import GenParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "maxItems": 3,
                                                        "items": {"type": "string",
                                                                  "maxLength": 6}}},
              "required": ["name", "tags"], "additionalProperties": False}
    gen = GenParams(max_tokens=80, constraint=Constraint("json_schema", json.dumps(schema)))
    prompt = session.tokenize(PROMPT, add_special=True)
    plain = session_done(session, prompt, gen, "none")
    spec = session_done(session, prompt, gen, "mtp")
    assert spec.tokens == plain.tokens and plain.complete
    json.loads(spec.text)
    forced = spec.stats.by_source.get("grammar", [0, 0])
    assert forced[0] > 0  # the keys came as free drafts
    assert spec.stats.accepted > forced[1], spec.stats  # and the head's drafts after them
    assert spec.stats.n_steps < plain.stats.n_steps


def test_auto_drafts_with_the_heads_where_they_pay_and_keeps_the_output(session, monkeypatch):
    """auto on a target with heads and no draft model: the heads are its model source, priced
    by a head step measured when auto starts; where they do not pay (this tiny model's head
    costs a whole target step) they are off and stop following the target; where the costs
    say they pay (made so here: a real model's head is one layer of many) they draft. Greedy
    output equal to plain either way."""
    from tandem.engine.drafting import auto
    from tandem.engine.loop.speculative import GenParams

    gen = GenParams(max_tokens=60, ignore_eos=True)
    prompt = session.tokenize(PROMPT, add_special=True)
    plain = session_done(session, prompt, gen, "none")
    off = session_done(session, prompt, gen, "auto")
    assert off.tokens == plain.tokens
    assert any(n.startswith("MTP heads off:") for n in off.stats.notes), off.stats.notes
    assert not session.target_ctx.follower.following
    assert session.costs(True).draft_token > 0  # a head step, measured
    monkeypatch.setattr(auto, "model_draft_gain", lambda costs, n_max, accept: 2.0)
    for costs in (session.costs(False), session.costs(True)):  # and a draft step cheap
        monkeypatch.setattr(costs, "draft_token", 1e-7)
    drafter = session.drafter("auto")
    drafter.budget.balance = 1.0  # as if earned: the first model draft is a probe paid from it
    on, _ = run(session.target_ctx, prompt, drafter, max_tokens=60, ignore_eos=True)
    assert on.tokens == plain.tokens
    assert on.stats.by_source.get("model", [0, 0])[0] > 0, (on.stats.by_source,
                                                            on.stats.notes)
    assert session.target_ctx.follower.following


def test_spec_bench_has_an_mtp_row_equal_to_plain(tiny_models, tmp_path):
    """spec-bench --strategies mtp on the target alone: its heads loaded for the mtp row, plain
    decoding measured without them following; greedy output equal to plain on every prompt."""
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "tandem", "spec-bench", "-m", str(tiny_models["mtp"]), "-t", "1",
           "--strategies", "mtp", "--quick", "--category", "code", "-n", "24", "--no-cost-curve",
           "--json"]
    res = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    plain = {r["prompt_id"]: r["tokens"] for r in doc["runs"] if r["config"] == "plain"}
    runs = [r for r in doc["runs"] if r["config"] == "mtp"]
    assert runs and all(r["tokens"] == plain[r["prompt_id"]] for r in runs), runs
    assert sum(r["accepted"] for r in runs) > 0


def test_tandem_hw_names_the_heads(tiny_models, tmp_path):
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    base = [sys.executable, "-m", "tandem", "hw", "-m"]
    res = subprocess.run(base + [str(tiny_models["mtp"]), "--json"], capture_output=True,
                         env=env, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    assert json.loads(res.stdout)["memory"]["target"]["mtp_heads"] == 1
    res = subprocess.run(base + [str(tiny_models["target"]), "--json"], capture_output=True,
                         env=env, timeout=120)
    assert json.loads(res.stdout)["memory"]["target"]["mtp_heads"] == 0


def test_heads_of_an_architecture_llama_cpp_does_not_run_are_refused(tiny_models, monkeypatch):
    """nextn layers that llama.cpp keeps unused (glm4's dense models): no MTP context (its
    graph would be the trunk's: an abort), a usage error instead."""
    from tandem.engine.pair import PairSession, SessionOptions
    from tandem.errors import UsageError

    monkeypatch.setattr(model_module, "MTP_ARCHS", frozenset({"qwen35"}))
    with pytest.raises(UsageError, match=r"runs no MTP head for its architecture \(glm4moe\)"):
        PairSession(tiny_models["mtp"], None, SessionOptions(strategy="mtp"))
    m = Model(tiny_models["mtp"], load_mtp=True)
    assert m.n_layer_nextn == 1 and not m.mtp_loaded
    m.close()


@pytest.fixture(scope="module")
def echo_model(tmp_path_factory):
    """The tiny MTP model with a head that only echoes the row it is given: eh_proj takes the
    hidden row alone, the head's layer adds nothing, so its logits are the output layer's on
    that row: the target's own logits at the row's position (the rows are after the output
    norm). Whichever row the engine carries to the head, the head names it."""
    from make_tiny_models import N_EMBD, _printable_mask, spm_vocab, write_gguf
    from tiny_mtp_models import MTP_SEED, TRUNK_LAYERS, _glm4moe_hparams, glm4moe_mtp_weights

    vocab = spm_vocab()
    w = glm4moe_mtp_weights(len(vocab[0]), _printable_mask(vocab[0]), MTP_SEED)
    p = f"blk.{TRUNK_LAYERS}."
    w[p + "nextn.eh_proj.weight"] = np.concatenate(
        [np.zeros((N_EMBD, N_EMBD)), np.eye(N_EMBD)], axis=1).astype(np.float32)
    for name in ("attn_output.weight", "ffn_down_shexp.weight"):
        w[p + name] = np.zeros_like(w[p + name])
    path = write_gguf(tmp_path_factory.mktemp("echo") / "echo.gguf", "glm4moe", "tiny-echo", w,
                      vocab, _glm4moe_hparams)
    m = Model(path, load_mtp=True)
    yield m
    m.close()


def test_the_head_gets_the_targets_row_of_the_position_before(echo_model):
    """After the prompt, the pending row is the target's at the last cached position; after
    a verify batch rolled back to the accepted drafts, the row of the last one kept (llama.cpp's
    accept()). The echo head's first draft is the target's argmax there."""
    m = echo_model
    c = ctx(m)
    head = use_mtp(c, True)
    tokens = m.tokenize(PROMPT, add_special=True)
    rows = np.array(c.decode(tokens[:-1], all_logits=True))
    assert int(np.argmax(head.start(tokens[-1]))) == int(np.argmax(rows[-1]))
    head.end()
    batch = [tokens[-1], 70, 71, 72]  # a verify batch, then two of its drafts rejected
    rows = np.array(c.decode(batch, all_logits=True))
    c.truncate(len(tokens) + 1)  # kept: the last prompt token and the first draft (70)
    assert head.n == len(c.tokens) == len(tokens) + 1
    assert int(np.argmax(head.start(99))) == int(np.argmax(rows[1]))
    head.end()
    c.close()
