"""Offload and memory plan for a target + draft pair, and what to change when it does not fit.

Speculative decoding only pays when the draft is fast, so the draft goes fully to the GPU first
and the target takes the layers that still fit; both models' weights, KV caches and compute
buffers must fit at once (machine/placement.py sizes each model as llama.cpp allocates it).
Pure arithmetic: no llama.cpp import, nothing printed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from tandem.errors import EXIT_MODEL, TandemError
from tandem.fsutil import fmt_bytes
from tandem.machine.placement import ContextSpec, ModelPlan, place
from tandem.machine.shapes import ModelShape

GiB = 1 << 30
MiB = 1 << 20
# Page cache and other processes: without MemAvailable (macOS) keep this share of RAM free.
RAM_SHARE_WITHOUT_AVAILABLE = 0.85
FITS, PARTIAL, NO_FIT = "fits", "partial", "does-not-fit"


class PlanError(TandemError):
    """The pair does not fit this machine's memory with these settings."""

    exit_code = EXIT_MODEL


class MemoryUse:
    """What `models` use of `gpu_budget` and `ram_budget` (`unified`: GPU memory is RAM):
    a one-slot Plan's, and a SlotsPlan's (machine/slots.py) on the same budgets."""

    models: tuple[ModelPlan, ...]
    gpu_budget: int | None
    ram_budget: int
    unified: bool

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


@dataclass(frozen=True)
class Plan(MemoryUse):
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
class MemoryBudget:
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
                     repack: bool = False) -> MemoryBudget:
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


def plan(target: ModelShape, draft: ModelShape | None, budget: MemoryBudget, ctx: ContextSpec,
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
            problems.append(f"the draft ({fmt_bytes(d_plan.gpu_total)} with {d_plan.gpu_layers} "
                            f"layers) does not fit in the GPU's {fmt_bytes(left)}")
        left -= d_plan.gpu_total if gpu else 0
    t_plan, t_ok = fit_layers(target, ctx, target_layers, max(left, 0), "target")
    if not t_ok:
        problems.append(f"the target's {t_plan.gpu_layers} requested GPU layers need "
                        f"{fmt_bytes(t_plan.gpu_total)}; {fmt_bytes(max(left, 0))} is left on the GPU")

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
        problems.append(f"both models need {fmt_bytes(result.ram_used)} of {what} but only "
                        f"{fmt_bytes(result.ram_budget)} is available")
        status = NO_FIT
    result = replace(result, status=status, problems=tuple(problems))
    if _advise and status != FITS:
        result = replace(result, advice=tuple(_advice(result, target, draft, budget, ctx,
                                                      draft_ctx, target_layers, draft_layers,
                                                      alternatives)))
    return result


def slots_that_fit(p: Plan, want: int) -> int:
    """The most slots, up to `want`, that fit beside the plan (which holds one slot's): each
    slot more, and the one kept for short requests, adds what one slot holds of both models
    where the plan puts it (ModelPlan.slot_gpu / slot_cpu: KV cache, recurrent state with its
    snapshots and checkpoint copies, the MTP context's KV) (serve --parallel)."""
    gpu = sum(m.slot_gpu for m in p.models)
    cpu = sum(m.slot_cpu for m in p.models)
    for n in range(max(want, 1), 1, -1):
        more = n  # n - 1 more slots, and the kept one
        gpu_ok = gpu == 0 or p.gpu_left is None or more * gpu <= p.gpu_left
        ram = more * (cpu + (gpu if p.unified else 0))
        if gpu_ok and ram <= p.ram_left:
            return n
    return 1


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
            out.append(f"quantize the KV cache to q8_0 (saves about {fmt_bytes(saved // 2)}; "
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
        out.append(f"free {fmt_bytes(-p.ram_left)} of RAM (close other programs)")
    if not out:
        out.append("choose a smaller pair or a lower-bit quantization; this one does not fit "
                   "even with a smaller context and a quantized KV cache")
    return out
