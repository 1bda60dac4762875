"""The target over llama.cpp's RPC backend, on loopback only, with real `tandem rpc-server`
processes started here and the tiny models: output identical to a local run in exact mode
(all layers remote, and split local + remote), and every fault ending in a clean error with
exit code 6 within a bounded time (nobody listening, an HTTP server, another protocol
version, a server killed or stopped mid-generation or mid-benchmark)."""
from __future__ import annotations

import http.server
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from tandem.engine.remote import rpc  # noqa: E402
from tandem.errors import EXIT_OK, EXIT_REMOTE, EXIT_USAGE, RemoteError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, **extra) -> dict:
    env = {**os.environ, "TANDEM_HOME": str(home), "NO_COLOR": "1", "TANDEM_HISTORY": "off"}
    env.update(extra)
    return env


class Server:
    """A `tandem rpc-server` on 127.0.0.1 and a free port, up once it answers a handshake."""

    def __init__(self, home: Path, *args: str):
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem", "rpc-server", "--port", str(self.port), "-t", "1",
             *args],
            env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.info = rpc.check_endpoint(self.endpoint, timeout=2)
                break
            except RemoteError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rpc-server did not come up: {self.proc.stderr.read()}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stderr.close()


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    return h


@pytest.fixture
def server(home):
    s = Server(home)
    yield s
    s.stop()


@pytest.fixture
def tandem(tiny_models, home, tmp_path):
    models = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t", "1"]

    def run(*args, env: dict | None = None, timeout: float = 120):
        return subprocess.run([sys.executable, "-m", "tandem", "run", *models, *args],
                              capture_output=True, env=_env(home, **(env or {})),
                              cwd=tmp_path, timeout=timeout, stdin=subprocess.DEVNULL)

    return run


def out(res) -> str:
    return res.stdout.decode()


def err(res) -> str:
    return res.stderr.decode()


def test_handshake_matches_tandems_own_server(server):
    """The protocol constants tandem checks against are the wheel's own: its server says so."""
    assert server.info.version == rpc.PROTO
    info = rpc.server_info(server.endpoint)
    assert info.devices and info.devices[0].total > 0 and info.free > 0


@pytest.mark.parametrize("strategy", ["none", "draft"])
def test_exact_output_identical_to_local_all_remote_and_split(tandem, server, strategy):
    args = ["--raw", "--exact", "-n", "48", "--strategy", strategy, "hello there"]
    local = tandem(*args)
    assert local.returncode == EXIT_OK, err(local)
    remote = tandem(*args, "--rpc", server.endpoint, "--verbose")
    assert remote.returncode == EXIT_OK, err(remote)
    assert out(remote) == out(local) and len(out(local)) > 20
    log = err(remote)
    # every target layer and the output on the server; the draft never
    assert log.count("assigned to device RPC0") == 3
    assert f"RPC0[{server.endpoint}] model buffer size" in log
    assert "offloaded 0/3 layers" in log or strategy == "none"
    split = tandem(*args, "--rpc", server.endpoint, "--verbose",
                   env={"TANDEM_GPU_LAYERS": "2"})  # layer 1 + output
    assert split.returncode == EXIT_OK, err(split)
    assert out(split) == out(local)
    log = err(split)
    assert "layer   1 assigned to device RPC0" in log
    assert "layer   0 assigned to device CPU" in log


