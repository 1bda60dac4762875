"""The settings schema, defined once: each key with its YAML place, environment variable, flag
and type (checked by msgspec, and its errors worded here); the vocabularies the engine maps to
llama.cpp's integers; the rules across keys.

Profiles, the config file, tuned results, the environment and the flags are all read through
it, so a key is spelled, checked and explained in one place (docs/hardware.md lists them).
Over 400 lines because the bounds on what a request may ask for (GRAMMAR_LIMITS) are written
here too, beside the settings, as the one statement of each number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sized

from tandem.errors import UsageError

# mtp: the target's own multi-token-prediction heads (a model with nextn layers, alone)
STRATEGIES = ("none", "draft", "ngram", "hybrid", "auto", "mtp")
# fast: llama.cpp's default kernels (repacked CPU weights), greedy output equal to plain
# decoding up to floating-point rounding; exact: bit-identical to plain decoding
MODES = ("fast", "exact")
FLASH_ATTN = ("auto", "on", "off")
KV_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
QUANTIZED_KV = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
ON_OFF = ("on", "off")
# where a drafted token came from: the draft model, the current prompt and output (prompt
# lookup), a file the user named, earlier answers (engine/drafting/history.py), or the tokens
# a grammar forces (engine/constrain/grammar.py)
DRAFT_SOURCES = ("model", "prediction", "prompt", "file", "history", "grammar")
MAX_CONTEXT = 1 << 20
# the longest draft: verify batches carry at most MAX_DRAFT drafts and the last token
# (engine/backend/llama.py MAX_OUTPUTS rows of logits); the flags, files, chat's /draft and the engine
# all check the draft length against the n_max field below
MAX_DRAFT = 64


def check_strategy(name: str) -> str:
    """A strategy name, checked where it does not arrive as a setting (chat's /strategy, the
    engine's options): the same words and message as the settings' own check."""
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}", f"choose one of: {', '.join(STRATEGIES)}")
    return name


def drafts(strategy: str) -> bool:
    """Whether a strategy drafts at all (every one but none)."""
    return check_strategy(strategy) != "none"


SERVE_MAX_TOKENS = 2048  # tandem serve: an answer's length when a request does not say


@dataclass(frozen=True)
class GrammarLimit:
    """A bound on what a grammar, a schema or a request's JSON may ask for, checked before
    anything compiles or walks it (engine/constrain/bounds.py, tandem/bounded_json.py)."""

    key: str
    value: int
    counts: str  # what is counted (docs/structured.md's table)
    found: str  # a refusal's words for the count found, "{n}" the count

    def says(self, n: int) -> str:
        return f"{self.found.format(n=f'{n:,}')} (the limit is {self.value:,})"


# Past these, llguidance's compile overflowed its native stack (a 5,000-rule GBNF chain, a
# 3,000-link $ref chain: the process died), took seconds (GBNF conversion is quadratic in
# chained rules: 3,000 rules 1.5 s) or failed at the first token (Earley rows past 2,000
# items). Real grammars and schemas stay far below them (docs/structured.md).
GRAMMAR_LIMITS: Mapping[str, GrammarLimit] = MappingProxyType({lim.key: lim for lim in (
    GrammarLimit("text_bytes", 256 << 10, "bytes of a grammar's or a schema's text",
          "is {n} bytes long"),
    GrammarLimit("rules", 1000, "rules in a GBNF grammar", "has {n} rules"),
    GrammarLimit("alternatives", 1000, "'|' alternatives in a GBNF grammar, all rules together",
          "has {n} '|' alternatives"),
    GrammarLimit("repeat", 1000, "the count of a GBNF repetition {m,n}", "repeats {n} times"),
    GrammarLimit("nesting", 100, "parentheses nested in a GBNF grammar",
          "nests parentheses {n} deep"),
    GrammarLimit("refs", 1000, "$ref keywords in a JSON schema (so no $ref chain is longer)",
          "has {n} $refs"),
    GrammarLimit("branches", 1000, "branches of one anyOf, oneOf or allOf, or objects and arrays "
                            "in one enum (its strings and numbers: no limit but the text's)",
          "has an anyOf/oneOf/allOf or enum of {n} structured entries"),
    GrammarLimit("json_depth", 100, "arrays and objects nested in a request body, a schema or a "
                             "tool call's arguments", "is nested more than {n} levels deep"),
)})


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
    kind: str  # int | float | choice | layers | endpoints | text
    default: Any
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    label: str = ""
    flag: str | None = None  # the command-line flag, where there is one
    secret: bool = False  # shown as "(set)", never its value (`tandem hw`, --json)

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def where(self) -> str:
        return self.flag or self.env

    @property
    def type(self) -> Any:
        """The value's type for msgspec, from kind, range and choices (built on first use:
        msgspec loads only when a value is checked, not for `tandem --help`)."""
        return _field_type(self)

    def normal(self, value: Any) -> Any:
        """What a library cannot know: choices are case-insensitive, and YAML 1.1 reads a
        bare on/off as a boolean."""
        if isinstance(value, bool) and "on" in self.choices:
            return "on" if value else "off"
        if isinstance(value, str) and self.kind in ("choice", "layers"):
            return value.strip().lower()
        if isinstance(value, (dict, list)) and self.kind == "text" and "schema" in self.key:
            import json

            return json.dumps(value)  # a schema written as YAML
        return value

    def parse(self, text: str) -> tuple[Any, str | None]:
        """A value written as text (environment, flags): (value, None) or (None, problem)."""
        # a secret is taken as written: a key with spaces is refused where it is used, not
        # silently changed into another key
        return self.check(text if self.secret else text.strip(), text=True)

    def check(self, value: Any, *, text: bool = False) -> tuple[Any, str | None]:
        """(normalized value, None) or (None, what is wrong), checked by msgspec against
        self.type; `text`: "12" may stand for 12 (environment, flags)."""
        import msgspec

        try:
            good = msgspec.convert(self.normal(value), self.type, strict=not text)
        except msgspec.ValidationError as exc:
            return None, explain(msgspec.inspect.type_info(self.type), value, str(exc), text)
        return check_endpoints(good) if self.kind == "endpoints" else (good, None)


@lru_cache(maxsize=None)
def _field_type(f: Field) -> Any:
    from typing import Annotated, Literal, Union

    from msgspec import Meta

    if f.kind == "int":
        return Annotated[int, Meta(ge=f.lo, le=f.hi)]
    if f.kind == "float":
        return Annotated[float, Meta(ge=f.lo, le=f.hi)]
    if f.kind == "choice":
        return one_of(f.choices)
    if f.kind == "text":
        # a grammar or a JSON schema (YAML may write the schema as a mapping: Field.normal)
        return Annotated[str, Meta(extra={"says": "must be text"})]
    if f.kind == "layers":
        return Annotated[Union[Literal["auto", "all"], Annotated[int, Meta(ge=0)]], Meta(extra={
            "says": "must be auto, all or a layer count",
            "range": "must be auto, all or a layer count >= 0"})]
    # endpoints: a string or a list of them; check_endpoints says the rest
    return Annotated[Union[str, list[str], None, bool],
                     Meta(extra={"says": "must be HOST:PORT[,HOST:PORT...]"})]


def one_of(choices: tuple[str, ...]) -> Any:
    """A choice among words, for msgspec, its message listing them in their order."""
    from typing import Annotated, Literal

    from msgspec import Meta

    return Annotated[Literal[choices], Meta(extra={"says": f"must be one of {', '.join(choices)}"})]


def explain(info: Any, raw: Any, message: str, text: bool = False, key: Any = None) -> str:
    """What is wrong with `raw`, in tandem's words: rendered from the declared type `info`
    (msgspec.inspect), whose check msgspec reported as `message`. Meta(extra=...) may word
    it: "says" for a value of the wrong kind, "range" for one out of range ({key}: the
    `key` it sits under)."""
    from msgspec import inspect as mi

    extra: dict[str, Any] = {}
    enum = message.startswith("Invalid enum")
    kind_error = enum or ", got `" in message

    def unwrap(t: Any) -> Any:
        while isinstance(t, mi.Metadata):
            extra.update({k: v for k, v in (t.extra or {}).items() if k not in extra})
            t = t.type
        return t

    info = unwrap(info)
    if isinstance(info, mi.UnionType):  # the member the value is meant for, if one
        kinds = {int: mi.IntType, float: (mi.FloatType, mi.IntType), str: mi.StrType,
                 dict: (mi.StructType, mi.DictType), list: mi.ListType}
        members = [unwrap(t) for t in info.types if not isinstance(t, mi.NoneType)]
        fit = [t for t in members if isinstance(t, kinds.get(type(raw), ()))]
        info = fit[0] if len(fit) == 1 else members[0] if len(members) == 1 else info
    shown = repr(raw) if text or enum else show(raw)
    if isinstance(info, mi.FloatType) and not kind_error:
        try:
            if not math.isfinite(float(raw)):
                return f"must be a finite number, got {float(raw)}"
        except (TypeError, ValueError):
            pass
    if not kind_error and "range" in extra:
        return f"{extra['range'].format(key=key)}, got {raw}"
    if "says" in extra:
        return f"{extra['says'].format(key=key)}, got {shown}"
    if isinstance(info, (mi.IntType, mi.FloatType)):
        if kind_error:
            return f"must be {'a whole number' if isinstance(info, mi.IntType) else 'a number'}, " \
                   f"got {shown}"
        lo, hi = (info.ge if info.ge is not None else info.gt), info.le
        if lo is not None and hi is not None:
            return f"must be in {num(lo)}..{num(hi)}, got {raw}"
        return f"must be {'>' if info.gt is not None else '>=' if lo is not None else '<='} " \
               f"{num(lo if lo is not None else hi)}, got {raw}"
    if isinstance(info, (mi.StructType, mi.DictType)):
        return f"must be a mapping, got {shown}"
    if isinstance(info, mi.ListType):
        return f"must be a list, got {shown}"
    if isinstance(info, mi.StrType):
        return f"must be text, got {shown}"
    if isinstance(info, mi.BoolType):
        return f"must be true or false, got {raw!r}"
    return message if ", got `" in message else f"{message}, got {shown}"


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
    if isinstance(value, (list, tuple)):  # of strings: Field.type says so
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
      label="batch size", flag="--batch-size"),
    F("n_ubatch", ("batch", "n_ubatch"), "TANDEM_UBATCH_SIZE", "int", 512, 1, 65536,
      label="ubatch size", flag="--ubatch-size"),
    F("n_threads", ("threads", "n_threads"), "TANDEM_THREADS", "int", 0, 0, 1024,
      label="threads", flag="--threads"),
    F("n_threads_batch", ("threads", "n_threads_batch"), "TANDEM_THREADS_BATCH", "int", 0, 0,
      1024, label="batch threads"),
    F("flash_attn", ("flash_attn",), "TANDEM_FLASH_ATTN", "choice", "on", choices=FLASH_ATTN,
      label="flash attention", flag="--flash-attn"),
    F("type_k", ("kv_cache", "type_k"), "TANDEM_CACHE_TYPE_K", "choice", "f16",
      choices=KV_TYPES, label="K cache type", flag="--cache-type-k"),
    F("type_v", ("kv_cache", "type_v"), "TANDEM_CACHE_TYPE_V", "choice", "f16",
      choices=KV_TYPES, label="V cache type", flag="--cache-type-v"),
    # llama.cpp's -ngl / -ngld (their long spellings: --n-gpu-layers, --gpu-layers)
    F("target_gpu_layers", ("offload", "target"), "TANDEM_GPU_LAYERS", "layers", "auto",
      label="GPU layers", flag="--n-gpu-layers"),
    F("draft_gpu_layers", ("offload", "draft"), "TANDEM_GPU_LAYERS_DRAFT", "layers", "auto",
      label="draft GPU layers", flag="--n-gpu-layers-draft"),
    F("history", ("history",), "TANDEM_HISTORY", "choice", "on", choices=ON_OFF,
      label="draft history", flag="--no-history"),
    # how llama.cpp reads both models' weights: mapped from the file (its default; off: read
    # into memory, llama.cpp's --no-mmap) and locked in RAM against swapping (--mlock)
    F("mmap", ("mmap",), "TANDEM_MMAP", "choice", "on", choices=ON_OFF,
      label="memory-mapped weights", flag="--no-mmap"),
    F("mlock", ("mlock",), "TANDEM_MLOCK", "choice", "off", choices=ON_OFF,
      label="weights locked in RAM", flag="--mlock"),
    F("gpu_reserve_mb", ("offload", "reserve_mb"), "TANDEM_GPU_RESERVE_MB", "int", 512, 0,
      1 << 20, label="GPU reserve (MiB)"),
    # llama.cpp RPC servers holding the target's layers (the draft stays local)
    F("rpc", ("rpc",), "TANDEM_RPC", "endpoints", "", label="RPC servers", flag="--rpc"),
    # seconds without any progress from a generation over RPC before the link is declared
    # stalled (the worker is stopped, exit 6); model loading gets rpc_load_timeout
    F("rpc_timeout", ("rpc_timeout",), "TANDEM_RPC_TIMEOUT", "float", 60.0, 0.1, 86400.0,
      label="RPC stall timeout (s)", flag="--rpc-timeout"),
    # what the output must match (at most one of them; engine/constrain/grammar.py)
    F("grammar", ("structured", "grammar"), "TANDEM_GRAMMAR", "text", "", label="grammar",
      flag="--grammar"),
    F("grammar_file", ("structured", "grammar_file"), "TANDEM_GRAMMAR_FILE", "text", "",
      label="grammar file", flag="--grammar-file"),
    F("json_schema", ("structured", "json_schema"), "TANDEM_JSON_SCHEMA", "text", "",
      label="JSON schema", flag="--json-schema"),
    F("json_schema_file", ("structured", "json_schema_file"), "TANDEM_JSON_SCHEMA_FILE", "text",
      "", label="JSON schema file", flag="--json-schema-file"),
    F("json_object", ("structured", "json_object"), "TANDEM_JSON_OBJECT", "choice", "off",
      choices=ON_OFF, label="any JSON object", flag="--json-object"),
    # copies of a hybrid or recurrent model's state kept to go back to (llama-server's
    # --ctx-checkpoints): a draft's single-token steps and a shorter prefix restore one
    F("ctx_checkpoints", ("ctx_checkpoints",), "TANDEM_CTX_CHECKPOINTS", "int", 8, 1, 1024,
      label="context checkpoints", flag="--ctx-checkpoints"),
    # `tandem serve`'s own (docs/serve.md); the others read them and ignore them
    F("host", ("serve", "host"), "TANDEM_HOST", "text", "127.0.0.1", label="listen address",
      flag="--host"),
    F("port", ("serve", "port"), "TANDEM_PORT", "int", 8080, 0, 65535, label="port",
      flag="--port"),
    F("queue", ("serve", "queue"), "TANDEM_QUEUE", "int", 8, 1, 4096, label="queue",
      flag="--queue"),
    F("timeout", ("serve", "timeout"), "TANDEM_TIMEOUT", "float", 30.0, 0.1, 3600.0,
      label="request timeout (s)", flag="--timeout"),
    F("cache_reuse", ("serve", "cache_reuse"), "TANDEM_CACHE_REUSE", "int", 256, 0, 1 << 20,
      label="cache reuse (tokens)", flag="--cache-reuse"),
    # slots decoded together (llama-server's -np; -1 or 0: auto), and the RAM prompt cache
    F("parallel", ("serve", "parallel"), "TANDEM_PARALLEL", "int", -1, -1, 64,
      label="parallel slots", flag="--parallel"),
    F("cache_ram", ("serve", "cache_ram"), "TANDEM_CACHE_RAM", "float", 8192.0, 0.0,
      float(1 << 20), label="prompt cache in RAM (MiB)", flag="--cache-ram"),
    F("cors", ("serve", "cors"), "TANDEM_CORS", "text", "", label="CORS origins",
      flag="--cors"),
    F("api_key", ("serve", "api_key"), "TANDEM_API_KEY", "text", "", label="API key",
      flag="--api-key", secret=True),
)
# the settings that constrain the output, of which one source may give at most one
CONSTRAINT_KEYS = ("grammar", "grammar_file", "json_schema", "json_schema_file", "json_object")
FIELDS_BY_KEY: Mapping[str, Field] = MappingProxyType({f.key: f for f in SETTING_FIELDS})

# Every other TANDEM_* variable tandem, its scripts or its tests read: with the settings' own
# variables, the names an unknown-variable warning knows (a typo such as TANDEM_THREAD was
# once ignored without a word)
OTHER_ENV = ("TANDEM_HOME", "TANDEM_PROFILE", "TANDEM_PAIR", "TANDEM_FORCE_PROFILE",
             "TANDEM_PROFILES_DIR", "TANDEM_DEBUG", "TANDEM_PIP_ARGS", "TANDEM_CACHE_DIR",
             "TANDEM_LLAMA_SERVER", "TANDEM_SKIP_REAL", "TANDEM_REAL_MODELS_HOME",
             "TANDEM_E2E_CAPTURE", "TANDEM_TEST_FULL", "TANDEM_TEST_READONLY",
             "TANDEM_TEST_UNREADABLE")
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
