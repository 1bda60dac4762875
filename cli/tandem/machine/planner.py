"""Offload and memory plan for a target + draft pair, following llama.cpp's own placement rules.

Speculative decoding only pays when the draft is fast, so the draft goes fully to the GPU first
and the target takes the layers that still fit; both models' weights, KV caches and compute
buffers must fit at once. The figures mirror what llama.cpp allocates (vendored llama.cpp
0c1e57098, src/llama-model.cpp, llama-context.cpp, ggml-cpu/repack.cpp):

* Weights. `n_gpu_layers = L` puts repeating layers `il >= n_layer + 1 - L` on the GPU and the
  output layer there once L >= 1; the input layer (token_embd) always stays on the CPU. A model
  with tied embeddings (no output.weight) gets a copy of token_embd on the output's device when
  that is not the CPU. With mmap, CPU weights are a mapped file range ("CPU_Mapped": the span from
  the first to the last CPU tensor). On CPU and Metal builds, matmul weights of some quant types
  are repacked into an extra "CPU_REPACK" buffer (CUDA builds put CPU weights in a pinned host
  buffer first, so they are not repacked).
* KV cache. n_ctx padded to 256 cells, per layer K = cells x n_embd_k_gqa, V = cells x
  n_embd_v_gqa in the cache types, on the device of the layer. Sliding-window layers are full
  size too (llama.cpp's default swa_full, which tandem keeps).
* Compute buffers. llama.cpp reserves for a worst-case batch of n_ubatch tokens whose outputs all
  need logits (n_outputs_max defaults to n_batch): n_out x n_vocab floats dominate for large
  vocabularies. Without flash attention the KQ matrix (n_ctx x n_ubatch x n_head floats) can be
  larger. The formulas were fitted on llama.cpp's reports (CPU: exact to 0.2%).

Pure arithmetic: no llama.cpp import, nothing printed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from tandem.errors import EXIT_MODEL, TandemError
from tandem.models.gguf_meta import GGML_TYPES, GGUFHeader

GiB = 1 << 30
MiB = 1 << 20
F32 = 4
KV_PAD = 256  # llama.cpp pads n_ctx (KV cells) to a multiple of 256
GPU_TENSOR_ALIGN = 256  # per-tensor allocation alignment in GPU buffers
# Page cache and other processes: without MemAvailable (macOS) keep this share of RAM free.
RAM_SHARE_WITHOUT_AVAILABLE = 0.85

_KV_TYPE_BYTES = {  # type -> (block elements, block bytes)
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
}


def row_bytes(type_name: str, n: int) -> int:
    block, size = _KV_TYPE_BYTES[type_name]
    return (n + block - 1) // block * size


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# ----------------------------------------------------------------------------- shapes


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

    @property
    def weights_bytes(self) -> int:
        return self.input_bytes + self.output_bytes + sum(self.layer_bytes)

    def kv_cell_bytes(self, layer: int, type_k: str, type_v: str) -> int:
        kv = self.n_head_kv[layer]
        return row_bytes(type_k, self.head_dim_k * kv) + row_bytes(type_v, self.head_dim_v * kv)

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
        return cls(name=name or header.name or header.source_name,
                   arch=header.architecture or "unknown", n_layer=n_layer, n_embd=n_embd,
                   n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_k, head_dim_v=head_v,
                   n_ff=n_ff, n_vocab=n_vocab, input_bytes=input_b, embd_bytes=embd_b,
                   output_bytes=output_b, tied_output=not has_output_weight,
                   layer_bytes=tuple(layers), tensors=tuple(tensors),
                   n_ctx_train=header.context_length or 0, exact=True)

    @classmethod
    def estimate(cls, name: str, size_bytes: int | None, hints: Iterable[str] = ()) -> ModelShape:
        """Approximate shape of a catalog model not on disk, from its name and file size.

        The architecture comes from a table of well-known model families (published
        config.json values); weights are split into embeddings, output and layers by typical
        Q4_K_M type sizes. Good to a few percent for planning; the GGUF header replaces it once
        the file is on disk.
        """
        text = " ".join([name, *hints]).lower()
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
    labels = re.findall(r"(?<![\d.])(\d+(?:\.\d+)?[bm])(?![a-z])", text)
    for label in labels:
        if label in table:
            return fam, table[label], label
    if labels:  # unknown size in a known family: the nearest by parameter count
        want = _params_from_label(labels[0])
        best = min(table, key=lambda k: abs(_params_from_label(k) - want))
        return fam, table[best], labels[0]
    return fam, table[sorted(table, key=_params_from_label)[len(table) // 2]], None


# ---------------------------------------------------------------------- context / placement


@dataclass(frozen=True)
class ContextSpec:
    """The llama.cpp context parameters that size memory."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: str = "auto"  # auto resolves to on: every backend tandem targets supports it
    type_k: str = "f16"
    type_v: str = "f16"
    # tandem's contexts cap logits rows at engine.llama.MAX_OUTPUTS (llama.cpp's 0 = n_batch)
    n_outputs_max: int = 65
    logit_rows: int = 1  # rows of logits one decode asks for (verify: n_max + 1)

    @property
    def cells(self) -> int:
        return _pad(self.n_ctx, KV_PAD)

    @property
    def fa(self) -> bool:
        return self.flash_attn != "off"

    @property
    def ubatch(self) -> int:
        return max(1, min(self.n_ubatch, self.n_batch, self.cells))

    @property
    def n_out(self) -> int:
        cap = self.n_outputs_max or self.n_batch
        return max(1, min(self.ubatch, cap))