@pytest.mark.parametrize("target, draft", [("hybrid", "draft"), ("target", "hybrid_draft")])
def test_a_hybrid_and_a_transformer_draft_for_each_other_over_rpc(tiny_models, home, tmp_path,
                                                                   server, target, draft):
    """Memory types mixed in a pair (issue 40): a hybrid target on the RPC server with a
    transformer draft here, and the reverse; every draft rejected (unrelated weights), each
    rolled back on its own kind of memory: the output is plain decoding's, here and remote."""
    def run(strategy: str, *extra: str):
        res = subprocess.run(
            [sys.executable, "-m", "tandem", "run", "-m", str(tiny_models[target]), "-md",
             str(tiny_models[draft]), "-t", "1", "--raw", "-n", "40", "--temp", "0",
             "--draft-p-min", "0", "--json", "--no-history", "--strategy", strategy, *extra,
             "abc abc abc hello world"],
            capture_output=True, env=_env(home), cwd=tmp_path, timeout=120,
            stdin=subprocess.DEVNULL)
        assert res.returncode == EXIT_OK, err(res)
        return json.loads(out(res))

    plain = run("none")
    for where in ((), ("--rpc", server.endpoint)):
        spec = run("draft", *where)
        assert spec["text"] == plain["text"] and spec["stats"]["drafted"] > 0, where
        assert spec["stats"]["accepted"] < spec["stats"]["drafted"], where


def _no_debris(home: Path, cwd: Path) -> None:
    assert not list(home.rglob("*.tmp")), list(home.rglob("*.tmp"))
    assert not list(cwd.glob("core*"))


def test_nobody_listening(tandem, home, tmp_path):
    port = free_port()
    res = tandem("--raw", "-n", "8", "--rpc", f"127.0.0.1:{port}", "hi", timeout=60)
    assert res.returncode == EXIT_REMOTE
    assert f"Error: nobody is listening on 127.0.0.1:{port}" in err(res)
    assert "Hint: " in err(res) and "Traceback" not in err(res) and out(res) == ""
    _no_debris(home, tmp_path)


