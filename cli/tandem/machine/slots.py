"""The memory of several slots decoded together (`tandem hw --parallel N`), planned before
anything loads: each slot's KV cells, its recurrent state (llama.cpp keeps 1 + n_rs_seq rows
of it per sequence: src/llama-memory-recurrent.cpp), the context checkpoints tandem keeps
per slot in RAM, and the MTP context's KV where the target drafts with its heads.

The slots share one context per model, laid out as the engine lays it out
(engine/backend/sequences.py shared_context): N slots and the one serve keeps for short
requests, each of n_ctx cells, plus the session's own sequence (one ubatch of cells, one
state); logits rows for every slot's verify batch. The models keep the GPU layers the
one-slot plan gave them (serve loads them so) and the rest must fit beside them.
Pure arithmetic: no llama.cpp import, nothing printed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.fsutil import fmt_bytes
from tandem.machine.placement import ContextSpec, ModelPlan, place
from tandem.machine.planner import MemoryBudget, MemoryUse, Plan, PlanError
from tandem.machine.shapes import ModelShape


@dataclass(frozen=True)
class SlotCosts:
    """One model's memory for one slot: what each slot more adds."""

    role: str
    kv: int  # n_ctx cells of the KV cache
    one_state: int  # one copy of the recurrent state (0: attention only)
    state_rows: int  # the copies llama.cpp holds per sequence: 1 + n_rs_seq
    n_checkpoints: int  # --ctx-checkpoints: copies kept in RAM per slot
    mtp_kv: int = 0  # the MTP context's KV of n_ctx cells (the heads' layers)

    @property
    def state(self) -> int:
        return self.state_rows * self.one_state

    @property
    def checkpoints(self) -> int:
        return self.n_checkpoints * self.one_state

    @property
    def total(self) -> int:
        return self.kv + self.state + self.checkpoints + self.mtp_kv

    def to_dict(self) -> dict:
        return {"role": self.role, "kv": self.kv, "state": self.state,
                "one_state": self.one_state, "state_rows": self.state_rows,
                "checkpoints": self.checkpoints, "n_checkpoints": self.n_checkpoints,
                "mtp_kv": self.mtp_kv, "total": self.total}


@dataclass(frozen=True)
class SlotsPlan(MemoryUse):
    """`parallel` slots (and `kept` more for short requests, as serve keeps one where there
    are several): each model's memory for all of them, on the one-slot plan's layers."""

    parallel: int
    kept: int
    base: Plan
    models: tuple[ModelPlan, ...]  # target (and draft) holding every slot
    per_slot: tuple[SlotCosts, ...]
    problems: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()

    @property
    def slots(self) -> int:
        return self.parallel + self.kept

    @property
    def gpu_budget(self) -> int | None:
        return self.base.gpu_budget

    @property
    def ram_budget(self) -> int:
        return self.base.ram_budget

    @property
    def unified(self) -> bool:
        return self.base.unified

    @property
    def total(self) -> int:
        return sum(m.total for m in self.models)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"parallel": self.parallel, "kept": self.kept, "slots": self.slots,
                "fits": self.fits, "total": self.total, "gpu_used": self.gpu_used
                if self.base.gpu_budget is not None else None, "gpu_left": self.gpu_left,
                "ram_used": self.ram_used, "ram_left": self.ram_left,
                "per_slot": [c.to_dict() for c in self.per_slot],
                "models": [m.to_dict() for m in self.models],
                "problems": list(self.problems), "advice": list(self.advice)}


def shared_spec(ctx: ContextSpec, slots: int) -> ContextSpec:
    """The context that holds `slots` sequences of ctx.n_ctx tokens (one: the context
    itself), as engine/backend/sequences.py shared_context makes it."""
    if slots <= 1:
        return ctx
    return replace(ctx, n_ctx=ctx.n_ctx * slots + ctx.n_ubatch, n_seq=slots + 1, slots=slots,
                   n_outputs_max=ctx.n_outputs_max * slots)


def slot_costs(shape: ModelShape, one: ModelPlan, ctx: ContextSpec, role: str) -> SlotCosts:
    """What one slot of `shape` costs: the one-slot plan `one` holds exactly one."""
    rows = 1 + (ctx.rs_seq if shape.snapshots else 0)
    return SlotCosts(role=role, kv=one.kv, one_state=shape.state_bytes,
                     state_rows=rows if shape.state_bytes else 0,
                     n_checkpoints=ctx.checkpoints if shape.state_bytes else 0,
                     mtp_kv=one.mtp_kv)