def repackable(t: PlanTensor, features: frozenset[str]) -> bool:
    """ggml-cpu's ggml_repack_get_optimal_repack_type for a matmul weight (x86 and ARM)."""
    if t.ndim < 2 or t.group == "input":  # token_embd is read by GET_ROWS, never repacked
        return False
    ty = t.type_name
    if "avx2" in features:
        if ty in ("Q4_0", "Q4_K", "IQ4_NL", "MXFP4") and t.ne1 % 8 == 0:
            return True
        if ty == "Q2_K" and "avx512" in features and t.ne1 % 8 == 0:
            return True
        return False
    if "neon" in features and ({"dotprod", "matmul_int8"} & features):
        if ty in ("Q4_K", "Q5_K", "Q6_K"):
            return t.ne1 % 8 == 0
        return ty in ("Q4_0", "IQ4_NL", "MXFP4", "Q8_0") and t.ne1 % 4 == 0
    return False


@dataclass(frozen=True)
class ModelPlan:
    """Where one model's memory goes. Byte counts; `buffers` uses llama.cpp's buffer names."""

    role: str  # target | draft
    name: str
    n_layer: int
    gpu_layers: int  # llama.cpp's n_gpu_layers: 0..n_layer + 1 (the +1 is the output layer)
    weights_gpu: int
    weights_cpu: int
    kv_gpu: int
    kv_cpu: int
    compute_gpu: int
    compute_cpu: int
    output_host: int  # llama.cpp's logits buffer
    buffers: Mapping[str, int]  # model buffers: CPU_Mapped, CPU_REPACK, CUDA0 / Metal
    kv_k: int = 0
    kv_v: int = 0
    exact: bool = True
    note: str = ""

    @property
    def max_layers(self) -> int:
        return self.n_layer + 1

    @property
    def on_gpu(self) -> bool:
        return self.gpu_layers >= self.max_layers

    @property
    def weights(self) -> int:
        return self.weights_gpu + self.weights_cpu

    @property
    def kv(self) -> int:
        return self.kv_gpu + self.kv_cpu

    @property
    def compute(self) -> int:
        return self.compute_gpu + self.compute_cpu

    @property
    def gpu_total(self) -> int:
        return self.weights_gpu + self.kv_gpu + self.compute_gpu

    @property
    def cpu_total(self) -> int:
        return self.weights_cpu + self.kv_cpu + self.compute_cpu + self.output_host

    @property
    def total(self) -> int:
        return self.gpu_total + self.cpu_total

    def to_dict(self) -> dict:
        return {
            "role": self.role, "name": self.name, "gpu_layers": self.gpu_layers,
            "max_layers": self.max_layers, "weights_gpu": self.weights_gpu,
            "weights_cpu": self.weights_cpu, "kv_gpu": self.kv_gpu, "kv_cpu": self.kv_cpu,
            "compute_gpu": self.compute_gpu, "compute_cpu": self.compute_cpu,
            "output_host": self.output_host, "total": self.total, "buffers": dict(self.buffers),
            "exact": self.exact, "note": self.note,
        }


