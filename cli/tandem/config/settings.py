"""Settings: one frozen object in which every value knows where it came from.

Precedence, highest first:

    cli      command-line flags
    env      environment variables (TANDEM_CTX_SIZE, TANDEM_DRAFT_MAX, ...; see SETTING_FIELDS)
    config   the user config file, <tandem_home>/config.yaml
    tuned    tuned settings, <tandem_home>/tuned/*.json (written by spec-bench --tune)
    profile  the hardware profile (detected, or chosen with --profile / TANDEM_PROFILE /
             `profile:` in the config file), with its memory tier applied
    default  tandem's defaults

The profile itself is chosen with the same precedence (cli > env > config > detection). A named
profile that does not match this machine is refused with the reason unless it is forced
(--force-profile, TANDEM_FORCE_PROFILE=1 or `force_profile: true` in the config); a forced one
is used with a warning. `session_options()` turns Settings (and a Plan) into the engine's
SessionOptions; `plan_for_settings()` runs the offload planner for a pair.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from tandem.errors import ModelError, UsageError
from tandem.fsutil import atomic_write_text, storage_error
from tandem.machine.profiles import (
    FIELDS_BY_KEY,
    QUANTIZED_KV,
    SETTING_FIELDS,
    Field,
    Located,
    Profile,
    ProfileError,
    ProfileMismatchError,
    get_profile,
    load_profiles,
    load_yaml,
    parse_setting_sections,
    select_profile,
)

SOURCES = ("cli", "env", "config", "tuned", "profile", "default")
# whether the engine loads the target's CPU weights repacked, per mode: fast mode uses
# llama.cpp's default (repacked); exact mode does not, because repacked weights switch GEMM
# kernels with the batch size and its verification must be batch-invariant
ENGINE_REPACK = {"fast": True, "exact": False}
# the `profile` key itself, when nothing named one, was "detected" from the hardware
CONFIG_NAME = "config.yaml"
TUNED_DIR = "tuned"
TUNED_VERSION = 1
CONFIG_ONLY_KEYS = ("profile", "pair", "force_profile")
ENV_PROFILE, ENV_PAIR, ENV_FORCE = "TANDEM_PROFILE", "TANDEM_PAIR", "TANDEM_FORCE_PROFILE"

# How each key is spelled on the command line (for messages).
CLI_FLAGS = {
    "strategy": "--strategy", "n_max": "--draft-max", "n_min": "--draft-min",
    "p_min": "--draft-p-min", "n_ctx": "--ctx-size", "n_batch": "--batch-size",
    "n_ubatch": "--ubatch-size", "n_threads": "--threads", "n_threads_batch": "--threads-batch",
    "flash_attn": "--flash-attn", "type_k": "--cache-type-k", "type_v": "--cache-type-v",
    "target_gpu_layers": "--gpu-layers", "draft_gpu_layers": "--gpu-layers-draft",
    "gpu_reserve_mb": "--gpu-reserve-mb", "pair": "--pair/PAIR", "profile": "--profile",
}
# Friendlier names accepted by cli_values(), as app.py's parameters are called.
CLI_ALIASES = {
    "ctx_size": "n_ctx", "draft_max": "n_max", "draft_min": "n_min", "draft_p_min": "p_min",
    "threads": "n_threads", "threads_batch": "n_threads_batch", "batch_size": "n_batch",
    "ubatch_size": "n_ubatch", "gpu_layers": "target_gpu_layers",
    "gpu_layers_draft": "draft_gpu_layers", "cache_type_k": "type_k", "cache_type_v": "type_v",
}


@dataclass(frozen=True)
class Setting:
    key: str
    value: Any
    source: str  # one of SOURCES ("detected" for an auto-selected profile)
    origin: str = ""  # the flag, variable, file:line or profile it came from

    def describe(self) -> str:
        return f"{self.source}: {self.origin}" if self.origin else self.source


@dataclass(frozen=True)
class Settings:
    """Resolved settings. Read values as attributes (`s.n_ctx`); `s.source("n_ctx")` says
    where each came from. Keys: pair, profile and every SETTING_FIELDS key."""

    values: Mapping[str, Setting]
    profile_obj: Profile
    profile_reason: str = ""
    hardware: Any = None  # tandem.machine.hardware.Hardware
    backend: str = "cpu"  # what will actually run: the profile's backend if the binding can
    warnings: tuple[str, ...] = ()
    tuned_path: str | None = None

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "values")
        if name in values:
            return values[name].value
        raise AttributeError(name)

    def get(self, key: str, default: Any = None) -> Any:
        s = self.values.get(key)
        return s.value if s is not None else default

    def source(self, key: str) -> str:
        return self.values[key].source

    def origin(self, key: str) -> str:
        return self.values[key].origin

    def to_dict(self) -> dict:
        return {k: {"value": s.value, "source": s.source, "origin": s.origin}
                for k, s in self.values.items()}


# ----------------------------------------------------------------------------- sources


def cli_values(**flags: Any) -> dict[str, Any]:
    """Command-line values for resolve_settings(): None (flag not given) is dropped and
    app.py's parameter names (ctx_size, draft_max, ...) are mapped to Settings keys."""
    out = {}
    for name, value in flags.items():
        if value is None:
            continue
        key = CLI_ALIASES.get(name, name)
        if key not in FIELDS_BY_KEY and key not in CONFIG_ONLY_KEYS:
            raise TypeError(f"unknown setting {name!r}")
        out[key] = value
    return out


