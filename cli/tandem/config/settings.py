"""Settings, merged once per command into one frozen object in which every value knows where
it came from. Precedence, highest first:

    cli      command-line flags
    env      environment variables (TANDEM_CTX_SIZE, TANDEM_DRAFT_MAX, ...; see config.schema)
    config   the user config file, <tandem_home>/config.yaml
    tuned    spec-bench --tune's result for these model files (config.tuned)
    profile  the hardware profile's values, with its memory tier applied
    default  the schema's defaults

Two steps, so that a bad flag fails before anything is downloaded: read_sources() reads and
checks the flags, the environment and the config file, and names the pair (cli > env > config
> the catalog's default, which the caller passes in) and the profile if one was named; the
caller (commands/compose.py) then chooses the profile (machine.profiles.choose_profile), finds
the pair's files and reads their tuned values, and resolve_settings() merges it all. Of two
values that break a rule across keys (config.schema.RULES), the one from the weaker source
yields, with a warning.

This module is config's bottom layer: it reads files and merges plain data, and imports
nothing from the machine, the models or the engine (tests/test_structure.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from tandem.config.files import Located, SettingsFileError, convert, load_yaml, values_of
from tandem.config.schema import FIELDS_BY_KEY, SETTING_FIELDS, broken_rules, unknown_env
from tandem.errors import UsageError

SOURCES = ("cli", "env", "config", "tuned", "profile", "default")
CONFIG_NAME = "config.yaml"
CONFIG_ONLY_KEYS = ("profile", "pair", "force_profile")
ENV_PROFILE, ENV_PAIR, ENV_FORCE = "TANDEM_PROFILE", "TANDEM_PAIR", "TANDEM_FORCE_PROFILE"


@dataclass(frozen=True)
class Setting:
    key: str
    value: Any
    source: str  # one of SOURCES ("detected" for an auto-selected profile)
    origin: str = ""  # the flag, variable, file:line or profile it came from

    def describe(self) -> str:
        return f"{self.source}: {self.origin}" if self.origin else self.source

    @property
    def shown(self) -> Any:
        """The value as tandem shows it: a secret (an API key) only as set or not."""
        if getattr(FIELDS_BY_KEY.get(self.key), "secret", False):
            return "(set)" if self.value else ""
        return self.value


@dataclass(frozen=True)
class Settings:
    """Resolved settings: one attribute per key of the schema (config.schema.SETTING_FIELDS)
    plus pair and profile; `source(key)` and `origin(key)` say where each came from. Values
    only: the hardware, the profile object and the pair's files that resolving them took are
    the caller's (commands/compose.py: Resolved)."""

    pair: str
    profile: str
    mode: str
    strategy: str
    n_max: int
    n_min: int
    p_min: float
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int
    n_threads_batch: int
    flash_attn: str
    type_k: str
    type_v: str
    target_gpu_layers: int | str
    draft_gpu_layers: int | str
    history: str
    mmap: str  # on: weights mapped from the file; off: read into memory
    mlock: str  # on: weights locked in RAM
    gpu_reserve_mb: int
    rpc: str  # HOST:PORT,... of llama.cpp RPC servers for the target ("": all local)
    rpc_timeout: float
    grammar: str  # GBNF text ("": none); at most one of these five is in effect
    grammar_file: str
    json_schema: str
    json_schema_file: str
    json_object: str  # on: any JSON object
    ctx_checkpoints: int  # saved copies of a hybrid or recurrent model's state
    host: str  # tandem serve's: the address, port, queue, timeouts, cache reuse, CORS and key
    port: int
    queue: int
    timeout: float
    cache_reuse: int
    parallel: int  # slots (-1 or 0: auto) and the RAM prompt cache's MiB
    cache_ram: float
    cors: str  # origins, comma-separated ("": none)
    api_key: str  # "": none
    sources: Mapping[str, Setting] = field(repr=False, default_factory=dict)

    def source(self, key: str) -> str:
        return self.sources[key].source

    def origin(self, key: str) -> str:
        return self.sources[key].origin

    def to_dict(self) -> dict:
        return {k: {"value": s.shown, "source": s.source, "origin": s.origin}
                for k, s in self.sources.items()}


VALUE_KEYS = ("pair", "profile", *FIELDS_BY_KEY)  # a schema key without a field fails here
assert set(VALUE_KEYS) <= {f.name for f in fields(Settings)}


# ----------------------------------------------------------------------------- sources


def _checked(f, value: Any, where: str, env: bool = False) -> Any:
    """A flag's or variable's value through the schema; a bad one is a usage error."""
    good, problem = f.parse(value) if isinstance(value, str) else f.check(value)
    if problem is None:
        return good
    if env:
        raise UsageError(f"environment variable {where}: {problem}", f"fix or unset {where}")
    if f.kind == "choice":
        raise UsageError(f"unknown {f.label} {value!r} ({where})",
                         f"choose one of: {', '.join(f.choices)}")
    raise UsageError(f"{f.label} {problem}", f"check {where}")


