"""From resolved settings to what the engine loads: the memory plan, the engine's
SessionOptions and the pair's files. `run`, `chat` and `spec-bench` prepare a session here."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from tandem.config.settings import Settings, resolve_settings
from tandem.machine.fit import plan_for_settings
from tandem.machine.hardware import detect
from tandem.machine.planner import require_fit


def gpu_layers_value(value: int | str, backend: str) -> int:
    """llama.cpp's n_gpu_layers for a setting without a plan: all = -1 (every layer)."""
    if value == "all":
        return -1
    if value == "auto":
        return 0 if backend == "cpu" else -1
    return int(value)


def session_options(settings: Settings, plan: Any = None, *, verbose: bool = False,
                    extra: Mapping[str, Any] | None = None):
    """The engine's SessionOptions for these settings; GPU layers come from `plan` when given
    (the planner resolves `auto`), else from the settings themselves."""
    from tandem.engine.llama import ContextParams
    from tandem.engine.session import DraftParams, SessionOptions

    exact = settings.mode == "exact"
    ctx = ContextParams(n_ctx=settings.n_ctx, n_batch=settings.n_batch,
                        n_ubatch=settings.n_ubatch, n_threads=settings.n_threads,
                        n_threads_batch=settings.n_threads_batch,
                        flash_attn=settings.flash_attn, type_k=settings.type_k,
                        type_v=settings.type_v)
    if exact:
        ctx = exact_context(ctx)
    if plan is not None:
        t_layers = plan.target.gpu_layers
        d_layers = plan.draft.gpu_layers if plan.draft is not None else 0
    else:
        t_layers = gpu_layers_value(settings.target_gpu_layers, settings.backend)
        d_layers = gpu_layers_value(settings.draft_gpu_layers, settings.backend)
    return SessionOptions(strategy=settings.strategy,
                          draft=DraftParams(n_max=settings.n_max, n_min=settings.n_min,
                                            p_min=settings.p_min),
                          target_ctx=ctx, draft_ctx=None, target_gpu_layers=t_layers,
                          draft_gpu_layers=d_layers, verbose=verbose, repack=not exact,
                          extra=dict(extra or {}))


def exact_context(ctx):
    """What exact mode needs of the target's context on llama.cpp's CPU kernels: flash
    attention on (without it, 2+ rows take other matmul kernels) and a q8_0 KV cache (with
    f16, single-token flash attention switches to a split-KV kernel at 512 cached tokens);
    verify batches then stay within EXACT_BATCH rows (engine/llama.py)."""
    return replace(ctx, flash_attn="on", type_k="q8_0", type_v="q8_0", exact=True)


@dataclass(frozen=True)
class Prepared:
    """What `run` / `chat` need to load a pair: settings, the plan and the engine options."""

    settings: Settings
    plan: Any  # tandem.machine.planner.Plan
    options: Any  # tandem.engine.session.SessionOptions
    target: Path
    draft: Path | None

    @property
    def warnings(self) -> list[str]:
        """For stderr: the settings' warnings, the pair's oddities and why a partial plan will
        be slow."""
        return (list(self.settings.warnings) + pair_warnings(self.target, self.draft)
                + list(self.plan.problems))


def pair_warnings(target: Path, draft: Path | None) -> list[str]:
    """A draft that cannot speed anything up: the target itself, or a larger model than the
    target (-m and -md swapped, most likely)."""
    if draft is None:
        return []
    try:
        if os.path.samefile(target, draft):
            return [f"the draft is the target itself ({Path(target).name}): every draft token "
                    "costs as much as a target token, so speculation cannot gain"]
        t_size, d_size = Path(target).stat().st_size, Path(draft).stat().st_size
    except OSError:
        return []
    if d_size > t_size:
        return [f"the draft {Path(draft).name} ({d_size / 1e6:.0f} MB) is larger than the "
                f"target {Path(target).name} ({t_size / 1e6:.0f} MB): swapped -m and -md?"]
    return []


def prepare_session(cli: Mapping[str, Any] | None, resolve_models, *, verbose: bool = False,
                    hardware: Any = None, home: Path | None = None,
                    extra: Mapping[str, Any] | None = None) -> Prepared:
    """Settings -> model paths -> plan -> SessionOptions, in that order.

    `resolve_models(pair_name) -> (target_path, draft_path or None)` finds (or downloads) the
    files of the resolved pair; commands.options.resolve_models fits. Raises planner.PlanError
    (exit 3, with what to change) when the pair cannot be loaded at all.
    """
    settings = resolve_settings(cli, hardware=hardware or detect(), home=home,
                                models=resolve_models)
    target, draft = settings.files
    p = require_fit(plan_for_settings(settings, target, draft))
    return Prepared(settings, p, session_options(settings, p, verbose=verbose, extra=extra),
                    Path(target), Path(draft) if draft is not None else None)
