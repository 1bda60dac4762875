"""`tandem serve` end to end: a real server on 127.0.0.1 (a port the kernel picks), the tiny
models, its own TANDEM_HOME, and the real `openai` client; plus the scheduler in-process
(cancellation within one step, the bounded queue) and the request checks."""
from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import Server, stop_cleanly, tiny_args as _models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["hello there", "write a loop", "sort the list", "tell me more", "abc def",
           "one two three", "the quick fox", "print it"]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    # exact mode: greedy answers are bit-identical to plain decoding whatever the cache holds,
    # so "the same answer as alone" is a fair test; strategy draft: seeds reproduce the text
    srv = Server([*_models(tiny_models), "--exact", "--strategy", "draft", "--queue", "4",
                  "--max-tokens", "64"], tmp_path_factory.mktemp("serve-home"))
    yield srv
    stop_cleanly(srv)


def _chat(client, prompt: str, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    return client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": prompt}], temperature=0, **kwargs)


def _stream_text(client, prompt: str, **kwargs) -> tuple[str, list]:
    chunks = list(_chat(client, prompt, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_chat_completion_not_streamed(server):
    resp = _chat(server.client(), "hello there")
    choice = resp.choices[0]
    assert resp.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    timings = resp.model_extra["timings"]
    for key in ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                "predicted_n", "predicted_ms", "predicted_per_token_ms",
                "predicted_per_second", "draft_n", "draft_n_accepted", "cache_n"):
        assert key in timings, key
    assert timings["predicted_n"] == usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == usage.prompt_tokens
    assert timings["draft_n_accepted"] <= timings["draft_n"]
    assert resp.model_extra["tandem"]["strategy"] == "draft"


def test_streamed_equals_not_streamed(server):
    client = server.client()
    whole = _chat(client, "write a loop").choices[0].message.content
    text, chunks = _stream_text(client, "write a loop", stream_options={"include_usage": True})
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and "timings" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 4, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    json.loads(events[-2][6:])  # every other event is one JSON object


def test_completions_and_models(server):
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["target"]
    resp = client.completions.create(model="target", prompt="abc def", max_tokens=6,
                                     temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="target", prompt="abc def", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == resp.choices[0].text


def test_return_tokens_gives_the_answers_ids_on_every_route(server):
    """llama-server's return_tokens: the ids detokenize to the answer, whole or streamed (the
    finish chunk's tandem.tokens; /completion's last object's tokens); without it none."""
    client = server.client()
    resp = _chat(client, "hello there", extra_body={"return_tokens": True})
    ids = resp.model_extra["tandem"]["tokens"]
    assert len(ids) == resp.usage.completion_tokens
    status, back, _ = server.raw("POST", "/detokenize", json.dumps({"tokens": ids}))
    assert status == 200 and back["content"] == resp.choices[0].message.content
    _, chunks = _stream_text(client, "hello there", extra_body={"return_tokens": True})
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals[0].model_extra["tandem"]["tokens"] == ids
    assert [c for c in chunks if "tokens" in (c.model_extra.get("tandem") or {})] == finals
    assert "tokens" not in _chat(client, "hello there").model_extra["tandem"]
    status, done, _ = server.raw("POST", "/completion", json.dumps(
        {"prompt": "abc def", "n_predict": 6, "temperature": 0, "return_tokens": True}))
    assert status == 200 and len(done["tokens"]) == done["tokens_predicted"] > 0
    plain = server.raw("POST", "/completion", json.dumps(
        {"prompt": "abc def", "n_predict": 6, "temperature": 0}))[1]
    assert plain["tokens"] == [] and plain["content"] == done["content"]
    status, err, _ = server.raw("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "return_tokens": "yes"}))
    assert status == 400 and err["error"]["param"] == "return_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(server, stream):
    client = server.client()
    full = _chat(client, "sort the list", max_tokens=24).choices[0].message.content
    assert len(full) >= 8, full
    stop = full[4:6]
    cut = full[:full.index(stop)]
    for value in (stop, [stop, "\u00a7never\u00a7"]):
        if stream:
            text, chunks = _stream_text(client, "sort the list", max_tokens=24, stop=value)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            resp = _chat(client, "sort the list", max_tokens=24, stop=value)
            text, reason = resp.choices[0].message.content, resp.choices[0].finish_reason
        assert text == cut and reason == "stop"


def test_seed_reproduces_sampled_text(server):
    client = server.client()

    def sample(seed):
        return client.chat.completions.create(
            model="target", messages=[{"role": "user", "content": "tell me more"}],
            max_tokens=16, temperature=1.0, seed=seed,
        ).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(1, 6)}) > 1  # the seed changes the draws


def test_output_equals_tandem_run(server, tiny_models, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "run", *_models(tiny_models), "--exact",
         "--strategy", "draft", "--no-history", "-n", "20", "--json", "one two three"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert out.returncode == 0, out.stderr
    expected = json.loads(out.stdout)["text"]
    got = _chat(server.client(), "one two three", max_tokens=20).choices[0].message.content
    assert got == expected


def test_turn_two_evaluates_only_new_tokens(server):
    client = server.client()
    first = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "the quick fox " * 20}]
    r1 = client.chat.completions.create(model="target", messages=first, max_tokens=16,
                                        temperature=0)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "and then?"}]
    r2 = client.chat.completions.create(model="target", messages=second, max_tokens=8,
                                        temperature=0)
    p1, p2 = r1.usage.prompt_tokens, r2.usage.prompt_tokens
    cached = r2.usage.prompt_tokens_details.cached_tokens
    t2 = r2.model_extra["timings"]
    # the KV cache holds turn 1's prompt (and answer): only what follows is evaluated
    assert cached >= p1 - 1
    assert t2["cache_n"] == cached and t2["prompt_n"] == p2 - cached
    assert t2["prompt_n"] <= p2 - p1 + 1 < p2
    # a different conversation shares only the template's start: evaluated almost whole
    r3 = _chat(client, "print it " * 30)
    assert r3.model_extra["timings"]["prompt_n"] > r3.usage.prompt_tokens // 2