def place(shape: ModelShape, ctx: ContextSpec, gpu_layers: int, *, role: str = "target",
          backend: str = "cpu", features: frozenset[str] = frozenset(), repack: bool = False,
          use_mmap: bool = True) -> ModelPlan:
    """Memory of `shape` loaded with n_gpu_layers = `gpu_layers` and context `ctx`.

    `repack`: the model is loaded with llama.cpp's extra CPU buffer types (use_extra_bufts);
    tandem's engine turns them off by default."""
    gpu = backend != "cpu"
    L = max(0, min(gpu_layers, shape.n_layer + 1)) if gpu else 0
    start = max(shape.n_layer + 1 - L, 0)
    on_gpu = [il >= start for il in range(shape.n_layer)] if gpu else [False] * shape.n_layer
    out_gpu = gpu and L >= 1
    repack = repack and backend in ("cpu", "metal")  # CUDA: pinned host buffer wins

    # --- weights ------------------------------------------------------------------
    w_gpu = sum(b for b, g in zip(shape.layer_bytes, on_gpu) if g)
    w_cpu = shape.input_bytes + sum(b for b, g in zip(shape.layer_bytes, on_gpu) if not g)
    if out_gpu:
        w_gpu += shape.output_bytes + (shape.embd_bytes if shape.tied_output else 0)
    else:
        w_cpu += shape.output_bytes
    buffers: dict[str, int] = {}
    repack_b = 0
    if shape.tensors:
        cpu_t = [t for t in shape.tensors if not _tensor_on_gpu(t, on_gpu, out_gpu)]
        rep = {t.name for t in cpu_t if repack and repackable(t, features)}
        repack_b = sum(t.nbytes for t in cpu_t if t.name in rep)
        mapped = [t for t in cpu_t if t.name not in rep]
        if shape.tied_output and not out_gpu and repack:
            embd = next((t for t in shape.tensors if t.name == "token_embd.weight"), None)
            if embd and repackable(replace(embd, group="output"), features):
                repack_b += embd.nbytes  # the output's copy of token_embd, repacked
                w_cpu += embd.nbytes
        if use_mmap and mapped and all(t.offset >= 0 for t in mapped):
            buffers["CPU_Mapped"] = (max(t.offset + t.nbytes for t in mapped)
                                     - min(t.offset for t in mapped))
        elif mapped:
            buffers["CPU"] = sum(t.nbytes for t in mapped)
        gpu_t = [t for t in shape.tensors if _tensor_on_gpu(t, on_gpu, out_gpu)]
        gpu_alloc = sum(_pad(t.nbytes, GPU_TENSOR_ALIGN) for t in gpu_t)
        if out_gpu and shape.tied_output:
            gpu_alloc += _pad(shape.embd_bytes, GPU_TENSOR_ALIGN)
    else:
        buffers["CPU_Mapped" if use_mmap else "CPU"] = w_cpu
        gpu_alloc = w_gpu
    if repack_b:
        buffers["CPU_REPACK"] = repack_b
    if gpu_alloc:
        buffers[_gpu_buffer_name(backend)] = gpu_alloc
        w_gpu = gpu_alloc

    # --- KV cache -----------------------------------------------------------------
    cells = ctx.cells
    kv_gpu = kv_cpu = k_all = v_all = 0
    for il in range(shape.n_layer):
        kvh = shape.n_head_kv[il]
        k = cells * row_bytes(ctx.type_k, shape.head_dim_k * kvh)
        v = cells * row_bytes(ctx.type_v, shape.head_dim_v * kvh)
        k_all += k
        v_all += v
        if on_gpu[il]:
            kv_gpu += k + v
        else:
            kv_cpu += k + v

    # --- compute buffers ----------------------------------------------------------
    ub, n_out = ctx.ubatch, ctx.n_out
    e, kv_dim = shape.n_embd, max(shape.n_head_kv) * shape.head_dim_k if shape.n_layer else 0
    out_phase = F32 * (n_out * shape.n_vocab + (2 if ctx.fa else 3) * ub * e)
    if ctx.fa:
        layer_phase = F32 * ub * (3 * shape.n_ff + 4 * e) + 2 * cells * ub
    else:
        layer_phase = F32 * (cells * ub * (shape.n_head + 1) + ub * (5 * e + 2 * kv_dim))
    if not gpu:
        c_gpu, c_cpu = 0, max(out_phase, layer_phase)
    else:
        any_gpu, any_cpu = any(on_gpu), not all(on_gpu)
        c_gpu = max(layer_phase if any_gpu else 0, out_phase if out_gpu else 0)
        host_inputs = F32 * ub * e + (2 if ctx.fa else 4) * cells * ub
        c_cpu = max(layer_phase if any_cpu else 0, out_phase if not out_gpu else 0, host_inputs)
        if backend == "cuda" and any_cpu and any_gpu:
            # op_offload: large batches run CPU-resident matmuls on the GPU with a temporary
            # copy of the weight, so the GPU buffer also holds the largest such tensor
            c_gpu += _largest_cpu_matmul(shape, on_gpu)
    output_host = F32 * shape.n_vocab * max(ctx.logit_rows, 1)
    return ModelPlan(role=role, name=shape.name, n_layer=shape.n_layer, gpu_layers=L,
                     weights_gpu=w_gpu, weights_cpu=w_cpu, kv_gpu=kv_gpu, kv_cpu=kv_cpu,
                     compute_gpu=c_gpu, compute_cpu=c_cpu, output_host=output_host,
                     buffers=buffers, kv_k=k_all, kv_v=v_all, exact=shape.exact,
                     note=shape.note)


