"""From the command's flags to what the engine loads: the settings resolved with this
machine's profile and the pair's files (resolve -> Resolved), the memory plan, the engine's
SessionOptions (session_options). `run`, `chat`, `serve` and `spec-bench` prepare a session
here (prepare_session -> Prepared) and open it (open_pair: in this process, or, with the
target on RPC servers, in a supervised worker: llama.cpp aborts the process that holds a
broken RPC connection), `hw` resolves here: the composition of the config, machine, models
and engine layers belongs above them, beside the commands."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from tandem.config.schema import endpoints
from tandem.config.settings import CONFIG_NAME, Settings, read_sources, resolve_settings
from tandem.config.tuned import tuned_values
from tandem.engine.backend.context_params import ROLLBACK_TOKENS, ContextParams, exact_context
from tandem.engine.remote.rpc import server_info
from tandem.engine.pair import Pair, SessionOptions
from tandem.engine.slot_plan import SlotPlan, one_slot_reason
from tandem.engine.drafting.drafters import DraftParams
from tandem.machine.fit import plan_for_settings, remote_plan_for_settings
from tandem.fsutil import fmt_bytes
from tandem.machine.hardware import Hardware, detect
from tandem.machine.planner import Plan, PlanError, require_fit
from tandem.machine.profiles import Profile, choose_profile, load_profiles
from tandem.models.catalog import get_pair
from tandem.models.store import tandem_home


@dataclass(frozen=True)
class Resolved:
    """A command's settings and what resolving them took: this machine, the profile chosen for
    it (and why), the backend that will run, the pair's files when known (paths or catalog
    ModelSpecs), the tuned file that applied, and the warnings for stderr."""

    settings: Settings
    hardware: Hardware
    profile: Profile
    profile_reason: str
    backend: str
    files: tuple[Any, Any] | None = None
    tuned_path: Path | None = None
    warnings: tuple[str, ...] = ()


def resolve(cli: Mapping[str, Any] | None, files: Any = None, *,
            env: Mapping[str, str] | None = None, home: Path | None = None,
            hardware: Hardware | None = None,
            profiles: Mapping[str, Profile] | None = None) -> Resolved:
    """Flags, env and config.yaml read and checked -> the profile chosen -> the pair's files
    -> their tuned values -> config.settings.resolve_settings, once.

    `cli`: {settings key: value or None} plus pair, profile and force_profile. `files`: the
    (target, draft) of the pair, or a function from the pair's name to them, called only once
    the flags, env and config have been checked (so a bad flag fails before a download); the
    tuned settings spec-bench saved for those files then apply. `env` defaults to os.environ,
    `home` to tandem_home(), `hardware` to detect(), `profiles` to the built-in ones and the
    home's."""
    env = os.environ if env is None else env
    home = Path(home) if home is not None else tandem_home()
    hardware = hardware or detect()
    sources = read_sources(cli or {}, env, home / CONFIG_NAME, get_pair().name)
    if profiles is None:
        profiles = load_profiles(user_dir=home / "profiles")
    choice = choose_profile(sources.profile, hardware, profiles, sources.force_profile)
    if callable(files):
        files = files(sources.pair.value)
    tuned, tuned_path, tuned_warnings = tuned_values(home, files, sources.threads)
    settings, merged = resolve_settings(sources, choice.setting, choice.values, tuned,
                                        cpu_threads=hardware.cpu.logical_cores or 0)
    warnings = [*hardware.warnings, *sources.warnings, *choice.warnings, *tuned_warnings,
                *merged]
    return Resolved(settings, hardware, choice.profile, choice.reason, choice.backend,
                    tuple(files) if files is not None else None, tuned_path,
                    tuple(dict.fromkeys(warnings)))


