#!/usr/bin/env python3
"""tandem with its target on a llama.cpp RPC server behind emulated links, against
llama.cpp's own llama-server --rpc on the same links.

For each round-trip time (--rtt, ms) it puts scripts/link_proxy.py (one-way delay rtt/2 each
way, --rate bytes/s) between the client and one `tandem rpc-server` on 127.0.0.1 (started with
--cache, so reloading the weights for each run is quick), checks the proxy's round trip with
a ping-pong, then runs every prompt through:

  tandem plain (--strategy none), auto, draft (--strategy draft)   each a `tandem run --json
      --rpc` through the link, the whole target on the server, the draft local
  llama-server plain and draft-simple (-ngl 99 --rpc, the draft local with -ngld 0), when the
      native tools exist (scripts/build_native.sh's bin dir; --native-bin), one server process
      per configuration (an rpc-server serves one client at a time, so configurations run one
      after the other)

Reported per RTT and configuration: the median decode tok/s (each tool's own timings, as
scripts/bench_peer.py reads them) and end-to-end tok/s (generated tokens over prompt + decode
time). Prompts, llama-server driving and tandem's JSON are bench_peer's harness
(tandem.bench.llama_server, tandem.bench.peer_runs).

  .venv/bin/python scripts/bench_rpc.py --rtt 0,2,10,20 --coding 4 --per-category 1 --out rpc.json
  .venv/bin/python scripts/bench_rpc.py -m t.gguf -md d.gguf --rtt 2 --coding 1 -n 16 --no-spec-bench
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import bench_peer  # the checkout's defaults: prompts file, tandem command, the pair
import link_proxy
from native_tools import native_bin
from tandem.bench.llama_server import (
    BASE_SERVER_ARGS,
    LlamaServer,
    ServerError,
    child_preexec,
    free_port,
)
from tandem.bench.peer_report import Row
from tandem.bench.peer_runs import load_prompts, parse_tandem_output, server_row, tandem_command

SCRIPTS = Path(__file__).resolve().parent
RUN_CONFIGS = {"tandem-plain": ["--strategy", "none"], "tandem-auto": ["--strategy", "auto"],
                  "tandem-draft": ["--strategy", "draft"]}
SERVER_CONFIGS = {"server-plain": "-ngl 99",
                  "server-draft": ("-ngl 99 --spec-type draft-simple -md {draft} -ngld 0 "
                                   "-td {threads} --spec-draft-p-min 0.75")}


class Proc:
    """A helper process whose first stdout line (or a ready check) says it is up."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, text=True, env=env,
                                     preexec_fn=child_preexec())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_rpc_server(tandem: list[str], threads: int, env: dict) -> tuple[Proc, int]:
    from tandem.engine.remote.rpc import check_endpoint
    from tandem.errors import RemoteError

    port = free_port()
    srv = Proc([*tandem, "rpc-server", "--port", str(port), "-t", str(threads), "--cache"], env)
    deadline = time.monotonic() + 120
    while True:
        try:
            check_endpoint(f"127.0.0.1:{port}", timeout=2)
            return srv, port
        except RemoteError:
            if srv.proc.poll() is not None or time.monotonic() > deadline:
                srv.stop()
                raise SystemExit(f"Error: tandem rpc-server did not start on port {port}") from None
            time.sleep(0.2)


def start_proxy(target_port: int, rtt_ms: float, rate: float) -> tuple[Proc, int]:
    proxy = Proc([sys.executable, str(SCRIPTS / "link_proxy.py"), "--target",
                  f"127.0.0.1:{target_port}", "--delay-ms", str(rtt_ms / 2), "--rate",
                  str(rate)])
    line = proxy.proc.stdout.readline()  # "listening 127.0.0.1:PORT"
    if not line.startswith("listening"):
        proxy.stop()
        raise SystemExit("Error: link_proxy.py did not start")
    return proxy, int(line.rsplit(":", 1)[1])


def e2e(row: Row) -> float:
    """Generated tokens over prompt + decode time."""
    ex = row.extra or {}
    if row.kind == "tandem":
        total = (ex.get("t_total") or 0.0)
    else:  # llama-server: prompt time from its prompt rate
        pps = ex.get("prompt_per_second") or 0.0
        prompt_s = (ex.get("prompt_n") or 0) / pps if pps > 0 else 0.0
        total = prompt_s + (ex.get("predicted_ms") or 0.0) / 1e3
    return row.n_generated / total if total > 0 else 0.0


def run_tandem(name, extra, prompts, ns, model_args, pair, ep, env) -> list[Row]:
    rows = []
    for p in prompts:
        cmd = tandem_command(ns.tandem, p, ns.n, ns.threads, ns.ctx, ns.seed, model_args,
                                  [*extra, "--rpc", ep], pair)
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=3600, env=env)
        row = Row(p.id, p.category, name, "tandem")
        if res.returncode != 0:
            row.error = f"tandem exited with code {res.returncode}: {res.stderr.strip()[-600:]}"
        else:
            row = parse_tandem_output(row, res.stdout)
            stats = json.loads([ln for ln in res.stdout.splitlines()
                                if ln.lstrip().startswith("{")][-1]).get("stats") or {}
            row.extra["t_total"] = stats.get("t_total")
        rows.append(row)
    return rows