def test_disconnect_mid_stream_frees_the_engine(server):
    client = server.client()
    before = server.health()["cancelled"]
    stream = client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "hello there"}],
        max_tokens=100000, temperature=0, stream=True)  # runs to the context end unless stopped
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 60
    while server.health()["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    health = server.health()
    assert health["cancelled"] == before + 1
    # the next request is served, and the cancelled answer went no further than it had to
    resp = _chat(client, "abc def", max_tokens=4)
    assert resp.choices[0].message.content
    assert health["last_cancel"]["generated"] < 4096 - 64


def test_concurrent_clients_get_their_own_answers(server):
    expected = {p: _chat(server.client(), p, max_tokens=8).choices[0].message.content
                for p in PROMPTS}
    for _ in range(10):  # warm: the first requests grow caches that then stay
        _chat(server.client(), PROMPTS[0], max_tokens=8)
    rss0 = server.rss_kib()
    results: list[tuple[str, str]] = []
    lock = threading.Lock()

    def client_run(i: int):
        client = server.client()
        prompt = PROMPTS[i]
        for j in range(20):
            try:
                if j % 2:
                    text, _ = _stream_text(client, prompt, max_tokens=8)
                else:
                    text = _chat(client, prompt, max_tokens=8).choices[0].message.content
                outcome = ("ok", text)
            except openai.RateLimitError as exc:
                assert exc.response.headers.get("retry-after"), exc
                outcome = ("refused", "")
            except openai.APIStatusError as exc:
                outcome = ("refused", "") if exc.status_code == 503 else ("error", repr(exc))
            with lock:
                results.append((prompt, *outcome))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client_run, range(8)))
    assert len(results) == 160  # none lost
    errors = [r for r in results if r[1] == "error"]
    assert errors == []
    ok = [r for r in results if r[1] == "ok"]
    assert ok, "every request was refused"
    mixed = [(p, t) for p, kind, t in ok if t != expected[p]]
    assert mixed == []
    assert server.health()["status"] == "ok"
    grown = server.rss_kib() - rss0
    assert grown < 100 * 1024, f"RSS grew by {grown} KiB over 160 requests"


