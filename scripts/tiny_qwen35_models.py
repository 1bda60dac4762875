"""A tiny replica of Qwen3.5/3.6's dense architecture (`qwen35`) for tests (< 1 s, ~0.6 MB).

qwen35.gguf: four trunk layers as Qwen3.5/3.6 are built, three gated delta-net (linear
attention) layers then one full attention layer (`full_attention_interval` 4), and block 4 a
nextn MTP layer (`nextn_predict_layers` 1). Tensor names, keys and shapes are the vendored
llama.cpp's (src/llama-arch.cpp, src/models/qwen35.cpp: load_arch_hparams, load_arch_tensors,
graph_mtp; conversion/qwen.py for what a converted checkpoint holds): the delta-net layers'
fused attn_qkv and attn_gate (z), ssm_conv1d over the q, k, v channels, ssm_beta, ssm_alpha,
ssm_dt.bias, ssm_a (-exp(A_log)), ssm_norm and ssm_out; the attention layer's attn_q with a
gate half per head, q/k norms and interleaved multi-section RoPE (`rope.dimension_sections`).
qwen35_draft.gguf: the trunk with DRAFT_NOISE noise and without the MTP layer, its draft.

The MTP head is made to draft well, as in tiny_mtp_models.py: token embeddings have RMS 1,
the delta-net layers write only a little (LINEAR_GAIN) into the residual stream, and the head
is the attention layer's copy fed with the token's own embedding (and HEAD_H_GAIN of the
target's hidden row): it computes what the trunk computes without the delta-net layers, the
target's next token about half the time (52 of 108 drafts at --draft-max 4 on
tests/test_tiny_qwen35.py's prompt; qwen35_draft.gguf: 59 of 83), so drafts get rejected and
the recurrent state rolled back. The seed is one whose greedy text varies (others settle
into one token repeated). Same SPM vocabulary and chat template as the other tiny models:
it pairs with target.gguf and hybrid.gguf.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from make_tiny_models import (DRAFT_NOISE, DRAFT_SEED, N_EMBD, _printable_mask,
                              add_noise, in_layer, mat, output_weights, spm_vocab, write_gguf)

TRUNK_LAYERS = 4  # block TRUNK_LAYERS is the nextn head
FULL_ATTENTION_INTERVAL = 4  # every fourth layer attends (Qwen3.5/3.6's config)
N_HEAD, N_HEAD_KV = 2, 1  # grouped-query attention, as Qwen3.5's
HEAD_DIM = 32  # a q8_0 block: --exact's quantized KV cache fits (16 would fall back to f16)
ROPE_DIMS = HEAD_DIM // 4  # partial rotary: Qwen3.5 rotates a quarter of its heads
ROPE_SECTIONS = [2, 1, 1, 0]  # pairs of dimensions per section, summing to ROPE_DIMS / 2
# the delta-net: head_k_dim == head_v_dim == ssm.state_size; fewer key heads than value heads
D_CONV, D_STATE, N_K_HEADS, N_V_HEADS = 4, 16, 2, 4
D_INNER = D_STATE * N_V_HEADS
CONV_DIM = 2 * D_STATE * N_K_HEADS + D_INNER  # the q, k and v channels the convolution sees
N_FF = 32  # narrower than the other tiny models': five layers in about 0.6 MB
LINEAR_GAIN = 0.1  # how much each delta-net layer adds to the residual stream (the head lacks it)
HEAD_H_GAIN = 0.05  # the share of the target's hidden row in the head's input
QWEN35_SEED = 1111


def _norms(*names: str) -> dict[str, np.ndarray]:
    return {f"{n}.weight": np.ones(N_EMBD, dtype=np.float32) for n in names}


def ffn_weights(rng: np.random.Generator, gain_down: float) -> dict[str, np.ndarray]:
    return {"ffn_gate.weight": mat(rng, N_FF, N_EMBD, 1.0),
            "ffn_up.weight": mat(rng, N_FF, N_EMBD, 1.0),
            "ffn_down.weight": mat(rng, N_EMBD, N_FF, gain_down)}


def delta_net_layer(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A gated delta-net layer (names without the blk.N. prefix), numpy shapes (out, in)."""
    return {**_norms("attn_norm", "post_attention_norm"),
            "attn_qkv.weight": mat(rng, CONV_DIM, N_EMBD, 1.5),
            "attn_gate.weight": mat(rng, D_INNER, N_EMBD, 1.0),
            "ssm_conv1d.weight": mat(rng, CONV_DIM, D_CONV, 1.5),
            # softplus(alpha + dt_bias) * ssm_a is the log decay: small steps, so that the
            # state remembers earlier tokens (the recurrent memory matters)
            "ssm_dt.bias": np.full(N_V_HEADS, -2.0, dtype=np.float32),
            "ssm_a": -np.linspace(0.5, 4.0, N_V_HEADS).astype(np.float32),
            "ssm_beta.weight": mat(rng, N_V_HEADS, N_EMBD, 1.0),
            "ssm_alpha.weight": mat(rng, N_V_HEADS, N_EMBD, 0.5),
            "ssm_norm.weight": np.ones(D_STATE, dtype=np.float32),
            "ssm_out.weight": mat(rng, N_EMBD, D_INNER, LINEAR_GAIN),
            **ffn_weights(rng, LINEAR_GAIN)}


