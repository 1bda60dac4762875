#!/usr/bin/env python3
"""Shape-matched synthetic GGUF models: Qwen2.5's dimensions, random weights, quantized by
llama-quantize as the real files are (Q4_K_M by default).

Costs (decode, verify batches, offload) depend on shapes and quantization, not on what the
weights say, so these stand in for the real files where nothing can be downloaded. The
vocabulary is SentencePiece-style (3 control tokens, 256 bytes, filler pieces) of Qwen2.5's
size; the shapes that share a vocabulary size share the same token list, and the 7B+ shapes
extend it by 128 tokens as Qwen's do, so llama.cpp accepts any two of them as a pair.
Acceptance between two random models means nothing.

  python scripts/synthetic_gguf.py OUTDIR --shapes 0.5b,7b --quantize-bin .../llama-quantize
  python scripts/synthetic_gguf.py OUTDIR --shapes tiny --quantize-bin ...  # two small shapes
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int


# Qwen2.5 (and Qwen2.5-Coder) configurations; "tiny-*" keep every row a multiple of 256 so
# that the K-quants apply as they do to the real shapes, and run in seconds on a CPU
SHAPES = {
    "0.5b": Shape(896, 24, 14, 2, 4864, 151936),
    "1.5b": Shape(1536, 28, 12, 2, 8960, 151936),
    "3b": Shape(2048, 36, 16, 2, 11008, 151936),
    "7b": Shape(3584, 28, 28, 4, 18944, 152064),
    "14b": Shape(5120, 48, 40, 8, 13824, 152064),
    "32b": Shape(5120, 64, 40, 8, 27648, 152064),
    "tiny-draft": Shape(256, 2, 4, 2, 768, 4096),
    "tiny-target": Shape(256, 4, 4, 2, 768, 4096),
}
ALIASES = {"tiny": ["tiny-draft", "tiny-target"]}
# llama-quantize's names for the file types
FTYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0", "F16")
CONTEXT = 32768
SPACE = "\u2581"


def parse_shapes(text: str) -> list[str]:
    out: list[str] = []
    for name in (s.strip().lower() for s in text.split(",") if s.strip()):
        for one in ALIASES.get(name, [name]):
            if one not in SHAPES:
                raise SystemExit(f"unknown shape {one!r}; known: "
                                 f"{', '.join(list(SHAPES) + list(ALIASES))}")
            if one not in out:
                out.append(one)
    return out


def vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * 3 + [6] * 256  # control, byte (llama.cpp's token types)
    tokens += [f"{SPACE}t{i}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))  # normal
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    return tokens, scores, types


def _random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    # random bits with the exponent held to 2^-7..2^-4: small signed values, no inf/nan; an
    # order of magnitude faster than drawing normals, which matters at 7B parameters
    bits = np.frombuffer(rng.bytes(2 * n), dtype=np.uint16)
    return ((bits & 0x8FFF) | 0x2000).view(np.float16)


def tensors(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape (rows, cols), kind) in file order; kind: matrix, norm or bias."""
    head = s.n_embd // s.n_head
    kv = head * s.n_head_kv
    out = [("token_embd.weight", (s.n_vocab, s.n_embd), "matrix")]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.n_embd,), "norm"),
                (p + "attn_q.weight", (s.n_embd, s.n_embd), "matrix"),
                (p + "attn_q.bias", (s.n_embd,), "bias"),
                (p + "attn_k.weight", (kv, s.n_embd), "matrix"),
                (p + "attn_k.bias", (kv,), "bias"),
                (p + "attn_v.weight", (kv, s.n_embd), "matrix"),
                (p + "attn_v.bias", (kv,), "bias"),
                (p + "attn_output.weight", (s.n_embd, s.n_embd), "matrix"),
                (p + "ffn_norm.weight", (s.n_embd,), "norm"),
                (p + "ffn_gate.weight", (s.n_ff, s.n_embd), "matrix"),
                (p + "ffn_up.weight", (s.n_ff, s.n_embd), "matrix"),
                (p + "ffn_down.weight", (s.n_embd, s.n_ff), "matrix")]
    # Qwen's own GGUF files carry output.weight even for the sizes whose embeddings are tied
    # (0.5B: token_embd Q5_0 + output Q8_0 in the Q4_K_M file), so these do too
    out += [("output_norm.weight", (s.n_embd,), "norm"),
            ("output.weight", (s.n_vocab, s.n_embd), "matrix")]
    return out


def write_f16(path: Path, name: str, s: Shape, seed: int) -> Path:
    """An F16 GGUF (F32 norms and biases) written tensor by tensor, never all in memory."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(name)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_file_type(1)  # MOSTLY_F16
    toks, scores, types = vocab(s.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    plan = tensors(s)
    for tname, shape, kind in plan:
        dtype = np.float16 if kind == "matrix" else np.float32
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape, kind in plan:
        n = int(np.prod(shape))
        if kind == "matrix":
            data = _random_f16(rng, n).reshape(shape)
        elif kind == "norm":
            data = np.ones(shape, dtype=np.float32)
        else:
            data = (rng.standard_normal(n) * 0.02).astype(np.float32).reshape(shape)
        w.write_tensor_data(data)
    w.close()
    return path


def make(outdir: Path, shapes: list[str], quantize_bin: Path | None, ftype: str = "Q4_K_M",
         threads: int = 0, log=print) -> dict[str, dict]:
    """Write (or reuse) OUTDIR/synthetic-<shape>-<ftype>.gguf for each shape; returns per
    shape its path and how long making it took."""
    outdir.mkdir(parents=True, exist_ok=True)
    made: dict[str, dict] = {}
    for name in shapes:
        final = outdir / f"synthetic-{name}-{ftype.lower()}.gguf"
        info = {"path": str(final), "ftype": ftype, **SHAPES[name].__dict__}
        if final.is_file():
            made[name] = {**info, "reused": True, "seconds": 0.0}
            continue
        t0 = time.perf_counter()
        f16 = outdir / f"synthetic-{name}-f16.gguf.part"
        log(f"writing {name} (F16)")
        write_f16(f16, f"synthetic-qwen2.5-{name}", SHAPES[name], seed=1000 + list(SHAPES).index(name))
        if ftype == "F16":
            f16.rename(final)
        else:
            if quantize_bin is None:
                raise SystemExit("quantizing needs --quantize-bin (llama-quantize)")
            log(f"quantizing {name} to {ftype}")
            cmd = [str(quantize_bin), str(f16), str(final) + ".part", ftype]
            if threads:
                cmd.append(str(threads))
            res = subprocess.run(cmd, capture_output=True, text=True)
            f16.unlink()
            if res.returncode != 0:
                raise RuntimeError(f"llama-quantize failed:\n{res.stderr[-2000:]}")
            Path(str(final) + ".part").rename(final)
        made[name] = {**info, "reused": False, "seconds": round(time.perf_counter() - t0, 1)}
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--shapes", default="0.5b,1.5b,7b",
                    help=f"comma-separated: {', '.join(list(SHAPES) + list(ALIASES))}")
    ap.add_argument("--ftype", default="Q4_K_M", choices=FTYPES)
    ap.add_argument("--quantize-bin", type=Path, help="llama-quantize (not needed for F16)")
    ap.add_argument("--threads", type=int, default=0, help="llama-quantize threads (0: its own)")
    ns = ap.parse_args()
    made = make(ns.outdir, parse_shapes(ns.shapes), ns.quantize_bin, ns.ftype, ns.threads,
                log=lambda msg: print(msg, file=sys.stderr))
    for name, info in made.items():
        print(f"{name}: {info['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