MALFORMED = [
    ("POST", "/v1/chat/completions", "{not json", None, 400),
    ("POST", "/v1/chat/completions", "", None, 400),
    ("POST", "/v1/chat/completions", "[1, 2]", None, 400),
    ("POST", "/v1/chat/completions", '"a string"', None, 400),
    ("POST", "/v1/chat/completions", "{}", None, 400),
    ("POST", "/v1/chat/completions", {"messages": []}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [1]}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"content": "x"}]}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, None, 400),
    ("chat", {"n": 2}, 400),
    ("chat", {"max_tokens": -1}, 400),
    ("chat", {"max_tokens": 0}, 400),
    ("chat", {"max_tokens": "ten"}, 400),
    ("chat", {"max_completion_tokens": 1.5}, 400),
    ("chat", {"temperature": "hot"}, 400),
    ("chat", {"temperature": -1}, 400),
    ("chat", {"top_p": 0}, 400),
    ("chat", {"top_k": -3}, 400),
    ("chat", {"stop": 5}, 400),
    ("chat", {"stop": [""]}, 400),
    ("chat", {"stop": ["x"] * 17}, 400),
    ("chat", {"stream": "yes"}, 400),
    ("chat", {"stream_options": {"include_usage": "yes"}}, 400),
    ("chat", {"seed": "abc"}, 400),
    ("chat", {"seed": -5}, 400),
    ("chat", {"temperature": 150}, 400),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f",
                                                          "parameters": {"type": "string"}}}]},
     400),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, 400),
    ("chat", {"logprobs": True}, 400),
    ("chat", {"presence_penalty": 1.0}, 400),
    ("chat", {"model": 7}, 400),
    ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None, 400),
    ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', None, 400),
    ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', None, 400),
    ("POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}', None, 400),
    ("POST", "/v1/chat/completions", "[" * 100000 + "]" * 100000, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, {"Content-Type": "text/plain"}, 415),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1000000}]}, None, 413),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * 20000}]}, None, 400),
    ("POST", "/v1/completions", {"prompt": 5}, None, 400),
    ("POST", "/v1/completions", {"prompt": ""}, None, 400),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 3}, None, 400),
    ("GET", "/v1/chat/completions", None, None, 405),
    ("GET", "/v1/nothing-here", None, None, 404),
    ("DELETE", "/v1/models", None, None, 405),
]


def _case(case):
    if case[0] == "chat":
        body = {"messages": [{"role": "user", "content": "x"}], **case[1]}
        return "POST", "/v1/chat/completions", body, None, case[2]
    return case


def test_malformed_requests_get_json_errors(server):
    assert len(MALFORMED) >= 25
    failures = []
    for case in MALFORMED:
        method, path, body, headers, want = _case(case)
        if isinstance(body, dict):
            body = json.dumps(body)
        status, reply, _ = server.raw(method, path, body, headers)
        err = reply.get("error") if isinstance(reply, dict) else None
        if status != want or not isinstance(err, dict) or not err.get("message") \
                or "type" not in err or "param" not in err or "code" not in err:
            failures.append((case if len(str(case)) < 300 else str(case)[:300], status, reply))
    assert failures == []
    assert server.health()["status"] == "ok"
    assert _chat(server.client(), "hello there", max_tokens=4).choices[0].message.content
    log = "".join(server.log)
    assert "Traceback" not in log, log


def test_each_request_gets_a_log_line(server):
    def lines():
        return [ln for ln in server.log if ln.startswith("tandem serve: POST")]

    before = len(lines())
    resp = _chat(server.client(), "hello there", max_tokens=5)
    _stream_text(server.client(), "hello there", max_tokens=5)
    server.raw("POST", "/v1/chat/completions", "{}")
    deadline = time.monotonic() + 30
    while len(lines()) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    plain, streamed, refused = lines()[before:before + 3]
    # the count is the answer's own (an answer may end before max_tokens)
    n = resp.usage.completion_tokens
    for line in (plain, streamed):
        assert re.match(r"tandem serve: POST /v1/chat/completions 200 · (slot \d · )?prompt \d+ "
                        rf"\(\d+ cached\) · {n} tokens · \d+\.\d\d s · [\d.]+ tok/s", line), line
    assert refused.startswith("tandem serve: POST /v1/chat/completions 400 · ")