@dataclass(frozen=True)
class Prepared:
    """What `run`, `chat`, `serve` and `spec-bench` need to load a pair: the resolved settings,
    the plan, the engine options and the pair's files."""

    resolved: Resolved
    plan: Plan
    options: SessionOptions
    target: Path
    draft: Path | None

    @property
    def settings(self) -> Settings:
        return self.resolved.settings

    @property
    def warnings(self) -> list[str]:
        """For stderr: the settings' warnings, the pair's oddities and why a partial plan will
        be slow."""
        return (list(self.resolved.warnings) + pair_warnings(self.target, self.draft)
                + memory_warnings(self.target, self.settings.strategy)
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
        return [f"the draft {Path(draft).name} ({fmt_bytes(d_size, decimal=True)}) is larger "
                f"than the target {Path(target).name} ({fmt_bytes(t_size, decimal=True)}): "
                "swapped -m and -md?"]
    return []


def memory_warnings(target: Path, strategy: str) -> list[str]:
    """A target whose state llama.cpp cannot roll back (a recurrent model, a hybrid without
    snapshots) decodes plain: said before it loads, from its header (models/memory_type.py),
    where the strategy would draft."""
    from tandem.config.schema import drafts
    from tandem.errors import TandemError
    from tandem.models import memory_type
    from tandem.models.gguf_meta import read_gguf_header

    if not drafts(strategy):
        return []
    try:
        header = read_gguf_header(target)
    except (TandemError, OSError):
        return []  # the loader says what is wrong with the file
    kind, how = memory_type.describe(header)
    if how not in (memory_type.NO_SNAPSHOTS, memory_type.ROLLBACK_WORDS[memory_type.RECURRENT]):
        return []
    return [f"{Path(target).name} is a {kind} model ({header.architecture}): llama.cpp cannot "
            f"roll its state back to a rejected draft, so it decodes plain (--strategy "
            f"{strategy} drafts nothing)"]


def prepare_session(cli: Mapping[str, Any] | None,
                    resolve_models: Callable[[str], tuple[Any, Any]], *, verbose: bool = False,
                    hardware: Hardware | None = None, home: Path | None = None) -> Prepared:
    """Settings -> model paths -> plan -> SessionOptions, in that order.

    `resolve_models(pair_name) -> (target_path, draft_path or None)` finds (or downloads) the
    files of the resolved pair; commands.options.resolve_models fits. `home`: tandem's home
    (default: $TANDEM_HOME or ~/.local/share/tandem), where settings, costs and history are
    kept. Raises planner.PlanError (exit 3, with what to change) when the pair cannot be
    loaded at all.
    """
    home = Path(home) if home is not None else tandem_home()
    r = resolve(cli, resolve_models, hardware=hardware, home=home)
    settings, (target, draft) = r.settings, r.files
    servers = endpoints(settings.rpc)
    p = plan_for_settings(settings, target, draft, hardware=r.hardware, backend=r.backend)
    if servers:
        # before llama.cpp sees them: it aborts the process on a server it cannot use
        infos = [server_info(ep) for ep in servers]
        require_remote_fit(p, remote_plan_for_settings(settings, target, infos))
    else:
        p = require_fit(p)
    return Prepared(r, p, session_options(settings, p, backend=r.backend, home=home,
                                          verbose=verbose),
                    Path(target), Path(draft) if draft is not None else None)


AUTO_SLOTS = 4  # llama-server's --parallel auto


def serve_slots(prepared: Prepared, want: int) -> tuple[SlotPlan, str | None]:
    """The slots `serve` decodes together for --parallel `want` (-1 or 0: auto, AUTO_SLOTS
    where memory allows), with one more kept for short requests where there are several,
    and why fewer: one where the engine says the pair takes one (engine/slot_plan.py:
    one_slot_reason), else as many as fit in memory."""
    from tandem.machine.planner import slots_that_fit

    opts = prepared.options
    auto = want <= 0
    # the engine's rule, asked of the files before they load
    one = one_slot_reason(strategy=opts.strategy, exact=opts.target_ctx.exact,
                          rpc=bool(opts.rpc))
    if one is not None:
        return SlotPlan(1), None if auto or want == 1 else f"--parallel {want}: one slot, {one}"
    n = slots_that_fit(prepared.plan, AUTO_SLOTS if auto else want)
    plan = SlotPlan(n, kept=1 if n > 1 else 0)  # the kept slot's memory is in slots_that_fit
    if n < (AUTO_SLOTS if auto else want) and not auto:
        return plan, f"--parallel {want}: {n} slots fit in memory"
    return plan, None


def files_on_disk(store, target, draft):
    """(target, draft) paths when they are on disk already (never downloads), else None;
    `target`/`draft`: catalog ModelSpecs or paths (draft may be None)."""
    paths = []
    for item in (target, draft):
        if item is None or isinstance(item, Path):
            paths.append(item)
        elif store.is_present(item):
            paths.append(store.path_for(item))
        else:
            return None
    return tuple(paths) if paths[0] is not None and paths[0].exists() else None


def needs(plan: Plan | None) -> int | None:
    """Both models' memory in a plan, GPU and RAM together (unified memory counted once):
    the one figure `tandem pairs` and `tandem hw` show for a pair."""
    return sum(m.total for m in plan.models) if plan is not None else None


def pair_plan(name: str, store, *, hardware: Hardware | None = None,
              profiles: Mapping[str, Profile] | None = None, home: Path | None = None) -> Plan:
    """The memory/offload plan `tandem hw NAME` shows for a catalog pair: its settings
    resolved as for a run (profile, config.yaml, env, the tuned values of its files when on
    disk), from its GGUF headers when on disk, else from the catalog's sizes."""
    spec = get_pair(name)
    r = resolve({"pair": spec.name}, lambda _: files_on_disk(store, spec.target, spec.draft),
                hardware=hardware, profiles=profiles, home=home)
    return plan_for_settings(r.settings, spec.target, spec.draft, store=store,
                             hardware=r.hardware, backend=r.backend)


def session_options(s: Settings, plan: Plan | None = None, *, backend: str = "cpu",
                    home: Path | None = None, verbose: bool = False) -> SessionOptions:
    """The engine's options for resolved settings: the draft length and its stops become the
    session's DraftParams; GPU layers come from `plan` (the planner resolves `auto`), else
    from the settings themselves on `backend` (Resolved.backend). `home`: where the session
    keeps costs and history. Threads the user did not fix are the engine's to choose."""
    exact = s.mode == "exact"
    # a hybrid target undoes drafts from snapshots: as many as the longest draft asks for
    ctx = ContextParams(n_ctx=s.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                        n_threads=s.n_threads, n_threads_batch=s.n_threads_batch,
                        flash_attn=s.flash_attn, type_k=s.type_k, type_v=s.type_v,
                        rollback=max(ROLLBACK_TOKENS, s.n_max), checkpoints=s.ctx_checkpoints)
    if plan is not None:
        layers = (plan.target.gpu_layers, plan.draft.gpu_layers if plan.draft else 0)
    else:
        layers = (gpu_layers_value(s.target_gpu_layers, backend),
                  gpu_layers_value(s.draft_gpu_layers, backend))
    rpc = endpoints(s.rpc)
    if rpc:
        # the offloaded layers go to the servers: all of them, unless the user chose a
        # count (a profile's count describes this machine's GPU, not the servers)
        chosen = s.target_gpu_layers if _source(s, "target_gpu_layers") not in (
            "profile", "default", "detected") else "all"
        layers = (gpu_layers_value(chosen, "rpc"), layers[1])
    return SessionOptions(strategy=s.strategy, draft=DraftParams(s.n_max, s.n_min, s.p_min),
                          target_ctx=exact_context(ctx) if exact else ctx, draft_ctx=None,
                          target_gpu_layers=layers[0], draft_gpu_layers=layers[1],
                          mmap=s.mmap == "on", mlock=s.mlock == "on",
                          verbose=verbose, repack=not exact, history=s.history == "on",
                          rpc=rpc, rpc_timeout=float(s.rpc_timeout),
                          home=Path(home) if home is not None else None,
                          adapt_threads=not user_threads(s))


USER_SOURCES = ("cli", "env", "config")  # a count from these is the user's own: honoured


def user_threads(s: Settings) -> bool:
    """Whether the user fixed the thread count (-t, TANDEM_THREADS, threads: in config.yaml,
    0 included); otherwise the engine chooses the fastest count now (engine/tuning/threads.py)."""
    return any(_source(s, key) in USER_SOURCES for key in ("n_threads", "n_threads_batch"))


def _source(s: Settings, key: str) -> str:
    try:
        return s.source(key)
    except KeyError:
        return "default"


def gpu_layers_value(value: int | str, backend: str) -> int:
    """llama.cpp's n_gpu_layers for a setting without a plan: all = -1 (every layer)."""
    if value == "all":
        return -1
    if value == "auto":
        return 0 if backend == "cpu" else -1
    return int(value)


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


def open_pair(target_path: Path, draft_path: Path | None, opts: SessionOptions) -> Pair:
    """A PairSession, or a RemotePair (the same Pair) when `opts.rpc` is set."""
    if opts.rpc:
        from tandem.engine.remote.worker import RemotePair

        return RemotePair(target_path, draft_path, opts)
    from tandem.engine.pair import PairSession

    return PairSession(target_path, draft_path, opts)
