"""`tandem serve --parallel 8` under load on the tiny FIM pair (issue 52): 8 clients at once
send a mix of requests (chats with a shared system prompt, streamed and whole, a JSON schema, a
forced tool call, a raw /v1/completions prompt, /infill), greedy, and every few requests one
of them drops a long stream part way. No request fails, every answered one equals the same
request alone (text and tool calls, token count, finish reason), the dropped streams are
cancelled and free their slots, and what is asked next still answers as alone.

`auto` takes the long run with the history library on: the server has its own TANDEM_HOME (the
test's) and each finished answer joins the library while other slots draft from it, so the
library's index is written and read from several slots at once (the race of issue 52).
`--strategy draft` takes a shorter run (the draft model in every slot's batch: `auto` turns it
off on this CPU); one server runs one strategy.

"Alone" is each distinct request sent once to the same server while it is idle, one at a time,
before the load; during the load each is sent again several times. The same server, not a fresh
one: its state (history library, cost curve, prompt cache, slots' caches) is part of what the
load runs on, and a greedy answer does not depend on it, only on the target's logits. What the
load changes is which rows are decoded together (other slots' rows, drafts of other lengths, a
prompt borrowed from another slot's cells), i.e. the batch shapes of llama.cpp's kernels, whose
logits differ a little (docs/serve.md, "Lossless per slot"): where an answer parts from its
alone one, the target's logits of the two tokens must be a near tie, the rule of
test_serve_parallel.assert_each_as_alone (a leak from another slot, a lost or misrouted piece,
a wrong count or finish reason fails it).
"""
from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import time

import pytest

from serve_helpers import Server, stop_cleanly
from test_serve_parallel import TOOLS, assert_each_as_alone

CLIENTS = 8
CANCEL_EVERY = 8  # every 8th request is a long stream its client drops after a few pieces
SYSTEM = "You answer in one short line and never repeat the question. " * 2  # shared by slots
PERSON = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}}


def distinct_requests() -> list[tuple[str, dict]]:
    """Five kinds of request in four variants each: 16 to 28 tokens, streamed or not."""
    out = []
    for i in range(4):
        n, stream = 16 + 4 * i, i % 2 == 0
        chat = [{"role": "system", "content": SYSTEM}]
        out += [
            ("/v1/chat/completions", {"messages": [*chat, {"role": "user", "content":
                                                           f"tell me about item {i}"}],
                                      "max_tokens": n, "stream": stream}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"person {i}"}],
                                      "max_tokens": n + 4, "response_format": PERSON,
                                      "stream": not stream}),
            ("/v1/chat/completions", {"messages": [*chat, {"role": "user", "content":
                                                           f"weather in city {i}?"}],
                                      "max_tokens": n + 4, "tools": TOOLS,
                                      "tool_choice": "required", "stream": stream}),
            ("/v1/completions", {"prompt": f"def scale_{i}(x):\n    return", "max_tokens": n,
                                 "stream": not stream}),
            ("/infill", {"input_prefix": f"def add_{i}(a, b):\n    return",
                         "input_suffix": "\n\nprint(add(1, 2))\n", "n_predict": n,
                         "stream": stream}),
        ]
    return out


def without_ids(calls):
    """Tool calls carry a fresh id per answer: compare them without it."""
    return [{k: v for k, v in c.items() if k != "id"} for c in calls or []]


def ask(srv: Server, path: str, body: dict) -> tuple[tuple, list[int]]:
    """The answer to one greedy request, whole and complete: (its text or streamed pieces and
    tool calls, its token count, its finish reason) and its token ids (return_tokens)."""
    body = {**body, "temperature": 0, "return_tokens": True}
    if body.get("stream") and path != "/infill":
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read().decode()
        assert resp.status == 200, f"{path} {resp.status}: {data}"
    finally:
        conn.close()
    if not body.get("stream"):
        b = json.loads(data)
        if path == "/infill":
            assert b["stop"] is True
            out = (b["content"], None, b["tokens_predicted"], b["stop_type"]), b["tokens"]
        else:
            choice = b["choices"][0]
            msg = choice.get("message", {})
            text = choice["text"] if "text" in choice else msg.get("content")
            out = ((text, without_ids(msg.get("tool_calls")), b["usage"]["completion_tokens"],
                    choice["finish_reason"]), b["tandem"]["tokens"])
    else:
        events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
        if path == "/infill":
            objs = [json.loads(e) for e in events]
            last = objs[-1]
            assert last["stop"] is True and all(not o["stop"] for o in objs[:-1]), data
            pieces = [o["content"] for o in objs[:-1]]
            out = (pieces, None, last["tokens_predicted"], last["stop_type"]), last["tokens"]
        else:
            assert events and events[-1] == "[DONE]", data
            objs = [json.loads(e) for e in events[:-1]]
            usage = [o["usage"] for o in objs if o.get("usage")]
            pieces, calls, ends, ids = [], [], [], []
            for o in objs:
                for c in o["choices"]:
                    d = c.get("delta", {})
                    if c.get("text") or d.get("content"):
                        pieces.append(c.get("text") or d.get("content"))
                    calls += without_ids(d.get("tool_calls"))
                    if c.get("finish_reason"):
                        ends.append(c["finish_reason"])
                ids += o.get("tandem", {}).get("tokens", [])
            assert len(ends) == 1 and len(usage) == 1, data
            out = (pieces, calls, usage[0]["completion_tokens"], ends[0]), ids
    (_, _, n, reason), ids = out
    assert reason and n == len(ids), f"{path}: {n} tokens counted, {len(ids)} returned"
    return out