def _check_cli(values: Mapping[str, Any]) -> dict[str, Located]:
    out = {}
    for key, value in values.items():
        if key in CONFIG_ONLY_KEYS:
            continue
        f = FIELDS_BY_KEY[key]
        if isinstance(value, str) and f.kind in ("int", "float", "layers"):
            value, problem = _parse_env_value(f, value)
        else:
            problem = None
        if problem is None:
            value, problem = f.check(value)
        if problem:
            flag = CLI_FLAGS.get(key, key)
            if f.kind == "choice":
                raise UsageError(f"unknown {f.label} {values[key]!r} ({flag})",
                                 f"choose one of: {', '.join(f.choices)}")
            raise UsageError(f"{f.label} {problem}", f"check {flag}")
        out[key] = Located(value, CLI_FLAGS.get(key, key), None)
    return out


def _parse_env_value(f: Field, raw: str) -> tuple[Any, str | None]:
    text = raw.strip()
    if f.kind == "int":
        try:
            return int(text), None
        except ValueError:
            return None, f"must be a whole number, got {raw!r}"
    if f.kind == "float":
        try:
            return float(text), None
        except ValueError:
            return None, f"must be a number, got {raw!r}"
    if f.kind == "layers" and text.lower() not in ("auto", "all"):
        try:
            return int(text), None
        except ValueError:
            return None, f"must be auto, all or a layer count, got {raw!r}"
    return text, None


def env_values(env: Mapping[str, str]) -> dict[str, Located]:
    """TANDEM_* variables (see SETTING_FIELDS for the names); bad values are usage errors."""
    out = {}
    for f in SETTING_FIELDS:
        raw = env.get(f.env)
        if raw is None or raw.strip() == "":
            continue
        value, problem = _parse_env_value(f, raw)
        if problem is None:
            value, problem = f.check(value)
        if problem:
            raise UsageError(f"environment variable {f.env}: {problem}",
                             f"fix or unset {f.env}")
        out[f.key] = Located(value, f.env, None)
    return out


def config_path(home: Path | None = None) -> Path:
    from tandem.models.store import tandem_home

    return (home or tandem_home()) / CONFIG_NAME


