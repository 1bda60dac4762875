"""llama.cpp's RPC protocol, the few messages tandem speaks itself, in pure Python: the hello
(version handshake), the device count and each device's memory.

llama.cpp ends the whole process (GGML_ABORT) when a server refuses the connection, fails the
handshake or speaks another version (ggml-rpc.cpp: rpc_dispatcher::start). So every endpoint
is checked here first, with timeouts, and a failure is a RemoteError naming host:port.

Wire format (ggml/src/ggml-rpc/ggml-rpc.cpp, protocol 7.0.0): a request is
| command (1 byte) | size (8 bytes, little-endian) | data |, a reply | size (8 bytes) | data |.
HELLO (14) carries 24 bytes of transport capabilities (zero: plain TCP) and is answered with
| major | minor | patch | padding | 24 bytes of capabilities |; the client accepts the same
major and a minor no higher than its own. DEVICE_COUNT (15) has no data and answers a uint32;
GET_DEVICE_MEMORY (11) takes a uint32 device and answers free and total as uint64.
"""
from __future__ import annotations

import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Sequence

from tandem.config.schema import split_endpoint
from tandem.errors import RemoteError

# ggml/include/ggml-rpc.h of the llama.cpp this wheel vendors; tests/test_rpc.py checks them
# against a server running on the wheel's own libggml
PROTO = (7, 0, 0)
CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 11, 14, 15
CAPS = 24  # RPC_CONN_CAPS_SIZE (transport.h)
HELLO_REPLY = 4 + CAPS
CONNECT_TIMEOUT = 5.0

_SERIAL = ("an rpc-server serves one client at a time: is another tandem or llama.cpp using "
           "it?")


@dataclass(frozen=True)
class RemoteDevice:
    index: int
    free: int
    total: int


@dataclass(frozen=True)
class ServerInfo:
    endpoint: str
    version: tuple[int, int, int]
    devices: tuple[RemoteDevice, ...] = ()
    rtt: float = 0.0  # seconds: the handshake's round trip

    @property
    def free(self) -> int:
        return sum(d.free for d in self.devices)


def _command(cmd: int, data: bytes = b"") -> bytes:
    return bytes([cmd]) + struct.pack("<Q", len(data)) + data


def _connect(endpoint: str, timeout: float) -> socket.socket:
    host, port = split_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise RemoteError(f"nobody is listening on {endpoint} (connection refused)",
                          f"start the server there with `tandem rpc-server --port {port}`, or "
                          "check the host and port in --rpc") from None
    except socket.gaierror as exc:
        raise RemoteError(f"cannot resolve the host of {endpoint}: {exc.strerror or exc}",
                          "check the host name in --rpc") from None
    except (socket.timeout, TimeoutError):
        raise RemoteError(f"no connection to {endpoint} within {timeout:g} s",
                          "check that the host is up and that no firewall drops the port") \
            from None
    except OSError as exc:
        raise RemoteError(f"cannot connect to {endpoint}: {exc.strerror or exc}",
                          "check the host and port in --rpc, and the network") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read(sock: socket.socket, n: int, endpoint: str, timeout: float, what: str) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _no_reply(endpoint, timeout, what)
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except (socket.timeout, TimeoutError):
            raise _no_reply(endpoint, timeout, what) from None
        except OSError as exc:
            raise RemoteError(f"the connection to {endpoint} broke during {what}: "
                              f"{exc.strerror or exc}", "check the server and the network") \
                from None
        if not chunk:
            if not buf:
                raise RemoteError(
                    f"{endpoint} closed the connection without answering {what}: not an "
                    "rpc-server, or one of another llama.cpp version (tandem speaks RPC "
                    f"protocol {_ver(PROTO)})",
                    "start the server with `tandem rpc-server` from this tandem version")
            raise _not_rpc(endpoint, buf, what, sock)
        buf += chunk
    return buf


def _no_reply(endpoint: str, timeout: float, what: str) -> RemoteError:
    return RemoteError(f"no answer from {endpoint} to {what} within {timeout:g} s",
                       f"{_SERIAL} Otherwise it is not an rpc-server, or the link stalls")


