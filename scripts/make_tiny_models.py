#!/usr/bin/env python3
"""Generate tiny synthetic GGUF models for tests (no downloads, ~0.5 MB each, < 1 s).

    python scripts/make_tiny_models.py OUTDIR

Writes target.gguf, draft.gguf (agrees with the target's greedy choice most of the time),
draft_weak.gguf (agrees less often), mismatch.gguf (a vocabulary llama.cpp refuses to
pair with the target), fim.gguf + fim_draft.gguf (a pair with fill-in-the-middle tokens) and
the models whose memory is recurrent (scripts/tiny_recurrent_models.py: hybrid.gguf +
hybrid_draft.gguf, recurrent.gguf), mtp.gguf, a model with its own MTP head
(scripts/tiny_mtp_models.py), and qwen35.gguf + qwen35_draft.gguf, Qwen3.5/3.6's architecture:
gated delta-net layers, one attention layer in four and an MTP head
(scripts/tiny_qwen35_models.py). All files are deterministic: fixed seeds, fixed metadata
order.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
CONTEXT_LENGTH = 4096
RMS_EPS = 1e-5

# Jinja chat template that only needs byte tokens: "<|role|>\ncontent\n" per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TARGET_SEED = 1234
DRAFT_SEED = 5678
DRAFT_WEAK_SEED = 9012
MISMATCH_SEED = 3456
FIM_SEED = 7890
# Relative noise added to every weight matrix of the target, tuned so that greedy next-token
# agreement with the target is ~70% (draft) and ~35% (draft_weak); see tests/test_tiny_models.py.
DRAFT_NOISE = 0.04
DRAFT_WEAK_NOISE = 0.12

# gguf TokenType values (llama.cpp LLAMA_TOKEN_TYPE_*), kept local so the constants are obvious.
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_BYTE = 6

SPACE_PIECE = "\u2581"  # SentencePiece's visible space; llama.cpp maps it back to " "


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, 256 byte tokens, then "▁" so that a space is one token."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [SPACE_PIECE]
    types = [TOKEN_CONTROL] * 3 + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL]
    scores = [0.0] * len(tokens)
    return tokens, scores, types


# Qwen2.5-Coder's fill-in-the-middle tokens, by name and GGUF key, for the FIM pair
FIM_TOKENS = (("<|fim_prefix|>", "pre"), ("<|fim_suffix|>", "suf"), ("<|fim_middle|>", "mid"),
              ("<|fim_pad|>", "pad"), ("<|repo_name|>", "rep"), ("<|file_sep|>", "sep"))


def fim_vocab() -> tuple[list[str], list[float], list[int]]:
    """spm_vocab() and then the six FIM control tokens (ids 260..265)."""
    tokens, scores, types = spm_vocab()
    return (tokens + [t for t, _ in FIM_TOKENS], scores + [0.0] * len(FIM_TOKENS),
            types + [TOKEN_CONTROL] * len(FIM_TOKENS))


def mismatch_vocab() -> tuple[list[str], list[float], list[int]]:
    """A 500-token SPM vocabulary whose ids >= 3 hold different texts than spm_vocab()."""
    words = [SPACE_PIECE] + [f"{SPACE_PIECE}w{i}" for i in range(240)]
    tokens = ["<unk>", "<s>", "</s>"] + words + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_CONTROL] * 3 + [TOKEN_NORMAL] * len(words) + [TOKEN_BYTE] * 256
    scores = [0.0] * 3 + [-float(i) for i in range(len(words))] + [0.0] * 256
    return tokens, scores, types


def _printable_mask(tokens: list[str]) -> np.ndarray:
    """True for tokens that decode to printable ASCII, newline or a space."""
    mask = np.zeros(len(tokens), dtype=bool)
    for i, text in enumerate(tokens):
        if text.startswith("<0x") and len(text) == 6:
            b = int(text[3:5], 16)
            mask[i] = 0x20 <= b < 0x7F or b == 0x0A
        elif text.startswith(SPACE_PIECE):
            mask[i] = True
    return mask


def mat(rng: np.random.Generator, rows: int, cols: int, gain: float) -> np.ndarray:
    """A random (rows, cols) matrix whose outputs have about `gain` times its inputs' scale."""
    return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)


def attention_weights(rng: np.random.Generator, gain_out: float = 1.5) -> dict[str, np.ndarray]:
    """One layer's q, k, v and output projections (names without the blk.N. prefix)."""
    return {"attn_q.weight": mat(rng, N_EMBD, N_EMBD, 2.0),
            "attn_k.weight": mat(rng, N_EMBD, N_EMBD, 2.0),
            "attn_v.weight": mat(rng, N_EMBD, N_EMBD, 1.0),
            "attn_output.weight": mat(rng, N_EMBD, N_EMBD, gain_out)}