def test_the_history_note_is_said_once(tiny_models, tmp_path):
    """Answers are kept for drafting by default: said once, after the first kept answer (8
    tokens or more), as run and chat say it; not again on the next answers."""
    srv = Server([*_models(tiny_models), "--exact", "--strategy", "none"], tmp_path / "home")
    try:
        for _ in range(3):
            resp = _chat(srv.client(), "Count from one to twenty.", max_tokens=16)
            assert resp.usage.completion_tokens >= 8
    finally:
        srv.stop()
    notes = [ln for ln in srv.log if ln.startswith("Note: tandem keeps its answers")]
    assert len(notes) == 1, notes
    assert (tmp_path / "home" / "history" / ".noted").exists()


def test_quiet_server_logs_no_requests(tiny_models, tmp_path):
    srv = Server([*_models(tiny_models), "--strategy", "none", "--quiet"], tmp_path / "home")
    try:
        _chat(srv.client(), "hello there", max_tokens=2)
        assert srv.health()["status"] == "ok"
    finally:
        srv.stop()
    assert not [ln for ln in srv.log if ln.startswith("tandem serve: POST")], srv.log


def test_context_overflow_is_a_clear_400(server):
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(server.client(), "fox " * 20000)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(server.client(), "x", n=2)
    assert exc.value.param == "n"


def test_api_key(tiny_models, tmp_path):
    srv = Server([*_models(tiny_models), "--strategy", "none", "--api-key", "s3cret"],
                 tmp_path / "home")
    try:
        with pytest.raises(openai.AuthenticationError):
            _chat(srv.client(api_key="wrong"), "hi", max_tokens=2)
        status, reply, _ = srv.raw("GET", "/v1/models")
        assert status == 401 and reply["error"]["type"] == "authentication_error"
        assert srv.health()["status"] == "ok"  # /health needs no key
        assert _chat(srv.client(api_key="s3cret"), "hi", max_tokens=2).choices[0].message.content
        assert "Warning" not in "".join(srv.log)  # loopback: no warning
    finally:
        srv.stop()


def test_busy_port_is_a_usage_error(tiny_models, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "tandem", "serve", *_models(tiny_models), "--port", str(port)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert out.returncode == 2, out.stderr
    assert "Error: cannot listen on 127.0.0.1" in out.stderr and "Hint:" in out.stderr


def test_run_does_not_import_the_http_stack():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "tandem", "run", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()]
    assert "tandem.commands.serve" in imported  # the probe sees our modules
    assert not [m for m in imported if m.split(".")[0] in ("starlette", "uvicorn")
                or m.startswith("tandem.serve")]


# ----- in-process: the scheduler and the checks -----

@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions

    os.environ.setdefault("TANDEM_HOME", str(tmp_path_factory.mktemp("pair-home")))
    opts = SessionOptions(strategy="draft", target_ctx=ContextParams(n_ctx=2048, n_threads=1,
                                                                     n_threads_batch=1))
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as session:
        yield session


def _run_job(scheduler, make, on_text=None):
    from tandem.serve.job_events import END, Text
    from tandem.serve.jobs import GenerationJob

    got: list = []
    done = threading.Event()

    def sink(event):
        got.append(event)
        if isinstance(event, Text) and on_text is not None:
            on_text(job)
        if isinstance(event, END):
            done.set()

    job = GenerationJob(make=make, sink=sink)
    scheduler.submit(job)
    assert done.wait(120)
    return got


def test_cancel_stops_within_one_step(pair):
    from tandem.engine.loop.sampling import SamplingParams
    from tandem.engine.loop.speculative import GenParams
    from tandem.serve.job_events import Cancelled, Done
    from tandem.serve.scheduler import Scheduler

    scheduler = Scheduler(pair, strategy="draft", record=False, queue_size=2)
    scheduler.start()
    try:
        prompt = pair.prompt_tokens([{"role": "user", "content": "hello there"}])
        gen = GenParams(max_tokens=1500, sampling=SamplingParams(), ignore_eos=True)
        seen = []

        def cancel_after_three(job):
            seen.append(1)
            if len(seen) == 3:
                job.cancel.set()

        got = _run_job(scheduler, lambda p: (prompt, gen), cancel_after_three)
        assert isinstance(got[-1], Cancelled)
        answer = got[-1].answer
        assert answer.reason == "interrupted"
        # the cancel was seen at the next event: at most the rest of that one step's tokens
        verify_batch = pair.options.draft.n_max + 1
        assert 3 <= answer.stats.n_generated <= 3 + verify_batch
        # the engine is free and consistent: the same prompt again gives a full answer
        got = _run_job(scheduler, lambda p: (prompt, GenParams(max_tokens=8)))
        assert isinstance(got[-1], Done) and got[-1].answer.stats.n_generated == 8
    finally:
        scheduler.stop()