def load_user_config(path: Path) -> tuple[dict[str, Located], dict[str, Located]]:
    """(setting values, config-only values: profile, pair, force_profile) from config.yaml.

    A missing or empty file is no configuration; anything invalid is a ProfileError naming the
    file, line and key.
    """
    if not path.is_file():
        return {}, {}
    doc = load_yaml(path)
    if doc is None:
        return {}, {}
    if not isinstance(doc, dict):
        raise ProfileError(path, None, None, "the config file must be a YAML mapping of keys")
    extra: dict[str, Located] = {}
    for key in CONFIG_ONLY_KEYS:
        if key not in doc:
            continue
        value, line = doc[key], doc.line_of(key) if hasattr(doc, "line_of") else None
        if key == "force_profile":
            if not isinstance(value, bool):
                raise ProfileError(path, line, key, f"must be true or false, got {value!r}")
        elif not isinstance(value, str) or not value.strip():
            raise ProfileError(path, line, key, f"must be a name, got {value!r}")
        extra[key] = Located(value.strip() if isinstance(value, str) else value, str(path), line)
    values = parse_setting_sections(doc, path, skip=CONFIG_ONLY_KEYS)
    return values, extra


# -------------------------------------------------------------------------------- tuned


def tuned_dir(home: Path | None = None) -> Path:
    from tandem.models.store import tandem_home

    return (home or tandem_home()) / TUNED_DIR


def tuned_path(pair: str, device: str, home: Path | None = None) -> Path:
    """Where tuned settings for (pair, device) are written: <home>/tuned/<pair>--<device>.json."""
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{pair}--{device}")
    return tuned_dir(home) / f"{safe}.json"


