#!/usr/bin/env python3
"""An emulated network link on 127.0.0.1: a TCP forwarder with a fixed one-way delay each way
and a rate cap, for measuring tandem over llama.cpp RPC at a given round-trip time (these
machines' kernels have no netem).

Each direction is a queue: a chunk read at time t leaves the sender's side of the link when
the link is free (rate cap: len / rate seconds per chunk, back to back), and is written
`delay` seconds after that. Chunks keep their order, and the two directions never wait for
each other (a reader task and a writer task per direction, timestamps instead of a sleep per
chunk in the reading loop).

  scripts/link_proxy.py --listen 127.0.0.1:50100 --target 127.0.0.1:50052 --delay-ms 5
  scripts/link_proxy.py --ping --delay-ms 5          # the round trip through it, measured

--ping starts an echo server and the proxy in front of it, ping-pongs small messages through
it and prints JSON: the configured delay and the measured round trips (min, median).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

CHUNK = 65536


class Direction:
    """One way of the link: order kept, delay and rate applied per chunk by timestamps."""

    def __init__(self, reader, writer, delay: float, rate: float | None):
        self.reader, self.writer, self.delay, self.rate = reader, writer, delay, rate
        self.queue: asyncio.Queue = asyncio.Queue()
        self.free_at = 0.0  # when the link finishes sending what is queued

    async def read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await self.reader.read(CHUNK)
                now = loop.time()
                if not data:
                    break
                start = max(now, self.free_at)
                self.free_at = start + (len(data) / self.rate if self.rate else 0.0)
                self.queue.put_nowait((self.free_at + self.delay, data))
        except (ConnectionError, OSError):
            pass
        finally:
            self.queue.put_nowait((None, None))

    async def write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await self.queue.get()
                if data is None:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                self.writer.write(data)
                await self.writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # half-close: the other direction may still carry an answer
            try:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                else:
                    self.writer.close()
            except (ConnectionError, OSError, RuntimeError):
                pass


async def serve(listen: tuple[str, int], target: tuple[str, int], delay: float,
                rate: float | None):
    """The proxy's server (already listening)."""

    async def handle(c_reader, c_writer):
        try:
            s_reader, s_writer = await asyncio.open_connection(*target)
        except OSError:
            c_writer.close()
            return
        for sock_writer in (c_writer, s_writer):
            sock = sock_writer.get_extra_info("socket")
            if sock is not None:
                import socket

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ways = [Direction(c_reader, s_writer, delay, rate), Direction(s_reader, c_writer, delay, rate)]
        try:
            await asyncio.gather(*(t for w in ways for t in (w.read(), w.write())))
        except asyncio.CancelledError:  # the proxy is shutting down
            pass
        finally:
            for w in (c_writer, s_writer):
                try:
                    w.close()
                except (ConnectionError, OSError, RuntimeError):
                    pass

    return await asyncio.start_server(handle, *listen)


async def ping(delay: float, rate: float | None, count: int = 20) -> dict:
    """Round trips of 64-byte messages through the proxy to an echo server."""

    async def echo(reader, writer):
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        writer.close()

    echo_srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    eport = echo_srv.sockets[0].getsockname()[1]
    proxy = await serve(("127.0.0.1", 0), ("127.0.0.1", eport), delay, rate)
    pport = proxy.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", pport)
    rtts = []
    msg = b"x" * 64
    for _ in range(count):
        t0 = time.perf_counter()
        writer.write(msg)
        await writer.drain()
        got = b""
        while len(got) < len(msg):
            got += await reader.read(len(msg) - len(got))
        rtts.append(time.perf_counter() - t0)
    writer.close()
    await asyncio.sleep(2 * delay + 0.05)  # the end of the stream reaches both servers
    proxy.close()
    echo_srv.close()
    return {"delay_ms": delay * 1e3, "configured_rtt_ms": 2 * delay * 1e3,
            "rate_bytes_per_s": rate, "count": count,
            "rtt_ms_min": min(rtts) * 1e3, "rtt_ms_median": statistics.median(rtts) * 1e3}


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=_addr, default=("127.0.0.1", 0),
                    help="HOST:PORT to listen on (default: 127.0.0.1, a free port)")
    ap.add_argument("--target", type=_addr, help="HOST:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each way")
    ap.add_argument("--rate", type=float, default=125e6,
                    help="bytes per second each way (default 125e6: 1 Gbit/s; 0: no cap)")
    ap.add_argument("--ping", action="store_true", help="measure the round trip through it")
    ap.add_argument("--count", type=int, default=20, help="ping-pongs for --ping")
    ns = ap.parse_args(argv)
    rate = ns.rate or None
    if ns.ping:
        print(json.dumps(asyncio.run(ping(ns.delay_ms / 1e3, rate, ns.count))))
        return 0
    if ns.target is None:
        ap.error("--target is required (or --ping)")
    if ns.listen[0] not in ("127.0.0.1", "localhost", "::1"):
        ap.error("the proxy listens on loopback only")

    async def run():
        srv = await serve(ns.listen, ns.target, ns.delay_ms / 1e3, rate)
        port = srv.sockets[0].getsockname()[1]
        print(f"listening 127.0.0.1:{port}", flush=True)  # the line scripts wait for
        async with srv:
            await srv.serve_forever()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
