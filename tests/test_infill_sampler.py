"""llama.cpp's `infill` sampler, which the editors' plugins name in `samplers` (llama.vim,
llama.vscode): sampling.infill_pick decides as llama-sampler.cpp's infill rule leaves the most
probable token (ends of generation when they weigh enough, candidates that are prefixes of one
another merged, no confident text -> end), and speculation under it is lossless."""
from __future__ import annotations

import math

import numpy as np
import pytest
from engine_helpers import draft_model, ngram_drafter, run  # noqa: E402
from scripted import ScriptedContext, ScriptedModel
from tandem.engine.drafting.drafters import NoDrafter
from tandem.engine.loop.sampling import SamplingParams, infill_pick
from tandem.serve.api_errors import ApiError
from tandem.serve.llama_api import parse_infill as infill_request

PIECES = [b"a", b"ab", b"x", b"y", b"z", b"w", b"v", b""]  # 7: the end of generation
EOG = 7
INFILL = SamplingParams(infill=True)


def _logits(probs: dict[int, float]) -> np.ndarray:
    out = np.full(len(PIECES), -1e4, dtype=np.float32)
    for t, p in probs.items():
        out[t] = math.log(p)
    return out


def _pick(probs, params=INFILL):
    return infill_pick(_logits(probs), [], params, lambda t: t == EOG, PIECES.__getitem__, EOG)


def test_the_ends_win_when_they_weigh_a_third_of_the_text_per_candidate():
    # all 8 tokens are candidates (top-k 40): the end wins once 3 * p_eog * 8 > 1 - p_eog
    assert _pick({2: 0.5, 3: 0.2, 4: 0.2, 0: 0.03, EOG: 0.07}) == EOG
    assert _pick({2: 0.5, 3: 0.2, 4: 0.24, 0: 0.03, EOG: 0.03}) == 2


def test_a_prefix_and_its_longer_token_count_as_one():
    # "a" (0.3) and "ab" (0.25) merge into "a": 0.55 beats "x" (0.45), the plain argmax
    assert _pick({0: 0.3, 1: 0.25, 2: 0.45}) == 0
    assert int(_logits({0: 0.3, 1: 0.25, 2: 0.45}).argmax()) == 2


def test_no_confident_text_token_ends_the_answer():
    # five tokens of 0.18 and "a" + "ab" = 0.1: no text token keeps 0.2, so the end
    assert _pick({2: 0.18, 3: 0.18, 4: 0.18, 5: 0.18, 6: 0.18, 0: 0.05, 1: 0.05}) == EOG
    assert _pick({2: 0.34, 3: 0.33, 4: 0.33}) == 2
    # merged into the likelier of the two: "ab" (0.24) takes "a" (0.19), then wins
    assert _pick({2: 0.19, 3: 0.19, 4: 0.19, 0: 0.19, 1: 0.24}) == 1


def test_top_k_limits_the_candidates_the_rule_counts():
    # with top-k 2 only "x" and the end are candidates: 3 * 0.1/0.6 * 2 > 0.5/0.6
    # top-k 1: "x" alone, no end among the candidates; top-k 4: 3 * (0.1/0.78) * 4 > 0.87
    probs = {2: 0.5, EOG: 0.1, 3: 0.09, 4: 0.09}
    assert _pick(probs, SamplingParams(infill=True, top_k=1)) == 2
    assert _pick(probs, SamplingParams(infill=True, top_k=4)) == EOG
    assert SamplingParams(infill=True, temperature=0.8).greedy  # a greedy rule whatever the T


def _target(prefix):
    # a path where the infill rule and the argmax part ways: "a" + "ab" outweigh "x" at
    # every third position, and the end wins from the tenth position on (the argmax: "x")
    n = len(prefix)
    if n >= 10:
        return _logits({2: 0.5, 3: 0.2, EOG: 0.3})
    if n % 3 == 0:
        return _logits({0: 0.3, 1: 0.25, 2: 0.45})
    return _logits({3 if n % 2 else 4: 0.7, 2: 0.3})


def _draft(prefix):
    return _logits({2: 0.6, 3: 0.2, 4: 0.2})  # disagrees with the target often


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_speculation_under_the_infill_rule_equals_plain_decoding_under_it(kind):
    model = ScriptedModel(len(PIECES), PIECES, eog=[EOG])
    plain, _ = run(ScriptedContext(model, _target), [2], NoDrafter(), max_tokens=30,
                   sampling=INFILL)
    argmax, _ = run(ScriptedContext(model, _target), [2], NoDrafter(), max_tokens=30)
    assert plain.reason == "eos" and argmax.reason == "length"
    assert 0 in plain.tokens and 0 not in argmax.tokens
    drafter = (draft_model(ScriptedContext(model, _draft), n_max=3) if kind == "draft"
               else ngram_drafter(n_max=3))
    spec, steps = run(ScriptedContext(model, _target), [2], drafter, max_tokens=30,
                      sampling=INFILL)
    assert spec.tokens == plain.tokens and spec.reason == "eos"
    assert sum(s.drafted for s in steps) > 0


def test_serve_reads_the_infill_sampler_from_samplers():
    base = {"input_prefix": "def f(", "input_suffix": ")\n"}
    assert infill_request({**base, "samplers": ["top_k", "top_p", "infill"]}).infill_sampler
    assert infill_request({**base, "samplers": "kpi"}).infill_sampler
    assert not infill_request({**base, "samplers": ["top_k"]}).infill_sampler
    assert not infill_request(base).infill_sampler
    with pytest.raises(ApiError, match="samplers"):
        infill_request({**base, "samplers": {"infill": 1}})