def _largest_cpu_matmul(shape: ModelShape, on_gpu: list[bool]) -> int:
    if shape.tensors:
        return max((t.nbytes for t in shape.tensors
                    if t.group == "layer" and t.ndim >= 2 and not on_gpu[t.layer]), default=0)
    # estimated shapes: an FFN matrix is about 30% of a transformer layer
    return int(max((b for b, g in zip(shape.layer_bytes, on_gpu) if not g), default=0) * 0.3)


def _tensor_on_gpu(t: PlanTensor, on_gpu: list[bool], out_gpu: bool) -> bool:
    if t.group == "layer":
        return on_gpu[t.layer]
    return t.group == "output" and out_gpu


def _gpu_buffer_name(backend: str) -> str:
    return {"cuda": "CUDA0", "metal": "Metal"}.get(backend, "GPU")


# ---------------------------------------------------------------------------------- plan

FITS, PARTIAL, NO_FIT = "fits", "partial", "does-not-fit"


class PlanError(TandemError):
    """The pair does not fit this machine's memory with these settings."""

    exit_code = EXIT_MODEL


@dataclass(frozen=True)
class Plan:
    backend: str
    target: ModelPlan
    draft: ModelPlan | None
    gpu_budget: int | None  # bytes both models may use on the GPU (free minus the reserve)
    gpu_reserve: int
    ram_budget: int
    unified: bool  # Apple Silicon: GPU memory is RAM
    status: str  # fits | partial | does-not-fit
    problems: tuple[str, ...] = ()  # what is wrong, one sentence each
    advice: tuple[str, ...] = ()  # what to change
    ctx: ContextSpec = ContextSpec()

    @property
    def models(self) -> tuple[ModelPlan, ...]:
        return (self.target,) + ((self.draft,) if self.draft else ())

    @property
    def gpu_used(self) -> int:
        return sum(m.gpu_total for m in self.models)

    @property
    def ram_used(self) -> int:
        used = sum(m.cpu_total for m in self.models)
        return used + (self.gpu_used if self.unified else 0)

    @property
    def gpu_left(self) -> int | None:
        return None if self.gpu_budget is None else self.gpu_budget - self.gpu_used

    @property
    def ram_left(self) -> int:
        return self.ram_budget - self.ram_used

    @property
    def fits(self) -> bool:
        return self.status != NO_FIT

    def to_dict(self) -> dict:
        return {
            "backend": self.backend, "status": self.status,
            "gpu_budget": self.gpu_budget, "gpu_reserve": self.gpu_reserve,
            "gpu_used": self.gpu_used if self.gpu_budget is not None else None,
            "gpu_left": self.gpu_left, "ram_budget": self.ram_budget, "ram_used": self.ram_used,
            "ram_left": self.ram_left, "unified_memory": self.unified,
            "context": {"n_ctx": self.ctx.n_ctx, "n_batch": self.ctx.n_batch,
                        "n_ubatch": self.ctx.n_ubatch, "flash_attn": self.ctx.flash_attn,
                        "type_k": self.ctx.type_k, "type_v": self.ctx.type_v},
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict() if self.draft else None,
            "problems": list(self.problems), "advice": list(self.advice),
        }


