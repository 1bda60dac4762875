"""Model shapes for the memory plan: exact from a GGUF header (every tensor's size and type),
or estimated for a catalog model not yet on disk from a table of well-known families."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from tandem.models.gguf_meta import GGML_TYPES, GGUFHeader
from tandem.models.memory_type import HYBRID_ARCHS, RECURRENT_ARCHS, SNAPSHOT_ARCHS


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of a row of n elements in a KV cache type."""
    block, size = KV_TYPE_BYTES[type_name]
    return (n + block - 1) // block * size


KV_TYPE_BYTES = {  # type -> (block elements, block bytes)
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
}


@dataclass(frozen=True)
class PlanTensor:
    name: str
    nbytes: int
    type_name: str
    ndim: int
    ne1: int  # rows (shape[1]), what the repack rules test
    offset: int  # in the data section; -1 when unknown
    group: str  # "input" | "output" | "layer"
    layer: int = -1


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about one model, exact (GGUF) or estimated (catalog)."""

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    input_bytes: int  # token_embd and other input-layer tensors (always on the CPU)
    embd_bytes: int  # token_embd.weight alone (copied to the GPU when the output is tied)
    output_bytes: int  # output layer tensors (output.weight, output_norm)
    tied_output: bool
    layer_bytes: tuple[int, ...]
    tensors: tuple[PlanTensor, ...] = ()  # present for GGUF shapes: exact buffers
    n_ctx_train: int = 0
    exact: bool = True
    note: str = ""
    # the layers with a recurrent state (hybrid and recurrent models; () for attention), the
    # bytes of one such layer's state (llama.cpp's n_embd_r + n_embd_s, f32), and whether
    # llama.cpp keeps n_rs_seq snapshots of it (llm_arch_supports_rs_rollback)
    recurrent: tuple[bool, ...] = ()
    state_row: int = 0
    snapshots: bool = False
    # the last `nextn` of the n_layer blocks are MTP heads (nextn_predict_layers): llama.cpp
    # keeps no KV or state for them in the model's own context, only in an MTP context's
    nextn: int = 0

    @property
    def weights_bytes(self) -> int:
        return self.input_bytes + self.output_bytes + sum(self.layer_bytes)

    @property
    def trunk(self) -> int:
        """The blocks the model's own context decodes (the MTP heads' are not among them)."""
        return self.n_layer - self.nextn

    @property
    def state_bytes(self) -> int:
        """One copy of the recurrent state, every layer's (what a context checkpoint holds)."""
        return self.state_row * sum(self.recurrent)

    # --- constructors -------------------------------------------------------------
    @classmethod
    def from_gguf(cls, header: GGUFHeader, name: str | None = None) -> ModelShape:
        """Exact shape from a GGUF header (tensor sizes from ggml block sizes)."""
        g = header.arch_get
        n_layer = _as_int(g("block_count"))
        n_embd = _as_int(g("embedding_length"))
        n_head = _as_max(g("attention.head_count"), 1)
        kv_raw = g("attention.head_count_kv", n_head)
        n_head_kv = _per_layer(kv_raw, n_layer, n_head)
        head_k = _as_int(g("attention.key_length"), n_embd // max(n_head, 1))
        head_v = _as_int(g("attention.value_length"), head_k)
        n_ff = _as_max(g("feed_forward_length"), 4 * n_embd)
        tokens = header.get("tokenizer.ggml.tokens")
        n_vocab = len(tokens) if isinstance(tokens, list) else _as_int(g("vocab_size"), 0)
        tensors = []
        input_b = output_b = embd_b = 0
        layers = [0] * n_layer
        has_output_weight = False
        for t in header.tensors:
            m = re.match(r"^blk\.(\d+)\.", t.name)
            ne1 = t.shape[1] if len(t.shape) > 1 else 1
            if m and int(m.group(1)) < n_layer:
                il = int(m.group(1))
                layers[il] += t.nbytes
                group = "layer"
            elif t.name.startswith("output"):
                il, group = -1, "output"
                output_b += t.nbytes
                has_output_weight |= t.name == "output.weight"
            else:  # token_embd, token_embd_norm, rope tables...: the input layer, on the CPU
                il, group = -1, "input"
                input_b += t.nbytes
                if t.name == "token_embd.weight":
                    embd_b = t.nbytes
                    n_vocab = n_vocab or ne1
            tensors.append(PlanTensor(t.name, t.nbytes, GGML_TYPES[t.ggml_type][0],
                                      len(t.shape), ne1, t.offset, group, il))
        nextn = min(max(_as_int(g("nextn_predict_layers")), 0), n_layer)
        return cls(name=name or header.name or header.source_name,
                   arch=header.architecture or "unknown", n_layer=n_layer, n_embd=n_embd,
                   n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_k, head_dim_v=head_v,
                   n_ff=n_ff, n_vocab=n_vocab, input_bytes=input_b, embd_bytes=embd_b,
                   output_bytes=output_b, tied_output=not has_output_weight,
                   layer_bytes=tuple(layers), tensors=tuple(tensors),
                   n_ctx_train=header.context_length or 0, exact=True, nextn=nextn,
                   **_recurrent_state(header, n_layer, n_embd, n_head, n_head_kv, nextn))

    @classmethod
    def estimate(cls, name: str, size_bytes: int | None, hints: Iterable[str] = (),
                 arch: str | None = None, mtp: bool = False) -> ModelShape:
        """Approximate shape of a catalog model not on disk, from its name and file size.

        The architecture comes from a table of well-known model families (published
        config.json values); weights are split into embeddings, output and layers by typical
        Q4_K_M type sizes. Good to a few percent for planning; the GGUF header replaces it once
        the file is on disk. `arch`: the catalog's llama.cpp architecture, which picks a
        hybrid family's table (its recurrent layers and state); `mtp`: the file carries the
        family's MTP heads (one more block each, planned as the header would say).
        """
        text = " ".join([name, *hints]).lower()
        hybrid = _known_hybrid(arch, text)
        if hybrid is not None:
            return _estimate_hybrid(name, size_bytes, arch, *hybrid, mtp=mtp)
        arch, dims, label = _known_shape(text)
        n_layer, n_embd, n_head, n_kv, head, n_ff, n_vocab, tied = dims
        params = _params_from_label(label) if label else None
        if size_bytes is None:
            # no size in the catalog: parameters x ~4.85 bits (Q4_K_M average)
            size_bytes = int((params or _params_from_dims(dims)) * 4.85 / 8)
        embd = int(n_vocab * n_embd * 144 / 256)  # Q4_K token_embd
        output = 0 if tied else int(n_vocab * n_embd * 210 / 256)  # Q6_K output.weight
        rest = max(size_bytes - embd - output, n_layer)
        per_layer = rest // n_layer
        return cls(name=name, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                   n_head_kv=(n_kv,) * n_layer, head_dim_k=head, head_dim_v=head, n_ff=n_ff,
                   n_vocab=n_vocab, input_bytes=embd, embd_bytes=embd, output_bytes=output,
                   tied_output=tied, layer_bytes=(per_layer,) * n_layer, exact=False,
                   note=f"estimated from the catalog ({arch} {label or '?'}); exact once "
                        "downloaded")


def _recurrent_state(header: GGUFHeader, n_layer: int, n_embd: int, n_head: int,
                     n_head_kv: tuple[int, ...], nextn: int = 0) -> dict[str, Any]:
    """Which layers keep a recurrent state and its size per layer, as llama.cpp sizes its
    recurrent memory (src/llama-hparams.cpp n_embd_r / n_embd_s; the layers from
    `attention.recurrent_layers`, `full_attention_interval` or the layers without KV heads;
    never the `nextn` MTP blocks at the end, which llama.cpp's hybrid memory filters out).
    Architectures whose state has another shape (Kimi's KDA, MiniMax's linear attention) are
    sized by the SSM keys they also carry, or not at all."""
    arch = header.architecture or ""
    if arch not in HYBRID_ARCHS and arch not in RECURRENT_ARCHS:
        return {}
    g = header.arch_get
    flags = g("attention.recurrent_layers")
    if isinstance(flags, list) and len(flags) == n_layer:
        recurrent = tuple(bool(x) for x in flags)
    elif arch in RECURRENT_ARCHS:
        recurrent = (True,) * n_layer
    elif _as_int(g("full_attention_interval")) > 0:
        k = _as_int(g("full_attention_interval"))
        recurrent = tuple((il + 1) % k != 0 for il in range(n_layer))
    else:  # LFM2, Nemotron-H, Jamba...: the layers without KV heads
        recurrent = tuple(h == 0 for h in n_head_kv)
    recurrent = tuple(r and il < n_layer - nextn for il, r in enumerate(recurrent))
    head_size = _as_int(g("wkv.head_size"))
    l_cache = _as_int(g("shortconv.l_cache"))
    d_conv, d_inner = _as_int(g("ssm.conv_kernel")), _as_int(g("ssm.inner_size"))
    d_state, n_group = _as_int(g("ssm.state_size")), _as_int(g("ssm.group_count"))
    if head_size:  # RWKV: token shift rows and the wkv state
        r, s = _as_int(g("token_shift_count"), 2) * n_embd, n_embd * head_size
    elif l_cache:  # LFM2's short convolutions
        r, s = n_embd * (l_cache - 1), 0
    else:  # Mamba, Mamba-2 and the gated delta nets (Qwen3.5): conv rows and the SSM state
        r, s = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state), d_state * d_inner
    return {"recurrent": recurrent, "state_row": 4 * (r + s),  # f32 (llama-model.cpp)
            "snapshots": arch in SNAPSHOT_ARCHS}


