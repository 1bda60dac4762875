"""Tiny models whose memory is not (only) an attention KV cache, for tests (< 1 s, ~0.5 MB).

hybrid.gguf: LFM2 (short-convolution, attention, short-convolution layers): llama.cpp rolls
its recurrent state back only inside the last batch, and only with n_rs_seq > 0.
hybrid_draft.gguf: the same weights with noise, a draft that agrees with it most of the time.
recurrent.gguf: Mamba, which llama.cpp cannot roll back at all (no snapshots).
sliding.gguf: Gemma 3 with a window of SLIDING_WINDOW tokens on every layer.
All use make_tiny_models' SPM vocabulary and chat template, so they pair with each other and
with target.gguf. Tensor names and keys are llama.cpp's (src/llama-arch.cpp,
src/models/lfm2.cpp, src/models/mamba.cpp of the vendored source).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from make_tiny_models import (DRAFT_NOISE, DRAFT_SEED, N_EMBD, N_FF, N_HEAD, _printable_mask,
                              add_noise, attention_weights, ffn_weights, in_layer, mat,
                              output_weights, spm_vocab, write_gguf)

# LFM2: which layers attend (the others are short convolutions); their head_count_kv is 0
LFM2_ATTENTION = (False, True, False)
L_CACHE = 3  # the short convolution's width (lfm2.shortconv.l_cache)
# Mamba: d_inner must be 2 * n_embd in llama.cpp (mamba.cpp)
MAMBA_LAYERS = 2
D_CONV, D_STATE, DT_RANK = 4, 16, 8

GEMMA_LAYERS = 2  # both within the window (llama.cpp's default pattern: every sixth is full)
SLIDING_WINDOW = 8

HYBRID_SEED = 2468
RECURRENT_SEED = 1357
SLIDING_SEED = 8642


def lfm2_weights(n_vocab: int, printable: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Random LFM2 weights, numpy shapes (out, in) as GGUFWriter expects."""
    rng = np.random.default_rng(seed)
    head = N_EMBD // N_HEAD
    w: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)}
    for i, attends in enumerate(LFM2_ATTENTION):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        if attends:
            w[p + "attn_q_norm.weight"] = np.ones(head, dtype=np.float32)
            w[p + "attn_k_norm.weight"] = np.ones(head, dtype=np.float32)
            w.update(in_layer(i, attention_weights(rng)))
        else:
            # the convolution over the last L_CACHE tokens is what makes the state recurrent
            w[p + "shortconv.conv.weight"] = mat(rng, N_EMBD, L_CACHE, 1.5)
            w[p + "shortconv.in_proj.weight"] = mat(rng, 3 * N_EMBD, N_EMBD, 1.5)
            w[p + "shortconv.out_proj.weight"] = mat(rng, N_EMBD, N_EMBD, 1.5)
        w[p + "ffn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        w.update(in_layer(i, ffn_weights(rng)))
    # LFM2's output norm is stored under this name (llama-arch.cpp: OUTPUT_NORM_LFM2)
    w["token_embd_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    w["output.weight"] = output_weights(rng, n_vocab, printable)
    return w


def mamba_weights(n_vocab: int, printable: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d_inner = 2 * N_EMBD
    w: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)}
    for i in range(MAMBA_LAYERS):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        w[p + "ssm_in.weight"] = mat(rng, 2 * d_inner, N_EMBD, 1.5)
        w[p + "ssm_conv1d.weight"] = mat(rng, d_inner, D_CONV, 1.0)
        w[p + "ssm_conv1d.bias"] = np.zeros(d_inner, dtype=np.float32)
        w[p + "ssm_x.weight"] = mat(rng, DT_RANK + 2 * D_STATE, d_inner, 1.0)
        w[p + "ssm_dt.weight"] = mat(rng, d_inner, DT_RANK, 1.0)
        w[p + "ssm_dt.bias"] = np.full(d_inner, -2.0, dtype=np.float32)  # softplus: small steps
        # A is stored as -exp(A_log) (convert_hf_to_gguf.py): negative, so the state decays
        a_log = np.log(np.tile(np.arange(1, D_STATE + 1, dtype=np.float32), (d_inner, 1)))
        w[p + "ssm_a"] = -np.exp(a_log).astype(np.float32)
        w[p + "ssm_d"] = np.ones(d_inner, dtype=np.float32)
        w[p + "ssm_out.weight"] = mat(rng, N_EMBD, d_inner, 1.5)
    w["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    w["output.weight"] = output_weights(rng, n_vocab, printable)
    return w


def gemma3_weights(n_vocab: int, printable: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    head = N_EMBD // N_HEAD
    w: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)}
    for i in range(GEMMA_LAYERS):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w[p + norm + ".weight"] = np.ones(N_EMBD, dtype=np.float32)
        w[p + "attn_q_norm.weight"] = np.ones(head, dtype=np.float32)
        w[p + "attn_k_norm.weight"] = np.ones(head, dtype=np.float32)
        w.update(in_layer(i, {**attention_weights(rng), **ffn_weights(rng)}))
    w["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    w["output.weight"] = output_weights(rng, n_vocab, printable)
    return w


def _write(path: Path, arch: str, name: str, weights: dict[str, np.ndarray], hparams) -> Path:
    return write_gguf(path, arch, name, weights, spm_vocab(), hparams)


def _lfm2_hparams(writer) -> None:
    writer.add_block_count(len(LFM2_ATTENTION))
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv([N_HEAD if a else 0 for a in LFM2_ATTENTION])
    writer.add_rope_freq_base(10000.0)
    writer.add_shortconv_l_cache(L_CACHE)


def _mamba_hparams(writer) -> None:
    writer.add_block_count(MAMBA_LAYERS)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_ssm_conv_kernel(D_CONV)
    writer.add_ssm_inner_size(2 * N_EMBD)
    writer.add_ssm_state_size(D_STATE)
    writer.add_ssm_time_step_rank(DT_RANK)


def _gemma3_hparams(writer) -> None:
    writer.add_block_count(GEMMA_LAYERS)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_key_length(N_EMBD // N_HEAD)
    writer.add_value_length(N_EMBD // N_HEAD)
    writer.add_sliding_window(SLIDING_WINDOW)


def make_recurrent_models(outdir: Path) -> dict[str, Path]:
    """Write hybrid.gguf, hybrid_draft.gguf, recurrent.gguf and sliding.gguf into outdir."""
    vocab = spm_vocab()
    printable = _printable_mask(vocab[0])
    hybrid = lfm2_weights(len(vocab[0]), printable, HYBRID_SEED)
    return {
        "hybrid": _write(outdir / "hybrid.gguf", "lfm2", "tiny-hybrid", hybrid, _lfm2_hparams),
        "hybrid_draft": _write(outdir / "hybrid_draft.gguf", "lfm2", "tiny-hybrid-draft",
                               add_noise(hybrid, DRAFT_NOISE, DRAFT_SEED), _lfm2_hparams),
        "recurrent": _write(outdir / "recurrent.gguf", "mamba", "tiny-recurrent",
                            mamba_weights(len(vocab[0]), printable, RECURRENT_SEED),
                            _mamba_hparams),
        "sliding": _write(outdir / "sliding.gguf", "gemma3", "tiny-sliding",
                          gemma3_weights(len(vocab[0]), printable, SLIDING_SEED),
                          _gemma3_hparams),
    }
