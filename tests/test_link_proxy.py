"""scripts/link_proxy.py (the emulated link) and scripts/bench_rpc.py (its benchmark), on the
tiny models: the proxy's measured round trip is at least the configured one (a lower bound
only: no timing upper bound is asserted), tandem over RPC through it gives the local output,
and bench_rpc runs end to end on one RTT and one prompt."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_measured_round_trip_is_at_least_twice_the_delay():
    import link_proxy

    res = asyncio.run(link_proxy.ping(0.005, 125e6, count=5))
    assert res["rtt_ms_min"] >= 10.0
    assert res["configured_rtt_ms"] == 10.0


def test_ping_cli_prints_json():
    res = subprocess.run([sys.executable, str(ROOT / "scripts/link_proxy.py"), "--ping",
                          "--delay-ms", "1", "--count", "3"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["rtt_ms_min"] >= 2.0 and doc["count"] == 3


def test_bench_rpc_smoke(tiny_models, tmp_path):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "rpc.json"
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "cli"), str(ROOT / "scripts"),
                                          os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench_rpc.py"), "-m", str(tiny_models["target"]),
         "-md", str(tiny_models["draft"]), "--rtt", "2", "--coding", "1", "--no-spec-bench",
         "-n", "12", "-t", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["pings_ms"]["2.0"] >= 2.0
    per = doc["summary"]["2.0"]
    for name in ("tandem-plain", "tandem-auto", "tandem-draft"):
        assert per[name]["n"] == 1 and per[name]["decode_tok_s"] > 0
        assert per[name]["e2e_tok_s"] > 0
    texts = {r["config"]: r["text"] for r in doc["rows"] if r["config"].startswith("tandem")}
    assert texts["tandem-plain"]
    assert "| 2.0 (" in res.stdout