def _more(sock: socket.socket, data: bytes) -> bytes:
    """A little more of a foreign answer, to say what it is."""
    try:
        sock.settimeout(0.5)
        while len(data) < 512:
            chunk = sock.recv(512 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


def _not_rpc(endpoint: str, data: bytes, what: str, sock: socket.socket | None = None) \
        -> RemoteError:
    if sock is not None:
        data = _more(sock, data)
    shown = data[:24].decode("ascii", "replace")
    printable = all(32 <= b < 127 or b in (9, 10, 13) for b in data[:24])
    low = data.lower()
    http = data.startswith(b"HTTP/") or b"<html" in low or b"<!doctype" in low
    looks = (f" (it begins {shown.splitlines()[0]!r}" + (": an HTTP server)" if http else ")")
             if printable else "")
    return RemoteError(f"{endpoint} does not speak llama.cpp's RPC protocol: its answer to "
                       f"{what} is malformed{looks}",
                       "point --rpc at a port where `tandem rpc-server` listens")


def _ver(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def _hello(sock: socket.socket, endpoint: str, timeout: float, last: bool) -> tuple[int, int, int]:
    """Send HELLO as llama.cpp's client does (negotiate_hello) and check the version it gets.
    `last`: nothing follows on this connection, so the write side is closed after the
    request; a server of another protocol (an HTTP server waiting for a line's end) then
    answers at once instead of waiting for more."""
    sock.sendall(_command(CMD_HELLO, bytes(CAPS)))
    if last:
        # an rpc-server answers at once; what is silent after a moment gets the end of the
        # stream (only then: a proxy that cannot half-close would cut the answer short)
        try:
            ready, _, _ = select.select([sock], [], [], min(1.0, timeout))
            if not ready:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    head = _read(sock, 8, endpoint, timeout, "the RPC handshake")
    (size,) = struct.unpack("<Q", head)
    if size != HELLO_REPLY:
        raise _not_rpc(endpoint, head, "the RPC handshake", sock)
    body = _read(sock, size, endpoint, timeout, "the RPC handshake")
    version = (body[0], body[1], body[2])
    if version[0] != PROTO[0] or version[1] > PROTO[1]:
        raise RemoteError(f"the rpc-server at {endpoint} speaks RPC protocol {_ver(version)}, "
                          f"tandem's llama.cpp speaks {_ver(PROTO)}",
                          "client and server must come from the same llama.cpp: start the "
                          "server with `tandem rpc-server` of this tandem version")
    return version


def check_endpoint(endpoint: str, timeout: float = CONNECT_TIMEOUT) -> ServerInfo:
    """Connect and shake hands; a RemoteError naming the endpoint if anything is off."""
    t0 = time.perf_counter()
    sock = _connect(endpoint, timeout)
    try:
        version = _hello(sock, endpoint, timeout, last=True)
        return ServerInfo(endpoint, version, rtt=time.perf_counter() - t0)
    finally:
        sock.close()


def server_info(endpoint: str, timeout: float = CONNECT_TIMEOUT) -> ServerInfo:
    """The handshake, then each device's free and total memory as the server reports them
    (what llama.cpp places layers by)."""
    check_endpoint(endpoint, timeout)  # a foreign server answers this one at once
    sock = _connect(endpoint, timeout)
    try:
        t0 = time.perf_counter()
        version = _hello(sock, endpoint, timeout, last=False)
        rtt = time.perf_counter() - t0
        sock.sendall(_command(CMD_DEVICE_COUNT))
        (count,) = struct.unpack("<I", _reply(sock, 4, endpoint, timeout, "DEVICE_COUNT"))
        devs = []
        for i in range(min(count, 16)):  # GGML_RPC_MAX_SERVERS bounds what a client uses
            sock.sendall(_command(CMD_GET_DEVICE_MEMORY, struct.pack("<I", i)))
            free, total = struct.unpack("<QQ", _reply(sock, 16, endpoint, timeout,
                                                      "GET_DEVICE_MEMORY"))
            devs.append(RemoteDevice(i, free, total))
        return ServerInfo(endpoint, version, tuple(devs), rtt)
    finally:
        sock.close()


def _reply(sock, size: int, endpoint: str, timeout: float, what: str) -> bytes:
    head = _read(sock, 8, endpoint, timeout, what)
    if struct.unpack("<Q", head)[0] != size:
        raise _not_rpc(endpoint, head, what, sock)
    return _read(sock, size, endpoint, timeout, what)


def broken(endpoints: Sequence[str], timeout: float = 2.0) -> list[tuple[str, str]]:
    """After a failure: which endpoints do not answer a handshake now, and why."""
    out = []
    for ep in endpoints:
        try:
            check_endpoint(ep, timeout)
        except RemoteError as exc:
            out.append((ep, exc.message))
    return out