def cli_values(cli: Mapping[str, Any]) -> dict[str, Located]:
    """The flags the user gave ({key: value}; None means not given), checked."""
    out = {}
    for key, value in cli.items():
        if value is None or key in CONFIG_ONLY_KEYS:
            continue
        if key not in FIELDS_BY_KEY:
            raise TypeError(f"unknown setting {key!r}")
        f = FIELDS_BY_KEY[key]
        out[key] = Located(_checked(f, value, f.flag or key), f.flag or key, None)
    return out


def env_values(env: Mapping[str, str]) -> dict[str, Located]:
    """TANDEM_* variables (see config.schema for the names)."""
    return {f.key: Located(_checked(f, env[f.env], f.env, env=True), f.env, None)
            for f in SETTING_FIELDS if (env.get(f.env) or "").strip()}


def load_user_config(path: Path) -> tuple[dict[str, Located], dict[str, Located]]:
    """(setting values, config-only values: profile, pair, force_profile) from config.yaml.
    A missing or empty file is no configuration; anything invalid names file, line and key."""
    if path.exists() and not path.is_file():
        # once silently ignored; a FIFO there would have blocked every run
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise SettingsFileError(path, None, None, f"is {kind}, not a config file",
                           f"move {path} out of the way (the config file is a YAML file)")
    doc = load_yaml(path) if path.is_file() else None
    if doc is None:
        return {}, {}
    if not isinstance(doc, dict):
        raise SettingsFileError(path, None, None, "the config file must be a YAML mapping of keys")
    from msgspec import UNSET

    obj = convert(doc, config_struct(), path)
    extra = {key: Located(value.strip() if isinstance(value, str) else value, str(path),
                          doc.line_of(key))
             for key in CONFIG_ONLY_KEYS if (value := getattr(obj, key)) is not UNSET}
    return values_of(obj, doc, path), extra


@lru_cache(maxsize=None)
def config_struct() -> type:
    """config.yaml's shape for msgspec: the settings and CONFIG_ONLY_KEYS (built once, as
    files.py builds the tuned files' one)."""
    from typing import Annotated

    from msgspec import UNSET, Meta

    from tandem.config.files import settings_struct

    name = Annotated[str, Meta(pattern=r"\S", extra={"says": "must be a name"})]
    return settings_struct("config", [("profile", name, UNSET), ("pair", name, UNSET),
                                      ("force_profile", bool, UNSET)])


def _first(*candidates) -> Setting | None:
    """The first named candidate (source, value, origin) as a Setting."""
    for source, value, origin in candidates:
        if value is not None and str(value).strip():
            return Setting("", str(value).strip(), source, origin)
    return None


def _named(key: str, cli: Mapping, env: Mapping, extra: Mapping[str, Located]) -> Setting | None:
    """pair or profile: cli > env > config."""
    loc = extra.get(key)
    s = _first(("cli", cli.get(key), FLAG_OF[key]), ("env", env.get(ENV_OF[key]), ENV_OF[key]),
               ("config", loc.value if loc else None,
                f"{loc.path}:{loc.line}" if loc and loc.line else (loc.path if loc else "")))
    return Setting(key, s.value, s.source, s.origin) if s else None


FLAG_OF = {"pair": "--pair/PAIR", "profile": "--profile"}
ENV_OF = {"pair": ENV_PAIR, "profile": ENV_PROFILE}


# ------------------------------------------------------------------------------ resolve


@dataclass(frozen=True)
class Sources:
    """The user's own sources, read and checked (read_sources): the flags, the environment
    and the config file, each {key: Located}; the pair (cli > env > config > default) and the
    profile's name when one was named (cli > env > config; None: detect one); whether a named
    profile that does not match this machine is forced; warnings (stray TANDEM_ variables)."""

    cli: Mapping[str, Located]
    env: Mapping[str, Located]
    config: Mapping[str, Located]
    pair: Setting
    profile: Setting | None
    force_profile: bool
    warnings: tuple[str, ...] = ()

    @property
    def threads(self) -> int:
        """The thread count the user set (0: all), as spec-bench keyed its tuned result."""
        return next((v["n_threads"].value for v in (self.cli, self.env, self.config)
                     if "n_threads" in v), 0)


