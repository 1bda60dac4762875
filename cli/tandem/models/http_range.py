"""A read-only file object over HTTP Range requests, for reading a file's first bytes
(a GGUF header) without downloading the rest.

Each `read(n)` is one `Range: bytes=pos-(pos+n-1)` request, so the caller decides how much
is fetched (tandem.models.gguf_meta in exact mode asks only for bytes the header certainly has).
A server that ignores Range is read no further than `n` bytes. Counts requests and bytes.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from tandem.errors import DownloadError

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class RangeReader:
    """`read(n)` over an HTTP URL. `client` is an httpx-style client (`.stream(...)`);
    `on_error` turns a transport/status exception into the caller's error type."""

    def __init__(
        self,
        url: str,
        client: Any,
        *,
        headers: dict[str, str] | None = None,
        size: int | None = None,
        timeout: float = 10.0,
        name: str = "remote file",
        raise_for_status: Callable[[Any], None] | None = None,
        on_error: Callable[[BaseException], BaseException] | None = None,
        retry_on: tuple[type[BaseException], ...] = (),
        retries: int = 2,
    ):
        self.url = url
        self.name = name
        self.size = size
        self.pos = 0
        self.requests = 0
        self.bytes_fetched = 0
        self._client = client
        self._headers = dict(headers or {})
        self._timeout = timeout
        self._raise_for_status = raise_for_status
        self._on_error = on_error
        self._retry_on = retry_on
        self._retries = retries

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            raise ValueError("RangeReader.read needs a byte count")  # never the whole file
        if n == 0 or (self.size is not None and self.pos >= self.size):
            return b""
        end = self.pos + n - 1
        if self.size is not None:
            end = min(end, self.size - 1)
        headers = {**self._headers, "Range": f"bytes={self.pos}-{end}",
                   "Accept-Encoding": "identity"}
        for attempt in range(self._retries + 1):
            try:
                data = self._fetch(headers, end - self.pos + 1)
                break
            except DownloadError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped by the owner
                # a dropped connection is retried (the same range) a couple of times
                if isinstance(exc, self._retry_on) and attempt < self._retries:
                    continue
                if self._on_error is None:
                    raise
                raise self._on_error(exc) from None
        self.pos += len(data)
        return data

    def _fetch(self, headers: dict[str, str], want: int) -> bytes:
        self.requests += 1
        with self._client.stream("GET", self.url, headers=headers,
                                 timeout=self._timeout) as resp:
            if resp.status_code == 416:  # asked past the end
                return b""
            if self._raise_for_status is not None:
                self._raise_for_status(resp)
            else:
                resp.raise_for_status()
            if resp.status_code == 200 and self.pos > 0:
                raise DownloadError(
                    f"{self.name}: the server ignores HTTP Range requests, so the header "
                    "cannot be read without downloading the whole file",
                    "download the file first (tandem pull), or use another endpoint",
                )
            if resp.status_code == 206:
                self._check_range(resp.headers.get("Content-Range", ""))
            chunks = []
            got = 0
            for chunk in resp.iter_bytes():
                chunks.append(chunk[: want - got])
                got += len(chunks[-1])
                self.bytes_fetched += len(chunks[-1])
                if got >= want:
                    break  # a server ignoring Range at pos 0 is cut off here
        return b"".join(chunks)

    def _check_range(self, value: str) -> None:
        m = _CONTENT_RANGE.match(value.strip())
        if m is None or int(m.group(1)) != self.pos:
            raise DownloadError(
                f"{self.name}: the server answered a Range request with bytes "
                f"{value or '(no Content-Range)'} instead of from offset {self.pos}",
                "try again; if it persists, use another endpoint (HF_ENDPOINT)",
            )
        if self.size is None and m.group(3) != "*":
            self.size = int(m.group(3))