def plan_slots(base: Plan, target: ModelShape, draft: ModelShape | None,
               budget: MemoryBudget, ctx: ContextSpec, draft_ctx: ContextSpec,
               parallel: int, *, _advise: bool = True) -> SlotsPlan:
    """`parallel` slots of the pair whose one-slot plan is `base` (planned with `ctx` and
    `draft_ctx`), on `budget`: fits when both models hold every slot on the GPU and in RAM
    the budget leaves; else the problems and what to change."""
    parallel = max(parallel, 1)
    kept = 1 if parallel > 1 else 0  # serve keeps one for short requests where several run
    kw = dict(backend=base.backend, features=budget.features, repack=budget.repack)
    specs = ((target, base.target, ctx, "target"), (draft, base.draft, draft_ctx, "draft"))
    models, per_slot = [], []
    for shape, one, c, role in specs:
        if shape is None or one is None:
            continue
        models.append(place(shape, shared_spec(c, parallel + kept), one.gpu_layers,
                            role=role, **kw))
        per_slot.append(slot_costs(shape, one, c, role))
    plan = SlotsPlan(parallel, kept, base, tuple(models), tuple(per_slot))
    problems = _problems(plan)
    advice: tuple[str, ...] = ()
    if problems and _advise:
        advice = tuple(_advice(base, target, draft, budget, ctx, draft_ctx, parallel))
    return replace(plan, problems=problems, advice=advice)


def require_slots_fit(p: SlotsPlan, what: str = "the pair") -> SlotsPlan:
    """`p` if every slot fits; else PlanError (exit 3) whose hint says what to change."""
    if not p.fits:
        raise PlanError(f"{_slots_words(p)} of {what} do not fit this machine: they "
                        f"{'; '.join(p.problems)}",
                        "; or ".join(p.advice) + " (see `tandem hw --parallel N`)")
    return p


def _slots_words(p: SlotsPlan) -> str:
    return f"{p.parallel} slot{'s' if p.parallel > 1 else ''}" + (
        f" and the {p.kept} kept for short requests" if p.kept else "")


def _problems(p: SlotsPlan) -> tuple[str, ...]:
    out = []
    if p.base.status == "does-not-fit":
        out.append("do not fit even as one slot (see the plan above)")
    if p.gpu_left is not None and p.gpu_left < 0:
        out.append(f"need {fmt_bytes(p.gpu_used)} of GPU memory on the one-slot plan's "
                   f"layers; {fmt_bytes(p.base.gpu_budget)} is there")
    if p.ram_left < 0:
        what = "unified memory" if p.base.unified else "RAM"
        out.append(f"need {fmt_bytes(p.ram_used)} of {what}; "
                   f"{fmt_bytes(p.base.ram_budget)} is available")
    return tuple(out)


def _advice(base, target, draft, budget, ctx, draft_ctx, parallel) -> list[str]:
    def fits(n: int, c: ContextSpec, dc: ContextSpec) -> bool:
        return plan_slots(base if c is ctx else _replan(base, target, draft, budget, c, dc),
                          target, draft, budget, c, dc, n, _advise=False).fits

    out = []
    n = next((k for k in range(parallel - 1, 0, -1) if fits(k, ctx, draft_ctx)), 0)
    if n:
        out.append(f"serve fewer slots: --parallel {n} fits")
    size = ctx.n_ctx // 2
    while size >= 512:
        c, dc = replace(ctx, n_ctx=size), replace(draft_ctx, n_ctx=size)
        if fits(parallel, c, dc):
            out.append(f"give each slot a smaller context: --ctx-size {size} fits "
                       f"{parallel} slots")
            break
        size //= 2
    k = ctx.checkpoints // 2
    while target.state_bytes and k >= 1:  # the setting's least is 1
        if fits(parallel, replace(ctx, checkpoints=k), replace(draft_ctx, checkpoints=k)):
            out.append(f"keep fewer context checkpoints per slot: --ctx-checkpoints {k} "
                       f"fits (copies of {fmt_bytes(target.state_bytes)} each)")
            break
        k //= 2
    if not out:
        out.append("choose a smaller pair or serve one slot")
    return out


def _replan(base: Plan, target, draft, budget, ctx, draft_ctx) -> Plan:
    """The one-slot plan with another context, on the same layers (what serve would load)."""
    from tandem.machine.planner import plan

    return plan(target, draft, budget, ctx, draft_ctx, target_layers=base.target.gpu_layers,
                draft_layers=base.draft.gpu_layers if base.draft else "auto", _advise=False)