def drop_part_way(srv: Server, i: int) -> None:
    """A long streamed chat whose client goes after its first pieces, as a closed editor tab."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"messages": [{"role": "user", "content": f"a long story, part {i}"}],
             "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        pieces = 0
        while pieces < 3:
            line = resp.fp.readline()
            assert line, "the stream ended before the client dropped it"
            pieces += line.startswith(b"data: ")
        conn.sock.shutdown(socket.SHUT_RDWR)
        resp.close()
    finally:
        conn.close()


def metrics(srv: Server) -> dict[str, float]:
    status, body, _ = srv.raw("GET", "/metrics")
    assert status == 200, body
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in body["_raw"].splitlines()
                                     if line and not line.startswith("#"))}


def accepted_from(values: dict[str, float], source: str) -> float:
    return values.get(
        f'tandem:spec_decode_accepted_tokens_by_source_total{{source="{source}"}}', 0.0)


def idle(srv: Server, cancels: int) -> dict:
    """/health once nothing runs or waits and every dropped stream is counted as cancelled."""
    for _ in range(600):
        health = srv.health()
        if health["processing"] == health["waiting"] == 0 and health["cancelled"] >= cancels:
            return health
        time.sleep(0.1)
    raise AssertionError(f"the server did not come to rest: {health}")


def under_load(srv: Server, requests: list, n: int) -> tuple[list, list, int]:
    """n requests from CLIENTS threads at once: the distinct requests in turn, every
    CANCEL_EVERY-th one a dropped stream. The answers by request, the failures, the drops."""
    jobs: queue.Queue = queue.Queue()
    for i in range(n):
        jobs.put(i)
    got: list = [[] for _ in requests]
    failures: list[str] = []
    start = threading.Barrier(CLIENTS)

    def client():
        start.wait()
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                if i % CANCEL_EVERY == CANCEL_EVERY - 1:
                    drop_part_way(srv, i)
                else:
                    k = (i * 7) % len(requests)  # a different kind each turn, each repeated
                    got[k].append(ask(srv, *requests[k]))
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                failures.append(f"request {i}: {exc!r}")

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client is still waiting"
    return got, failures, n // CANCEL_EVERY


@pytest.mark.parametrize("strategy, n, source", [("auto", 200, "history"),
                                                 ("draft", 64, "model")])
def test_eight_clients_at_once_each_answer_as_alone(tiny_models, tmp_path, strategy, n,
                                                    source):
    srv = Server(["-m", str(tiny_models["fim"]), "-md", str(tiny_models["fim_draft"]),
                  "-t", "1", "--parallel", str(CLIENTS), "--strategy", strategy], tmp_path)
    try:
        requests = distinct_requests()
        alone = [ask(srv, *r) for r in requests]
        before = metrics(srv)
        got, failures, cancels = under_load(srv, requests, n)
        assert not failures, failures
        health = idle(srv, cancels)
        answered = sum(map(len, got))
        assert answered == n - cancels
        assert (health["served"], health["cancelled"]) == (len(requests) + answered, cancels)
        for k, answers in enumerate(got):
            assert_each_as_alone(tiny_models["fim"], [requests[k]] * len(answers),
                                 [alone[k]] * len(answers), answers)
        # the drafts under load came from the source this strategy is here for
        assert accepted_from(metrics(srv), source) > accepted_from(before, source)
        if strategy == "auto":
            assert any((tmp_path / "history").iterdir())  # the library this server filled
        # after the drops every slot is free, and what comes next answers as alone
        status, slots, _ = srv.raw("GET", "/slots")
        assert status == 200 and len(slots) == CLIENTS + 1
        assert not any(s["is_processing"] for s in slots), slots
        assert_each_as_alone(tiny_models["fim"], requests, alone, [ask(srv, *r) for r in requests])
    finally:
        srv.stop()
    stop_cleanly(srv)
