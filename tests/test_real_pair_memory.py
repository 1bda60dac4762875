"""The planner against llama.cpp on the real default pair: model buffers, KV cache and compute
buffers within 10% of what llama.cpp reports for the same load (the issue's acceptance check).

Uses the pair already in the store (TANDEM_REAL_MODELS_HOME, else the user's TANDEM_HOME) and
skips when it is not there: it loads the models once, it never downloads or generates.
"""
from __future__ import annotations

import pytest
from tandem.machine.hardware import detect
from tandem.machine.placement import ContextSpec, place
from tandem.machine.shapes import ModelShape

pytestmark = pytest.mark.slow

# read at import, before any test points TANDEM_HOME at a temporary directory
MiB = 1 << 20

CONFIGS = {  # the cpu profile's settings, then a long context without flash attention
    "profile": ContextSpec(n_ctx=4096, n_batch=512, n_ubatch=512, flash_attn="on"),
    "long-no-fa-q8k": ContextSpec(n_ctx=32768, n_batch=512, n_ubatch=512, flash_attn="off",
                                  type_k="q8_0"),
}


def test_planner_within_10_percent_of_llama_cpp(real_pair):
    from llama_log import llama_reports
    from tandem.models.gguf_meta import read_gguf_header

    paths = {"target": real_pair[0], "draft": real_pair[1]}  # conftest fetches it once
    ctxs = {name: {"n_ctx": c.n_ctx, "n_batch": c.n_batch, "n_ubatch": c.n_ubatch,
                   "flash_attn": c.flash_attn, "type_k": c.type_k, "type_v": c.type_v}
            for name, c in CONFIGS.items()}
    # as the engine loads them (no repacking), and with llama.cpp's CPU_REPACK buffer
    items = [{"key": f"{role}{'+repack' if repack else ''}", "path": str(path),
              "repack": repack, "ctxs": ctxs}
             for repack in (False, True) for role, path in paths.items()]
    reports = llama_reports(items)
    hw = detect()
    features = hw.ggml_cpu_features
    rows = []
    for item in items:
        shape = ModelShape.from_gguf(read_gguf_header(item["path"]))
        got = reports[item["key"]]
        for name, ctx in CONFIGS.items():
            p = place(shape, ctx, 0, backend="cpu", features=features,
                      repack=item["repack"] and hw.backend.repack)
            real = got["ctxs"][name]
            assert set(p.buffers) == set(got["model"]), (item["key"], p.buffers, got["model"])
            pairs = [(f"model {b}", p.buffers[b], got["model"][b]) for b in got["model"]]
            pairs += [("KV cache", p.kv, real["kv"]),
                      ("compute", p.compute_cpu, real["compute"]["CPU"])]
            for what, mine, theirs in pairs:
                rows.append((item["key"], name, what, mine / MiB, theirs / MiB))
                assert mine == pytest.approx(theirs, rel=0.10), (item["key"], name, what)
    print("\nmodel          config          figure              planner MiB  llama.cpp MiB   diff")
    for key, name, what, mine, theirs in rows:
        print(f"{key:14} {name:15} {what:19} {mine:11.2f} {theirs:14.2f} "
              f"{(mine - theirs) / theirs * 100:+6.2f}%")