def save_tuned(path: Path, settings: Mapping[str, Any], *, pair: str | None = None,
               device: str | None = None, measured: Mapping[str, Any] | None = None) -> Path:
    """Write tuned settings ({Settings key: value}) in the format load_tuned() reads.

    The later tuning issue owns what goes in; this keeps the format in one place.
    """
    nested: dict[str, Any] = {}
    for key, value in settings.items():
        f = FIELDS_BY_KEY[key]
        v, problem = f.check(value)
        if problem:
            raise UsageError(f"tuned setting {key}: {problem}", None)
        node = nested
        for part in f.path[:-1]:
            node = node.setdefault(part, {})
        node[f.path[-1]] = v
    doc = {"version": TUNED_VERSION, "pair": pair, "device": device, "settings": nested,
           "measured": dict(measured or {}), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                   time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise storage_error(exc, "the tuned settings", path, home_hint=True) from None
    return path


def load_tuned(pair: str | None, device: str | None, home: Path | None = None,
               models: tuple[Any, Any] | None = None, threads: int = 0
               ) -> tuple[dict[str, Located], Path | None, list[str]]:
    """The best tuned settings for (pair, device): ({key: Located}, file, warnings).

    Two formats live in <home>/tuned/. tandem.config.settings' own (save_tuned) names the pair and
    device it was measured for (either may be absent: applies to all). spec-bench --tune's
    (tandem.bench.tune) is keyed by its file name, a hash of this machine, the thread count and
    the model files: it applies when `models` (target, draft paths) hash to it, and wins over
    the first kind; its context size is not applied (spec-bench measures speed, the context
    is the user's need). The most specific file wins, then the newest. Unreadable files are
    skipped with a warning: a stale tuning result must never stop `tandem run`.
    """
    directory = tuned_dir(home)
    if not directory.is_dir():
        return {}, None, []
    warnings: list[str] = []
    best: tuple[tuple[int, float], Path, dict] | None = None
    bench_key = None
    for path in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if "settings" not in doc and isinstance(doc.get("overall"), dict):
                if models is None:
                    continue  # spec-bench's: needs the model files to know if it applies
                if bench_key is None:
                    bench_key = _bench_key(models, threads)
                if path.stem != bench_key:
                    continue
                values = parse_setting_sections(_from_bench(doc["overall"]), path)
                rank = (3, path.stat().st_mtime)
            else:
                if not isinstance(doc.get("settings"), dict):
                    raise ValueError("no 'settings' mapping")
                if doc.get("version", TUNED_VERSION) != TUNED_VERSION:
                    raise ValueError(f"unsupported version {doc.get('version')!r}")
                values = parse_setting_sections(doc["settings"], path)
                fp, fd = doc.get("pair"), doc.get("device")
                if (fp and fp != pair) or (fd and fd != device):
                    continue
                rank = ((fp is not None) + (fd is not None), path.stat().st_mtime)
        except (OSError, ValueError, RecursionError, ProfileError) as exc:
            msg = exc.message if isinstance(exc, ProfileError) else (
                "nested too deeply" if isinstance(exc, RecursionError) else str(exc))
            warnings.append(f"ignored tuned settings {path}: {msg}")
            continue
        if best is None or rank > best[0]:
            best = (rank, path, values)
    if best is None:
        return {}, None, warnings
    _, path, values = best
    return {k: Located(v.value, str(path), None) for k, v in values.items()}, path, warnings


def _bench_key(models: tuple[Any, Any], threads: int) -> str:
    from tandem.bench.tune import machine_pair_key  # imports the engine: only when needed

    target, draft = models
    return machine_pair_key(Path(target), Path(draft) if draft is not None else None, threads)


# spec-bench's ContextParams fields -> setting sections (n_ctx deliberately left out)
_BENCH_CTX = {"n_batch": ("batch", "n_batch"), "n_ubatch": ("batch", "n_ubatch"),
              "n_threads": ("threads", "n_threads"),
              "n_threads_batch": ("threads", "n_threads_batch"),
              "flash_attn": ("flash_attn",), "type_k": ("kv_cache", "type_k"),
              "type_v": ("kv_cache", "type_v")}


def _from_bench(overall: Mapping[str, Any]) -> dict[str, Any]:
    """spec-bench's winning configuration as setting sections."""
    out: dict[str, Any] = {}
    spec = {k: overall[k] for k in ("strategy", "n_max", "n_min", "p_min") if k in overall}
    if spec:
        out["speculative"] = spec
    ctx = overall.get("target_ctx")
    if isinstance(ctx, Mapping):
        for key, path in _BENCH_CTX.items():
            if key in ctx and ctx[key] is not None:
                if len(path) == 1:
                    out[path[0]] = ctx[key]
                else:
                    out.setdefault(path[0], {})[path[1]] = ctx[key]
    return out


# ------------------------------------------------------------------------------ resolve


def resolve_settings(cli: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
                     home: Path | None = None, hardware: Any = None,
                     profiles: Mapping[str, Profile] | None = None,
                     force_profile: bool | None = None,
                     models: tuple[Any, Any] | None = None) -> Settings:
    """Merge every source into one Settings (see the module docstring for the order).

    `cli`: {Settings key: value} of the flags the user gave (see cli_values()); `env` defaults
    to os.environ, `home` to tandem_home(), `hardware` to tandem.machine.hardware.detect(), `profiles`
    to load_profiles() (built-in + user). `models` (target, draft paths), once known, let
    spec-bench's tuned settings for those files apply.
    """
    from tandem.models.store import tandem_home

    cli = dict(cli or {})
    env = os.environ if env is None else env
    home = home or tandem_home()
    warnings: list[str] = []
    if hardware is None:
        from tandem.machine.hardware import detect

        hardware = detect()
    warnings += list(hardware.warnings)

    cli_vals = _check_cli(cli)
    env_vals = env_values(env)
    cfg_vals, cfg_extra = load_user_config(home / CONFIG_NAME)

    # the profile: cli > env > config > detection
    if profiles is None:
        profiles = load_profiles(user_dir=home / "profiles")
    force = force_profile if force_profile is not None else cli.get("force_profile")
    if force is None:
        force = _truthy(env.get(ENV_FORCE)) or bool(
            cfg_extra.get("force_profile", Located(False, "", None)).value)
    name_src = _first(("cli", cli.get("profile"), CLI_FLAGS["profile"]),
                      ("env", env.get(ENV_PROFILE), ENV_PROFILE),
                      ("config", _val(cfg_extra.get("profile")), _where(cfg_extra.get("profile"))))
    if name_src is not None:
        source, name, origin = name_src
        try:
            profile, w = get_profile(name, hardware, profiles, force=bool(force))
        except ProfileMismatchError as exc:
            if source != "cli":  # say where the name came from: it may be long forgotten
                exc.message = f"{exc.message} (profile set by {origin})"
                exc.args = (exc.message,)
            raise
        warnings += w
        profile_setting = Setting("profile", profile.name, source, origin)
        reason = f"chosen with {origin}"
    else:
        profile, reason = select_profile(hardware, profiles)
        profile_setting = Setting("profile", profile.name, "detected", reason)

    # the pair: cli > env > config > catalog default
    pair_src = _first(("cli", cli.get("pair"), CLI_FLAGS["pair"]),
                      ("env", env.get(ENV_PAIR), ENV_PAIR),
                      ("config", _val(cfg_extra.get("pair")), _where(cfg_extra.get("pair"))))
    if pair_src is not None:
        pair_setting = Setting("pair", pair_src[1], pair_src[0], pair_src[2])
    else:
        from tandem.models.catalog import get_pair

        pair_setting = Setting("pair", get_pair().name, "default", "catalog default")

    threads = next((v["n_threads"].value for v in (cli_vals, env_vals, cfg_vals)
                    if "n_threads" in v), 0)  # what spec-bench keyed its result with
    tuned_vals, tpath, tw = load_tuned(pair_setting.value, hardware.device_id, home,
                                       models=models, threads=threads)
    warnings += tw
    tier = profile.tier_for(hardware.accelerator_memory)
    prof_origin = profile.name
    prof_vals = {}
    for key, loc in profile.values_for(hardware).items():
        in_tier = tier is not None and key in tier.values
        prof_vals[key] = Located(loc.value, prof_origin + (
            f" (tier >= {tier.min_memory_gib:g} GiB)" if in_tier else ""), loc.line)

    layers = [("cli", cli_vals), ("env", env_vals), ("config", cfg_vals),
              ("tuned", tuned_vals), ("profile", prof_vals)]
    values: dict[str, Setting] = {"pair": pair_setting, "profile": profile_setting}
    for f in SETTING_FIELDS:
        for source, vals in layers:
            if f.key in vals:
                loc = vals[f.key]
                origin = loc.path if source in ("cli", "env", "profile") else \
                    f"{loc.path}" + (f":{loc.line}" if loc.line else "")
                values[f.key] = Setting(f.key, loc.value, source, origin)
                break
        else:
            values[f.key] = Setting(f.key, f.default, "default", "")
    warnings += _reconcile(values)
    warnings += _thread_warnings(values, hardware)
    backend = effective_backend(profile, hardware)
    return Settings(values=MappingProxyType(values), profile_obj=profile,
                    profile_reason=reason, hardware=hardware, backend=backend,
                    warnings=tuple(dict.fromkeys(warnings)),
                    tuned_path=str(tpath) if tpath else None)


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def _val(loc: Located | None) -> Any:
    return loc.value if loc is not None else None


def _where(loc: Located | None) -> str:
    return f"{loc.path}:{loc.line}" if loc is not None and loc.line else (loc.path if loc else "")


def _first(*candidates):
    for source, value, origin in candidates:
        if value is not None and str(value).strip():
            return source, str(value).strip(), origin
    return None


def _rank(s: Setting) -> int:
    return SOURCES.index(s.source) if s.source in SOURCES else len(SOURCES)  # lower: stronger


def _reconcile(values: dict[str, Setting]) -> list[str]:
    """Rules across keys. Of two conflicting values, the one from the weaker source yields
    (with a warning), so `--draft-max 2` works whatever n_min the profile has; a conflict
    inside one source (one file, two flags) is an error."""
    warnings: list[str] = []

    def settle(a: str, b: str, fix_a: Any, fix_b: Any, problem: str, hint: str) -> None:
        sa, sb = values[a], values[b]
        if sa.source == sb.source:
            raise UsageError(f"{problem} (both from {sa.describe()})", hint)
        key, new, winner = (a, fix_a, sb) if _rank(sa) > _rank(sb) else (b, fix_b, sa)
        old = values[key]
        values[key] = Setting(key, new, winner.source,
                              f"adjusted to {winner.key} from {winner.describe()}")
        warnings.append(f"{problem}: {key} set to {new} (was {old.value} from {old.describe()})")

    v = {k: s.value for k, s in values.items()}
    if v["n_min"] > v["n_max"]:
        settle("n_min", "n_max", v["n_max"], v["n_min"],
               f"draft min {v['n_min']} exceeds draft max {v['n_max']}",
               "make --draft-min <= --draft-max")
    if v["n_ubatch"] > v["n_batch"]:
        settle("n_ubatch", "n_batch", v["n_batch"], v["n_ubatch"],
               f"n_ubatch {v['n_ubatch']} exceeds n_batch {v['n_batch']}",
               "make n_ubatch <= n_batch")
    if v["type_v"] in QUANTIZED_KV and v["flash_attn"] == "off":
        settle("type_v", "flash_attn", "f16", "auto",
               f"a quantized V cache ({v['type_v']}) needs flash attention, which is off",
               "set flash_attn to auto, or type_v to f16")
    return warnings


def _thread_warnings(values: Mapping[str, Setting], hardware: Any) -> list[str]:
    """More threads than the CPU has only makes llama.cpp's threads wait for each other."""
    cores = getattr(getattr(hardware, "cpu", None), "logical_cores", 0) or 0
    out = []
    for key in ("n_threads", "n_threads_batch"):
        s = values[key]
        if cores and s.value > cores:
            out.append(f"{FIELDS_BY_KEY[key].label} {s.value} ({s.describe()}) exceeds this "
                       f"machine's {cores} CPU threads; generation will be slower, not faster")
    return out


def effective_backend(profile: Profile, hardware: Any) -> str:
    """The backend that will run: the profile's, if the installed binding can offload."""
    if profile.backend == "cpu" or hardware is None:
        return profile.backend if hardware is None else "cpu"
    binding = hardware.backend.name if hardware.backend is not None else "unknown"
    if binding in ("cpu", "unknown"):
        return "cpu"
    if binding in ("cuda", "metal"):
        return binding
    return profile.backend


# --------------------------------------------------------------------- plan + session


def context_spec(settings: Settings, role: str = "target"):
    """The planner's ContextSpec for one model of the pair."""
    from tandem.engine.llama import MAX_OUTPUTS
    from tandem.machine.planner import ContextSpec

    rows = settings.n_max + 1 if role == "target" else 1
    return ContextSpec(n_ctx=settings.n_ctx, n_batch=settings.n_batch, n_ubatch=settings.n_ubatch,
                       flash_attn=settings.flash_attn, type_k=settings.type_k,
                       type_v=settings.type_v, logit_rows=rows, n_outputs_max=MAX_OUTPUTS)


def model_shape(ref: Any, store: Any = None):
    """A planner ModelShape from a GGUF path, a catalog ModelSpec (its file when on disk,
    else an estimate from the catalog) or a ModelShape."""
    from tandem.machine.planner import ModelShape
    from tandem.models.catalog import ModelSpec

    if isinstance(ref, ModelShape):
        return ref
    if isinstance(ref, ModelSpec):
        if store is not None:
            path = store.path_for(ref)
            if path.is_file():
                return _shape_from_file(path, ref.name)
        size = ref.size if ref.size is not None else getattr(ref, "approx_size", None)
        return ModelShape.estimate(ref.name, size, hints=(ref.filename, ref.repo))
    return _shape_from_file(Path(ref), None)


_SHAPES: dict[tuple, Any] = {}


def _shape_from_file(path: Path, name: str | None):
    from tandem.machine.planner import ModelShape
    from tandem.models.gguf_meta import read_gguf_header

    try:
        st = path.stat()
    except OSError:
        return ModelShape.from_gguf(read_gguf_header(path))  # raises the usual ModelError
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHAPES:  # a 150k-token vocabulary takes ~0.3 s to parse
        _SHAPES[key] = ModelShape.from_gguf(read_gguf_header(path), name or path.name)
    return _SHAPES[key]


def plan_for_settings(settings: Settings, target: Any, draft: Any = None, *, store: Any = None,
                      suggest_pairs: bool = True):
    """Offload plan for `target` + `draft` (paths, catalog ModelSpecs or ModelShapes) under
    `settings` on its hardware. Smaller catalog pairs are suggested when it does not fit."""
    from tandem.machine.planner import Budget, plan

    t_shape = _shape_of(target, store, "target")
    d_shape = _shape_of(draft, store, "draft") if draft is not None else None
    budget = Budget.for_hardware(settings.hardware, settings.gpu_reserve_mb,
                                 backend=settings.backend, repack=ENGINE_REPACK[settings.mode])
    same_draft = getattr(draft, "name", None)
    alternatives = _smaller_pairs(t_shape, same_draft) if suggest_pairs else ()
    return plan(t_shape, d_shape, budget, context_spec(settings, "target"),
                context_spec(settings, "draft"), target_layers=settings.target_gpu_layers,
                draft_layers=settings.draft_gpu_layers, alternatives=alternatives)


def _shape_of(ref: Any, store: Any, role: str):
    """model_shape(), with a bad file's error saying which of the two models it is."""
    try:
        return model_shape(ref, store)
    except ModelError as exc:
        if exc.message.startswith(f"{role} model"):
            raise
        exc.message = f"{role} model: {exc.message}"
        exc.args = (exc.message,)
        raise


def _smaller_pairs(than, draft_name: str | None):
    """Catalog pairs with a smaller target, best suggestion first: the same draft (so the same
    family and vocabulary), then the largest."""
    from tandem.models.catalog import load_catalog

    out = []
    for name, pair in load_catalog().items():
        t = model_shape(pair.target, None)  # estimates: reading headers here would be slow
        if t.weights_bytes < than.weights_bytes * 0.9:
            same = pair.draft.name == draft_name
            out.append(((same, t.weights_bytes), name, t, model_shape(pair.draft, None)))
    out.sort(key=lambda x: x[0], reverse=True)
    return [(n, t, d) for _, n, t, d in out]


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
    from dataclasses import replace

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
    from tandem.machine.hardware import detect
    from tandem.machine.planner import require_fit

    hardware = hardware or detect()
    settings = resolve_settings(cli, hardware=hardware, home=home)
    target, draft = resolve_models(settings.pair)
    # again with the files known: spec-bench's tuned results are keyed by them
    settings = resolve_settings(cli, hardware=hardware, home=home, models=(target, draft))
    p = require_fit(plan_for_settings(settings, target, draft))
    return Prepared(settings, p, session_options(settings, p, verbose=verbose, extra=extra),
                    Path(target), Path(draft) if draft is not None else None)


# ------------------------------------------------------------------- recommendations


@dataclass(frozen=True)
class PairAdvice:
    name: str
    status: str  # fits | partial | does-not-fit | unknown (not in the catalog)
    plan: Any = None
    exact: bool = False  # planned from the GGUF files on disk
    note: str = ""


def recommended_pairs(settings: Settings, store: Any = None) -> list[PairAdvice]:
    """The profile's recommended pairs for this machine's memory, each planned."""
    from tandem.models.catalog import load_catalog

    catalog = load_catalog()
    lookup = {n.lower(): n for n in catalog}
    for n, p in catalog.items():
        for a in p.aliases:
            lookup.setdefault(a.lower(), n)
    out = []
    for name in settings.profile_obj.pairs_for(settings.hardware):
        canonical = lookup.get(name.lower())
        if canonical is None:
            out.append(PairAdvice(name, "unknown", note="not in this catalog"))
            continue
        pair = catalog[canonical]
        p = plan_for_settings(settings, pair.target, pair.draft, store=store,
                              suggest_pairs=False)
        out.append(PairAdvice(canonical, p.status, p, exact=p.target.exact))
    return out


__all__ = [
    "CLI_FLAGS", "PairAdvice", "Prepared", "SOURCES", "Setting", "Settings", "cli_values",
    "config_path",
    "context_spec", "effective_backend", "env_values", "gpu_layers_value", "load_tuned",
    "load_user_config", "model_shape", "plan_for_settings", "prepare_session", "recommended_pairs",
    "resolve_settings", "save_tuned", "session_options", "tuned_dir", "tuned_path",
]
