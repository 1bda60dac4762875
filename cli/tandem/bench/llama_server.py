"""llama.cpp's llama-server as the benchmarks against it drive it: one process per named
configuration on 127.0.0.1, started and waited for, asked over HTTP, stopped.

The binary comes from the caller (the benchmark scripts build it from the llama.cpp that
llama-cpp-python vendors, with this machine's CMake flags). A server is started with its own
free port and its log in a file; every failure (it will not start, exits, answers with an
HTTP error, is unreachable) is a ServerError that says which server and quotes its log.
"""
from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# Base arguments of every server configuration; -m, --host and --port are added by LlamaServer.
BASE_SERVER_ARGS = "-t {threads} -c {ctx} -np 1 --jinja"
SERVER_CONFIGS = {
    # llama-server's own defaults (repacked weights, f16 KV cache, flash attention auto)
    "plain": "",
    # In this llama.cpp `-md` alone loads the draft but does not speculate: --spec-type does.
    # Draft length: llama-server's default (--spec-draft-n-max); p-min as tandem's profile.
    "draft": "--spec-type draft-simple -md {draft} -td {threads} --spec-draft-p-min 0.75",
    # ngram-mod's defaults (n-min 48) target long repeated code; short n-grams suit 128 tokens.
    "ngram": ("--spec-type ngram-mod --spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max 8 "
              "--spec-ngram-mod-n-match 3"),
}
DEFAULT_SERVERS = ["plain", "draft", "ngram"]
BASELINE = "plain"  # every comparison's denominator: llama-server with its defaults


class ServerError(RuntimeError):
    """llama-server would not start, exited, or did not answer a request."""


def die_with_parent() -> None:  # pragma: no cover - runs in the child, Linux only
    """Best effort, as a Popen preexec_fn: the child gets SIGTERM when the process that
    started it dies, even by SIGKILL (no llama-server left computing on a shared machine)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def child_preexec():
    """die_with_parent where it works (Linux), else nothing."""
    return die_with_parent if sys.platform.startswith("linux") else None


def post_json(port: int, path: str, body: dict,
              timeout: float = 1800.0) -> tuple[dict, float]:
    """POST `body` to 127.0.0.1:port/path: (the JSON answer, seconds until it was read); any
    failure as a ServerError."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read()), time.perf_counter() - t0
    except urllib.error.HTTPError as exc:
        raise ServerError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(str(exc)) from exc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process on 127.0.0.1, its log in log_dir/server-NAME.log."""

    def __init__(self, name: str, binary: Path, model: Path, args: list[str], log_dir: Path):
        self.name, self.binary, self.model, self.args = name, binary, model, args
        self.log_path = log_dir / f"server-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def cmd(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 600.0) -> None:
        self.port = free_port()
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=child_preexec())
        except OSError as exc:
            raise ServerError(f"cannot start llama-server ({self.binary}): {exc}") from exc
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(
                    f"llama-server '{self.name}' exited with code {rc} while starting.\n"
                    f"command: {shlex.join(self.cmd)}\nlast lines of {self.log_path}:\n"
                    f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # 503 while loading, or not listening yet
            time.sleep(0.25)
        raise ServerError(f"llama-server '{self.name}' not ready after {timeout:.0f}s; "
                          f"last lines of {self.log_path}:\n{self.log_tail()}")

    def chat(self, messages: list[dict], n: int, seed: int, timeout: float = 900.0) -> dict:
        """One greedy /v1/chat/completions request without the prompt cache: its JSON."""
        body = {"messages": messages, "max_tokens": n, "n_predict": n, "temperature": 0.0,
                "seed": seed, "cache_prompt": False, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise ServerError(f"llama-server '{self.name}': HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            rc = self.proc.poll() if self.proc else None
            why = f" (it exited with code {rc}; log:\n{self.log_tail()})" if rc is not None else ""
            raise ServerError(f"llama-server '{self.name}': {exc}{why}") from exc

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
