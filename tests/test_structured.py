"""Structured outputs (issue 30): generate() under a grammar is lossless (greedy: the same
tokens as plain constrained decoding for every strategy; T > 0: the same distribution),
drafts the grammar refuses are cut before verification, forced tokens are free drafts that
count as drafted and accepted, and every bad grammar input ends in Error:/Hint:."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("llguidance")

from engine_helpers import auto_drafter, draft_model, hybrid, ngram_drafter, run  # noqa: E402
from scripted import FakeClock, ScriptedContext, ScriptedModel, logits_of  # noqa: E402
from tandem.engine.constrain.grammar import Constraint, GrammarError, GrammarState  # noqa: E402
from tandem.engine.drafting.drafters import (  # noqa: E402
    NoDrafter,
)
from tandem.engine.loop.sampling import SamplingParams, distribution  # noqa: E402
from tandem.errors import EXIT_OK, EXIT_USAGE  # noqa: E402

# a scripted vocabulary: five letters and an end token; the grammar allows a|b|c, then b|c|d,
# then "x", so the target's favourite first token (d) and the draft's are refused
PIECES = [b"a", b"b", b"c", b"d", b"x", b""]
V, EOS = len(PIECES), 5
GBNF = 'root ::= [abc] [bcd] "x"'
FIRST, SECOND = {0, 1, 2}, {1, 2, 3}


def _target_fn(prefix):
    if len(prefix) == 1:
        return logits_of([0.3, 0.2, 0.1, 0.4], V)  # d most likely, refused by the grammar
    if len(prefix) == 2:
        return logits_of([0.5, 0.2, 0.1, 0.2] if prefix[1] == 0 else [0.1, 0.3, 0.3, 0.3], V)
    return logits_of([0.1, 0.1, 0.1, 0.1, 0.6], V)


def _draft_fn(prefix):
    if len(prefix) == 1:
        return logits_of([0.2, 0.2, 0.1, 0.5], V)  # often drafts the refused d
    return logits_of([0.4, 0.3, 0.2, 0.1], V)


def _masked(logits, allowed):
    out = np.full_like(logits, -np.inf)
    idx = sorted(allowed)
    out[idx] = logits[idx]
    return out


def _expected(sp):
    """Plain constrained sampling's distribution of the first two tokens."""
    out = {}
    p0 = distribution(_masked(_target_fn([EOS]), FIRST), [], sp)
    for a in FIRST:
        p1 = distribution(_masked(_target_fn([EOS, a]), SECOND), [], sp)
        for b in SECOND:
            if p0.prob(a) * p1.prob(b) > 0:
                out[(a, b)] = p0.prob(a) * p1.prob(b)
    return out


def _scripted(clock):
    model = ScriptedModel(V, PIECES, eog=[EOS])
    tctx = ScriptedContext(model, _target_fn, clock=clock, cost=lambda n: 0.1)
    dctx = ScriptedContext(model, _draft_fn, clock=clock, cost=lambda n: 0.001)
    return model, tctx, dctx


def _drafter(kind, dctx):
    if kind == "none":
        return NoDrafter()
    model = draft_model(dctx, n_max=3)
    return model if kind == "draft" else hybrid(model, n_max=3)


@pytest.mark.parametrize("kind", ["draft", "hybrid"])
def test_sampled_drafts_under_a_grammar_keep_the_masked_distribution(kind, monkeypatch):
    """Drafts drawn from the unmasked q, cut where the grammar refuses them and verified
    against the masked target with q conditioned on the mask: plain constrained sampling's
    distribution (chi-square over 2000 seeds)."""
    from scipy.stats import chisquare

    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    sp = SamplingParams(temperature=1.0, top_k=0)
    samples, drafted = [], 0
    for seed in range(2000):
        model, tctx, dctx = _scripted(clock)
        done, _ = run(tctx, [EOS], _drafter(kind, dctx), max_tokens=3,
                      sampling=SamplingParams(temperature=1.0, top_k=0, seed=seed),
                      constraint=Constraint("gbnf", GBNF))
        samples.append(tuple(done.tokens[:2]))
        drafted += done.stats.drafted
    assert drafted > 1000  # drafts were verified, not all cut
    expected = _expected(sp)
    keys = sorted(expected)
    counts = {k: samples.count(k) for k in keys}
    assert sum(counts.values()) == len(samples), "a token the grammar refuses was emitted"
    obs = np.array([counts[k] for k in keys], dtype=float)
    exp = np.array([expected[k] for k in keys]) * len(samples)
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 0.01, (counts, expected)