def test_a_port_that_speaks_http(tandem, home, tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        ep = f"127.0.0.1:{httpd.server_address[1]}"
        res = tandem("--raw", "-n", "8", "--rpc", ep, "hi", timeout=60)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert res.returncode == EXIT_REMOTE, err(res)
    assert f"Error: {ep} does not speak llama.cpp's RPC protocol" in err(res)
    assert "HTTP server" in err(res) and "Traceback" not in err(res)
    _no_debris(home, tmp_path)


def _fake_server(reply: bytes):
    """Answers each connection's first 33 bytes (a HELLO) with `reply`."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    stop = threading.Event()

    def serve():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                got = b""
                try:
                    while len(got) < 33:
                        chunk = conn.recv(33 - len(got))
                        if not chunk:
                            break
                        got += chunk
                    if got[:1] == bytes([14]) and struct.unpack("<Q", got[1:9])[0] == 24:
                        conn.sendall(reply)
                except OSError:
                    pass
        sock.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{sock.getsockname()[1]}", stop


def test_wrong_protocol_version(tandem, home, tmp_path):
    ep, stop = _fake_server(struct.pack("<Q", 28) + bytes([6, 1, 0, 0]) + bytes(24))
    try:
        res = tandem("--raw", "-n", "8", "--rpc", ep, "hi", timeout=60)
    finally:
        stop.set()
    assert res.returncode == EXIT_REMOTE, err(res)
    assert f"Error: the rpc-server at {ep} speaks RPC protocol 6.1.0" in err(res)
    assert f"speaks {'.'.join(map(str, rpc.PROTO))}" in err(res)
    _no_debris(home, tmp_path)


def _run_until_text(tiny_models, home, tmp_path, ep, *extra):
    """`tandem run` streaming a long answer over `ep`; returns the process once it has
    printed some text, and what it printed so far."""
    cmd = [sys.executable, "-m", "tandem", "run", "-m", str(tiny_models["target"]), "-md",
           str(tiny_models["draft"]), "-t", "1", "--raw", "-n", "8000", "-c", "8192",
           "--strategy", "draft", "--rpc", ep, *extra, "hello there"]
    proc = subprocess.Popen(cmd, env=_env(home), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    got = b""
    deadline = time.monotonic() + 90
    while len(got) < 40:
        assert time.monotonic() < deadline, "no text streamed"
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, proc.stderr.read()
            got += chunk
    return proc, got


def _finish(proc, got: bytes, limit: float):
    t0 = time.monotonic()
    try:
        rest, errs = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"tandem did not end within {limit} s of the fault") from None
    return got + rest, errs.decode(), time.monotonic() - t0


def test_server_killed_mid_generation(tiny_models, home, tmp_path, server):
    proc, got = _run_until_text(tiny_models, home, tmp_path, server.endpoint)
    server.proc.kill()  # kill -9
    text, errs, took = _finish(proc, got, 60)
    assert proc.returncode == EXIT_REMOTE, errs
    assert f"Error: the RPC link to {server.endpoint} failed" in errs
    assert "Hint: " in errs and "Traceback" not in errs and "GGML" not in errs
    assert len(text) >= 40 and text.endswith(b"\n") and len(text) < 8000
    _no_debris(home, tmp_path)


def test_server_stalled_mid_generation(tiny_models, home, tmp_path, server):
    proc, got = _run_until_text(tiny_models, home, tmp_path, server.endpoint,
                                "--rpc-timeout", "3")
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        text, errs, took = _finish(proc, got, 60)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert proc.returncode == EXIT_REMOTE, errs
    assert f"Error: the RPC link to {server.endpoint} failed" in errs
    assert "sent nothing for 3 s" in errs and "--rpc-timeout" in errs
    assert text.endswith(b"\n") and "Traceback" not in errs
    _no_debris(home, tmp_path)


HOST_PORT = "RPC servers must be HOST:PORT[,HOST:PORT...]: "


@pytest.mark.parametrize("value, error", [
    ("localhost", HOST_PORT + "'localhost' is not HOST:PORT"),
    ("127.0.0.1:0", HOST_PORT + "the port of '127.0.0.1:0' must be a number in 1..65535"),
    ("127.0.0.1:70000", HOST_PORT + "the port of '127.0.0.1:70000' must be a number in 1..65535"),
    ("a:1,a:1", "RPC servers names a server twice"),
])
def test_bad_endpoints_are_usage_errors(tandem, value, error):
    """Each refusal says what is wrong with that value: one expected message per case (an
    `A and B or C` assert once passed on C alone)."""
    res = tandem("--raw", "-n", "4", "--rpc", value, "hi", timeout=60)
    assert res.returncode == EXIT_USAGE, err(res)
    assert err(res).splitlines() == [f"Error: {error}", "Hint: check --rpc"], err(res)
    assert out(res) == ""


def test_rpc_from_env_and_config(tandem, home, server, tiny_models):
    base = ["--raw", "--exact", "-n", "16", "--strategy", "none", "hello"]
    local = out(tandem(*base))
    via_env = tandem(*base, env={"TANDEM_RPC": server.endpoint})
    assert via_env.returncode == EXIT_OK, err(via_env)
    assert out(via_env) == local
    (home / "config.yaml").write_text(f"rpc:\n  - {server.endpoint}\nrpc_timeout: 30\n")
    via_cfg = tandem(*base, "--verbose")
    assert via_cfg.returncode == EXIT_OK, err(via_cfg)
    assert out(via_cfg) == local and "assigned to device RPC0" in err(via_cfg)
    bad = tandem(*base, env={"TANDEM_RPC": "nohost"})
    assert bad.returncode == EXIT_USAGE and "TANDEM_RPC" in err(bad)


def test_rpc_server_refuses_open_addresses_and_busy_ports(home, server):
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "tandem", "rpc-server", *args],
                              capture_output=True, env=_env(home), timeout=60,
                              stdin=subprocess.DEVNULL)

    res = serve("--host", "0.0.0.0", "--port", str(free_port()))
    assert res.returncode == EXIT_USAGE and "--allow-remote" in res.stderr.decode()
    res = serve("--port", str(server.port))
    assert res.returncode == EXIT_USAGE and "already in use" in res.stderr.decode()


def test_rpc_server_stops_cleanly_on_ctrl_c(home):
    s = Server(home)
    try:
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(30) == 0
        assert "rpc-server stopped." in s.proc.stderr.read().decode()
    finally:
        s.stop()


@pytest.mark.parametrize("seed", range(4))
def test_rpc_server_takes_ctrl_c_at_any_point_of_its_start_up(home, seed):
    """A SIGINT at a random point of start-up (seeded: reproducible): before the command
    runs it is main()'s `Interrupted.` (130), from the command's first line on the server's
    own stop (0); never a hang in llama.cpp's teardown, never a traceback."""
    import random

    delay = random.Random(seed).uniform(0.0, 1.5)  # python's start, the imports, ggml, bind
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "rpc-server", "--port", str(port),
                             "-t", "1"], env=_env(home), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)  # a hang fails here
        errs = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stderr.close()
    assert "Traceback" not in errs, errs
    # each way out says its own word: the server's stop, main()'s (or the imports') Ctrl-C,
    # or the signal itself while the interpreter was still starting
    said = {0: "rpc-server stopped.", 130: "Interrupted.", -signal.SIGINT: ""}
    assert code in said, (code, errs)
    assert said[code] in errs, (code, errs)


