"""scripts/bench_concurrency.py (issue 41): its scenarios against a fake server whose answers
and delays are known (the rows' arithmetic), its report's ratios, the servers' arguments
(same context per slot), and the script on the tiny FIM pair with tandem serve only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAT_S, INFILL_S = 0.3, 0.1  # the fake's time per chat answer and per /infill
PREDICTED = 7  # tokens of every fake answer


def _timings(n: int = PREDICTED) -> dict:
    return {"prompt_n": 11, "predicted_n": n, "predicted_ms": 100.0,
            "predicted_per_second": 70.0}


class _Fake(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, time.perf_counter(), body))
        if self.path == "/infill":
            time.sleep(INFILL_S)
            return self._json({"content": "x", "timings": _timings(3)})
        if not body.get("stream"):
            time.sleep(CHAT_S)
            return self._json({"choices": [{"message": {"content": "hi"},
                                            "finish_reason": "length"}], "timings": _timings()})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(3):
            time.sleep(CHAT_S / 3)
            chunk = {"choices": [{"delta": {"content": f"t{i}"}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        last = {"choices": [{"delta": {}, "finish_reason": "length"}], "timings": _timings()}
        self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())

    def _json(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    httpd.seen = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd, SimpleNamespace(name="fake", port=httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


def test_four_at_once_aggregate_is_tokens_over_wall(fake):
    import bench_concurrency as bc

    httpd, server = fake
    prompts = [bc.chat_prompts()[i] for i in bc.FOUR_PROMPTS]
    row = bc.scenario_four(server, 0, prompts, 96, 42)
    assert row.error is None and len(row.requests) == 4
    assert row.tokens == 4 * PREDICTED
    assert row.tok_s == pytest.approx(row.tokens / row.wall_s)
    lat = [r["latency_s"] for r in row.requests]
    assert all(x >= CHAT_S for x in lat) and row.latency_s == pytest.approx(sum(lat) / 4)
    assert row.wall_s >= max(lat)
    assert row.wall_s < 4 * CHAT_S  # sent together: they overlapped on the threaded fake
    sends = [t for path, t, _ in httpd.seen]
    assert max(sends) - min(sends) < CHAT_S
    assert {b["max_tokens"] for _, _, b in httpd.seen} == {96}
    assert all(b["temperature"] == 0.0 and not b["stream"] for _, _, b in httpd.seen)


def test_alone_one_at_a_time(fake):
    import bench_concurrency as bc

    httpd, server = fake
    prompts = [bc.chat_prompts()[i] for i in bc.ALONE_PROMPTS]
    row = bc.scenario_alone(server, 1, prompts, 96, 42)
    assert row.error is None and row.rep == 1 and row.tokens == 4 * PREDICTED
    assert row.tok_s == 70.0  # the server's own timings
    assert row.latency_s >= CHAT_S and row.wall_s >= 4 * CHAT_S
    starts = [r["sent_s"] for r in row.requests]
    assert all(b - a >= CHAT_S for a, b in zip(starts, starts[1:]))


def test_infill_during_chat(fake):
    import bench_concurrency as bc

    httpd, server = fake
    hole = bc.infill_hole()
    row = bc.scenario_infill(server, 0, bc.chat_prompts()[bc.CHAT_PROMPT], hole, 200, 0.1, 42)
    assert row.error is None and row.overlapped
    assert INFILL_S <= row.latency_s < CHAT_S
    assert row.chat_total_s >= CHAT_S and row.tokens == PREDICTED and row.prompt_n == 11
    (chat_path, t_chat, chat_body), (fill_path, t_fill, fill_body) = sorted(
        httpd.seen, key=lambda s: s[1])
    assert chat_path == "/v1/chat/completions" and chat_body["stream"]
    assert chat_body["max_tokens"] == 200
    # the /infill reaches the server after the chat (the order: the gap the server sees
    # shrinks on a loaded machine, where the chat's request itself arrives late)
    assert fill_path == "/infill" and t_fill > t_chat
    assert fill_body["n_predict"] == 128 and fill_body["input_extra"]
    assert fill_body["input_prefix"].endswith("\n") and hole.extra["hole"].strip()


def test_the_hole_is_cut_from_its_file():
    import bench_concurrency as bc
    from tandem.bench.editor_workload import code_files

    hole = bc.infill_hole()
    b, text = hole.body, code_files()["csv.py"]
    assert b["input_prefix"] + hole.extra["hole"] + b["input_suffix"] in text
    size = len(b["input_prefix"]) + len(b["input_suffix"]) + len(b["input_extra"][0]["text"])
    assert 0.9 * bc.INFILL_CHARS <= size <= bc.INFILL_CHARS


def test_report_ratios_per_repetition_and_busy_marks():
    from bench_concurrency import ALONE, BASELINE, FOUR, Row, report

    rows = [Row(BASELINE, FOUR, 0, latency_s=2.0, tok_s=10.0, tokens=40, step_ms=150.0),
            Row("tandem", FOUR, 0, latency_s=1.0, tok_s=30.0, tokens=40, step_ms=100.0),
            Row(BASELINE, FOUR, 1, latency_s=4.0, tok_s=20.0, tokens=40, step_ms=120.0),
            Row("tandem", FOUR, 1, latency_s=1.0, tok_s=20.0, tokens=40, step_ms=160.0),
            Row(BASELINE, ALONE, 0, latency_s=1.0, tok_s=10.0, tokens=40),
            Row("tandem", ALONE, 0, latency_s=2.0, tok_s=5.0, tokens=40, busy=0.6)]
    text = report(rows, [BASELINE, "tandem"])
    # x latency: median of 2/1 and 4/1; x tok/s: median of 30/10 and 20/20; ms/step: median
    # of 100 and 160, x step: median of 150/100 and 120/160
    assert ("| four-at-once | tandem | 2 | 1.00 | 3.00 | - | - | 25.0 | 2.00 | 130.0 | 1.12 "
            "| 40 | - |") in text
    assert ("| alone | tandem | 1 | 2.00 | 0.50 busy | - | - | 5.0 | 0.50 busy | - | - | 40 "
            "| 1/1 |") in text


def test_each_request_counts_its_decode_steps_alike_on_both_servers():
    """tandem's decode holds one step per verify batch (its `tandem.verify_steps`), counted
    with end-of-text when the answer stopped there; llama-server's one per predicted token
    less the drafts it accepted."""
    from bench_concurrency import Row, _finish, _request

    llama = {"timings": {"predicted_n": 96, "predicted_ms": 14400.0, "prompt_n": 50,
                         "prompt_ms": 900.0, "draft_n_accepted": 0}}
    tandem = {"timings": {"predicted_n": 95, "predicted_ms": 13000.0, "prompt_n": 50,
                          "prompt_ms": 950.0, "draft_n_accepted": 20},
              "choices": [{"finish_reason": "stop"}], "tandem": {"verify_steps": 80}}
    a = _request("chat", "a", 0.0, 15.0, llama, 0.0)
    b = _request("chat", "b", 0.0, 14.0, tandem, 0.0)
    assert a["step_ms"] == 150.0 and b["step_ms"] == 162.5  # 13000 ms / 80 steps
    assert _request("chat", "c", 0.0, 1.0, None, 0.0)["step_ms"] is None
    row = Row("x", "four-at-once", 0)
    row.requests = [a, b]
    assert _finish(row, []).step_ms == 156.25 and row.error is None


def test_servers_get_the_same_context_per_slot():
    from bench_concurrency import llama_args, rep_order, without_np

    auto = llama_args("defaults", 2, 4096, Path("d.gguf"))
    assert "-np" not in auto and auto[auto.index("-c") + 1] == "16384"
    one = llama_args("np1", 2, 4096, Path("d.gguf"))
    assert one[one.index("-np") + 1] == "1" and one[one.index("-c") + 1] == "4096"
    draft = llama_args("draft", 2, 4096, Path("d.gguf"))
    assert "-np" not in draft and "draft-simple" in draft and "d.gguf" in draft
    assert without_np(["-t", "2", "-np", "1", "--jinja"]) == ["-t", "2", "--jinja"]
    names = ["a", "b", "c", "d"]
    assert [rep_order(names, r) for r in range(3)] == [
        ["a", "b", "c", "d"], ["d", "c", "b", "a"], ["b", "c", "d", "a"]]


def test_parallel_flag_only_when_tandem_serve_lists_it():
    from bench_concurrency import tandem_has_parallel

    assert tandem_has_parallel([sys.executable, "-c", "print('--parallel  -np  <int>')"])
    assert not tandem_has_parallel([sys.executable, "-c", "print('--queue <int>')"])


def test_bench_concurrency_on_tiny_models(tiny_models, tmp_path):
    """tandem serve only: every scenario measured, its rows' arithmetic, the JSON written."""
    out = tmp_path / "conc.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_concurrency.py"), "-m",
         str(tiny_models["fim"]), "-md", str(tiny_models["fim_draft"]), "--no-llama",
         "--no-quiet-check", "--reps", "1", "-n", "16", "--chat-tokens", "32",
         "--infill-delay", "0", "-t", "1", "-c", "4096", "--out", str(out),
         "--log-dir", str(tmp_path / "logs"), "--no-tandem-one"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    rows = {r["scenario"]: r for r in data["rows"]}
    assert set(rows) == {"infill-during-chat", "four-at-once", "alone"}
    assert all(r["error"] is None and r["server"] == "tandem" for r in rows.values())
    four = rows["four-at-once"]
    assert four["tokens"] == sum(q["predicted_n"] for q in four["requests"]) > 0
    assert four["tok_s"] == pytest.approx(four["tokens"] / four["wall_s"])
    assert four["latency_s"] == pytest.approx(
        sum(q["latency_s"] for q in four["requests"]) / 4)
    assert all(q["latency_s"] > 0 for r in rows.values() for q in r["requests"])
    assert rows["infill-during-chat"]["prompt_n"] > 0
    assert rows["alone"]["tok_s"] > 0
    # tandem's non-streamed answers carry its verify steps: each one's time per step
    assert four["step_ms"] > 0 and all(q["step_ms"] > 0 for q in four["requests"])
    assert data["meta"]["ctx_per_slot"] == 4096
    assert "| four-at-once | tandem | 1 |" in res.stdout


def test_together_runs_each_scenario_on_every_server_in_turn(tiny_models, tmp_path):
    """--together: both servers up at once, each scenario on one then the other (one server
    at a time would run every scenario on the first before starting the second)."""
    from bench_concurrency import ALONE, FOUR, ONE_SLOT, TANDEM

    out = tmp_path / "conc.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_concurrency.py"), "-m",
         str(tiny_models["fim"]), "-md", str(tiny_models["fim_draft"]), "--no-llama",
         "--no-quiet-check", "--reps", "1", "-n", "8", "-t", "1", "-c", "1024", "--out",
         str(out), "--log-dir", str(tmp_path / "logs"), "--together",
         "--scenario", FOUR, "--scenario", ALONE],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scenario"], r["server"]) for r in rows] == [
        (FOUR, TANDEM), (FOUR, ONE_SLOT), (ALONE, TANDEM), (ALONE, ONE_SLOT)]
    assert all(r["error"] is None and r["tokens"] > 0 for r in rows)
    ready = [i for i, line in enumerate(res.stderr.splitlines()) if " ready on " in line]
    first = next(i for i, line in enumerate(res.stderr.splitlines()) if f" {FOUR}: " in line)
    assert len(ready) == 2 and max(ready) < first  # both up before the first scenario