@pytest.mark.parametrize("kind", ["draft", "hybrid"])
def test_greedy_under_a_grammar_equals_plain_and_refused_drafts_are_never_verified(kind):
    clock = FakeClock()
    model, tctx, dctx = _scripted(clock)
    plain, _ = run(tctx, [EOS], NoDrafter(), max_tokens=5, constraint=Constraint("gbnf", GBNF))
    model, tctx, dctx = _scripted(clock)
    spec, steps = run(tctx, [EOS], _drafter(kind, dctx), max_tokens=5,
                      constraint=Constraint("gbnf", GBNF))
    assert spec.tokens == plain.tokens == (0, 1, 4)  # a (d refused), then b, then x
    assert spec.complete is True and spec.reason == "eos"
    # the draft model's first proposal starts with the refused d: cut to nothing
    assert steps[0].drafted == 0


def test_forced_tokens_are_free_drafts_counted_as_drafted_and_accepted():
    clock = FakeClock()
    model, tctx, dctx = _scripted(clock)
    grammar = Constraint("gbnf", 'root ::= "abcx" [ab]')
    spec, steps = run(tctx, [EOS], ngram_drafter(n_max=3), max_tokens=8, constraint=grammar)
    assert spec.tokens[:4] == (0, 1, 2, 4)
    first = steps[0]
    # all four forced tokens in one step: free drafts are bounded by the verify batch and
    # the room left, not by the drafter's n_max (3)
    assert first.sources == (("grammar", 4, 4),) and first.drafted == first.accepted == 4
    assert spec.stats.by_source["grammar"][0] == spec.stats.by_source["grammar"][1] >= 4
    assert spec.stats.accepted == spec.stats.drafted
    model, tctx, dctx = _scripted(clock)
    plain, plain_steps = run(tctx, [EOS], NoDrafter(), max_tokens=8, constraint=grammar)
    assert plain.tokens == spec.tokens and plain.stats.drafted == 0  # none drafts nothing
    assert len(plain_steps) > len(steps)


def _abcd(prefix):
    # after the prompt: a, b, c, d, then x (the scripted target and a perfect draft)
    return logits_of([0.6 if i == len(prefix) - 1 else 0.1 for i in range(5)], V)


@pytest.mark.parametrize("kind", ["draft", "hybrid"])
def test_the_drafter_continues_the_forced_tokens_in_the_same_batch(kind):
    """The grammar forces "ab"; the drafter's c, d follow them in the one verify batch, and
    only they count as the drafter's (its sources, its acceptance)."""
    grammar = Constraint("gbnf", 'root ::= "ab" [abcd] [abcd] "x"')
    model = ScriptedModel(V, PIECES, eog=[EOS])
    clock = FakeClock()
    tctx = ScriptedContext(model, _abcd, clock=clock, cost=lambda n: 0.1)
    dctx = ScriptedContext(model, _abcd, clock=clock, cost=lambda n: 0.001)
    spec, steps = run(tctx, [EOS], _drafter(kind, dctx), max_tokens=8, constraint=grammar)
    plain, _ = run(ScriptedContext(model, _abcd), [EOS], NoDrafter(), max_tokens=8,
                   constraint=grammar)
    assert spec.tokens == plain.tokens == (0, 1, 2, 3, 4)
    first = steps[0]
    assert first.forced == 2 and first.drafted > 2 and first.accepted == first.drafted
    # the drafter's own tokens under its own sources, after the grammar's
    assert first.sources[0] == ("grammar", 2, 2) and len(first.sources) > 1
    assert {s for s, _, _ in first.sources[1:]} <= {"model", "prompt"}
    assert sum(d for _, d, _ in first.sources[1:]) == first.drafted - 2
    assert sum(a for _, _, a in first.sources[1:]) == first.accepted - 2
    assert spec.stats.by_source["grammar"] == [2, 2]