def test_queue_is_bounded(pair):
    from tandem.serve.job_events import Dropped
    from tandem.serve.jobs import GenerationJob
    from tandem.serve.scheduler import QueueFull, Scheduler

    scheduler = Scheduler(pair, queue_size=2)  # not started: nothing is taken off the queue
    outcomes = []
    jobs = [GenerationJob(make=lambda p: None, sink=outcomes.append) for _ in range(3)]
    scheduler.submit(jobs[0])
    scheduler.submit(jobs[1])
    with pytest.raises(QueueFull):
        scheduler.submit(jobs[2])
    scheduler.stop()  # what waits is cancelled, never dropped silently
    assert outcomes == [Dropped(), Dropped()]


class _TokenizesInScheduler:
    """The pair as a remote one is to serve: its tokenizer is called in the scheduler."""

    tokenizes_aside = False

    def __init__(self, pair):
        self._pair = pair

    def __getattr__(self, name):
        return getattr(self._pair, name)


def test_a_call_job_comes_back_as_its_value_or_its_refusal(pair):
    """A plain call on the pair (a remote pair's tokenizer) runs where answers run: its value
    comes back as Returned, a TandemError it raises as Refused, each the job's one event;
    /tokenize on such a pair answers through one."""
    from tandem.errors import UsageError
    from tandem.serve.job_events import Refused, Returned
    from tandem.serve.jobs import CallJob
    from tandem.serve.prompt import PromptBudget
    from tandem.serve.routes import ServeConfig, build_app
    from tandem.serve.scheduler import Defaults, Scheduler

    def call(scheduler, fn) -> list:
        got: list = []
        done = threading.Event()
        scheduler.submit(CallJob(fn, lambda event: (got.append(event), done.set())))
        assert done.wait(60)
        return got

    def refuse(p):
        raise UsageError("no such call", "call another")

    scheduler = Scheduler(_TokenizesInScheduler(pair))
    scheduler.start()
    try:
        assert call(scheduler, lambda p: p.tokenize("hello")) == [Returned(pair.tokenize("hello"))]
        [refused] = call(scheduler, refuse)
        assert isinstance(refused, Refused) and refused.error.message == "no such call"
        app = build_app(scheduler, ServeConfig(model_id="m", defaults=Defaults(),
                                            budget=PromptBudget(2048)))
        status, reply = _asgi(app, "POST", "/tokenize", json.dumps({"content": "hi"}).encode())
        assert status == 200 and reply == {"tokens": pair.tokenize("hi")}
    finally:
        scheduler.stop()


def test_protocol_checks():
    from tandem.serve import protocol
    from tandem.serve.listening import is_loopback

    req = protocol.parse_chat({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "hi"}], "stop": "x", "max_tokens": 5.0, "seed": -1})
    assert req.messages[0] == {"role": "system", "content": "a\nb"}
    assert req.stop == ("x",) and req.max_tokens == 5 and req.seed is None
    assert protocol.parse_chat({"messages": [{"role": "user", "content": "x"}],
                                "max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3
    with pytest.raises(protocol.ApiError) as exc:
        protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "top_p": True})
    assert exc.value.status == 400 and exc.value.param == "top_p"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")


@pytest.mark.parametrize("key,value", [("temperature", -1.0), ("temperature", 101.0),
                                       ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5),
                                       ("min_p", 1.0), ("repeat_penalty", 0.0),
                                       ("seed", -2), ("seed", 1 << 64)])