def _chat(tiny_models, home, script: str, *args, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "tandem", "chat", "-m", str(tiny_models["target"]), "-md",
         str(tiny_models["draft"]), "-t", "1", "-n", "16", "--exact", "--plain-probe", "0",
         "--strategy", "draft", *args],
        input=script, capture_output=True, text=True, env=_env(home, COLUMNS="100"),
        timeout=timeout)


def _answers(out: str) -> list[str]:
    """The chat's answers (after the prompt) and its context figures (KV reuse)."""
    return [ln for ln in out.splitlines()
            if ln.startswith(">>> ") or ln.startswith(("context ", "last prompt"))]


def test_chat_over_rpc_answers_as_locally(tiny_models, home, server):
    script = "hello there\nsecond turn\n/stats\n"
    local = _chat(tiny_models, home, script)
    remote = _chat(tiny_models, home, script, "--rpc", server.endpoint)
    assert local.returncode == EXIT_OK and remote.returncode == EXIT_OK, remote.stderr
    assert _answers(remote.stdout) == _answers(local.stdout)
    assert len(_answers(local.stdout)) >= 4 and "rest from the KV cache" in remote.stdout
    assert "Error:" not in remote.stderr


def test_chat_ends_with_exit_6_when_the_server_dies(tiny_models, home, server):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "chat", "-m", str(tiny_models["target"]), "-md",
         str(tiny_models["draft"]), "-t", "1", "-n", "16", "--plain-probe", "0",
         "--rpc", server.endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=_env(home, COLUMNS="100"), text=True)
    try:
        proc.stdin.write("hello there\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 90
        seen = ""
        while "tok/s" not in seen:  # the first answer is complete
            assert time.monotonic() < deadline
            seen += proc.stdout.readline()
        server.proc.kill()
        server.proc.wait(10)
        out, errs = proc.communicate("second turn\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_REMOTE, errs
    assert f"Error: the RPC link to {server.endpoint} failed" in errs
    assert "Traceback" not in errs
    assert not list(home.rglob("*.tmp"))


def test_two_servers_placement_matches_the_plan(tandem, tiny_models, home):
    """llama.cpp splits the offloaded layers by the servers' free memory (here as --mem
    says: 1 to 3); `tandem hw --rpc` predicts the same devices per layer, and the output is
    still identical."""
    import re

    a, b = Server(home, "--mem", "100"), Server(home, "--mem", "300")
    try:
        eps = f"{a.endpoint},{b.endpoint}"
        args = ["--raw", "--exact", "-n", "32", "--strategy", "draft", "hello there"]
        local = tandem(*args)
        remote = tandem(*args, "--rpc", eps, "--verbose")
        assert remote.returncode == EXIT_OK, err(remote)
        assert out(remote) == out(local)
        placed = {}
        for il, dev in re.findall(r"layer +(\d+) assigned to device (\w+)", err(remote)):
            placed.setdefault(int(il), dev)  # the target loads first
        hw = subprocess.run([sys.executable, "-m", "tandem", "hw", "-m",
                             str(tiny_models["target"]), "--rpc", eps, "--json"],
                            capture_output=True, env=_env(home), timeout=120)
        assert hw.returncode == EXIT_OK, hw.stderr.decode()
        plan = json.loads(hw.stdout)["remote_target"]
        predicted = {}
        for d in plan["devices"]:
            for il in d["layers"]:
                predicted[il] = d["device"]
            if d["output"]:
                predicted[len(placed) - 1] = d["device"]
        assert predicted == placed
        assert placed == {0: "RPC0", 1: "RPC1", 2: "RPC1"}  # equal memory would give 0, 0, 1
        assert [d["free"] for d in plan["devices"][1:]] == [100 << 20, 300 << 20]
        assert [d["endpoint"] for d in plan["devices"]] == ["", a.endpoint, b.endpoint]
    finally:
        a.stop()
        b.stop()


def test_hw_shows_the_layers_on_the_remote_device(tiny_models, home, server):
    res = subprocess.run([sys.executable, "-m", "tandem", "hw", "-m", str(tiny_models["target"]),
                          "-md", str(tiny_models["draft"]), "--rpc", server.endpoint],
                         capture_output=True, env=_env(home, COLUMNS="160"), timeout=120)
    assert res.returncode == EXIT_OK, res.stderr.decode()
    text = res.stdout.decode()
    assert "Target over RPC" in text
    row = next(ln for ln in text.splitlines() if "RPC0" in ln)
    assert server.endpoint in row and "2/2: 0-1 + output" in row
    assert "Across the link per token" in text


def test_auto_measures_its_costs_over_the_link(tandem, home, server):
    """A remote target's costs are keyed by the endpoints (not the local ones) and the run's
    notes say how the link was priced."""

    args = ["--raw", "-n", "24", "--strategy", "auto", "--json", "hello there"]
    local = tandem(*args)
    assert local.returncode == EXIT_OK, err(local)
    def costs_files():  # the calibrations, not the acceptance kept beside them
        return {p for p in (home / "costs").glob("*.json") if not p.name.endswith(".knowledge.json")}

    before = costs_files()
    remote = tandem(*args, "--rpc", server.endpoint)
    assert remote.returncode == EXIT_OK, err(remote)
    notes = " ".join(json.loads(out(remote))["stats"].get("notes", []))
    # priced over the link, not with the local run's cached costs
    assert f"costs: measured over RPC {server.endpoint}" in notes
    new = costs_files() - before
    if "machine busy while calibrating" in notes:  # a busy machine's figures are never kept
        assert new == set(), new
    else:  # kept under its own key, beside the local one
        assert len(new) == 1, new
        assert json.loads(new.pop().read_text())["source"] == \
            f"measured over RPC {server.endpoint}"


def test_a_server_too_small_for_its_share_is_refused(tandem, home):
    from tandem.errors import EXIT_MODEL

    small = Server(home, "--mem", "1")
    try:
        res = tandem("--raw", "-n", "4", "--rpc", small.endpoint, "hi", timeout=60)
    finally:
        small.stop()
    assert res.returncode == EXIT_MODEL, err(res)
    assert "does not fit over these RPC servers" in err(res) and "RPC0" in err(res)
    assert "reports 1 MiB free" in err(res)


def test_ctrl_c_stops_a_remote_run_and_frees_the_server(tiny_models, home, tmp_path, server):
    cmd = [sys.executable, "-m", "tandem", "run", "-m", str(tiny_models["target"]), "-md",
           str(tiny_models["draft"]), "-t", "1", "--raw", "-n", "8000", "-c", "8192",
           "--strategy", "draft", "--rpc", server.endpoint, "hello there"]
    proc = subprocess.Popen(cmd, env=_env(home), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    got = b""
    deadline = time.monotonic() + 90
    while len(got) < 40:
        assert time.monotonic() < deadline
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, proc.stderr.read()
            got += chunk
    proc.send_signal(signal.SIGINT)
    text, errs, _ = _finish(proc, got, 60)
    assert proc.returncode == 130, errs
    assert "Interrupted." in errs and "Traceback" not in errs
    assert text.endswith(b"\n") and len(text) < 8000
    # the worker is gone with its connection: the server (one client at a time) answers again
    assert rpc.check_endpoint(server.endpoint, timeout=10).version == rpc.PROTO


def test_spec_bench_over_rpc(tiny_models, home, tmp_path, server):
    res = subprocess.run(
        [sys.executable, "-m", "tandem", "spec-bench", "-m", str(tiny_models["target"]), "-md",
         str(tiny_models["draft"]), "-t", "1", "--quick", "--strategies", "none,draft", "-n",
         "8", "--rpc", server.endpoint, "--verbose"], capture_output=True, env=_env(home),
        cwd=tmp_path, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == EXIT_OK, err(res)[-2000:]
    assert "| draft |" in out(res)
    assert "assigned to device RPC0" in err(res)


def _spec_bench(tiny_models, *args: str) -> list[str]:
    return [sys.executable, "-m", "tandem", "spec-bench", "-m", str(tiny_models["target"]),
            "-md", str(tiny_models["draft"]), "-t", "1", "--strategies", "none,draft", *args]


def test_spec_bench_over_rpc_reports_what_a_local_run_does(tiny_models, home, tmp_path,
                                                           server):
    """The measuring runs in the worker over the link: in exact mode the same runs, tokens
    and report rows as in this process, and the cost curve crosses the pipe too."""
    reports = {}
    for where, extra in (("local", []), ("remote", ["--rpc", server.endpoint])):
        res = subprocess.run(
            _spec_bench(tiny_models, "--exact", "--per-category", "1", "-n", "12", "--out",
                        str(tmp_path / where), *extra), capture_output=True, env=_env(home),
            cwd=tmp_path, timeout=300, stdin=subprocess.DEVNULL)
        assert res.returncode == EXIT_OK, err(res)[-2000:]
        reports[where] = json.loads((tmp_path / where / "report.json").read_text())
    local, remote = reports["local"], reports["remote"]
    assert len(local["runs"]) == 12 and not remote["partial"]

    def runs(r):
        return sorted((x["config"], x["prompt_id"], x["rep"], tuple(x["tokens"]))
                      for x in r["runs"])

    def rows(r):
        return sorted((c["config"], c["category"], c["runs"], c["identical"], c["compared"])
                      for c in r["cells"])

    assert runs(remote) == runs(local)
    assert rows(remote) == rows(local)
    assert set(remote["meta"]["costs"]["verify_ms"]) == set(local["meta"]["costs"]["verify_ms"])
    assert remote["meta"]["costs"]["drafts"]
    _no_debris(home, tmp_path)


def _bench_until_first_run(tiny_models, home, tmp_path, ep, *extra):
    """spec-bench over `ep` with long runs (12 of them) and --out; returns the process once
    its first run is reported on stderr, and the stderr so far."""
    cmd = _spec_bench(tiny_models, "--per-category", "1", "-n", "2000", "-c", "4096",
                      "--no-warmup", "--no-cost-curve", "--out", str(tmp_path / "out"),
                      "--rpc", ep, *extra)
    proc = subprocess.Popen(cmd, env=_env(home), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = b""
    deadline = time.monotonic() + 120
    while b"[1/12]" not in seen:
        assert time.monotonic() < deadline, f"no run reported: {seen.decode()}"
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, seen.decode()
            seen += chunk
    assert b"[12/12]" not in seen  # the fault comes mid-benchmark
    return proc, seen


def _partial_report(tmp_path: Path, text: bytes) -> None:
    """The runs recorded before the fault are kept, marked partial, and nothing else."""
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["partial"] is True and 1 <= len(report["runs"]) < 12
    assert b"**Partial results**" in text
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_spec_bench_ends_with_exit_6_when_the_server_dies(tiny_models, home, tmp_path, server):
    proc, seen = _bench_until_first_run(tiny_models, home, tmp_path, server.endpoint)
    server.proc.kill()  # kill -9
    text, errs, took = _finish(proc, b"", 60)
    errs = seen.decode() + errs
    assert proc.returncode == EXIT_REMOTE, errs
    assert errs.count(f"Error: the RPC link to {server.endpoint} failed") == 1
    assert "Hint: " in errs and "Traceback" not in errs and "GGML" not in errs
    _partial_report(tmp_path, text)
    _no_debris(home, tmp_path)


def test_spec_bench_ends_with_exit_6_when_the_server_stalls(tiny_models, home, tmp_path,
                                                            server):
    proc, seen = _bench_until_first_run(tiny_models, home, tmp_path, server.endpoint,
                                        "--rpc-timeout", "3")
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        # 3 s without progress, a 2 s handshake to name the server, the report: far below
        # the 60 s default stall limit, which would mean --rpc-timeout was not honoured
        text, errs, took = _finish(proc, b"", 30)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    errs = seen.decode() + errs
    assert proc.returncode == EXIT_REMOTE, errs
    assert errs.count(f"Error: the RPC link to {server.endpoint} failed") == 1
    assert "sent nothing for 3 s" in errs and "--rpc-timeout" in errs
    assert "Traceback" not in errs
    _partial_report(tmp_path, text)
    _no_debris(home, tmp_path)


def test_ctrl_c_stops_a_remote_spec_bench_with_a_partial_report(tiny_models, home, tmp_path,
                                                                server):
    """Ctrl-C reaches the parent only; it tells the worker, which ends after its run."""
    proc, seen = _bench_until_first_run(tiny_models, home, tmp_path, server.endpoint)
    proc.send_signal(signal.SIGINT)
    text, errs, _ = _finish(proc, b"", 60)
    errs = seen.decode() + errs
    assert proc.returncode == 130, errs
    assert "Interrupted: partial results" in errs and "Traceback" not in errs
    _partial_report(tmp_path, text)
    _no_debris(home, tmp_path)
    # the worker is gone with its connection: the server answers again
    assert rpc.check_endpoint(server.endpoint, timeout=10).version == rpc.PROTO


@pytest.mark.parametrize("value,expect", [
    ("127.0.0.1:50052", "127.0.0.1:50052"), (" a:1 , b.example:65535 ", "a:1,b.example:65535"),
    (["h1:2", "h2:3"], "h1:2,h2:3"), ("", ""), (None, "")])
def test_endpoint_setting_normalizes(value, expect):
    from tandem.config.schema import FIELDS_BY_KEY

    assert FIELDS_BY_KEY["rpc"].check(value) == (expect, None)


@pytest.mark.parametrize("value,problem", [
    ("host", "not HOST:PORT"), ("h:0", "1..65535"), ("h:x", "1..65535"), ("[::1]:5", "IPv6"),
    ("a:1,a:1", "twice"), (5, "HOST:PORT"), (",".join(f"h{i}:1" for i in range(17)), "16")])
def test_endpoint_setting_refuses(value, problem):
    from tandem.config.schema import FIELDS_BY_KEY

    good, why = FIELDS_BY_KEY["rpc"].check(value)
    assert good is None and problem in why


def test_bad_rpc_in_config_names_file_and_line(tandem, home):
    (home / "config.yaml").write_text("context: 1024\nrpc: localhost\n")
    res = tandem("--raw", "-n", "4", "hi", timeout=60)
    assert res.returncode == EXIT_USAGE, err(res)
    assert "config.yaml, line 2: key 'rpc'" in err(res) and "HOST:PORT" in err(res)


def test_a_port_that_never_answers_times_out(tandem, home, tmp_path):
    """A listener that accepts connections and says nothing (a busy rpc-server serving
    another client looks the same): a bounded wait, then exit 6 naming it."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # never accepted: the kernel completes the connection, nobody reads
    ep = f"127.0.0.1:{silent.getsockname()[1]}"
    try:  # the subprocess's own timeout bounds the wait; the message says the handshake's
        res = tandem("--raw", "-n", "4", "--rpc", ep, "hi", timeout=60)
    finally:
        silent.close()
    assert res.returncode == EXIT_REMOTE, err(res)
    assert f"Error: no answer from {ep} to the RPC handshake within" in err(res)
    assert "one client at a time" in err(res)
    _no_debris(home, tmp_path)


def test_serve_over_rpc_answers_as_locally_and_a_dead_server_is_a_502(tiny_models, home,
                                                                      tmp_path, server):
    """`tandem serve --rpc`: the pair in a supervised worker, so a server that dies answers
    the request with a 502 JSON error instead of aborting the HTTP server."""
    pytest.importorskip("openai")
    from test_serve import Server as Serve

    args = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t", "1",
            "--exact", "--strategy", "draft", "--max-tokens", "16"]
    local = Serve(args, tmp_path / "local-home")
    try:
        want = local.client().chat.completions.create(
            model="t", messages=[{"role": "user", "content": "hello there"}], temperature=0)
    finally:
        local.stop()
    remote = Serve([*args, "--rpc", server.endpoint], home)
    try:
        got = remote.client().chat.completions.create(
            model="t", messages=[{"role": "user", "content": "hello there"}], temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
        server.stop()  # kill -9: llama.cpp would abort the process holding the connection
        status, body, _ = remote.raw("POST", "/v1/chat/completions", json.dumps(
            {"model": "t", "messages": [{"role": "user", "content": "write a loop"}]}))
        assert status == 502, body
        assert server.endpoint in body["error"]["message"]
        assert remote.health()["status"] == "ok"  # the HTTP server is still up
    finally:
        remote.stop()
    assert "Traceback" not in "".join(remote.log), "".join(remote.log)


def test_editor_routes_over_rpc_answer_as_locally(tiny_models, home, tmp_path, server):
    """/infill, /tokenize, /detokenize, /apply-template and /props with the target remote:
    the FIM prompt and the utility calls go through the worker (between answers, on the
    scheduler), and give what a local server gives."""
    pytest.importorskip("openai")
    from test_serve import Server as Serve

    args = ["-m", str(tiny_models["fim"]), "-md", str(tiny_models["fim_draft"]), "-t", "1",
            "--exact", "--strategy", "draft", "--max-tokens", "12"]
    calls = [("POST", "/infill", {"input_prefix": "def f(x):\n", "input_suffix": "\n\nf(1)\n",
                                  "input_extra": [{"filename": "a.py", "text": "A = 1\n"}],
                                  "temperature": 0, "response_fields": ["content",
                                                                        "tokens_evaluated"]}),
             ("POST", "/tokenize", {"content": "hi <|fim_pad|>", "with_pieces": True}),
             ("POST", "/detokenize", {"tokens": [1, 104, 105, 263]}),
             ("POST", "/apply-template", {"messages": [{"role": "user", "content": "x"}]})]
    answers = {}
    for where, extra, folder in (("local", [], tmp_path / "local-home"),
                                 ("remote", ["--rpc", server.endpoint], home)):
        srv = Serve([*args, *extra], folder)
        try:
            for method, path, body in calls:
                status, got, _ = srv.raw(method, path, json.dumps(body))
                assert status == 200, (where, path, got)
                answers[(where, path)] = got
            status, props, _ = srv.raw("GET", "/props")
            answers[(where, "n_ctx")] = props["default_generation_settings"]["n_ctx"]
        finally:
            srv.stop()
        assert "Traceback" not in "".join(srv.log), "".join(srv.log)
    for key in [k for k in answers if k[0] == "local"]:
        assert answers[("remote", key[1])] == answers[key], key