def test_a_drafter_learns_only_from_its_part_of_a_batch_that_began_with_forced_tokens():
    from tandem.engine.loop.events import StepEvent
    from tandem.engine.tuning.costs import CostModel

    auto = auto_drafter(None, CostModel({n: 0.1 for n in range(1, 18)}), n_max=4)
    sp, rng = SamplingParams(), np.random.default_rng(0)
    prompt = [9, 1, 2, 3, 4, 5, 9, 1, 2]
    auto.prefill(prompt)
    d = auto.propose(prompt + [3], 6, sp, rng, False)  # after a forced token 3: 4, 5, ...
    assert d.source == "prompt" and d.tokens[:2] == [4, 5]
    n = len(d.tokens)
    auto.observe(StepEvent(0, 1 + n, 1 + 1, 6, 0.0, 0.3, 0.0, forced=1))
    assert auto.step_sources == (("prompt", n, 1),)  # the forced token is not the prompt's
    # the time is the whole batch's (the forced token, the n drafts, the last token)
    assert auto.costs.verify[n + 2] == pytest.approx(0.14)
    assert auto.costs.verify[n + 1] == pytest.approx(0.1)


def test_an_output_cut_by_max_tokens_is_marked_incomplete():
    clock = FakeClock()
    model, tctx, dctx = _scripted(clock)
    done, _ = run(tctx, [EOS], NoDrafter(), max_tokens=2, constraint=Constraint("gbnf", GBNF))
    assert done.reason == "length" and done.complete is False
    free, _ = run(ScriptedContext(model, _target_fn), [EOS], NoDrafter(), max_tokens=2)
    assert free.complete is None  # no grammar, nothing to say


def test_grammar_state_commits_rolls_back_and_forces():
    model = ScriptedModel(V, PIECES, eog=[EOS])
    g = GrammarState(Constraint("gbnf", 'root ::= "ab" [cd] "x"'), model)
    assert g.forced() == [0, 1]
    assert g.valid_prefix([0, 1, 3, 0]) == 3
    g.commit(0)
    g.commit(1)
    assert list(np.nonzero(g.mask())[0]) == [2, 3]
    assert not g.allowed(0) and g.allowed(3)
    g.rollback(1)
    assert list(np.nonzero(g.mask())[0]) == [1]
    with pytest.raises(GrammarError):
        g.commit(4)


