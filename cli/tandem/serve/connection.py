"""Connection hygiene for `tandem serve`, on uvicorn's own h11 protocol.

uvicorn closes a connection idle between requests (its keep-alive timeout) but waits for
ever on one that sends nothing, or only part of its headers, and answers framing errors in
plain text. This subclass adds what its settings do not have: a deadline for a request's
headers, a bound on open connections (uvicorn's `limit_concurrency` answers in plain text),
and OpenAI's JSON error object for every refusal made before the application runs. The
body's own deadline is the application's (serve/routes.py: read_json).
"""
from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

IDLE_TIMEOUT = 5  # s between requests on a kept-alive connection (uvicorn's keep-alive timeout)
# s from a connection (or a request's first byte) to its whole headers, and again for the body
REQUEST_TIMEOUT = 30.0
MAX_CONNECTIONS = 64  # open at once; beyond, a 503 and the connection closed


def error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response carrying OpenAI's error object, closing the connection."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


def guarded(header_timeout: float = REQUEST_TIMEOUT,
            max_connections: int = MAX_CONNECTIONS) -> type[H11Protocol]:
    """The protocol class for uvicorn's `http` setting, with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})


class GuardedH11Protocol(H11Protocol):
    header_timeout = REQUEST_TIMEOUT
    max_connections = MAX_CONNECTIONS

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = None
        if len(self.connections) > self.max_connections:
            self._refuse(503, "Service Unavailable",
                         f"over {self.max_connections} connections are open; retry later",
                         "too_many_connections")
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            if self._header_timer is None:  # a request's first bytes: its headers' deadline
                self._arm()
        else:
            self._disarm()  # the headers are in

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request's framing (a bad request line, Content-Length or chunk, a
        NUL in a header, two Host headers): the JSON error, then the connection closes."""
        self._disarm()
        self.transport.write(error_bytes(
            400, "Bad Request", "the request is not valid HTTP/1.1 (its request line, headers "
            "or body framing)", "invalid_http"))
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        timer, self._header_timer = getattr(self, "_header_timer", None), None
        if timer is not None:
            timer.cancel()

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._refuse(408, "Request Timeout",
                     f"the request's headers did not arrive within {self.header_timeout:g} s",
                     "request_timeout")

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        self.logger.warning("tandem serve: %s", message)
        self.transport.write(error_bytes(status, reason, message, code))
        self.transport.close()
