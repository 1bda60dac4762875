"""From resolved settings to what the engine loads: the memory plan, the engine's
SessionOptions (SessionOptions.from_settings) and the pair's files. `run`, `chat` and `spec-bench` prepare a session here."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tandem.config.schema import endpoints
from tandem.config.settings import Settings, resolve_settings
from tandem.engine.rpc import server_info
from tandem.engine.session import SessionOptions
from tandem.machine.fit import plan_for_settings, remote_plan_for_settings
from tandem.machine.hardware import detect, fmt_bytes
from tandem.machine.planner import PlanError, require_fit


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
    servers = endpoints(settings.rpc)
    p = plan_for_settings(settings, target, draft)
    if servers:
        # before llama.cpp sees them: it aborts the process on a server it cannot use
        infos = [server_info(ep) for ep in servers]
        require_remote_fit(p, remote_plan_for_settings(settings, target, infos))
    else:
        p = require_fit(p)
    return Prepared(settings, p, SessionOptions.from_settings(settings, p, verbose=verbose,
                                                              extra=extra),
                    Path(target), Path(draft) if draft is not None else None)


def require_remote_fit(local, remote) -> None:
    """A remote target: each server's share within its free memory, and this machine's share
    of the target plus the draft within its RAM; else PlanError (exit 3) saying where."""
    problems = list(remote.problems)
    here = remote.devices[0].total + (local.draft.total if local.draft else 0)
    if here > local.ram_budget:
        problems.append(f"this machine needs {fmt_bytes(here)} (the draft and "
                        f"{len(remote.devices[0].layers)} target layers) of "
                        f"{fmt_bytes(local.ram_budget)} available")
    if problems:
        raise PlanError("the target does not fit over these RPC servers: " + "; ".join(problems),
                        "add a server to --rpc, lower --ctx-size, or choose a smaller pair; "
                        "`tandem hw --rpc ...` shows the plan")
