"""A tiny model with its own multi-token-prediction head ("nextn" layer), for tests (< 1 s).

mtp.gguf: GLM-4.5's architecture (glm4moe), the simplest llama.cpp drafts from with MTP
(src/models/glm4-moe.cpp: attention KV memory, one nextn block; Qwen3.5's trunk is a hybrid
of gated delta-net layers, step35's heads are chained, Gemma 4's share the target's memory).
Two dense trunk layers (`leading_dense_block_count` = 2) and block 2 the nextn head:
`blk.2.nextn.eh_proj` mixes the next token's embedding with the target's last hidden row,
then one attention layer and an MoE FFN (routed experts plus a shared expert), the model's
output norm and output.

The head's weights are chosen so that its drafts are often right: it copies the trunk's last
layer. eh_proj passes the token's embedding through (and HEAD_H_GAIN of the target's hidden
row, so that the rows the engine carries to the head matter), its attention and shared expert
are layer 1's weights, its routed experts output zero. Token embeddings have RMS 1, so the
head's normalised input is the embedding itself; the trunk's layer 0 writes only a little
(FIRST_LAYER_GAIN) into the residual stream. The head then computes what the trunk computes
without layer 0's contribution: the target's next token most of the time, not always (about
three quarters of its drafts are accepted at --draft-max 4: 60 of 77 on tests/test_mtp.py's
prompt; with FIRST_LAYER_GAIN 0.25, 47 of 132). Same SPM vocabulary and chat template as the other tiny
models, so it pairs with target.gguf.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from make_tiny_models import (N_EMBD, N_FF, N_HEAD, _printable_mask, attention_weights, ffn_weights,
                              output_weights, spm_vocab, write_gguf)

TRUNK_LAYERS = 2  # dense; block TRUNK_LAYERS is the nextn head
N_EXPERT = 2  # the head's MoE: routed experts (zero output) beside the shared expert
FIRST_LAYER_GAIN = 0.05  # how much layer 0 adds to the residual stream, which the head lacks
HEAD_H_GAIN = 0.05  # the share of the target's hidden row in the head's input
MTP_SEED = 4321


def _layer(rng, gain: float) -> dict[str, np.ndarray]:
    """A trunk layer: its norms, attention and FFN, both scaled by `gain`."""
    return {"attn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
            **attention_weights(rng, gain),
            "post_attention_norm.weight": np.ones(N_EMBD, dtype=np.float32),
            **ffn_weights(rng, gain)}


def glm4moe_mtp_weights(n_vocab: int, printable: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """The trunk's and the head's weights, numpy shapes (out, in) as GGUFWriter expects."""
    rng = np.random.default_rng(seed)
    embd = rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)
    embd /= np.sqrt((embd ** 2).mean(axis=1, keepdims=True))  # RMS 1: enorm(e) == e
    w: dict[str, np.ndarray] = {"token_embd.weight": embd}
    layers = []
    for i in range(TRUNK_LAYERS):
        gain = FIRST_LAYER_GAIN if i == 0 else 1.5
        layer = _layer(rng, gain)
        layers.append(layer)
        w.update({f"blk.{i}.{name}": a for name, a in layer.items()})
    last, p = layers[-1], f"blk.{TRUNK_LAYERS}."
    for name in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm"):
        w[p + name + ".weight"] = last[name + ".weight"].copy()
    for part in ("gate", "up", "down"):  # the shared expert is layer 1's FFN
        w[p + f"ffn_{part}_shexp.weight"] = last[f"ffn_{part}.weight"].copy()
    w[p + "ffn_gate_inp.weight"] = np.zeros((N_EXPERT, N_EMBD), dtype=np.float32)
    w[p + "exp_probs_b.bias"] = np.zeros(N_EXPERT, dtype=np.float32)
    w[p + "ffn_gate_exps.weight"] = np.zeros((N_EXPERT, N_FF, N_EMBD), dtype=np.float32)
    w[p + "ffn_up_exps.weight"] = np.zeros((N_EXPERT, N_FF, N_EMBD), dtype=np.float32)
    w[p + "ffn_down_exps.weight"] = np.zeros((N_EXPERT, N_EMBD, N_FF), dtype=np.float32)
    # concat(enorm(e), hnorm(h)) -> the token's embedding and a little of the hidden row
    w[p + "nextn.eh_proj.weight"] = np.concatenate(
        [np.eye(N_EMBD), HEAD_H_GAIN * np.eye(N_EMBD)], axis=1).astype(np.float32)
    w[p + "nextn.enorm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    w[p + "nextn.hnorm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    w["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    w["output.weight"] = output_weights(rng, n_vocab, printable)
    return w


def _glm4moe_hparams(writer) -> None:
    writer.add_block_count(TRUNK_LAYERS + 1)  # the nextn block counts as a block
    writer.add_nextn_predict_layers(1)
    writer.add_leading_dense_block_count(TRUNK_LAYERS)
    writer.add_feed_forward_length(N_FF)
    writer.add_expert_feed_forward_length(N_FF)
    writer.add_expert_count(N_EXPERT)
    writer.add_expert_used_count(1)
    writer.add_expert_shared_count(1)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)


def make_mtp_models(outdir: Path) -> dict[str, Path]:
    """Write mtp.gguf into outdir."""
    vocab = spm_vocab()
    weights = glm4moe_mtp_weights(len(vocab[0]), _printable_mask(vocab[0]), MTP_SEED)
    return {"mtp": write_gguf(outdir / "mtp.gguf", "glm4moe", "tiny-mtp", weights, vocab,
                              _glm4moe_hparams)}
