"""The settings schema, defined once: each key with its YAML place, environment variable, flag
and check; the vocabularies the engine maps to llama.cpp's integers; the rules across keys.

Profiles, the config file, tuned results, the environment and the flags are all read through
it, so a key is spelled, checked and explained in one place (docs/hardware.md lists them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sized

from tandem.errors import UsageError

STRATEGIES = ("none", "draft", "ngram", "hybrid", "auto")
# fast: llama.cpp's default kernels (repacked CPU weights), greedy output equal to plain
# decoding up to floating-point rounding; exact: bit-identical to plain decoding
MODES = ("fast", "exact")
FLASH_ATTN = ("auto", "on", "off")
KV_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
QUANTIZED_KV = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
ON_OFF = ("on", "off")
# where a drafted token came from: the draft model, the current prompt and output (prompt
# lookup), a file the user named, or earlier answers (engine/history.py)
DRAFT_SOURCES = ("model", "prompt", "file", "history")
MAX_CONTEXT = 1 << 20
# the longest draft: verify batches carry at most MAX_DRAFT drafts and the last token
# (engine/llama.py MAX_OUTPUTS rows of logits); the flags, files, chat's /draft and the engine
# all check the draft length against the n_max field below
MAX_DRAFT = 64


def check_strategy(name: str) -> str:
    """A strategy name, checked where it does not arrive as a setting (chat's /strategy, the
    engine's options): the same words and message as the settings' own check."""
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}", f"choose one of: {', '.join(STRATEGIES)}")
    return name


def check_max_tokens(max_tokens: int) -> int:
    """The most tokens to generate: at least one (run's and chat's -n, chat's /max-tokens,
    the engine's GenParams)."""
    if max_tokens < 1:
        raise UsageError(f"max tokens must be >= 1, got {max_tokens}",
                         "pass -n with a positive number of tokens")
    return max_tokens


def check_prompt(prompt: Sized) -> None:
    """A prompt, as text (before the models load) or as tokens (the engine): not empty."""
    if not len(prompt) or isinstance(prompt, str) and not prompt.strip():
        raise UsageError("the prompt is empty", "pass a prompt argument or pipe text on stdin")


@dataclass(frozen=True)
class Field:
    """One setting: its key, where it sits in YAML, its environment variable and flag, its
    check. `label` is how messages name it ("draft max")."""

    key: str
    path: tuple[str, ...]
    env: str
    kind: str  # int | float | choice | layers | endpoints
    default: Any
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    label: str = ""
    flag: str | None = None  # the command-line flag, where there is one

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def where(self) -> str:
        return self.flag or self.env

    def parse(self, text: str) -> tuple[Any, str | None]:
        """A value written as text (environment, flags): (value, None) or (None, problem)."""
        raw, text = text, text.strip()
        if self.kind == "endpoints":
            return self.check(text)
        try:
            if self.kind == "int" or (self.kind == "layers" and text.lower() not in ("auto", "all")):
                return self.check(int(text))
            if self.kind == "float":
                return self.check(float(text))
        except ValueError:
            want = {"int": "a whole number", "float": "a number"}.get(
                self.kind, "auto, all or a layer count")
            return None, f"must be {want}, got {raw!r}"
        return self.check(text)

    def check(self, value: Any) -> tuple[Any, str | None]:
        """(normalized value, None) or (None, what is wrong)."""
        if self.kind == "endpoints":
            return check_endpoints(value)
        if self.kind == "choice":
            if isinstance(value, bool) and "on" in self.choices:
                value = "on" if value else "off"  # YAML 1.1 reads bare on/off as booleans
            v = value.strip().lower() if isinstance(value, str) else None
            if v not in self.choices:
                got = repr(value) if isinstance(value, str) else show(value)
                return None, f"must be one of {', '.join(self.choices)}, got {got}"
            return v, None
        if self.kind == "layers":
            if isinstance(value, str) and value.strip().lower() in ("auto", "all"):
                return value.strip().lower(), None
            if isinstance(value, bool) or not isinstance(value, int):
                return None, f"must be auto, all or a layer count, got {show(value)}"
            if value < 0:
                return None, f"must be auto, all or a layer count >= 0, got {value}"
            return value, None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                self.kind == "int" and not isinstance(value, int)):
            return None, f"must be {'a whole number' if self.kind == 'int' else 'a number'}, " \
                         f"got {show(value)}"
        if self.kind == "float":
            value = float(value)
            if not math.isfinite(value):  # NaN passes every range check below
                return None, f"must be a finite number, got {value}"
        if self.lo is not None and value < self.lo or self.hi is not None and value > self.hi:
            return None, f"must be in {num(self.lo)}..{num(self.hi)}, got {value}"
        return value, None


MAX_RPC_SERVERS = 16  # GGML_RPC_MAX_SERVERS (ggml-rpc.h)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); ValueError saying what is wrong."""
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"{endpoint!r} is not HOST:PORT")
    if ":" in host:  # llama.cpp's client splits HOST:PORT at the first ':' (parse_endpoint)
        raise ValueError(f"{endpoint!r}: llama.cpp's RPC client takes a host name or an IPv4 "
                         "address, not an IPv6 one")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"the port of {endpoint!r} must be a number in 1..65535")
    if any(c.isspace() for c in host) or "," in host or not host:
        raise ValueError(f"{endpoint!r} has no usable host")
    return host, int(port)