def _as_int(v: Any, default: int = 0) -> int:
    if isinstance(v, bool):
        return default
    if isinstance(v, int):
        return v
    if isinstance(v, list) and v:
        return max(int(x) for x in v)
    return default


def _as_max(v: Any, default: int) -> int:
    out = _as_int(v, 0)
    return out or default


def _per_layer(v: Any, n_layer: int, default: int) -> tuple[int, ...]:
    if isinstance(v, list) and len(v) == n_layer:
        return tuple(int(x) for x in v)
    return (_as_int(v, default) or default,) * n_layer


# (layers, n_embd, heads, kv heads, head dim, n_ff, vocab, tied embeddings) by family and size
_FAMILIES: dict[str, dict[str, tuple[int, int, int, int, int, int, int, bool]]] = {
    "qwen2": {
        "0.5b": (24, 896, 14, 2, 64, 4864, 151936, False),
        "1.5b": (28, 1536, 12, 2, 128, 8960, 151936, False),
        "3b": (36, 2048, 16, 2, 128, 11008, 151936, False),
        "7b": (28, 3584, 28, 4, 128, 18944, 152064, False),
        "14b": (48, 5120, 40, 8, 128, 13824, 152064, False),
        "32b": (64, 5120, 40, 8, 128, 27648, 152064, False),
        "72b": (80, 8192, 64, 8, 128, 29568, 152064, False),
    },
    "qwen3": {
        "0.6b": (28, 1024, 16, 8, 128, 3072, 151936, True),
        "1.7b": (28, 2048, 16, 8, 128, 6144, 151936, True),
        "4b": (36, 2560, 32, 8, 128, 9728, 151936, True),
        "8b": (36, 4096, 32, 8, 128, 12288, 151936, False),
        "14b": (40, 5120, 40, 8, 128, 17408, 151936, False),
        "32b": (64, 5120, 64, 8, 128, 25600, 151936, False),
    },
    "llama": {
        "1b": (16, 2048, 32, 8, 64, 8192, 128256, True),
        "3b": (28, 3072, 24, 8, 128, 8192, 128256, True),
        "8b": (32, 4096, 32, 8, 128, 14336, 128256, False),
        "70b": (80, 8192, 64, 8, 128, 28672, 128256, False),
    },
    "gemma3": {
        "270m": (18, 640, 4, 1, 256, 2048, 262144, True),
        "1b": (26, 1152, 4, 1, 256, 6912, 262144, True),
        "4b": (34, 2560, 8, 4, 256, 10240, 262144, True),
        "12b": (48, 3840, 16, 8, 256, 15360, 262144, True),
        "27b": (62, 5376, 32, 16, 128, 21504, 262144, True),
    },
}