def test_one_rule_for_sampling_values_in_cli_and_api(key, value):
    """The CLI (SamplingParams) and the API (protocol) refuse the same values, and both take
    seed -1 as a random seed."""
    from tandem.engine.loop.sampling import SamplingParams
    from tandem.errors import UsageError
    from tandem.serve.protocol import ApiError, parse_chat

    with pytest.raises(UsageError):
        SamplingParams(**{key: value})
    with pytest.raises(ApiError) as exc:
        parse_chat({"messages": [{"role": "user", "content": "x"}], key: value})
    assert exc.value.param == key
    assert SamplingParams(seed=None).seed is None
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "seed": -1}).seed is None


def test_both_caches_keep_the_common_prefix(pair):
    """Turn 2 of a conversation: the target and the draft model each evaluate only what
    follows turn 1 (the draft's prefill is counted directly on its context)."""
    from tandem.engine.backend.llama import common_prefix
    from tandem.serve import protocol
    from tandem.serve.scheduler import Defaults, Scheduler, prepare

    scheduler = Scheduler(pair, strategy="draft", record=False)
    scheduler.start()
    evaluated = []
    real = pair.draft_ctx.prefill

    def counting(tokens, *args, **kwargs):
        n = real(tokens, *args, **kwargs)
        evaluated.append(n)
        return n

    pair.draft_ctx.prefill = counting
    try:
        first = [{"role": "user", "content": "the quick fox " * 20}]
        req1 = protocol.parse_chat({"messages": first, "max_tokens": 12})
        a1 = _run_job(scheduler, lambda p: prepare(p, req1, Defaults()))[-1].answer
        second = first + [{"role": "assistant", "content": a1.text},
                          {"role": "user", "content": "and then?"}]
        req2 = protocol.parse_chat({"messages": second, "max_tokens": 4})
        kv1 = list(pair.target_ctx.tokens)  # what turn 1 left in the target's cache
        tokens1, tokens2 = (pair.prompt_tokens(m) for m in (first, second))
        evaluated.clear()
        a2 = _run_job(scheduler, lambda p: prepare(p, req2, Defaults()))[-1].answer
        p1, p2 = a1.stats.n_prompt, a2.stats.n_prompt
        assert tokens2[:len(tokens1)] == tokens1 and p2 == len(tokens2)
        # exactly the tokens past the longest common prefix were evaluated (the last prompt
        # token goes with the first verify batch), and that prefix covers all of turn 1's prompt
        keep = common_prefix(kv1, tokens2[:-1])
        assert keep >= p1 and a2.stats.n_prompt_eval == p2 - keep
        assert a2.stats.n_prompt_eval <= p2 - p1 + 1
        assert evaluated and evaluated[0] <= p2 - p1 + 1  # the draft's prompt phase
    finally:
        del pair.draft_ctx.prefill
        scheduler.stop()


def _asgi(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    """One request through the ASGI app in this process (no socket): status and JSON body."""
    import asyncio

    sent = []

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays connected

    out = {"status": 0, "body": b""}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    try:
        asyncio.run(app(scope, receive, send))
    except RuntimeError as exc:  # Starlette re-raises a bug after answering (uvicorn logs it)
        assert "boom" in str(exc)
    return out["status"], json.loads(out["body"])


def test_a_bug_is_a_500_json_error_and_the_app_goes_on():
    from tandem.serve.routes import ServeConfig, build_app
    from tandem.serve.scheduler import Defaults

    from tandem.serve.prompt import PromptBudget
    from tandem.engine.backend.fim import FimTokens

    from tandem.engine.drafting.drafters import DraftParams

    class Broken:
        busy, waiting, capacity, served, cancelled, last_cancel = False, 0, 1, 0, 0, None
        slots, processing, prompt_cache = [], 0, None
        strategy, draft = "none", DraftParams()  # what a request that does not say runs with
        # prompts go to the scheduler; the vocabulary's facts are read at the start
        pair = SimpleNamespace(tokenizes_aside=False, fim_tokens=FimTokens(),
                               props=lambda: {"n_vocab": 10})

        def submit(self, job):
            raise RuntimeError("boom")

    app = build_app(Broken(), ServeConfig(model_id="m", defaults=Defaults(),
                                          budget=PromptBudget(4096)))
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    status, reply = _asgi(app, "POST", "/v1/chat/completions", body)
    assert status == 500
    assert reply["error"]["type"] == "server_error" and "RuntimeError" in reply["error"]["message"]
    status, reply = _asgi(app, "GET", "/health")
    assert status == 200 and reply["status"] == "ok"


def test_bench_serve_smoke(tiny_models, tmp_path):
    """scripts/bench_serve.py on the tiny pair, tandem serve only: every turn measured, and
    turns 2+ evaluate only their new tokens."""
    out = tmp_path / "serve.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_serve.py"), "-m",
         str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "--no-llama",
         "--no-mt-bench", "--per-group", "1", "-n", "8", "-t", "1", "--out", str(out),
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["error"] is None and r["tok_s"] > 0 for r in rows)
    prev = {(r["conv"], r["turn"]): r for r in rows}
    later = [(prev[(r["conv"], r["turn"] - 1)], r) for r in rows if r["turn"] >= 2]
    # the whole previous prompt (and more: its answer) came from the cache
    assert later and all(r["cache_n"] >= p["cache_n"] + p["prompt_n"] - 1 for p, r in later)
    assert "| code-edit | t2+ | tandem |" in res.stdout