def check_endpoints(value: Any) -> tuple[Any, str | None]:
    """llama.cpp's --rpc value: HOST:PORT[,HOST:PORT...] (a YAML list is fine too), normalized
    to the comma-separated string; empty: no RPC server (everything local)."""
    if value is None or value is False:
        return "", None
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            return None, f"must be a list of HOST:PORT strings, got {show(value)}"
        parts = [v.strip() for v in value]
    elif isinstance(value, str):
        parts = [v.strip() for v in value.split(",")] if value.strip() else []
    else:
        return None, f"must be HOST:PORT[,HOST:PORT...], got {show(value)}"
    for part in parts:
        try:
            split_endpoint(part)
        except ValueError as exc:
            return None, f"must be HOST:PORT[,HOST:PORT...]: {exc}"
    if len(set(parts)) != len(parts):
        return None, "names a server twice"
    if len(parts) > MAX_RPC_SERVERS:
        return None, f"names {len(parts)} servers; llama.cpp takes at most {MAX_RPC_SERVERS}"
    return ",".join(parts), None


def endpoints(value: str) -> tuple[str, ...]:
    """The normalized setting as a tuple of HOST:PORT."""
    return tuple(p for p in (value or "").split(",") if p)


def num(x: float | None) -> str:
    return "" if x is None else (str(int(x)) if float(x).is_integer() else str(x))


def show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return f"{type(value).__name__} {value!r}"


F = Field
SETTING_FIELDS: tuple[Field, ...] = (
    F("mode", ("mode",), "TANDEM_MODE", "choice", "fast", choices=MODES, label="numeric mode",
      flag="--exact"),
    F("strategy", ("speculative", "strategy"), "TANDEM_STRATEGY", "choice", "draft",
      choices=STRATEGIES, label="strategy", flag="--strategy"),
    F("n_max", ("speculative", "n_max"), "TANDEM_DRAFT_MAX", "int", 4, 0, MAX_DRAFT,
      label="draft max", flag="--draft-max"),
    F("n_min", ("speculative", "n_min"), "TANDEM_DRAFT_MIN", "int", 0, 0, MAX_DRAFT,
      label="draft min", flag="--draft-min"),
    F("p_min", ("speculative", "p_min"), "TANDEM_DRAFT_P_MIN", "float", 0.5, 0.0, 1.0,
      label="draft p-min", flag="--draft-p-min"),
    F("n_ctx", ("context",), "TANDEM_CTX_SIZE", "int", 4096, 256, MAX_CONTEXT,
      label="context size", flag="--ctx-size"),
    F("n_batch", ("batch", "n_batch"), "TANDEM_BATCH_SIZE", "int", 512, 1, 65536,
      label="batch size"),
    F("n_ubatch", ("batch", "n_ubatch"), "TANDEM_UBATCH_SIZE", "int", 512, 1, 65536,
      label="ubatch size"),
    F("n_threads", ("threads", "n_threads"), "TANDEM_THREADS", "int", 0, 0, 1024,
      label="threads", flag="--threads"),
    F("n_threads_batch", ("threads", "n_threads_batch"), "TANDEM_THREADS_BATCH", "int", 0, 0,
      1024, label="batch threads"),
    F("flash_attn", ("flash_attn",), "TANDEM_FLASH_ATTN", "choice", "on", choices=FLASH_ATTN,
      label="flash attention"),
    F("type_k", ("kv_cache", "type_k"), "TANDEM_CACHE_TYPE_K", "choice", "f16",
      choices=KV_TYPES, label="K cache type"),
    F("type_v", ("kv_cache", "type_v"), "TANDEM_CACHE_TYPE_V", "choice", "f16",
      choices=KV_TYPES, label="V cache type"),
    F("target_gpu_layers", ("offload", "target"), "TANDEM_GPU_LAYERS", "layers", "auto",
      label="GPU layers"),
    F("draft_gpu_layers", ("offload", "draft"), "TANDEM_GPU_LAYERS_DRAFT", "layers", "auto",
      label="draft GPU layers"),
    F("history", ("history",), "TANDEM_HISTORY", "choice", "on", choices=ON_OFF,
      label="draft history", flag="--no-history"),
    F("gpu_reserve_mb", ("offload", "reserve_mb"), "TANDEM_GPU_RESERVE_MB", "int", 512, 0,
      1 << 20, label="GPU reserve (MiB)"),
    # llama.cpp RPC servers holding the target's layers (the draft stays local)
    F("rpc", ("rpc",), "TANDEM_RPC", "endpoints", "", label="RPC servers", flag="--rpc"),
    # seconds without any progress from a generation over RPC before the link is declared
    # stalled (the worker is stopped, exit 6); model loading gets rpc_load_timeout
    F("rpc_timeout", ("rpc_timeout",), "TANDEM_RPC_TIMEOUT", "float", 60.0, 0.1, 86400.0,
      label="RPC stall timeout (s)", flag="--rpc-timeout"),
)
FIELDS_BY_KEY: Mapping[str, Field] = MappingProxyType({f.key: f for f in SETTING_FIELDS})