def run_server(name, args, prompts, ns, target, draft, ep, log_dir) -> list[Row]:
    extra = args.format(draft=draft, threads=ns.threads)
    srv = LlamaServer(name, ns.native_bin / "llama-server", target,
                      [*BASE_SERVER_ARGS.format(threads=ns.threads, ctx=ns.ctx).split(),
                       *extra.split(), "--rpc", ep], log_dir)
    try:
        srv.start()
        return [server_row(srv, p, ns.n, ns.seed) for p in prompts]
    except ServerError as exc:
        return [Row(p.id, p.category, name, "server", error=str(exc)) for p in prompts]
    finally:
        srv.stop()


def summarize(rows: list[Row]) -> dict:
    out: dict = {}
    for r in rows:
        if not r.ok:
            continue
        d = out.setdefault(str(r.extra["rtt_ms"]), {}).setdefault(
            r.config, {"decode": [], "e2e": [], "drafted": 0, "accepted": 0})
        d["decode"].append(r.tok_s)
        d["e2e"].append(e2e(r))
        d["drafted"] += r.drafted
        d["accepted"] += r.accepted
    return {rtt: {c: {"n": len(v["decode"]), "decode_tok_s": statistics.median(v["decode"]),
                      "e2e_tok_s": statistics.median(v["e2e"]),
                      "acceptance": v["accepted"] / v["drafted"] if v["drafted"] else None}
                  for c, v in per.items()} for rtt, per in out.items()}


def render(summary: dict, pings: dict, configs: list[str]) -> str:
    lines = ["| RTT (ms, measured) | " + " | ".join(configs) + " |",
             "|---|" + "---|" * len(configs)]
    for rtt, per in summary.items():
        cells = []
        for c in configs:
            v = per.get(c)
            cells.append(f"{v['decode_tok_s']:.1f} / {v['e2e_tok_s']:.1f}" if v else "-")
        lines.append(f"| {rtt} ({pings[rtt]:.1f}) | " + " | ".join(cells) + " |")
    return "decode / end-to-end tok/s, medians over the prompts\n\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path)
    ap.add_argument("-md", "--model-draft", type=Path)
    ap.add_argument("--rtt", default="0,2,10,20", help="round-trip times in ms, comma-separated")
    ap.add_argument("--rate", type=float, default=125e6, help="bytes/s each way (1 Gbit/s)")
    ap.add_argument("--prompts", type=Path, default=bench_peer.DEFAULT_PROMPTS)
    ap.add_argument("--no-spec-bench", action="store_true", help="coding prompts only")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--category", action="append")
    ap.add_argument("--coding", type=int, default=4)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--native-bin", type=Path, default=None,
                    help="llama-server's directory (default: scripts/build_native.sh's, if built)")
    ap.add_argument("--no-server", action="store_true", help="skip the llama-server half")
    ap.add_argument("--out", type=Path, help="JSON with every row and the summary")
    return ap


def native_dir(ns) -> Path | None:
    """The native tools, only if already built (this script never builds them)."""
    if ns.no_server:
        return None
    if ns.native_bin is not None:
        return ns.native_bin if (ns.native_bin / "llama-server").exists() else None
    d = native_bin(build=False)  # where scripts/build_native.sh builds, without building
    return d if d and (d / "llama-server").exists() else None


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.tandem = bench_peer.default_tandem()
    target, draft, model_args, pair = bench_peer.resolve_models(ns)
    prompts = load_prompts(None if ns.no_spec_bench else ns.prompts, ns.per_category,
                                ns.category, False, ns.coding)
    if not prompts:
        raise SystemExit("Error: no prompts (check --prompts, --coding)")
    ns.native_bin = native_dir(ns)
    rtts = [float(x) for x in ns.rtt.split(",") if x.strip()]
    env = {**os.environ, "TANDEM_HISTORY": "off"}
    log_dir = Path(ns.out).parent if ns.out else Path(".")
    configs = list(RUN_CONFIGS) + (list(SERVER_CONFIGS) if ns.native_bin else [])
    if not ns.native_bin:
        print("llama-server not built (scripts/build_native.sh): tandem only", file=sys.stderr)
    rows: list[Row] = []
    pings: dict[str, float] = {}
    server, port = start_rpc_server(ns.tandem, ns.threads, env)
    try:
        for rtt in rtts:
            measured = asyncio.run(link_proxy.ping(rtt / 2e3, ns.rate, 10))["rtt_ms_median"]
            pings[str(rtt)] = measured
            proxy, pport = start_proxy(port, rtt, ns.rate)
            ep = f"127.0.0.1:{pport}"
            print(f"RTT {rtt} ms (measured {measured:.2f} ms) through {ep}", file=sys.stderr)
            try:
                got: list[Row] = []
                for name, extra in RUN_CONFIGS.items():
                    got += run_tandem(name, extra, prompts, ns, model_args, pair, ep, env)
                if ns.native_bin:
                    for name, args in SERVER_CONFIGS.items():
                        got += run_server(name, args, prompts, ns, target, draft, ep, log_dir)
            finally:
                proxy.stop()
            for r in got:
                r.extra = {**(r.extra or {}), "rtt_ms": rtt}
                if r.error:
                    print(f"  {r.config} {r.prompt_id}: {r.error[:300]}", file=sys.stderr)
            rows += got
    finally:
        server.stop()
    summary = summarize(rows)
    print(render(summary, pings, configs))
    if ns.out:
        ns.out.write_text(json.dumps({"rtts": rtts, "rate": ns.rate, "pings_ms": pings,
                                      "summary": summary,
                                      "rows": [asdict(r) for r in rows]}, indent=1))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