@dataclass(frozen=True)
class Budget:
    """Memory the plan may use, and how the backend places things."""

    backend: str = "cpu"  # cpu | cuda | metal
    gpu: int | None = None  # bytes for both models on the GPU (after the reserve)
    gpu_reserve: int = 0
    ram: int = 8 * GiB
    unified: bool = False
    features: frozenset[str] = frozenset()  # ggml CPU features (repack rules)
    repack: bool = False  # models loaded with llama.cpp's extra CPU buffer types

    @classmethod
    def for_hardware(cls, hw, reserve_mb: int = 512, backend: str | None = None,
                     repack: bool = False) -> Budget:
        """From tandem.machine.hardware.Hardware; the backend defaults to what the binding can do.
        `repack`: whether the engine loads models with llama.cpp's extra CPU buffer types
        (tandem's engine does not by default: repacked weights are not batch-invariant)."""
        if backend is None:
            b = hw.backend.name if hw.backend is not None else hw.vendor
            backend = {"nvidia": "cuda", "apple": "metal"}.get(b, b)
            if backend not in ("cuda", "metal"):
                backend = "cpu"
        reserve = reserve_mb * MiB
        free = hw.gpu_free if backend != "cpu" else None
        gpu = max(free - reserve, 0) if free is not None else None
        if backend != "cpu" and gpu is None:
            backend = "cpu"
        ram = hw.ram_available if hw.ram_available is not None else \
            int(hw.ram_total * RAM_SHARE_WITHOUT_AVAILABLE)
        if hw.backend is not None and hw.backend.system_info:
            repack = repack and hw.backend.repack  # a binding built without REPACK
        return cls(backend=backend, gpu=gpu, gpu_reserve=reserve if gpu is not None else 0,
                   ram=ram, unified=backend == "metal", features=hw.ggml_cpu_features,
                   repack=repack)


def plan(target: ModelShape, draft: ModelShape | None, budget: Budget, ctx: ContextSpec,
         draft_ctx: ContextSpec | None = None, *, target_layers: int | str = "auto",
         draft_layers: int | str = "auto",
         alternatives: Sequence[tuple[str, ModelShape, ModelShape | None]] = (),
         _advise: bool = True) -> Plan:
    """Place the draft (fully on the GPU first), then as much of the target as still fits.

    `target_layers` / `draft_layers`: "auto" (planner decides), "all", or llama.cpp's
    n_gpu_layers count. `alternatives`: smaller pairs (name, target, draft) to suggest when
    this one does not fit.
    """
    draft_ctx = draft_ctx or replace(ctx, logit_rows=1)
    gpu = budget.backend != "cpu" and budget.gpu is not None
    kw = dict(backend=budget.backend if gpu else "cpu", features=budget.features,
              repack=budget.repack)
    problems: list[str] = []
    left = budget.gpu if gpu else 0

    def fit_layers(shape: ModelShape, c: ContextSpec, want: int | str, room: int, role: str):
        top = shape.n_layer + 1
        if not gpu:
            return place(shape, c, 0, role=role, **kw), True
        if want == "all" or isinstance(want, int):
            n = top if want == "all" else min(want, top)
            p = place(shape, c, n, role=role, **kw)
            return p, p.gpu_total <= room
        best = place(shape, c, 0, role=role, **kw)
        for n in range(top, 0, -1):  # the largest count that fits (monotone in n)
            p = place(shape, c, n, role=role, **kw)
            if p.gpu_total <= room:
                return p, True
        return best, True

    d_plan = None
    if draft is not None:
        d_plan, ok = fit_layers(draft, draft_ctx, draft_layers, left, "draft")
        if not ok:
            problems.append(f"the draft ({_gib(d_plan.gpu_total)} with {d_plan.gpu_layers} "
                            f"layers) does not fit in the GPU's {_gib(left)}")
        left -= d_plan.gpu_total if gpu else 0
    t_plan, t_ok = fit_layers(target, ctx, target_layers, max(left, 0), "target")
    if not t_ok:
        problems.append(f"the target's {t_plan.gpu_layers} requested GPU layers need "
                        f"{_gib(t_plan.gpu_total)}; {_gib(max(left, 0))} is left on the GPU")

    status = FITS if not problems else NO_FIT
    if gpu and status == FITS:
        if d_plan is not None and not d_plan.on_gpu:
            status = PARTIAL
            problems.append(f"the draft fits only {d_plan.gpu_layers}/{d_plan.max_layers} layers "
                            "on the GPU; a draft running on the CPU usually makes speculative "
                            "decoding slower than plain decoding")
        if not t_plan.on_gpu:
            status = PARTIAL
            problems.append(f"the target fits {t_plan.gpu_layers}/{t_plan.max_layers} layers "
                            f"on the GPU; the other {t_plan.max_layers - t_plan.gpu_layers} run "
                            "on the CPU, which is much slower")
    result = Plan(backend=budget.backend if gpu else "cpu", target=t_plan, draft=d_plan,
                  gpu_budget=budget.gpu if gpu else None,
                  gpu_reserve=budget.gpu_reserve if gpu else 0, ram_budget=budget.ram,
                  unified=budget.unified and gpu, status=status, ctx=ctx)
    if result.ram_left < 0:
        what = "RAM (unified memory)" if result.unified else "RAM"
        problems.append(f"both models need {_gib(result.ram_used)} of {what} but only "
                        f"{_gib(result.ram_budget)} is available")
        status = NO_FIT
    result = replace(result, status=status, problems=tuple(problems))
    if _advise and status != FITS:
        result = replace(result, advice=tuple(_advice(result, target, draft, budget, ctx,
                                                      draft_ctx, target_layers, draft_layers,
                                                      alternatives)))
    return result