# Every other TANDEM_* variable tandem, its scripts or its tests read: with the settings' own
# variables, the names an unknown-variable warning knows (a typo such as TANDEM_THREAD was
# once ignored without a word)
OTHER_ENV = ("TANDEM_HOME", "TANDEM_PROFILE", "TANDEM_PAIR", "TANDEM_FORCE_PROFILE",
             "TANDEM_PROFILES_DIR", "TANDEM_DEBUG", "TANDEM_PIP_ARGS", "TANDEM_CACHE_DIR",
             "TANDEM_LLAMA_SERVER", "TANDEM_SKIP_REAL", "TANDEM_REAL_MODELS_HOME",
             "TANDEM_E2E_CAPTURE", "TANDEM_TEST_FULL", "TANDEM_TEST_READONLY",
             "TANDEM_TEST_UNREADABLE", "TANDEM_API_KEY")
KNOWN_ENV = frozenset(f.env for f in SETTING_FIELDS) | frozenset(OTHER_ENV)
_FLAG_ONLY = {"TEMP": "--temp", "TEMPERATURE": "--temp", "TOP_P": "--top-p", "TOP_K": "--top-k",
              "MIN_P": "--min-p", "SEED": "--seed", "REPEAT_PENALTY": "--repeat-penalty",
              "MAX_TOKENS": "-n", "N_PREDICT": "-n"}


def unknown_env(env: Mapping[str, str]) -> str | None:
    """One warning naming the TANDEM_* variables tandem does not know, each with its close
    match (or the flag, for settings that have no variable); None when there are none."""
    import difflib

    suffixes = {name[len("TANDEM_"):]: name for name in KNOWN_ENV}
    parts = []
    for name in sorted(n for n in env if n.startswith("TANDEM_") and n not in KNOWN_ENV):
        rest = name[len("TANDEM_"):]
        close = difflib.get_close_matches(rest, list(suffixes), n=1, cutoff=0.75)
        if close:
            parts.append(f"{name} (did you mean {suffixes[close[0]]}?)")
        elif rest in _FLAG_ONLY:
            parts.append(f"{name} (no variable sets it: pass {_FLAG_ONLY[rest]})")
        else:
            parts.append(name)
    if not parts:
        return None
    return ("ignored unknown environment variable" + ("s " if len(parts) > 1 else " ")
            + ", ".join(parts) + "; docs/hardware.md lists tandem's variables")
FIELDS_BY_PATH: Mapping[tuple[str, ...], Field] = MappingProxyType(
    {f.path: f for f in SETTING_FIELDS})
SECTIONS = {f.path[0] for f in SETTING_FIELDS if len(f.path) == 2}
SCALARS = {f.path[0] for f in SETTING_FIELDS if len(f.path) == 1}


@dataclass(frozen=True)
class Rule:
    """A rule across two keys. When it is broken, a file names `key`; during resolution the
    key from the weaker source takes its value from `fixes`, computed from the values."""

    key: str
    other: str
    broken: Callable[[Mapping[str, Any]], bool]
    problem: Callable[[Mapping[str, Any]], str]  # for a file: what is wrong with `key`
    conflict: Callable[[Mapping[str, Any]], str]  # for two sources: what they disagree on
    fixes: Mapping[str, Callable[[Mapping[str, Any]], Any]]
    hint: str


def _not_above(a: str, b: str, hint: str) -> Rule:
    fa, fb = FIELDS_BY_KEY[a], FIELDS_BY_KEY[b]
    return Rule(a, b, lambda v: v[a] > v[b],
                lambda v: f"must not exceed {fb.dotted} ({v[b]}), got {v[a]}",
                lambda v: f"{fa.label} {v[a]} exceeds {fb.label} {v[b]}",
                {a: lambda v: v[b], b: lambda v: v[a]}, hint)


RULES = (
    _not_above("n_min", "n_max", "make --draft-min <= --draft-max"),
    _not_above("n_ubatch", "n_batch", "make n_ubatch <= n_batch"),
    Rule("type_v", "flash_attn", lambda v: v["type_v"] in QUANTIZED_KV and v["flash_attn"] == "off",
         lambda v: f"a quantized V cache ({v['type_v']}) needs flash attention, but flash_attn "
                   "is off",
         lambda v: f"a quantized V cache ({v['type_v']}) needs flash attention, which is off",
         {"type_v": lambda v: "f16", "flash_attn": lambda v: "auto"},
         "set flash_attn to auto (or on), or type_v to f16"),
)


def broken_rules(values: Mapping[str, Any]) -> list[Rule]:
    """The rules `values` break; keys a rule needs but `values` lack are not checked."""
    return [r for r in RULES if r.key in values and r.other in values and r.broken(values)]
