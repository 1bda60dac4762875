"""`tandem rpc-server`: llama.cpp's RPC server on tandem's own libggml, so that the client
(`--rpc HOST:PORT`) and the server always speak the same protocol version."""
from __future__ import annotations

import errno
import ipaddress
import os
import signal
import socket
import sys
import threading
from typing import Annotated, Optional

import typer

from tandem.errors import UsageError

WARNING = ("llama.cpp's RPC protocol has no authentication and no encryption: anyone who "
           "reaches {ep} can run computations on this machine and read what it holds. "
           "Never expose it to an open network; use it on a trusted LAN or through an SSH "
           "tunnel.")


app = typer.Typer()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@app.command("rpc-server")
def rpc_server(
    host: Annotated[str, typer.Option("--host", "-H", help="Address to listen on (default: loopback only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port.")] = 50052,
    threads: Annotated[int, typer.Option("--threads", "-t", help="CPU threads for the computations (0: half the cores, as llama.cpp's rpc-server).")] = 0,
    mem: Annotated[Optional[int], typer.Option("--mem", help="MiB this server offers (reported to clients as its free memory, which llama.cpp places layers by; default: what the device has free).")] = None,
    cache: Annotated[bool, typer.Option("--cache", "-c", help="Keep received tensors in llama.cpp's local file cache (faster reloads of the same model).")] = False,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="Allow a --host other than loopback (the protocol is unauthenticated).")] = False,
):
    """Serve this machine's device (its GPU, else its CPU) to a tandem on another host, which
    places target layers here with --rpc HOST:PORT. Runs until Ctrl-C.

    Examples:

      tandem rpc-server                                  # 127.0.0.1:50052, for a local test

      tandem rpc-server --host 192.168.1.20 --allow-remote --port 50052 --mem 20000

      # then, on the machine that runs tandem:
      tandem run --rpc 192.168.1.20:50052 "Write a quicksort in C"
    """
    signal.signal(signal.SIGINT, _stop)  # first: a Ctrl-C at any point from here ends at once
    from tandem.engine.remote import ggml
    from tandem.engine.remote.rpc import PROTO

    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be in 1..65535, got {port}", "pick a free TCP port")
    if mem is not None and mem < 1:
        raise UsageError(f"--mem must be at least 1 (MiB), got {mem}", "omit it to offer "
                         "what the device has free")
    if threads < 0:
        raise UsageError(f"--threads must be >= 0, got {threads}", "0 picks half the cores")
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not is_loopback(host):
        if not allow_remote:
            raise UsageError(f"--host {host} would serve other machines, and the RPC protocol "
                             "is unauthenticated",
                             "add --allow-remote if this network is trusted, or keep the "
                             "default 127.0.0.1 and reach it through an SSH tunnel")
        print(f"Warning: {WARNING.format(ep=endpoint)}", file=sys.stderr)
    _check_port(host, port)
    n_threads = threads or max(1, (os.cpu_count() or 2) // 2)
    cache_dir = None
    if cache:
        from tandem.models.store import tandem_home

        cache_dir = tandem_home() / "rpc-cache"
        cache_dir.mkdir(parents=True, exist_ok=True)
    served = ggml.served_devices()
    shown = ", ".join(f"{d.name} ({d.description}, "
                      f"{min(d.free >> 20, mem) if mem else d.free >> 20} MiB offered)"
                      for d in served)
    print(f"tandem rpc-server: llama.cpp RPC protocol {'.'.join(map(str, PROTO))} on "
          f"{endpoint}, serving {shown}, {n_threads} threads; Ctrl-C stops it", file=sys.stderr)
    # llama.cpp's server logs with printf: onto stderr with everything else that is no result
    sys.stdout.flush()
    os.dup2(2, 1)
    done = threading.Event()

    def serve():
        try:
            ggml.serve(endpoint, n_threads, str(cache_dir) if cache_dir else None,
                       mem=mem << 20 if mem else None)
        finally:
            done.set()

    # in a thread: the server blocks in C for good, and the main thread must stay free to
    # take Ctrl-C (_stop runs there, between two waits)
    threading.Thread(target=serve, name="rpc-server", daemon=True).start()
    while not done.wait(0.5):
        pass
    raise UsageError(f"llama.cpp's RPC server could not listen on {endpoint}",
                     "see its message above; pick another --port or --host")


def _stop(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    """SIGINT from the command's first line on, wherever start-up is: said, and the process
    ends at once. Never a normal exit (nor a KeyboardInterrupt that would take one): once the
    serving thread is inside llama.cpp, C++ destructors at exit free what it uses and hang."""
    try:
        print("rpc-server stopped.", file=sys.stderr)
        sys.stderr.flush()
    finally:
        os._exit(0)


def _check_port(host: str, port: int) -> None:
    """Bind once in Python, for a clear message: llama.cpp only prints that it failed."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"cannot use --host {host}: {exc.strerror or exc}",
                         "pass an address of this machine") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is already in use",
                             "pick another --port, or stop what listens there") from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                         "pass an address of this machine with --host") from None
    finally:
        sock.close()