# ----------------------------------------------------------------------- tiny GGUF models

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "name": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"}},
    "required": ["id", "kind", "name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def exact_session(tiny_models):
    from tandem.engine.backend.llama import ContextParams, exact_context
    from tandem.engine.pair import PairSession, SessionOptions

    opts = SessionOptions(strategy="none", target_ctx=exact_context(
        ContextParams(n_ctx=512, n_threads=1)), repack=False)
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as s:
        s.pricing.keep_knowledge = False
        yield s


def _done(session, prompt, gen, strategy):
    from tandem.engine.loop.events import DoneEvent

    return [ev for ev in session.generate(prompt, gen, strategy=strategy, record=False)
            if isinstance(ev, DoneEvent)][0]


def test_greedy_json_schema_output_equals_plain_for_every_strategy_and_validates(exact_session):
    jsonschema = pytest.importorskip("jsonschema")
    from tandem.config.schema import STRATEGIES
    from tandem.engine.loop.speculative import GenParams

    gen = GenParams(max_tokens=80, constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    prompts = [[1, 30 + i, 31 + i, 32, 33] for i in range(3)]
    for prompt in prompts:
        plain = _done(exact_session, prompt, gen, "none")
        assert plain.complete, plain.text
        jsonschema.validate(json.loads(plain.text), SCHEMA)
        for strategy in STRATEGIES:
            if strategy == "mtp":  # this target has no MTP heads: tests/test_mtp.py's model
                continue
            done = _done(exact_session, prompt, gen, strategy)
            assert done.tokens == plain.tokens, strategy
            if strategy != "none":  # the keys, quotes and separators came as free drafts
                assert done.stats.by_source.get("grammar", [0])[0] > 0, strategy
                assert done.stats.n_steps < plain.stats.n_steps, strategy


def test_an_unknown_format_is_an_annotation_and_own_options_merge(exact_session):
    """Real schemas carry formats llguidance does not know ("url", "path"): the value is a
    string as JSON Schema says; a schema's own x-guidance options keep tandem's others."""
    jsonschema = pytest.importorskip("jsonschema")
    from tandem.engine.loop.speculative import GenParams

    schema = {"type": "object", "properties": {"home": {"type": "string", "format": "url",
                                                         "maxLength": 8}},
              "required": ["home"], "additionalProperties": False}
    gen = GenParams(max_tokens=40, constraint=Constraint("json_schema", json.dumps(schema)))
    done = _done(exact_session, [1, 30, 31], gen, "none")
    assert done.complete, done.text
    jsonschema.validate(json.loads(done.text), schema)
    # oneOf that llguidance cannot prove exclusive: refused unless the schema asks for anyOf
    one_of = {"oneOf": [{"type": "string", "maxLength": 4}, {"type": "string", "maxLength": 3}]}
    with pytest.raises(GrammarError, match="oneOf") as err:
        Constraint("json_schema", json.dumps(one_of)).compiled()
    assert "coerce_one_of" in err.value.hint
    coerced = {**one_of, "x-guidance": {"coerce_one_of": True}}
    gen = GenParams(max_tokens=20, constraint=Constraint("json_schema", json.dumps(coerced)))
    done = _done(exact_session, [1, 30, 31], gen, "none")
    assert done.complete and len(json.loads(done.text)) <= 4, done.text


def test_grammar_text_never_becomes_a_control_token(exact_session):
    """User text is data: a grammar that spells "</s>" is written as bytes, never as the
    end-of-sequence token (which would end the output)."""
    from tandem.engine.loop.speculative import GenParams

    gen = GenParams(max_tokens=20, constraint=Constraint("gbnf", 'root ::= "</s>" [a-z]'))
    done = _done(exact_session, [1, 40, 41], gen, "ngram")
    assert done.text.startswith("</s>") and done.complete
    assert 2 not in done.tokens  # </s> is token 2 in the tiny vocabulary


# ----------------------------------------------------------------------- the command line


def _main(monkeypatch, capsys, tmp_path, *argv):
    from tandem.commands.app import main

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "argv", ["tandem", *argv])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


@pytest.fixture
def tiny_args(tiny_models):
    return ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t", "1",
            "--raw", "--no-history", "--strategy", "ngram"]


BAD = [
    (["--grammar", 'root = "a"'], "invalid GBNF grammar (--grammar): Expected ::="),
    (["--grammar", 'root ::= foo'], "Rule 'foo' not found"),
    (["--grammar", 'x ::= "a"'], "No 'root' rule found"),
    (["--grammar", "   "], "the grammar (--grammar) is empty"),
    (["-j", '{"type": "object",'], "is not valid JSON"),
    (["-j", '[1, 2]'], "must be an object, got list"),
    (["-j", '{"type": "strin"}'], "Invalid type: strin"),
    (["-j", '{"type": "string", "format": "uuid2", "x-guidance": {"lenient": false}}'],
     "Unknown format: uuid2"),
    (["-j", '{"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}'],
     "oneOf not fully supported"),
    (["-j", '{"dependentSchemas": {"a": {}}}'], "Unimplemented keys"),
    (["-j", '{"type": "string", "minLength": 5, "maxLength": 2}'], "Unsatisfiable schema"),
    (["-j", "false"], "Unsatisfiable schema"),
    (["-jf", "/nonexistent/schema.json"], "JSON schema file not found"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "grammar file not found"),
    (["-j", "{}", "--grammar", 'root ::= "a"'], "cannot be used together"),
    (["--json-object", "--json-schema-file", "x.json"], "cannot be used together"),
]


@pytest.mark.parametrize("flags,message", BAD)
def test_bad_structured_inputs_end_in_error_and_hint(flags, message, monkeypatch, capsys,
                                                     tmp_path, tiny_args):
    code, out, err = _main(monkeypatch, capsys, tmp_path, "run", *tiny_args, *flags, "hi")
    assert code == EXIT_USAGE, err
    assert "Traceback" not in err and out == ""
    assert "Error: " in err and message in err and "Hint: " in err, err


