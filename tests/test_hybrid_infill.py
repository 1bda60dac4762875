"""/infill keystrokes on a hybrid model (issue 40): an editor sends one request per keystroke,
each sharing the prompt up to the cursor with the last one. A hybrid's recurrent state cannot
be truncated there, so the server comes back to a saved copy taken before the prompt's end
(llama-server's context checkpoints) and evaluates only what follows it; each answer equals
a fresh server's."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")

from serve_helpers import Server  # noqa: E402

# a file long enough that the copies kept before the prompt's end lie before the cursor
PREFIX = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(24))
SUFFIX = "\n\nprint(total(3))\n"
KEYSTROKES = ["def total(", "def total(x", "def total(x)", "def total(x):"]


@pytest.fixture(scope="module")
def hybrid_fim(tmp_path_factory):
    """The tiny hybrid (LFM2) with the FIM pair's vocabulary: tokens for /infill."""
    from make_tiny_models import _printable_mask, fim_vocab, write_gguf
    from tiny_recurrent_models import HYBRID_SEED, _lfm2_hparams, lfm2_weights

    vocab = fim_vocab()
    weights = lfm2_weights(len(vocab[0]), _printable_mask(vocab[0]), HYBRID_SEED)
    path = tmp_path_factory.mktemp("hybrid-fim") / "hybrid_fim.gguf"
    return write_gguf(path, "lfm2", "tiny-hybrid-fim", weights, vocab, _lfm2_hparams)


def _infill(server, typed: str) -> dict:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": typed,
            "n_predict": 12, "temperature": 0, "cache_prompt": True}
    status, answer, _ = server.raw("POST", "/infill", json.dumps(body))
    assert status == 200, answer
    return answer


def test_infill_keystrokes_evaluate_only_what_follows_a_saved_copy(hybrid_fim, tmp_path):
    args = ["-m", str(hybrid_fim), "-t", "1", "--strategy", "ngram", "--no-history",
            "-c", "2048"]
    server = Server(args, tmp_path / "home")
    try:
        answers = [_infill(server, typed) for typed in KEYSTROKES]
    finally:
        server.stop()
    first, later = answers[0], answers[1:]
    assert first["timings"]["prompt_n"] == first["tokens_evaluated"] > 600
    print("keystrokes: prompt tokens / evaluated:",
          [(a["tokens_evaluated"], a["timings"]["prompt_n"]) for a in answers])
    # the whole prompt is tokens_evaluated; prompt_n what the server evaluated of it. The
    # second keystroke comes back to llama-server's copy 4 + n_ubatch (512) tokens before
    # the first prompt's end; the later ones to the copy where the last prompt parted
    assert 0 < later[0]["timings"]["prompt_n"] <= 4 + 512 + 4, later[0]["timings"]
    for typed, a in zip(KEYSTROKES[2:], later[1:]):
        assert 0 < a["timings"]["prompt_n"] < a["tokens_evaluated"] / 10, (typed, a["timings"])
    for i, typed in enumerate(KEYSTROKES):
        fresh = Server(args, tmp_path / f"fresh{i}")
        try:
            alone = _infill(fresh, typed)
        finally:
            fresh.stop()
        assert alone["timings"]["prompt_n"] == alone["tokens_evaluated"]
        assert alone["content"] == answers[i]["content"], typed