def require_fit(p: Plan, what: str = "the pair") -> Plan:
    """`p` if the models can be loaded (fully or partly offloaded); else PlanError whose hint
    says what to change."""
    if p.status == NO_FIT:
        raise PlanError(f"{what} does not fit this machine: {'; '.join(p.problems)}",
                        "; or ".join(p.advice) + " (see `tandem hw`)")
    return p


def _fully_fits(p: Plan) -> bool:
    return p.status == FITS


def _advice(p: Plan, target, draft, budget, ctx, draft_ctx, t_layers, d_layers,
            alternatives) -> list[str]:
    out: list[str] = []

    def again(c: ContextSpec, dc: ContextSpec) -> Plan:
        return plan(target, draft, budget, c, dc, target_layers=t_layers, draft_layers=d_layers,
                    _advise=False)

    n = ctx.n_ctx // 2
    while n >= 512:
        if _fully_fits(again(replace(ctx, n_ctx=n), replace(draft_ctx, n_ctx=n))):
            out.append(f"use a smaller context: {n} tokens fits (--ctx-size {n}, or "
                       f"`context: {n}` in the config)")
            break
        n //= 2
    if ctx.type_k == "f16" or ctx.type_v == "f16":
        q = dict(type_k="q8_0", type_v="q8_0", flash_attn="on" if not ctx.fa else
                 ctx.flash_attn)
        if _fully_fits(again(replace(ctx, **q), replace(draft_ctx, **q))):
            saved = p.target.kv + (p.draft.kv if p.draft else 0)
            out.append(f"quantize the KV cache to q8_0 (saves about {_gib(saved // 2)}; "
                       "TANDEM_CACHE_TYPE_K=q8_0 TANDEM_CACHE_TYPE_V=q8_0, or kv_cache: "
                       "{type_k: q8_0, type_v: q8_0})")
    if ctx.ubatch > 256:
        c2 = replace(ctx, n_batch=min(ctx.n_batch, 256), n_ubatch=256)
        d2 = replace(draft_ctx, n_batch=min(draft_ctx.n_batch, 256), n_ubatch=256)
        if _fully_fits(again(c2, d2)):
            out.append("use smaller batches (batch: {n_batch: 256, n_ubatch: 256}): the "
                       "compute buffers shrink with n_ubatch")
    for name, t, d in alternatives:
        alt = plan(t, d, budget, ctx, draft_ctx, target_layers="auto", draft_layers="auto",
                   _advise=False)
        if _fully_fits(alt):
            out.append(f"choose a smaller pair: {name} fits with these settings "
                       f"(`tandem hw --pair {name}`)")
            break
    if p.ram_left < 0:
        out.append(f"free {_gib(-p.ram_left)} of RAM (close other programs)")
    if not out:
        out.append("choose a smaller pair or a lower-bit quantization; this one does not fit "
                   "even with a smaller context and a quantized KV cache")
    return out


def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB // 4 else f"{n / MiB:.0f} MiB"


__all__ = [
    "Budget", "ContextSpec", "FITS", "ModelPlan", "ModelShape", "NO_FIT", "PARTIAL", "Plan",
    "PlanError", "PlanTensor", "place", "plan", "repackable", "require_fit", "row_bytes",
]