def test_a_binary_schema_file_and_a_schema_in_config(monkeypatch, capsys, tmp_path, tiny_args):
    blob = tmp_path / "s.json"
    blob.write_bytes(b"\x00\x01")
    code, _, err = _main(monkeypatch, capsys, tmp_path, "run", *tiny_args, "-jf", str(blob), "hi")
    assert code == EXIT_USAGE and "looks binary" in err
    # config.yaml may write the schema as YAML; a flag overrides it, one source gives one
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.yaml").write_text(
        "structured:\n  json_schema: {type: object, properties: {n: {type: integer}},"
        " required: [n]}\n")
    code, out, err = _main(monkeypatch, capsys, tmp_path, "run", *tiny_args, "-n", "40", "hi")
    assert code == EXIT_OK, err
    assert isinstance(json.loads(out)["n"], int)
    code, out, err = _main(monkeypatch, capsys, tmp_path, "run", *tiny_args, "-n", "40",
                           "--grammar", 'root ::= "yes" | "no"', "hi")
    assert code == EXIT_OK and out.strip() in ("yes", "no"), err
    monkeypatch.setenv("TANDEM_GRAMMAR", 'root ::= "no"')
    code, out, err = _main(monkeypatch, capsys, tmp_path, "run", *tiny_args, "hi")
    assert code == EXIT_OK and out.strip() == "no", err


def test_an_output_the_token_limit_cuts_is_an_error_after_the_text(monkeypatch, capsys, tmp_path,
                                                                   tiny_args):
    code, out, err = _main(monkeypatch, capsys, tmp_path, "run", *tiny_args, "-n", "3",
                           "-j", json.dumps(SCHEMA), "hi")
    assert code == EXIT_USAGE and out.startswith("{")
    assert "before the grammar was complete" in err and "raise -n" in err
    code, out, err = _main(monkeypatch, capsys, tmp_path, "run", *tiny_args, "-n", "3",
                           "--json", "--json-object", "hi")
    answer = json.loads(out)
    assert code == EXIT_USAGE and answer["complete"] is False and answer["finish_reason"] == "length"


def test_llguidance_loads_only_when_a_grammar_is_used(tiny_models, tmp_path):
    """--help and a plain run never import it (checked in a fresh interpreter, in-process)."""
    code = (
        "import io, sys\n"
        "from tandem.commands.app import main\n"
        "sys.argv = ['tandem'] + sys.argv[1:]\n"
        "sys.stdin = io.TextIOWrapper(io.BytesIO(b''))\n"
        "try:\n    main()\n"
        "except SystemExit as e:\n"
        "    print('EXIT', e.code, 'llguidance' in sys.modules, file=sys.stderr)\n")
    env = {"TANDEM_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    base = ["-m", str(tiny_models["target"]), "-t", "1", "--raw", "-n", "4", "--no-history"]
    for args, loaded in ((["run", "--help"], False), (["run", *base, "hi"], False),
                         (["run", *base, "--json-object", "hi"], True)):
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, env=env,
                             timeout=120)
        tail = res.stderr.decode().strip().splitlines()[-1]
        assert tail.startswith("EXIT") and tail.endswith(str(loaded)), (args, res.stderr.decode())


# ----------------------------------------------------------------------- the real pair


@pytest.mark.slow
def test_real_pair_json_schema_is_lossless_and_valid(real_pair):
    jsonschema = pytest.importorskip("jsonschema")
    from tandem.engine.backend.llama import ContextParams, exact_context
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.pair import PairSession, SessionOptions

    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "born": {"type": "integer"},
        "works": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["name", "born", "works"]}
    opts = SessionOptions(strategy="none", target_ctx=exact_context(
        ContextParams(n_ctx=1024, n_threads=2)), repack=False)
    gen = GenParams(max_tokens=60, constraint=Constraint("json_schema", json.dumps(schema)))
    with PairSession(*real_pair, opts) as s:
        s.pricing.keep_knowledge = False
        prompt = s.prompt_tokens([{"role": "user", "content":
                                   "Extract: William Shakespeare, born 1564, wrote Hamlet, "
                                   "Macbeth and Othello."}])
        plain = _done(s, prompt, gen, "none")
        jsonschema.validate(json.loads(plain.text), schema)
        for strategy in ("ngram", "draft"):
            done = _done(s, prompt, gen, strategy)
            assert done.tokens == plain.tokens, (strategy, done.text, plain.text)
            assert done.stats.by_source["grammar"][1] > 0
