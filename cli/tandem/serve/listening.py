"""Where `tandem serve` listens: the socket bound before the models load (a busy port fails
fast, with a hint), whether a host is loopback (beyond it, a key is advised), and the address
as the command prints it."""
from __future__ import annotations

import ipaddress
import socket
import sys

from tandem.errors import UsageError

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket: a port in use or a host that does not resolve is a UsageError
    with a hint, not uvicorn's log line and exit."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"cannot listen on {host!r}: {exc.strerror}",
                         "pass --host with an address of this machine, e.g. 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                         "pick another --port (0: any free port), or stop what uses it") from None
    sock.set_inheritable(True)
    return sock


def listen_note(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def warn(message: str) -> None:
    print(f"Warning: {message}", file=sys.stderr)