def test_bench_serve_report_ratios():
    from bench_serve import BASELINE, Row, report

    rows = [Row(BASELINE, "c", "g", 1, latency_s=2.0, tok_s=10.0, predicted_n=10),
            Row("tandem", "c", "g", 1, latency_s=1.0, tok_s=15.0, predicted_n=10)]
    text = report(rows, ["tandem", BASELINE])
    assert "| g | t1 | tandem | 1 | 1.00 | 15.0 | 0 | 2.00x | 1.50x | - |" in text


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "port must be in 0..65535, got 70000"),
    (["--queue", "0"], "queue must be in 1..4096, got 0"),
    (["--api-key", " "], "the API key (--api-key) is empty"),
    (["--api-key", " k"], "the API key (--api-key) starts or ends with whitespace"),
    (["--timeout", "0"], "request timeout (s) must be in 0.1..3600"),
    (["--host", "no-such-host.invalid"], "cannot listen on 'no-such-host.invalid'"),
])
def test_bad_serve_flags(tiny_models, tmp_path, args, message):
    """Each refused before the models load, in the settings schema's words."""
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "serve", *_models(tiny_models), "--port", "0", *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert out.returncode == 2, out.stderr
    assert f"Error: {message}" in out.stderr and "Hint:" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_settings_come_from_the_environment_and_config(tiny_models, tmp_path):
    """host, port, queue, timeout, cache reuse, CORS and the API key are settings like the
    others (issue 39): env and config.yaml set them, flags win, and `tandem hw` shows the key
    only as set."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text("serve:\n  queue: 3\n  timeout: 7\n  api_key: k1\n")
    env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_PORT": "70000"}
    out = subprocess.run([sys.executable, "-m", "tandem", "serve", *_models(tiny_models)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "environment variable TANDEM_PORT" in out.stderr
    env["TANDEM_API_KEY"] = "s3cret"
    out = subprocess.run([sys.executable, "-m", "tandem", "hw", "--json"], capture_output=True,
                         text=True, timeout=120, env={**env, "TANDEM_PORT": "0"})
    settings = json.loads(out.stdout)["settings"]
    assert settings["queue"] == {"value": 3, "source": "config",
                                 "origin": f"{home / 'config.yaml'}:2"}
    assert settings["api_key"]["value"] == "(set)" and "s3cret" not in out.stdout + out.stderr
    assert settings["port"]["source"] == "env" and settings["host"]["value"] == "127.0.0.1"
    # a server whose key is in config.yaml wants it; a flag's key wins over the file's
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.yaml").write_text("serve:\n  api_key: k1\n")
    for flags, key in (([], "k1"), (["--api-key", "k2"], "k2")):
        srv = Server([*_models(tiny_models), "--strategy", "none", *flags], served)
        try:
            assert srv.raw("GET", "/v1/models")[0] == 401
            assert srv.raw("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})[0] \
                == 200
        finally:
            srv.stop()