def ffn_weights(rng: np.random.Generator, gain_down: float = 1.5) -> dict[str, np.ndarray]:
    """One layer's gated FFN (names without the blk.N. prefix)."""
    return {"ffn_gate.weight": mat(rng, N_FF, N_EMBD, 1.0),
            "ffn_up.weight": mat(rng, N_FF, N_EMBD, 1.0),
            "ffn_down.weight": mat(rng, N_EMBD, N_FF, gain_down)}


def output_weights(rng: np.random.Generator, n_vocab: int, printable: np.ndarray) -> np.ndarray:
    """The output matrix, rows of non-printable tokens (control tokens, bytes >= 0x7F) shrunk
    so that greedy text stays printable ASCII."""
    out = mat(rng, n_vocab, N_EMBD, 4.0)
    out[~printable] *= 0.05
    return out


def in_layer(i: int, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"blk.{i}.{name}": a for name, a in weights.items()}


def random_weights(n_vocab: int, printable: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Random llama weights, numpy shapes (out, in) as GGUFWriter expects.

    Attention and FFN outputs are scaled up so that context (not just the last token) moves
    the logits, which keeps greedy generation varied.
    """
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32),
    }
    for i in range(N_LAYER):
        one = np.ones(N_EMBD, dtype=np.float32)
        w.update(in_layer(i, {"attn_norm.weight": one, **attention_weights(rng),
                              "ffn_norm.weight": one.copy(), **ffn_weights(rng)}))
    w["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    w["output.weight"] = output_weights(rng, n_vocab, printable)
    return w


def add_noise(weights: dict[str, np.ndarray], rel: float, seed: int) -> dict[str, np.ndarray]:
    """Copy of weights with Gaussian noise of `rel` times each matrix's std added."""
    rng = np.random.default_rng(seed)
    noisy = {}
    for name, w in weights.items():
        if w.ndim == 2:
            w = w + (rng.standard_normal(w.shape) * rel * w.std()).astype(np.float32)
        noisy[name] = w.astype(np.float32)
    return noisy


def write_model(
    path: Path,
    name: str,
    weights: dict[str, np.ndarray],
    vocab: tuple[list[str], list[float], list[int]],
) -> Path:
    return write_gguf(path, "llama", name, weights, vocab, _llama_hparams)


def _llama_hparams(writer) -> None:
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)


def write_gguf(path: Path, arch: str, name: str, weights: dict[str, np.ndarray],
               vocab: tuple[list[str], list[float], list[int]], hparams) -> Path:
    """A tiny model of architecture `arch`: the shared keys, `hparams(writer)`'s own, the SPM
    vocabulary with the chat template (and FIM tokens where the vocabulary has them), the
    tensors."""
    import gguf  # test-only dependency; imported late so `--help` works without it

    tokens, scores, types = vocab
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(N_EMBD)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_file_type(0)  # ALL_F32
    hparams(writer)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    # Without this SPM would prepend "▁" to every prompt, so text would not round-trip.
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for token, key in FIM_TOKENS:
        if token in tokens:
            writer.add_uint32(f"tokenizer.ggml.fim_{key}_token_id", tokens.index(token))
    for tensor_name, array in weights.items():
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_tiny_models(outdir: Path) -> dict[str, Path]:
    """Write the models into outdir and return {"target": path, "draft": ..., ...}."""
    from tiny_mtp_models import make_mtp_models  # all three import this module
    from tiny_qwen35_models import make_qwen35_models
    from tiny_recurrent_models import make_recurrent_models

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    vocab = spm_vocab()
    target = random_weights(len(vocab[0]), _printable_mask(vocab[0]), TARGET_SEED)
    other_vocab = mismatch_vocab()
    other = random_weights(len(other_vocab[0]), _printable_mask(other_vocab[0]), MISMATCH_SEED)
    fim = fim_vocab()
    fim_target = random_weights(len(fim[0]), _printable_mask(fim[0]), FIM_SEED)
    return {
        # a pair whose vocabulary has fill-in-the-middle tokens (the others have none)
        "fim": write_model(outdir / "fim.gguf", "tiny-fim", fim_target, fim),
        "fim_draft": write_model(outdir / "fim_draft.gguf", "tiny-fim-draft",
                                 add_noise(fim_target, DRAFT_NOISE, DRAFT_SEED), fim),
        "target": write_model(outdir / "target.gguf", "tiny-target", target, vocab),
        "draft": write_model(
            outdir / "draft.gguf", "tiny-draft", add_noise(target, DRAFT_NOISE, DRAFT_SEED), vocab
        ),
        "draft_weak": write_model(
            outdir / "draft_weak.gguf",
            "tiny-draft-weak",
            add_noise(target, DRAFT_WEAK_NOISE, DRAFT_WEAK_SEED),
            vocab,
        ),
        "mismatch": write_model(outdir / "mismatch.gguf", "tiny-mismatch", other, other_vocab),
        **make_recurrent_models(outdir),
        **make_mtp_models(outdir),
        **make_qwen35_models(outdir),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for name, path in make_tiny_models(Path(argv[0])).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