def attention_layer(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The full attention layer: attn_q's rows are each head's query then its output gate."""
    return {**_norms("attn_norm", "post_attention_norm"),
            "attn_q.weight": mat(rng, 2 * N_HEAD * HEAD_DIM, N_EMBD, 2.0),
            "attn_k.weight": mat(rng, N_HEAD_KV * HEAD_DIM, N_EMBD, 2.0),
            "attn_v.weight": mat(rng, N_HEAD_KV * HEAD_DIM, N_EMBD, 1.0),
            "attn_output.weight": mat(rng, N_EMBD, N_HEAD * HEAD_DIM, 3.0),
            "attn_q_norm.weight": np.ones(HEAD_DIM, dtype=np.float32),
            "attn_k_norm.weight": np.ones(HEAD_DIM, dtype=np.float32),
            **ffn_weights(rng, 1.5)}


def qwen35_weights(n_vocab: int, printable: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """The trunk's and the MTP head's weights."""
    rng = np.random.default_rng(seed)
    embd = rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)
    embd /= np.sqrt((embd ** 2).mean(axis=1, keepdims=True))  # RMS 1: enorm(e) == e
    w: dict[str, np.ndarray] = {"token_embd.weight": embd}
    for i in range(TRUNK_LAYERS):
        attends = (i + 1) % FULL_ATTENTION_INTERVAL == 0
        layer = attention_layer(rng) if attends else delta_net_layer(rng)
        w.update(in_layer(i, layer))
    # the head: the last trunk layer's (the attention one's) copy, reading
    # concat(enorm(e), hnorm(h)) through eh_proj
    head = {name: a.copy() for name, a in layer.items()}
    head["nextn.eh_proj.weight"] = np.concatenate(
        [np.eye(N_EMBD), HEAD_H_GAIN * np.eye(N_EMBD)], axis=1).astype(np.float32)
    head.update(_norms("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm"))
    w.update(in_layer(TRUNK_LAYERS, head))
    w["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    w["output.weight"] = output_weights(rng, n_vocab, printable)
    return w


def _hparams(n_nextn: int):
    def hparams(writer) -> None:
        writer.add_block_count(TRUNK_LAYERS + n_nextn)  # the nextn block counts as a block
        if n_nextn:
            writer.add_nextn_predict_layers(n_nextn)
        writer.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
        writer.add_feed_forward_length(N_FF)
        writer.add_head_count(N_HEAD)
        writer.add_head_count_kv(N_HEAD_KV)
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_rope_dimension_count(ROPE_DIMS)
        writer.add_rope_dimension_sections(ROPE_SECTIONS)
        writer.add_rope_freq_base(10000.0)
        writer.add_ssm_conv_kernel(D_CONV)
        writer.add_ssm_state_size(D_STATE)
        writer.add_ssm_group_count(N_K_HEADS)
        writer.add_ssm_time_step_rank(N_V_HEADS)
        writer.add_ssm_inner_size(D_INNER)
    return hparams


def make_qwen35_models(outdir: Path) -> dict[str, Path]:
    """Write qwen35.gguf and qwen35_draft.gguf into outdir."""
    vocab = spm_vocab()
    weights = qwen35_weights(len(vocab[0]), _printable_mask(vocab[0]), QWEN35_SEED)
    trunk = {n: a for n, a in weights.items() if not n.startswith(f"blk.{TRUNK_LAYERS}.")}
    return {
        "qwen35": write_gguf(outdir / "qwen35.gguf", "qwen35", "tiny-qwen35", weights, vocab,
                             _hparams(1)),
        "qwen35_draft": write_gguf(outdir / "qwen35_draft.gguf", "qwen35", "tiny-qwen35-draft",
                                   add_noise(trunk, DRAFT_NOISE, DRAFT_SEED), vocab, _hparams(0)),
    }
