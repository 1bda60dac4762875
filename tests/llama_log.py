"""Load models in a subprocess with llama.cpp's log on and read back the buffer sizes it reports.

A subprocess, because llama.cpp only logs through our callback when verbose, and that setting is
process-wide (tandem.engine.backend.llama.init_backend). Each model is loaded once; every context
configuration is then created (and freed) on it, which costs milliseconds, not a reload.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

MiB = 1 << 20

_SCRIPT = r"""
import json, os, sys
from tandem.engine.backend.llama import Context, ContextParams, Model
for item in json.loads(sys.argv[1]):
    os.write(2, ("### MODEL " + item["key"] + "\n").encode())
    m = Model(item["path"], item.get("gpu_layers", 0), verbose=True,
              repack=item.get("repack", False))
    for name, params in item["ctxs"].items():
        os.write(2, ("### CTX " + name + "\n").encode())
        Context(m, ContextParams(**params)).close()
    m.close()
"""

_MODEL_BUF = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")
_KV = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB")
_COMPUTE = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")


def llama_reports(items: list[dict], timeout: float = 300) -> dict[str, dict]:
    """items: [{"key", "path", "gpu_layers", "repack", "ctxs": {name: ContextParams kwargs}}] ->
    {key: {"model": {buffer: bytes}, "ctxs": {name: {"kv": bytes, "compute": {buffer: bytes}}}}}
    """
    env = dict(os.environ)
    cli = str(Path(__file__).resolve().parents[1] / "cli")
    env["PYTHONPATH"] = cli + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(items)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"llama.cpp load failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out: dict[str, dict] = {}
    for chunk in res.stderr.split("### MODEL ")[1:]:
        key, _, log = chunk.partition("\n")
        head, *ctx_chunks = log.split("### CTX ")
        model = {m.group(1): float(m.group(2)) * MiB for m in _MODEL_BUF.finditer(head)}
        ctxs = {}
        for c in ctx_chunks:
            name, _, clog = c.partition("\n")
            ctxs[name] = {
                "kv": sum(float(m.group(1)) * MiB for m in _KV.finditer(clog)),
                "compute": {m.group(1): float(m.group(2)) * MiB for m in _COMPUTE.finditer(clog)},
            }
        out[key] = {"model": model, "ctxs": ctxs}
    return out
