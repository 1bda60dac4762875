"""A local stand-in for the Hugging Face hub, for driving the real huggingface_hub client.

A threaded http.server on 127.0.0.1 answering the endpoints huggingface_hub 2.4 uses:

    HEAD/GET /{org}/{name}/resolve/{revision}/{path}   X-Repo-Commit, ETag (sha256 of LFS
        files, quoted), X-Linked-Etag, X-Linked-Size, Content-Length, Accept-Ranges; Range
        requests answered with 206 + Content-Range; unknown repos/files answered with 404 +
        X-Error-Code RepoNotFound / EntryNotFound, as the hub does
    GET /api/models/{org}/{name}/tree/{revision}        the repo listing (user/repo:QUANT)

It records every request and counts the body bytes it served per file, and can cut the
connection in the middle of a body (once per file) to exercise resumed downloads.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class HubFile:
    data: bytes
    etag: str  # sha256 for LFS files (what the hub sends), may be made wrong on purpose
    lfs: bool = True


@dataclass
class Request:
    method: str
    path: str
    range: str | None


@dataclass
class FakeHub:
    repos: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)  # "repo/path" -> body bytes sent
    cut_once: set[str] = field(default_factory=set)  # "repo/path": cut the next GET halfway
    ignore_range: bool = False
    url: str = ""

    def add(self, repo: str, path: str, data: bytes, *, etag: str | None = None,
            lfs: bool = True) -> HubFile:
        f = HubFile(data, etag or hashlib.sha256(data).hexdigest(), lfs)
        self.repos.setdefault(repo, {})[path] = f
        return f

    def gets(self, fpath: str) -> list[Request]:
        """GET requests for a file (its path inside the repo)."""
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path
                and unquote(r.path).endswith("/" + fpath)]

    @property
    def total_served(self) -> int:
        return sum(self.served.values())


def _handler(hub: FakeHub, lock: threading.Lock):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _record(self) -> None:
            with lock:
                hub.requests.append(Request(self.command, self.path, self.headers.get("Range")))

        def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str) -> None:
            self._send(status, {"X-Error-Code": code, "X-Error-Message": message,
                                "X-Repo-Commit": COMMIT, "Content-Type": "text/plain"},
                       message.encode())

        def do_HEAD(self):  # noqa: N802
            self._record()
            self._resolve()

        def do_GET(self):  # noqa: N802
            self._record()
            path = unquote(urlsplit(self.path).path)
            if path.startswith("/api/models/"):
                self._tree(path)
            else:
                self._resolve()

        def _tree(self, path: str) -> None:
            m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", path)
            if not m or m.group(1) not in hub.repos:
                return self._error(404, "RepoNotFound", "Repository not found")
            items = []
            for p, f in sorted(hub.repos[m.group(1)].items()):
                item = {"type": "file", "oid": hashlib.sha1(f.data).hexdigest(),
                        "size": len(f.data), "path": p}
                if f.lfs:
                    item["lfs"] = {"oid": f.etag, "size": len(f.data), "pointerSize": 134}
                items.append(item)
            self._send(200, {"Content-Type": "application/json"}, json.dumps(items).encode())

        def _resolve(self) -> None:
            path = unquote(urlsplit(self.path).path)
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if not m:
                return self._error(404, "RepoNotFound", "Repository not found")
            repo, _rev, fpath = m.groups()
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound", "Repository not found")
            f = hub.repos[repo].get(fpath)
            if f is None:
                return self._error(404, "EntryNotFound", "Entry not found")
            key = f"{repo}/{fpath}"
            size = len(f.data)
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if f.lfs:
                headers.update({"X-Linked-Etag": f'"{f.etag}"', "X-Linked-Size": str(size)})
            start, end, status = 0, size - 1, 200
            rng = self.headers.get("Range")
            if rng and not hub.ignore_range and self.command == "GET":
                rm = _RANGE.match(rng.strip())
                if rm:
                    start = int(rm.group(1))
                    end = min(int(rm.group(2)) if rm.group(2) else size - 1, size - 1)
                    if start >= size:
                        return self._send(416, {"Content-Range": f"bytes */{size}"})
                    status = 206
                    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            body = f.data[start:end + 1]
            headers["Content-Length"] = str(len(body))
            if self.command == "HEAD":
                return self._send(200, {**headers, "Content-Length": str(size)})
            cut = False
            with lock:
                if key in hub.cut_once and len(body) > 1:
                    hub.cut_once.discard(key)
                    cut = True
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            sent = body[: len(body) // 2] if cut else body
            try:
                self.wfile.write(sent)
                self.wfile.flush()
            except OSError:
                pass
            with lock:
                hub.served[key] = hub.served.get(key, 0) + len(sent)
            if cut:  # drop the connection mid-body, as a flaky network would
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    return Handler


class FakeHubServer:
    """Context manager running a FakeHub on 127.0.0.1 (an OS-chosen port)."""

    def __init__(self, hub: FakeHub | None = None):
        self.hub = hub or FakeHub()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.hub, self._lock))
        self._server.daemon_threads = True
        self.hub.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self.hub

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (connections are refused at once)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def use_fake_hub(monkeypatch, tmp_path, endpoint: str) -> None:
    """Point tandem and huggingface_hub at `endpoint`, online, with fresh HF_HOME and
    TANDEM_HOME under tmp_path."""
    import huggingface_hub.constants as hf_constants
    from tandem.models import hub as tandem_hub

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    # huggingface_hub read HF_HUB_OFFLINE at import, possibly under the offline test default
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    try:  # its user-agent code fetches a registry from the (import-time) endpoint once a day
        from huggingface_hub.utils import _detect_agent

        monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    except (ImportError, AttributeError):
        pass
    tandem_hub.reset_reachability()