# hybrid families by llama.cpp architecture and size: the dims as in _FAMILIES, then the
# recurrent layers' shape (full_attention_interval, conv kernel, key heads, key head dim,
# value heads, value head dim) and the MTP layers the family publishes. Qwen3.5, 3.6 and 3.8
# 27B share one config (Qwen/Qwen3.6-27B's config.json as public code quotes it; the
# attention dims as THUDM/slime's scripts/models/qwen3.5-27B.sh): only sizes confirmed there.
_HYBRID_FAMILIES: dict[str, dict[str, tuple[tuple, tuple]]] = {
    "qwen35": {
        "27b": ((64, 5120, 24, 4, 256, 17408, 248320, False), (4, 4, 16, 128, 48, 128, 1)),
    },
}


def _known_hybrid(arch: str | None, text: str):
    """(dims, recurrent shape, label) of a hybrid family's size named in `text`; None where
    the table does not know it (then the plan has no state to show, as before)."""
    table = _HYBRID_FAMILIES.get(arch or "")
    if not table:
        return None
    for label in re.findall(r"(?<![\d.a])(\d+(?:\.\d+)?[bm])(?![a-z])", text):
        if label in table:
            return (*table[label], label)
    return None


def _estimate_hybrid(name: str, size_bytes: int | None, arch: str, dims: tuple, rec: tuple,
                     label: str, *, mtp: bool) -> ModelShape:
    """A hybrid's estimated shape: ModelShape.estimate's weights, its attention layers' KV
    heads, and the state of its recurrent layers as llama.cpp sizes it (_recurrent_state)."""
    interval, conv, k_heads, k_dim, v_heads, v_dim, heads = rec
    n_trunk, n_embd, n_head, n_kv, head, n_ff, n_vocab, tied = dims
    nextn = heads if mtp else 0
    n_layer = n_trunk + nextn  # a head is one more block, as in the GGUF
    embd = int(n_vocab * n_embd * 144 / 256)
    output = 0 if tied else int(n_vocab * n_embd * 210 / 256)
    # no size in the catalog: parameters x ~4.85 bits (Q4_K_M average), as estimate()
    size = size_bytes if size_bytes is not None else int(_params_from_label(label) * 4.85 / 8)
    per_layer = max(size - embd - output, n_layer) // n_layer
    d_inner = v_heads * v_dim
    r, s = (conv - 1) * (d_inner + 2 * k_heads * k_dim), k_dim * d_inner
    recurrent = tuple((il + 1) % interval != 0 and il < n_trunk for il in range(n_layer))
    return ModelShape(
        name=name, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=tuple(0 if r_ else n_kv for r_ in recurrent), head_dim_k=head,
        head_dim_v=head, n_ff=n_ff, n_vocab=n_vocab, input_bytes=embd, embd_bytes=embd,
        output_bytes=output, tied_output=tied, layer_bytes=(per_layer,) * n_layer,
        exact=False, recurrent=recurrent, state_row=4 * (r + s),
        snapshots=arch in SNAPSHOT_ARCHS, nextn=nextn,
        note=f"estimated from the catalog ({arch} {label}, hybrid); exact once downloaded")


