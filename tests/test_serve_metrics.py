"""GET /metrics: llama-server's Prometheus names, counting what the answers said (issue 41's
observability): the counters are the sums of the responses' own timings."""
from __future__ import annotations

import json
import re

import pytest
from serve_helpers import Server, tiny_args

pytest.importorskip("llama_cpp")


def _parse(text: str) -> dict[str, float]:
    """`name{labels} value` lines; HELP/TYPE lines checked to precede each family."""
    values, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            assert re.sub(r"\{.*\}$", "", key) in typed, line
            values[key] = float(value)
    return values


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    s = Server([*tiny_args(tiny_models), "--strategy", "draft", "--draft-p-min", "0"],
               tmp_path_factory.mktemp("home"))
    yield s
    s.stop()


def test_the_counters_are_the_answers_sums(server):
    status, body, headers = server.raw("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    before = _parse(body["_raw"])
    assert before["llamacpp:tokens_predicted_total"] == 0
    timings = []
    for prompt in ("one two three one two three one two", "one two three one two three"):
        # the same prompt twice: the second reuses the first's KV cache (cached tokens)
        for _ in range(2):
            status, out, _ = server.raw("POST", "/completion", json.dumps(
                {"prompt": prompt, "n_predict": 24, "temperature": 0}))
            assert status == 200, out
            timings.append(out["timings"])
    status, body, _ = server.raw("GET", "/metrics")
    got = _parse(body["_raw"])
    assert got["llamacpp:tokens_predicted_total"] == sum(t["predicted_n"] for t in timings)
    assert got["llamacpp:prompt_tokens_total"] == sum(t["prompt_n"] for t in timings)
    assert got["llamacpp:prompt_tokens_cached_total"] == sum(t["cache_n"] for t in timings) > 0
    drafted = sum(t["draft_n"] for t in timings)
    accepted = sum(t["draft_n_accepted"] for t in timings)
    assert got["llamacpp:spec_decode_num_draft_tokens_total"] == drafted > 0
    assert got["llamacpp:spec_decode_num_accepted_tokens_total"] == accepted
    per_pos = {k: v for k, v in got.items() if "accepted_tokens_per_pos_total" in k}
    assert sum(per_pos.values()) == accepted and '{position="0"}' in next(iter(per_pos))
    by_source = {k: v for k, v in got.items() if k.startswith("tandem:spec_decode_draft_")}
    assert sum(by_source.values()) == drafted
    assert got["llamacpp:requests_processing"] == 0 and got["llamacpp:requests_deferred"] == 0
    assert got["llamacpp:n_tokens_max"] >= max(t["prompt_n"] + t["cache_n"] + t["predicted_n"]
                                               for t in timings)


def test_metrics_need_the_api_key_when_one_is_set(tiny_models, tmp_path):
    s = Server([*tiny_args(tiny_models), "--api-key", "sesame"], tmp_path / "home")
    try:
        assert s.raw("GET", "/metrics")[0] == 401
        status, body, _ = s.raw("GET", "/metrics", headers={"Authorization": "Bearer sesame"})
        assert status == 200 and "llamacpp:prompt_tokens_total 0" in body["_raw"]
    finally:
        s.stop()