def read_sources(cli: Mapping[str, Any], env: Mapping[str, str], config_path: Path,
                 default_pair: str) -> Sources:
    """Step one: the flags, the environment and the config file at `config_path`, checked (a
    bad value fails here, before the caller downloads anything), and the config-only keys.

    `cli`: {key: value} of the flags the user gave (None: not given), keys as in the schema
    plus pair, profile and force_profile. `default_pair`: the pair when none is named."""
    cli = dict(cli)
    warnings = [w for w in (unknown_env(env),) if w]
    cli_vals = cli_values(cli)
    env_vals = env_values(env)
    cfg_vals, cfg_extra = load_user_config(config_path)
    force = cli.get("force_profile")
    if force is None:
        force = (env.get(ENV_FORCE) or "").strip().lower() in ("1", "true", "yes", "on") or \
            bool(cfg_extra["force_profile"].value if "force_profile" in cfg_extra else False)
    pair = _named("pair", cli, env, cfg_extra) or Setting("pair", default_pair, "default",
                                                          "catalog default")
    return Sources(cli_vals, env_vals, cfg_vals, pair, _named("profile", cli, env, cfg_extra),
                   bool(force), tuple(warnings))


def resolve_settings(sources: Sources, profile: Setting, profile_values: Mapping[str, Located],
                     tuned: Mapping[str, Located] | None = None,
                     cpu_threads: int = 0) -> tuple[Settings, list[str]]:
    """Step two: merge every source into one Settings (see the module docstring for the
    order) and nothing else. (Settings, the warnings of the merge.)

    `profile`: the chosen profile's name with its source and why; `profile_values`: its
    values for this machine, each Located at the profile (and tier) it came from; `tuned`:
    spec-bench's values for the pair's files (config.tuned.tuned_values); `cpu_threads`: this
    machine's CPU threads, which cap a thread count (0: unknown, no cap)."""
    values = {"profile": profile, "pair": sources.pair}
    layers = [("cli", sources.cli), ("env", sources.env), ("config", sources.config),
              ("tuned", tuned or {}), ("profile", profile_values)]
    for f in SETTING_FIELDS:
        source, loc = next(((s, vals[f.key]) for s, vals in layers if f.key in vals),
                           ("default", None))
        if loc is None:
            values[f.key] = Setting(f.key, f.default, "default", "")
        else:
            origin = loc.path + (f":{loc.line}" if loc.line and source in ("config", "tuned")
                                 else "")
            values[f.key] = Setting(f.key, loc.value, source, origin)
    warnings = _reconcile(values)
    warnings += _thread_warnings(values, cpu_threads)
    return (Settings(**{k: values[k].value for k in VALUE_KEYS},
                     sources=MappingProxyType(values)), warnings)


def _rank(s: Setting) -> int:
    return SOURCES.index(s.source) if s.source in SOURCES else len(SOURCES)  # lower: stronger


def _reconcile(values: dict[str, Setting]) -> list[str]:
    """The schema's rules across keys. Of two conflicting values, the one from the weaker
    source yields (with a warning), so `--draft-max 2` works whatever n_min the profile has;
    a conflict inside one source (one file, two flags) is an error."""
    warnings: list[str] = []
    plain = {k: s.value for k, s in values.items()}
    for rule in broken_rules(plain):
        sa, sb = values[rule.key], values[rule.other]
        problem = rule.conflict(plain)
        if sa.source == sb.source:
            raise UsageError(f"{problem} (both from {sa.describe()})", rule.hint)
        key, winner = (rule.key, sb) if _rank(sa) > _rank(sb) else (rule.other, sa)
        old, new = values[key], rule.fixes[key](plain)
        values[key] = Setting(key, new, winner.source,
                              f"adjusted to {winner.key} from {winner.describe()}")
        warnings.append(f"{problem}: {key} set to {new} (was {old.value} from {old.describe()})")
        plain[key] = new
    return warnings


THREADS_OVER_CORES = 4  # above this many times the CPU's threads a count is surely a typo


def _thread_warnings(values: dict[str, Setting], cores: int) -> list[str]:
    """More threads than the CPU has only makes llama.cpp's threads wait for each other (-t 1000
    on 2 cores ran 100x slower): a count above the CPU's `cores` threads is capped to them with
    a warning, one above THREADS_OVER_CORES times them is refused, whatever its source."""
    warnings: list[str] = []
    for key in ("n_threads", "n_threads_batch"):
        s = values[key]
        if not cores or s.value <= cores:
            continue
        label = FIELDS_BY_KEY[key].label
        if s.value > THREADS_OVER_CORES * cores:
            raise UsageError(f"{label} {s.value} ({s.describe()}) is far above this machine's "
                             f"{cores} CPU threads", f"use at most {cores} threads, or 0 for all")
        values[key] = Setting(key, cores, s.source, f"capped to the CPU's threads from "
                                                   f"{s.describe()}")
        warnings.append(f"{label} {s.value} ({s.describe()}) exceeds this machine's {cores} CPU "
                        f"threads; using {cores} (more would be slower, not faster)")
    return warnings