def _params_from_label(label: str) -> float:
    num, unit = float(label[:-1]), label[-1]
    return num * (1e9 if unit == "b" else 1e6)


def _params_from_dims(d) -> float:
    n_layer, n_embd, n_head, n_kv, head, n_ff, n_vocab, tied = d
    per_layer = n_embd * (n_head * head * 2 + n_kv * head * 2) + 3 * n_embd * n_ff
    return n_layer * per_layer + n_vocab * n_embd * (1 if tied else 2)


def _known_shape(text: str):
    if "qwen3" in text:
        fam = "qwen3"
    elif "qwen" in text:  # Qwen2 / Qwen2.5 / Coder / DeepSeek-R1 distills
        fam = "qwen2"
    elif "gemma" in text:
        fam = "gemma3"
    elif "llama" in text:
        fam = "llama"
    else:
        fam = "qwen2"
    table = _FAMILIES[fam]
    # an MoE's "-A4B" counts its active parameters, not its size: never the model's label
    labels = re.findall(r"(?<![\d.a])(\d+(?:\.\d+)?[bm])(?![a-z])", text)
    for label in labels:
        if label in table:
            return fam, table[label], label
    if labels:  # unknown size in a known family: the nearest by parameter count
        want = _params_from_label(labels[0])
        best = min(table, key=lambda k: abs(_params_from_label(k) - want))
        return fam, table[best], labels[0]
    return fam, table[sorted(table, key=_params_from_label)[len(table) // 2]], None
