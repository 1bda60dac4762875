"""The tiny replica of Qwen3.5/3.6 (scripts/tiny_qwen35_models.py: three gated delta-net
layers, one attention layer, one MTP head) under the pinned llama-cpp-python (issue 53): it
loads as llama.cpp's `qwen35`, tandem reads it as a hybrid with its head, and `tandem run`
with every strategy keeps plain decoding's greedy output while drafts are rejected and the
recurrent state rolled back."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from tandem.engine.backend.llama import Model  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("name", ["qwen35", "qwen35_draft"])
def test_the_pinned_binding_loads_it_and_its_greedy_text_varies(tiny_models, name):
    llm = llama_cpp.Llama(model_path=str(tiny_models[name]), verbose=False, n_ctx=512)
    assert llm.metadata["general.architecture"] == "qwen35"
    out = llm.create_completion(PROMPT, max_tokens=40, temperature=0.0)
    text = out["choices"][0]["text"]
    assert len(text) >= 20 and len(set(text)) >= 10, text  # not one token repeated


def test_the_engine_loads_it_as_a_hybrid_with_one_head(tiny_models):
    model = Model(tiny_models["qwen35"], load_mtp=True)
    assert model.arch == "qwen35" and model.memory == "hybrid"
    assert model.mtp_loaded and model.n_layer_nextn == 1
    assert model.n_layer == 4  # the trunk: llama.cpp counts the nextn block apart
    model.close()
    draft = Model(tiny_models["qwen35_draft"], load_mtp=True)
    assert draft.memory == "hybrid" and draft.n_layer_nextn == 0 and not draft.mtp_loaded
    draft.close()


def test_the_header_shows_qwen35s_layers(tiny_models):
    """tandem's plan reads from the header what llama.cpp builds: three recurrent layers, one
    attending, then the head's block (attention, not recurrent)."""
    from tandem.machine.fit import model_shape
    from tandem.models.gguf_meta import read_gguf_header
    from tandem.models.memory_type import describe

    shape = model_shape(tiny_models["qwen35"])
    assert shape.recurrent == (True, True, True, False, False) and shape.nextn == 1
    assert shape.snapshots and shape.state_row > 0
    assert describe(read_gguf_header(tiny_models["qwen35"]))[0] == "hybrid"


# ----- every strategy through `tandem run`


@pytest.fixture(scope="module")
def qwen35_cli(tiny_models, tmp_path_factory):
    """`tandem run --json` on the tiny Qwen3.5, greedy; returns (answer, stats, stderr)."""
    base = tmp_path_factory.mktemp("qwen35-cli")

    def go(*args, strategy: str, label: str = ""):
        env = {**os.environ, "TANDEM_HOME": str(base / f"{strategy}{label}"), "NO_COLOR": "1"}
        cmd = [sys.executable, "-m", "tandem", "run", "-m", str(tiny_models["qwen35"]),
               "--strategy", strategy, "-n", "80", "--temp", "0", "--draft-p-min", "0",
               "--draft-max", "4", "-t", "1", "--json", "--no-history", *args, PROMPT]
        res = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr.decode()
        out = json.loads(res.stdout)
        return out["text"], out["stats"], res.stderr.decode()

    return go


@pytest.fixture(scope="module")
def plain(qwen35_cli):
    answer, stats, _ = qwen35_cli(strategy="none")
    assert stats["n_generated"] == 80 and stats["drafted"] == 0
    return answer


@pytest.mark.parametrize("strategy", ["draft", "mtp"])
def test_drafts_are_rejected_and_rolled_back_and_the_output_kept(qwen35_cli, plain,
                                                                 tiny_models, strategy):
    """The draft model and the MTP head are right often, not always: every rejection rolls
    the target's delta-net state back, and a wrong one would change the text after it."""
    extra = ["-md", str(tiny_models["qwen35_draft"])] if strategy == "draft" else []
    answer, stats, err = qwen35_cli(*extra, strategy=strategy)
    assert answer == plain, err
    assert stats["strategy"] == strategy and stats["accepted"] > 0, stats
    assert stats["drafted"] - stats["accepted"] > 0, stats


def test_ngram_keeps_the_output(qwen35_cli, plain):
    answer, stats, err = qwen35_cli(strategy="ngram")
    assert answer == plain and stats["strategy"] == "ngram", err


def test_auto_keeps_the_output(qwen35_cli, plain, tiny_models, tmp_path):
    """auto with the MTP heads as its model source, then with the draft model and a
    prediction that is wrong every ninth character (whether they draft follows this
    machine's measured costs, so only the output is asserted)."""
    answer, stats, err = qwen35_cli(strategy="auto")
    assert answer == plain and stats["strategy"] == "auto", err
    prediction = tmp_path / "prediction.txt"
    prediction.write_text("".join(("z" if c == "q" else "q") if i % 9 == 8 else c
                                  for i, c in enumerate(plain)))
    answer, stats, err = qwen35_cli("-md", str(tiny_models["qwen35_draft"]), "--prediction",
                                    str(prediction), strategy="auto", label="-prediction")
    assert answer == plain and stats["strategy"] == "auto", err


def test_sampled_mtp_drafts_on_the_replica_keep_the_targets_distribution(tiny_models):
    """Positions 0 and 1 at T=1 with top-k 8, plain against the replica's MTP heads
    (independent seeds), chi-square per position, 1500 samples a side: drafts rejected on a
    hybrid go back from llama.cpp's snapshots, and the distribution stays the target's."""
    from engine_helpers import assert_same_first_tokens, sampled_first_tokens
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.backend.llama import Context
    from tandem.engine.backend.mtp import use_mtp
    from tandem.engine.drafting.drafters import DraftParams, NoDrafter
    from tandem.engine.drafting.mtp import MtpDrafter

    model = Model(tiny_models["qwen35"], load_mtp=True)
    ctx = Context(model, ContextParams(n_ctx=512, n_threads=1))
    try:
        prompt = model.tokenize(PROMPT, add_special=True)
        n = 1500
        plain, _, _ = sampled_first_tokens(ctx, prompt, NoDrafter(), range(n))
        drafter = MtpDrafter(use_mtp(ctx, True), DraftParams(n_max=4, n_min=0, p_min=0.0))
        spec, drafted, rejected = sampled_first_tokens(ctx, prompt, drafter,
                                                       range(10**6, 10**6 + n))
        assert drafted >= 2 * n and rejected > n // 10, (drafted, rejected)
        assert_same_first_tokens(plain, spec, "mtp on the qwen35 replica")
    finally:
        ctx.close()
        model.close()
