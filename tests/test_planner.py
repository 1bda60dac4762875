"""Offload planner: llama.cpp's placement rules, memory figures against llama.cpp's own reports
(tiny models here; the real pair in test_real_pair_memory.py), and the plans the profiles give
the recorded machines for the catalog's recommended pairs."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hw_fixtures import CPU_ONLY, machine
from tandem.commands.compose import resolve
from tandem.machine.fit import plan_for_settings, recommended_pairs
from tandem.machine.placement import ContextSpec, place, repackable
from tandem.machine.planner import FITS, NO_FIT, PARTIAL, MemoryBudget, GiB, MiB, plan
from tandem.machine.shapes import ModelShape, PlanTensor, row_bytes
from tandem.models.catalog import ModelSpec, load_catalog
from tandem.models.gguf_meta import read_gguf_header

AVX2 = frozenset({"avx2", "fma", "f16c"})


def toy(n_layer=4, layer=100 * MiB, tied=False, vocab=1000, embd=64) -> ModelShape:
    """A hand-made shape with round numbers."""
    return ModelShape(name="toy", arch="llama", n_layer=n_layer, n_embd=embd, n_head=4,
                      n_head_kv=(2,) * n_layer, head_dim_k=16, head_dim_v=16, n_ff=256,
                      n_vocab=vocab, input_bytes=40 * MiB, embd_bytes=40 * MiB,
                      output_bytes=0 if tied else 30 * MiB, tied_output=tied,
                      layer_bytes=(layer,) * n_layer, exact=False)


# ------------------------------------------------------------------------- GGUF shapes


def test_shape_from_tiny_gguf(tiny_models):
    h = read_gguf_header(tiny_models["target"])
    s = ModelShape.from_gguf(h)
    assert (s.arch, s.n_layer, s.n_embd, s.n_head, s.n_ff, s.n_vocab) == ("llama", 2, 64, 4, 128,
                                                                          260)
    assert s.n_head_kv == (4, 4) and s.head_dim_k == s.head_dim_v == 16
    assert not s.tied_output and s.exact
    assert s.weights_bytes == sum(t.nbytes for t in h.tensors)
    assert s.embd_bytes == s.input_bytes == 260 * 64 * 4
    assert s.output_bytes == 260 * 64 * 4 + 64 * 4  # output.weight + output_norm


def test_tiny_plan_matches_llama_cpp(tiny_models):
    """The planner's model buffer, KV cache and compute buffer against llama.cpp's log."""
    from llama_log import llama_reports

    shape = ModelShape.from_gguf(read_gguf_header(tiny_models["target"]))
    configs = {
        "default": ContextSpec(n_ctx=4096),
        "small-q8": ContextSpec(n_ctx=300, n_batch=64, n_ubatch=64, flash_attn="off",
                                type_k="q8_0", type_v="f16"),
    }
    ctxs = {k: {"n_ctx": c.n_ctx, "n_batch": c.n_batch, "n_ubatch": c.n_ubatch,
                "flash_attn": c.flash_attn, "type_k": c.type_k, "type_v": c.type_v}
            for k, c in configs.items()}
    got = llama_reports([{"key": "tiny", "path": str(tiny_models["target"]), "ctxs": ctxs}])
    got = got["tiny"]
    for key, ctx in configs.items():
        p = place(shape, ctx, 0, features=AVX2)
        assert set(got["model"]) == set(p.buffers) == {"CPU_Mapped"}
        assert p.buffers["CPU_Mapped"] == pytest.approx(got["model"]["CPU_Mapped"], rel=0.02)
        assert p.kv == pytest.approx(got["ctxs"][key]["kv"], rel=0.02)
        assert p.compute_cpu == pytest.approx(got["ctxs"][key]["compute"]["CPU"], rel=0.10)


# ----------------------------------------------------------------------- llama.cpp rules


def test_layer_placement_follows_llama_cpp():
    s = toy()
    ctx = ContextSpec(n_ctx=1024)
    cpu = place(s, ctx, 5, backend="cpu")
    assert cpu.gpu_layers == 0 and cpu.weights_gpu == 0  # CPU builds ignore n_gpu_layers
    p0 = place(s, ctx, 0, backend="cuda")
    assert (p0.weights_gpu, p0.kv_gpu, p0.compute_gpu) == (0, 0, 0)
    p1 = place(s, ctx, 1, backend="cuda")  # n_gpu_layers=1 offloads only the output layer
    assert p1.weights_gpu == pytest.approx(30 * MiB, abs=4096) and p1.kv_gpu == 0
    p2 = place(s, ctx, 2, backend="cuda")  # ...then the last repeating layer
    assert p2.weights_gpu == pytest.approx(130 * MiB, abs=4096)
    assert p2.kv_gpu == p2.kv // 4
    full = place(s, ctx, 99, backend="cuda")
    assert full.gpu_layers == 5 and full.on_gpu
    assert full.weights_cpu == 40 * MiB  # token_embd always stays on the CPU
    assert full.kv_cpu == 0


def test_tied_embeddings_are_copied_to_the_gpu():
    s = toy(tied=True)
    full = place(s, ContextSpec(), 5, backend="cuda")
    assert full.weights_gpu == pytest.approx(400 * MiB + 40 * MiB, abs=4096)
    assert full.weights_cpu == 40 * MiB


def test_kv_cache_sizes():
    assert row_bytes("f16", 256) == 512
    assert row_bytes("q8_0", 256) == 8 * 34
    assert row_bytes("q4_0", 256) == 8 * 18
    s = toy()
    p = place(s, ContextSpec(n_ctx=300), 0)  # padded to 512 cells
    assert p.kv == 4 * 512 * (2 * 32 * 2)
    q = place(s, ContextSpec(n_ctx=300, type_k="q8_0", type_v="q8_0"), 0)
    assert q.kv == 4 * 512 * 2 * 34


def test_compute_buffer_is_logits_bound_unless_attention_is_bigger():
    s = toy(vocab=150_000, embd=1024)
    fa = place(s, ContextSpec(n_ctx=4096, n_outputs_max=0), 0)  # llama.cpp's default: n_batch rows
    assert fa.compute_cpu == 4 * (512 * 150_000 + 2 * 512 * 1024)
    few_outputs = place(s, ContextSpec(n_ctx=4096, n_outputs_max=8), 0)
    assert few_outputs.compute_cpu < fa.compute_cpu / 4
    no_fa_long = place(s, ContextSpec(n_ctx=65536, flash_attn="off"), 0)
    assert no_fa_long.compute_cpu > 4 * 65536 * 512 * 4  # the KQ matrix dominates


def test_repack_rules():
    q4k = PlanTensor("blk.0.ffn_up.weight", 1000, "Q4_K", 2, 8960, 0, "layer", 0)
    assert repackable(q4k, AVX2)
    assert not repackable(replace(q4k, ne1=8961), AVX2)
    assert not repackable(replace(q4k, type_name="Q6_K"), AVX2)
    assert not repackable(replace(q4k, group="input"), AVX2)  # token_embd: GET_ROWS
    assert not repackable(replace(q4k, ndim=1), AVX2)
    assert not repackable(q4k, frozenset({"sse3"}))
    arm = frozenset({"neon", "dotprod"})
    assert repackable(replace(q4k, type_name="Q6_K"), arm)
    assert repackable(replace(q4k, type_name="Q8_0", ne1=4), arm)
    assert repackable(replace(q4k, type_name="Q2_K"), AVX2 | {"avx512"})


def test_repack_only_when_asked_and_never_on_cuda():
    s = toy()
    t = PlanTensor("blk.0.attn_q.weight", 100 * MiB, "Q4_K", 2, 64, 0, "layer", 0)
    s = replace(s, n_layer=1, layer_bytes=(100 * MiB,), n_head_kv=(2,), tensors=(t,),
                input_bytes=0, output_bytes=0, embd_bytes=0)
    assert place(s, ContextSpec(), 0, backend="cpu", features=AVX2,
                 repack=True).buffers["CPU_REPACK"]
    assert "CPU_REPACK" not in place(s, ContextSpec(), 0, backend="cpu", features=AVX2).buffers
    assert "CPU_REPACK" not in place(s, ContextSpec(), 0, backend="cuda", features=AVX2,
                                     repack=True).buffers


# ------------------------------------------------------------------------------ plans


def test_draft_goes_first_and_the_target_fills_the_rest():
    target, draft = toy(n_layer=10, layer=1 * GiB), toy(n_layer=4, layer=50 * MiB)
    budget = MemoryBudget(backend="cuda", gpu=6 * GiB, ram=64 * GiB)
    p = plan(target, draft, budget, ContextSpec(n_ctx=2048))
    assert p.draft.on_gpu
    assert p.status == PARTIAL and 0 < p.target.gpu_layers < p.target.max_layers
    assert p.gpu_left >= 0
    assert p.gpu_used + place(target, ContextSpec(n_ctx=2048), p.target.gpu_layers + 1,
                              backend="cuda").gpu_total - p.target.gpu_total > 6 * GiB
    assert any("run on the CPU" in x for x in p.problems)
    assert any("smaller pair" in a or "lower-bit" in a for a in p.advice)


def test_advice_names_context_and_kv_quantization():
    target = toy(n_layer=20, layer=100 * MiB)  # 2 GiB of weights, 5 GiB of f16 KV at 16k
    big_kv = replace(target, n_head_kv=(32,) * 20, head_dim_k=128, head_dim_v=128)
    budget = MemoryBudget(backend="cuda", gpu=6 * GiB, ram=64 * GiB)
    p = plan(big_kv, None, budget, ContextSpec(n_ctx=16384))
    assert p.status == PARTIAL
    assert any("smaller context" in a for a in p.advice)
    assert any("q8_0" in a for a in p.advice)


def test_explicit_layers_that_do_not_fit_and_ram():
    target = toy(n_layer=10, layer=1 * GiB)
    p = plan(target, None, MemoryBudget(backend="cuda", gpu=2 * GiB, ram=64 * GiB), ContextSpec(),
             target_layers="all")
    assert p.status == NO_FIT and "requested GPU layers" in p.problems[0]
    small = toy(n_layer=2, layer=10 * MiB)
    p = plan(target, None, MemoryBudget(backend="cpu", ram=4 * GiB), ContextSpec(),
             alternatives=[("small-pair", small, None)])
    assert p.status == NO_FIT and not p.fits
    assert any("available" in x for x in p.problems)
    assert any("small-pair" in a for a in p.advice)


def _spec(name: str, gb: float) -> ModelSpec:
    return ModelSpec(name=name, repo="x/y", filename=f"{name}.gguf", size=int(gb * 1e9))


def test_hardware_md_sizes_on_the_recorded_gpus():
    """32B Q4_K_M (19.85 GB) + 0.5B fit a 24 GB card entirely, not a 16 GB one
    (docs/hardware.md)."""
    big = (_spec("qwen2.5-32b-instruct-q4_k_m", 19.85), _spec("qwen2.5-0.5b-instruct", 0.398))
    mid = (_spec("qwen2.5-14b-instruct-q4_k_m", 8.99), big[1])
    for kind, fits_big in (("rtx4090", True), ("rtx4080", False)):
        r = resolve({}, env={}, home=_empty_home(), hardware=machine(kind))
        s, on = r.settings, dict(hardware=r.hardware, backend=r.backend)
        p = plan_for_settings(s, *big, **on)
        assert p.draft.on_gpu
        assert (p.status == FITS) is fits_big
        if not fits_big:
            assert p.status == PARTIAL and p.target.gpu_layers < p.target.max_layers
        p = plan_for_settings(s, *mid, **on)
        assert p.status == FITS and p.target.on_gpu


def _empty_home():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="tandem-home-"))


@pytest.mark.parametrize("kind,profile", [("rtx4090", "rtx-4090"), ("rtx4080", "rtx-4080"),
                                          ("m2-ultra", "mac-studio"), ("cpu-box", "cpu")])
def test_recommended_pairs_fit_the_recorded_machines(kind, profile, tmp_path):
    """Every recommended pair the catalog knows gets a plan that fits, all on the GPU where
    there is one (sizes from the catalog; estimated architectures)."""
    hw = machine(kind)
    r = resolve({}, env={}, home=tmp_path, hardware=hw)
    s, on = r.settings, dict(hardware=r.hardware, backend=r.backend)
    assert s.profile == profile
    advice = recommended_pairs(s, r.profile, **on)
    assert advice
    known = [a for a in advice if a.status != "unknown"]
    catalog = load_catalog()
    assert all(a.name in catalog for a in known)
    for a in known:
        assert a.status == FITS, (a.name, a.plan.problems)
        if hw.vendor != "cpu":
            assert a.plan.target.on_gpu and a.plan.draft.on_gpu, a.name
            assert a.plan.gpu_left >= 0
        else:
            assert a.plan.backend == "cpu" and a.plan.ram_left >= 0
    # the default pair, whatever the profile recommends, fits everywhere
    default = plan_for_settings(s, catalog[s.pair].target, catalog[s.pair].draft, **on)
    assert default.status == FITS


def test_gpu_box_with_cpu_only_binding_plans_for_the_cpu(tmp_path):
    hw = machine("rtx4090", backend=CPU_ONLY)
    r = resolve({}, env={}, home=tmp_path, hardware=hw)
    assert r.settings.profile == "rtx-4090" and r.backend == "cpu"
    assert any("-DGGML_CUDA=on" in w and "pip install" in w for w in r.warnings)
    assert MemoryBudget.for_hardware(hw, backend=r.backend).backend == "cpu"


# --------------------------------------------------------------------------- estimates


@pytest.mark.parametrize("name,layers,vocab,tied", [
    ("qwen2.5-coder-32b-instruct-q4_k_m", 64, 152064, False),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", 24, 151936, False),
    ("qwen3-0.6b-q4_k_m", 28, 151936, True),
    ("llama-3.3-70b-instruct-q4_k_m", 80, 128256, False),
    ("llama-3.2-1b-instruct-q4_k_m", 16, 128256, True),
    ("gemma-3-27b-it-q4_k_m", 62, 262144, True),
    ("deepseek-r1-distill-qwen-32b-q4_k_m", 64, 152064, False),
])
def test_estimated_shapes(name, layers, vocab, tied):
    s = ModelShape.estimate(name, int(10e9))
    assert (s.n_layer, s.n_vocab, s.tied_output) == (layers, vocab, tied)
    assert not s.exact and s.weights_bytes == pytest.approx(10e9, rel=0.01)
    unsized = ModelShape.estimate(name, None)
    assert unsized.weights_bytes > 0


def test_estimate_is_close_to_the_real_header(tiny_models):
    """Estimated Qwen2.5 1.5B layout vs what the GGUF says (from the catalog's exact size)."""
    s = ModelShape.estimate("qwen2.5-coder-1.5b-instruct-q4_k_m", 1117320768)
    assert (s.n_layer, s.n_embd, s.n_head_kv[0], s.head_dim_k) == (28, 1536, 2, 128)
    kv = place(s, ContextSpec(n_ctx=4096), 0).kv
    assert kv == 112 * MiB  # llama.cpp: "llama_kv_cache: size = 112.00 MiB"


def test_planner_assumes_the_engines_logits_row_cap():
    pytest.importorskip("llama_cpp")
    from tandem.engine.backend.llama import MAX_OUTPUTS, ContextParams

    assert ContextSpec().n_outputs_max == MAX_OUTPUTS == ContextParams().n_outputs_max
