"""Where one model's memory goes for a given n_gpu_layers, following llama.cpp's own placement
rules. The figures mirror what llama.cpp allocates (vendored llama.cpp
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

from dataclasses import dataclass, replace
from typing import Mapping

from tandem.config.schema import FIELDS_BY_KEY, MAX_DRAFT

from tandem.machine.shapes import ModelShape, PlanTensor, row_bytes

F32 = 4
KV_PAD = 256  # llama.cpp pads n_ctx (KV cells) to a multiple of 256
GPU_TENSOR_ALIGN = 256  # per-tensor allocation alignment in GPU buffers


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ContextSpec:
    """The llama.cpp context parameters that size memory."""

    n_ctx: int = FIELDS_BY_KEY["n_ctx"].default
    n_batch: int = FIELDS_BY_KEY["n_batch"].default
    n_ubatch: int = FIELDS_BY_KEY["n_ubatch"].default
    flash_attn: str = "auto"  # auto resolves to on: every backend tandem targets supports it
    type_k: str = FIELDS_BY_KEY["type_k"].default
    type_v: str = FIELDS_BY_KEY["type_v"].default
    # tandem's contexts cap logits rows at MAX_DRAFT + 1 (engine's MAX_OUTPUTS; llama.cpp's
    # 0 = n_batch)
    n_outputs_max: int = MAX_DRAFT + 1
    logit_rows: int = 1  # rows of logits one decode asks for (verify: n_max + 1)
    # a hybrid's snapshots of its recurrent state (llama.cpp's n_rs_seq: the longest draft)
    # and the saved copies of the state a context keeps (--ctx-checkpoints)
    rs_seq: int = 0
    checkpoints: int = 0
    # several slots in one context (machine/slots.py): the sequences llama.cpp's recurrent
    # memory holds a state for (n_seq_max) and the slots that each keep their own checkpoints
    n_seq: int = 1
    slots: int = 1
    # an MTP context beside this one (--strategy mtp): the KV of the model's MTP heads
    mtp: bool = False

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
    # the recurrent state beside the KV cache, its n_rs_seq snapshots included, on the
    # device of its layer; and the context checkpoints' copies of it, in host memory
    state_gpu: int = 0
    state_cpu: int = 0
    snapshots: int = 0  # of state_gpu + state_cpu: the n_rs_seq snapshots
    copies: int = 0
    # the MTP context's KV cache (its heads' layers only), on the device of those layers
    mtp_kv_gpu: int = 0
    mtp_kv_cpu: int = 0

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
    def state(self) -> int:
        return self.state_gpu + self.state_cpu

    @property
    def mtp_kv(self) -> int:
        return self.mtp_kv_gpu + self.mtp_kv_cpu

    @property
    def slot_gpu(self) -> int:
        """What each slot more holds on the GPU (machine/planner.slots_that_fit)."""
        return self.kv_gpu + self.state_gpu + self.mtp_kv_gpu

    @property
    def slot_cpu(self) -> int:
        """What each slot more holds in RAM: its checkpoint copies too."""
        return self.kv_cpu + self.state_cpu + self.copies + self.mtp_kv_cpu

    @property
    def gpu_total(self) -> int:
        return (self.weights_gpu + self.kv_gpu + self.state_gpu + self.mtp_kv_gpu
                + self.compute_gpu)

    @property
    def cpu_total(self) -> int:
        return (self.weights_cpu + self.kv_cpu + self.state_cpu + self.copies
                + self.mtp_kv_cpu + self.compute_cpu + self.output_host)

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
            "state_gpu": self.state_gpu, "state_cpu": self.state_cpu,
            "state_snapshots": self.snapshots, "state_copies": self.copies,
            "mtp_kv_gpu": self.mtp_kv_gpu, "mtp_kv_cpu": self.mtp_kv_cpu,
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

    kv_gpu, kv_cpu, k_all, v_all = _kv_cache(shape, ctx, on_gpu)
    mtp_gpu, mtp_cpu = _kv_cache(shape, ctx, on_gpu, heads=True)[:2] if ctx.mtp else (0, 0)
    c_gpu, c_cpu = _compute_buffers(shape, ctx, on_gpu, out_gpu, backend)
    output_host = F32 * shape.n_vocab * max(ctx.logit_rows, 1)
    # llama.cpp's recurrent memory: one row per sequence and per snapshot (1 + n_rs_seq),
    # n_rs_seq clamped to 0 where the architecture keeps none
    rows = 1 + (ctx.rs_seq if shape.snapshots else 0)
    per_layer = [shape.state_row * rows * ctx.n_seq if r else 0 for r in shape.recurrent]
    state_gpu = sum(b for b, g in zip(per_layer, on_gpu) if g)
    state_cpu = sum(per_layer) - state_gpu
    return ModelPlan(role=role, name=shape.name, n_layer=shape.n_layer, gpu_layers=L,
                     weights_gpu=w_gpu, weights_cpu=w_cpu, kv_gpu=kv_gpu, kv_cpu=kv_cpu,
                     compute_gpu=c_gpu, compute_cpu=c_cpu, output_host=output_host,
                     buffers=buffers, kv_k=k_all, kv_v=v_all, exact=shape.exact,
                     note=shape.note, state_gpu=state_gpu, state_cpu=state_cpu,
                     snapshots=shape.state_bytes * (rows - 1) * ctx.n_seq,
                     copies=ctx.checkpoints * shape.state_bytes * ctx.slots,
                     mtp_kv_gpu=mtp_gpu, mtp_kv_cpu=mtp_cpu)


def _kv_cache(shape: ModelShape, ctx: ContextSpec, on_gpu: list[bool], heads: bool = False
              ) -> tuple[int, int, int, int]:
    """The KV cache's bytes: (on the GPU, on the CPU, all K, all V); `heads`: the MTP
    context's, which holds the MTP heads' layers only (the model's own holds the others)."""
    cells = ctx.cells
    kv_gpu = kv_cpu = k_all = v_all = 0
    for il in range(shape.n_layer):
        if (il >= shape.trunk) != heads:
            continue
        if shape.recurrent and shape.recurrent[il]:
            continue  # a hybrid's recurrent layers keep no KV cache
        kvh = shape.n_head_kv[il]
        k = cells * row_bytes(ctx.type_k, shape.head_dim_k * kvh)
        v = cells * row_bytes(ctx.type_v, shape.head_dim_v * kvh)
        k_all += k
        v_all += v
        if on_gpu[il]:
            kv_gpu += k + v
        else:
            kv_cpu += k + v
    return kv_gpu, kv_cpu, k_all, v_all


def _compute_buffers(shape: ModelShape, ctx: ContextSpec, on_gpu: list[bool], out_gpu: bool,
                     backend: str) -> tuple[int, int]:
    """The compute buffers' bytes: (on the GPU, on the CPU)."""
    cells, ub, n_out = ctx.cells, ctx.ubatch, ctx.n_out
    e, kv_dim = shape.n_embd, max(shape.n_head_kv) * shape.head_dim_k if shape.n_layer else 0
    out_phase = F32 * (n_out * shape.n_vocab + (2 if ctx.fa else 3) * ub * e)
    if ctx.fa:
        layer_phase = F32 * ub * (3 * shape.n_ff + 4 * e) + 2 * cells * ub
    else:
        layer_phase = F32 * (cells * ub * (shape.n_head + 1) + ub * (5 * e + 2 * kv_dim))
    if backend == "cpu":
        return 0, max(out_phase, layer_phase)
    any_gpu, any_cpu = any(on_gpu), not all(on_gpu)
    c_gpu = max(layer_phase if any_gpu else 0, out_phase if out_gpu else 0)
    host_inputs = F32 * ub * e + (2 if ctx.fa else 4) * cells * ub
    c_cpu = max(layer_phase if any_cpu else 0, out_phase if not out_gpu else 0, host_inputs)
    if backend == "cuda" and any_cpu and any_gpu:
        # op_offload: large batches run CPU-resident matmuls on the GPU with a temporary
        # copy of the weight, so the GPU buffer also holds the largest such tensor
        c_gpu += _largest_cpu_matmul(shape, on_gpu)
    return c_gpu, c_cpu


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
