"""A live `tandem serve` for tests: a subprocess on 127.0.0.1 (a port the kernel picks) with
its own TANDEM_HOME, its stderr kept, and raw HTTP requests beside the `openai` client."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """`tandem serve ...` in a subprocess; stderr is drained into `log` by a thread."""

    def __init__(self, args: list[str], home: Path):
        env = {**os.environ, "TANDEM_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        env.pop("TANDEM_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem", "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
            cwd=str(ROOT))
        self.log: list[str] = []
        self.port: int | None = None
        found = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    found.set()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(180) or self.port is None:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.base_url, **kwargs)

    def raw(self, method: str, path: str, body: bytes | str | None = None,
            headers: dict | None = None, timeout: float = 120) -> tuple[int, dict, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, str):
                body = body.encode()
            hdrs = {"Content-Type": "application/json"} if body is not None else {}
            hdrs.update(headers or {})
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read()
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = {"_raw": data.decode(errors="replace")}
            return resp.status, parsed, dict(resp.getheaders())
        finally:
            conn.close()

    def health(self) -> dict:
        status, body, _ = self.raw("GET", "/health")
        assert status == 200, body
        return body

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def tiny_args(tiny_models) -> list[str]:
    return ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t", "1"]


def stop_cleanly(srv: Server) -> None:
    """Stop a module's server and hold it to a clean exit: Ctrl-C's codes, no traceback."""
    srv.stop()
    assert srv.proc.returncode in (0, 130, -signal.SIGINT), "".join(srv.log)
    assert "Traceback" not in "".join(srv.log), "".join(srv.log)
