"""Plans for pairs under resolved settings: model shapes from GGUF files or the catalog, the
offload plan for a pair, and the profile's recommended pairs checked against this machine."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config.schema import MAX_DRAFT
from tandem.errors import ModelError
from tandem.machine.placement import ContextSpec
from tandem.machine.planner import MemoryBudget, plan
from tandem.machine.shapes import ModelShape
from tandem.models.catalog import ModelSpec, load_catalog
from tandem.models.gguf_meta import read_gguf_header

# whether the engine loads the target's CPU weights repacked, per mode: fast mode uses
# llama.cpp's default (repacked); exact mode does not, because repacked weights switch GEMM
# kernels with the batch size and its verification must be batch-invariant
ENGINE_REPACK = {"fast": True, "exact": False}


def context_spec(settings, role: str = "target", mtp: bool = False):
    """The planner's ContextSpec for one model of the pair; `mtp`: the target drafts with
    its MTP heads (their context's KV is planned beside it)."""

    from tandem.engine.backend.context_params import ROLLBACK_TOKENS

    rows = settings.n_max + 1 if role == "target" else 1
    # as the engine makes each context (commands.compose.session_options): n_rs_seq the
    # longest draft, --ctx-checkpoints copies; a model without a recurrent state has neither
    return ContextSpec(n_ctx=settings.n_ctx, n_batch=settings.n_batch, n_ubatch=settings.n_ubatch,
                       flash_attn=settings.flash_attn, type_k=settings.type_k,
                       type_v=settings.type_v, logit_rows=rows, n_outputs_max=MAX_DRAFT + 1,
                       rs_seq=max(ROLLBACK_TOKENS, settings.n_max),
                       checkpoints=settings.ctx_checkpoints, mtp=mtp and role == "target")


def model_shape(ref: Any, store: Any = None, mtp: bool = False):
    """A planner ModelShape from a GGUF path, a catalog ModelSpec (its file when on disk,
    else an estimate from the catalog; `mtp`: with the MTP heads its pair drafts with) or a
    ModelShape."""
    if isinstance(ref, ModelShape):
        return ref
    if isinstance(ref, ModelSpec):
        if store is not None:
            path = store.path_for(ref)
            if path.is_file():
                return _shape_from_file(path, ref.name)
        size = ref.size if ref.size is not None else getattr(ref, "approx_size", None)
        return ModelShape.estimate(ref.name, size, hints=(ref.filename, ref.repo),
                                   arch=ref.arch, mtp=mtp)
    return _shape_from_file(Path(ref), None)


_SHAPES: dict[tuple, Any] = {}


def _shape_from_file(path: Path, name: str | None):
    try:
        st = path.stat()
    except OSError:
        return ModelShape.from_gguf(read_gguf_header(path))  # raises the usual ModelError
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHAPES:  # a 150k-token vocabulary takes ~0.3 s to parse
        _SHAPES[key] = ModelShape.from_gguf(read_gguf_header(path), name or path.name)
    return _SHAPES[key]


def plan_for_settings(settings, target: Any, draft: Any = None, *, hardware, backend: str,
                      store: Any = None, suggest_pairs: bool = True, mtp: bool = False):
    """Offload plan for `target` + `draft` (paths, catalog ModelSpecs or ModelShapes) under
    `settings` on `hardware` (machine.hardware.Hardware), running on `backend` (the profile's
    backend as the binding allows: machine.profiles.effective_backend). Smaller catalog pairs
    are suggested when it does not fit. `mtp`: the target drafts with its MTP heads."""
    t_shape = _shape_of(target, store, "target", mtp)
    d_shape = _shape_of(draft, store, "draft") if draft is not None else None
    budget = MemoryBudget.for_hardware(hardware, settings.gpu_reserve_mb, backend=backend,
                                 repack=ENGINE_REPACK[settings.mode])
    same_draft = getattr(draft, "name", None)
    alternatives = _smaller_pairs(t_shape, same_draft) if suggest_pairs else ()
    return plan(t_shape, d_shape, budget, context_spec(settings, "target", mtp),
                context_spec(settings, "draft"), target_layers=settings.target_gpu_layers,
                draft_layers=settings.draft_gpu_layers, alternatives=alternatives)


def slots_for_settings(settings, base, parallel: int, target: Any, draft: Any = None, *,
                       hardware, backend: str, store: Any = None, mtp: bool = False):
    """`parallel` slots (machine/slots.py) of the pair whose one-slot plan is `base`
    (plan_for_settings with the same arguments), under `settings` on `hardware`."""
    from tandem.machine.slots import plan_slots

    t_shape = _shape_of(target, store, "target", mtp)
    d_shape = _shape_of(draft, store, "draft") if draft is not None else None
    budget = MemoryBudget.for_hardware(hardware, settings.gpu_reserve_mb, backend=backend,
                                       repack=ENGINE_REPACK[settings.mode])
    return plan_slots(base, t_shape, d_shape, budget, context_spec(settings, "target", mtp),
                      context_spec(settings, "draft"), parallel)


def _shape_of(ref: Any, store: Any, role: str, mtp: bool = False):
    """model_shape(), with a bad file's error saying which of the two models it is."""
    try:
        return model_shape(ref, store, mtp)
    except ModelError as exc:
        if exc.message.startswith(f"{role} model"):
            raise
        exc.message = f"{role} model: {exc.message}"
        exc.args = (exc.message,)
        raise


def _smaller_pairs(than, draft_name: str | None):
    """Catalog pairs with a smaller target, best suggestion first: the same draft (so the same
    family and vocabulary), then the largest."""
    out = []
    for name, pair in load_catalog().items():
        t = model_shape(pair.target, None)  # estimates: reading headers here would be slow
        if t.weights_bytes < than.weights_bytes * 0.9:
            same = pair.draft is not None and pair.draft.name == draft_name
            d = model_shape(pair.draft, None) if pair.draft is not None else None
            out.append(((same, t.weights_bytes), name, t, d))
    out.sort(key=lambda x: x[0], reverse=True)
    return [(n, t, d) for _, n, t, d in out]


@dataclass(frozen=True)
class PairAdvice:
    name: str
    status: str  # fits | partial | does-not-fit | unknown (not in the catalog)
    plan: Any = None
    exact: bool = False  # planned from the GGUF files on disk
    note: str = ""


def recommended_pairs(settings, profile, *, hardware, backend: str,
                      store: Any = None) -> list[PairAdvice]:
    """`profile`'s recommended pairs for the memory of `hardware`, each planned."""
    catalog = load_catalog()
    lookup = {n.lower(): n for n in catalog}
    for n, p in catalog.items():
        for a in p.aliases:
            lookup.setdefault(a.lower(), n)
    out = []
    for name in profile.pairs_for(hardware):
        canonical = lookup.get(name.lower())
        if canonical is None:
            out.append(PairAdvice(name, "unknown", note="not in this catalog"))
            continue
        pair = catalog[canonical]
        p = plan_for_settings(settings, pair.target, pair.draft, hardware=hardware,
                              backend=backend, store=store, suggest_pairs=False)
        out.append(PairAdvice(canonical, p.status, p, exact=p.target.exact))
    return out


def remote_plan_for_settings(settings, target: Any, servers, *, store: Any = None):
    """Where the target's layers go over the RPC servers `servers` (engine.rpc.ServerInfo,
    in --rpc order), with the layer count the engine will use: all, unless the user set
    one (a profile's count describes this machine's GPU)."""
    from tandem.machine.remote import plan_remote

    layers = settings.target_gpu_layers
    if settings.source("target_gpu_layers") in ("profile", "default") or layers in ("auto", "all"):
        layers = -1
    return plan_remote(_shape_of(target, store, "target"), context_spec(settings, "target"),
                       int(layers), [(s.endpoint, [(d.free, d.total) for d in s.devices])
                                     for s in servers])
