"""Hardware profiles: load and validate profiles/*.yaml (and the user's), match them to a machine.

A profile says how tandem should run on one kind of machine: backend, offload of target and
draft, flash attention, KV cache types, context, batch sizes, threads, speculative defaults,
the catalog pairs worth recommending for its memory, and the cost figures (docs/hardware.md) that
speedup predictions use. docs/hardware.md documents every key.

Every file is validated on load; an error names the file, the line and the dotted key. The same
section schema (`SETTING_FIELDS`) is used by the user config file and tuned settings, so
settings.py parses those with the functions here.

Where profiles come from: $TANDEM_PROFILES_DIR, else the profiles/ directory of the source tree
this package sits in (an editable install keeps it there). User profiles live in
<tandem_home>/profiles/*.yaml: a new name adds a profile, a built-in name overrides just the
keys it sets, and `extends: NAME` starts a new profile from another one.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import yaml

from tandem.errors import UsageError

GiB = 1 << 30

KV_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
QUANTIZED_KV = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
STRATEGIES = ("none", "draft", "ngram", "hybrid", "auto")
FLASH_ATTN = ("auto", "on", "off")
# fast: llama.cpp's default kernels (repacked CPU weights), greedy output equal to plain
# decoding up to floating-point rounding; exact: bit-identical to plain decoding
MODES = ("fast", "exact")
BACKENDS = ("cuda", "metal", "cpu")
VENDORS = ("nvidia", "apple", "cpu", "any")
MAX_CONTEXT = 1 << 20


class ProfileError(UsageError):
    """A profile, config or tuned file is invalid: `path`, `line` and `key` say where."""

    def __init__(self, path: str | Path, line: int | None, key: str | None, problem: str,
                 hint: str | None = None):
        where = str(path) + (f", line {line}" if line else "")
        what = f"key '{key}': " if key else ""
        super().__init__(f"{where}: {what}{problem}",
                         hint or f"fix {Path(str(path)).name} (see docs/hardware.md for every key)")
        self.path, self.line, self.key, self.problem = str(path), line, key, problem


class ProfileMismatchError(UsageError):
    """The requested profile does not fit this machine."""


# ------------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class Field:
    """One setting: its flat key, where it sits in YAML, its environment variable, its check."""

    key: str
    path: tuple[str, ...]
    env: str
    kind: str  # int | float | choice | layers | name
    default: Any
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    help: str = ""
    label: str = ""  # how messages name it ("draft max"), as the engine's own errors do

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    def check(self, value: Any) -> tuple[Any, str | None]:
        """(normalized value, None) or (None, what is wrong)."""
        kind = self.kind
        if kind == "choice":
            if isinstance(value, bool) and "on" in self.choices:
                value = "on" if value else "off"  # YAML 1.1 reads bare on/off as booleans
            if not isinstance(value, str):
                return None, f"must be one of {', '.join(self.choices)}, got {_show(value)}"
            v = value.strip().lower()
            if v not in self.choices:
                return None, f"must be one of {', '.join(self.choices)}, got {value!r}"
            return v, None
        if kind == "layers":
            if isinstance(value, str) and value.strip().lower() in ("auto", "all"):
                return value.strip().lower(), None
            if isinstance(value, bool) or not isinstance(value, int):
                return None, f"must be auto, all or a layer count, got {_show(value)}"
            if value < 0:
                return None, f"must be auto, all or a layer count >= 0, got {value}"
            return value, None
        if kind == "name":
            if not isinstance(value, str) or not value.strip():
                return None, f"must be a non-empty name, got {_show(value)}"
            return value.strip(), None
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                return None, f"must be a whole number, got {_show(value)}"
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return None, f"must be a number, got {_show(value)}"
            value = float(value)
            if not math.isfinite(value):  # NaN passes every range check below
                return None, f"must be a finite number, got {value}"
        if self.lo is not None and value < self.lo or self.hi is not None and value > self.hi:
            return None, f"must be in {_num(self.lo)}..{_num(self.hi)}, got {value}"
        return value, None


def _num(x: float | None) -> str:
    return "" if x is None else (str(int(x)) if float(x).is_integer() else str(x))


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return f"{type(value).__name__} {value!r}"


SETTING_FIELDS: tuple[Field, ...] = (
    Field("mode", ("mode",), "TANDEM_MODE", "choice", "fast", choices=MODES,
          help="fast (llama.cpp's kernels; = plain decoding up to float rounding) | exact "
               "(bit-identical to plain decoding)", label="numeric mode"),
    Field("strategy", ("speculative", "strategy"), "TANDEM_STRATEGY", "choice", "draft",
          choices=STRATEGIES, help="none | draft | ngram | hybrid | auto", label="strategy"),
    Field("n_max", ("speculative", "n_max"), "TANDEM_DRAFT_MAX", "int", 4, 0, 64,
          help="most tokens drafted per step", label="draft max"),
    Field("n_min", ("speculative", "n_min"), "TANDEM_DRAFT_MIN", "int", 0, 0, 64,
          help="drafts shorter than this are dropped", label="draft min"),
    Field("p_min", ("speculative", "p_min"), "TANDEM_DRAFT_P_MIN", "float", 0.5, 0.0, 1.0,
          help="stop drafting below this draft probability", label="draft p-min"),
    Field("n_ctx", ("context",), "TANDEM_CTX_SIZE", "int", 4096, 256, MAX_CONTEXT,
          help="context size in tokens (both models)", label="context size"),
    Field("n_batch", ("batch", "n_batch"), "TANDEM_BATCH_SIZE", "int", 512, 1, 65536,
          help="logical batch: most tokens per llama_decode call", label="batch size"),
    Field("n_ubatch", ("batch", "n_ubatch"), "TANDEM_UBATCH_SIZE", "int", 512, 1, 65536,
          help="physical batch; sizes the compute buffers", label="ubatch size"),
    Field("n_threads", ("threads", "n_threads"), "TANDEM_THREADS", "int", 0, 0, 1024,
          help="generation threads (0: all cores)", label="threads"),
    Field("n_threads_batch", ("threads", "n_threads_batch"), "TANDEM_THREADS_BATCH", "int", 0,
          0, 1024, help="prompt/verify-batch threads (0: same as n_threads)",
          label="batch threads"),
    Field("flash_attn", ("flash_attn",), "TANDEM_FLASH_ATTN", "choice", "on",
          choices=FLASH_ATTN, help="auto | on | off", label="flash attention"),
    Field("type_k", ("kv_cache", "type_k"), "TANDEM_CACHE_TYPE_K", "choice", "f16",
          choices=KV_TYPES, help="K cache type", label="K cache type"),
    Field("type_v", ("kv_cache", "type_v"), "TANDEM_CACHE_TYPE_V", "choice", "f16",
          choices=KV_TYPES, help="V cache type (quantized needs flash attention)",
          label="V cache type"),
    Field("target_gpu_layers", ("offload", "target"), "TANDEM_GPU_LAYERS", "layers", "auto",
          help="target layers on the GPU: auto (planner) | all | N", label="GPU layers"),
    Field("draft_gpu_layers", ("offload", "draft"), "TANDEM_GPU_LAYERS_DRAFT", "layers", "auto",
          help="draft layers on the GPU: auto (all if it fits) | all | N",
          label="draft GPU layers"),
    Field("gpu_reserve_mb", ("offload", "reserve_mb"), "TANDEM_GPU_RESERVE_MB", "int", 512, 0,
          1 << 20, help="MiB of GPU memory left free (driver context, fragmentation)",
          label="GPU reserve (MiB)"),
)
FIELDS_BY_KEY: Mapping[str, Field] = MappingProxyType({f.key: f for f in SETTING_FIELDS})
FIELDS_BY_PATH: Mapping[tuple[str, ...], Field] = MappingProxyType(
    {f.path: f for f in SETTING_FIELDS})
SECTIONS = {f.path[0] for f in SETTING_FIELDS if len(f.path) == 2}
SCALARS = {f.path[0] for f in SETTING_FIELDS if len(f.path) == 1}

PROFILE_KEYS = ("name", "description", "priority", "extends", "match", "backend",
                "recommended_pairs", "tiers", "cost", "notes")
MATCH_KEYS = ("vendor", "gpu_name", "chip", "os", "min_memory_gib", "max_memory_gib")
TIER_KEYS = ("min_memory_gib", "recommended_pairs", "note")
COST_KEYS = ("source", "bandwidth_gbps", "bw_eff_gbps", "eta", "t0_ms", "t0_small_ms",
             "decode_ms", "verify_ratio", "draft_ratio", "variants")


# ------------------------------------------------------------------------- YAML + lines


class LineDict(dict):
    """A dict that remembers the line of each key (and of itself) in its YAML file."""

    line: int = 0
    key_lines: dict

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LineDict:
    loader.flatten_mapping(node)
    out = LineDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float)) or isinstance(key, bool):
            raise yaml.constructor.ConstructorError(
                None, None, f"unsupported key {key!r}", key_node.start_mark)
        if key in out:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: Path, text: str | None = None) -> Any:
    """Parse YAML keeping line numbers; syntax errors become ProfileError with the line."""
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(path, None, None, f"cannot read: {exc.strerror or exc}",
                               "check that the file exists and is readable") from None
        except UnicodeDecodeError:
            raise ProfileError(path, None, None, "is not UTF-8 text") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise ProfileError(path, line, None, f"YAML syntax error: {problem}",
                           "fix the YAML syntax at that line (indentation, a missing ':' or "
                           "quote)") from None
    except yaml.YAMLError as exc:
        raise ProfileError(path, None, None, f"YAML error: {exc}") from None
    except RecursionError:  # PyYAML composes recursively; a nesting bomb ends here
        raise ProfileError(path, None, None, "is nested too deeply to be a settings file") \
            from None


# --------------------------------------------------------------------- section parsing


@dataclass(frozen=True)
class Located:
    """A validated value and where it was written."""

    value: Any
    path: str
    line: int | None


def parse_setting_sections(doc: Mapping, path: str | Path, *, skip: Iterable[str] = (),
                           prefix: str = "") -> dict[str, Located]:
    """Validate the setting sections of a mapping (profile, tier, user config, tuned file).

    Returns {flat key: Located}. Keys listed in `skip` belong to the caller and are ignored
    here; any other unknown key is an error naming its line.
    """
    skip = set(skip)
    out: dict[str, Located] = {}
    for key, value in doc.items():
        if key in skip:
            continue
        line = _line(doc, key)
        dotted = f"{prefix}{key}"
        if key in SCALARS:
            out.update(_one(FIELDS_BY_PATH[(key,)], value, path, line, dotted))
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise ProfileError(path, line, dotted, f"must be a mapping, got {_show(value)}")
            for sub, subval in value.items():
                f = FIELDS_BY_PATH.get((key, sub))
                if f is None:
                    known = [p[1] for p in FIELDS_BY_PATH if p[0] == key]
                    raise ProfileError(path, _line(value, sub), f"{dotted}.{sub}",
                                       f"unknown key; {key} takes: {', '.join(known)}")
                out.update(_one(f, subval, path, _line(value, sub), f"{dotted}.{sub}"))
        else:
            raise ProfileError(path, line, dotted, "unknown key" + _suggest(key, skip))
    return out


def _one(f: Field, value: Any, path, line, dotted) -> dict[str, Located]:
    v, problem = f.check(value)
    if problem:
        raise ProfileError(path, line, dotted, problem)
    return {f.key: Located(v, str(path), line)}


def _line(doc: Any, key: Any) -> int | None:
    return doc.line_of(key) if isinstance(doc, LineDict) else None


def _suggest(key: Any, own: Iterable[str] = ()) -> str:
    """Close matches among the keys of this kind of file: the setting sections plus `own`
    (a profile's keys, or the config file's profile/pair/force_profile)."""
    import difflib

    known = sorted(SECTIONS | SCALARS | set(own))
    close = difflib.get_close_matches(str(key), known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f"; known keys: {', '.join(known)}"


def check_combination(values: Mapping[str, Located | Any], path: str | Path) -> None:
    """Rules across keys: n_min <= n_max, n_ubatch <= n_batch, quantized V needs flash attn."""

    def get(k):
        v = values.get(k)
        return v.value if isinstance(v, Located) else v

    def line(k):
        v = values.get(k)
        return v.line if isinstance(v, Located) else None

    if get("n_min") is not None and get("n_max") is not None and get("n_min") > get("n_max"):
        raise ProfileError(path, line("n_min"), "speculative.n_min",
                           f"must not exceed speculative.n_max ({get('n_max')}), "
                           f"got {get('n_min')}")
    if get("n_ubatch") is not None and get("n_batch") is not None \
            and get("n_ubatch") > get("n_batch"):
        raise ProfileError(path, line("n_ubatch"), "batch.n_ubatch",
                           f"must not exceed batch.n_batch ({get('n_batch')}), "
                           f"got {get('n_ubatch')}")
    if get("type_v") in QUANTIZED_KV and get("flash_attn") == "off":
        raise ProfileError(path, line("type_v"), "kv_cache.type_v",
                           f"a quantized V cache ({get('type_v')}) needs flash attention, "
                           "but flash_attn is off", "set flash_attn: auto (or on), or type_v: f16")


# ------------------------------------------------------------------------------ profile


@dataclass(frozen=True)
class MatchRules:
    vendor: str = "any"
    gpu_name: tuple[str, ...] = ()
    chip: tuple[str, ...] = ()
    os: tuple[str, ...] = ()
    min_memory_gib: float | None = None
    max_memory_gib: float | None = None


@dataclass(frozen=True)
class Tier:
    """Overrides that apply when the machine has at least `min_memory_gib` (VRAM or unified)."""

    min_memory_gib: float
    values: Mapping[str, Located]
    recommended_pairs: tuple[str, ...] | None = None
    note: str = ""


@dataclass(frozen=True)
class Profile:
    name: str
    path: str
    description: str = ""
    priority: int = 0
    match: MatchRules = MatchRules()
    backend: str = "cpu"
    values: Mapping[str, Located] = field(default_factory=dict)
    recommended_pairs: tuple[str, ...] = ()
    tiers: tuple[Tier, ...] = ()
    cost: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    origin: str = "builtin"  # builtin | user | user override

    # --- matching -------------------------------------------------------------------
    def mismatch(self, hw) -> list[str]:
        """Why this profile does not fit `hw` (a tandem.machine.hardware.Hardware); empty if it does."""
        m = self.match
        reasons: list[str] = []
        if m.vendor != "any" and hw.vendor != m.vendor:
            need = {"nvidia": "an NVIDIA GPU", "apple": "Apple Silicon",
                    "cpu": "a machine without a supported GPU"}[m.vendor]
            reasons.append(f"needs {need}; this machine has {_describe(hw)}")
            return reasons  # the finer rules below would only repeat it
        if m.gpu_name:
            names = [g.name for g in hw.nvidia_gpus]
            if not any(s.lower() in n.lower() for s in m.gpu_name for n in names):
                reasons.append(f"needs a GPU named like {' or '.join(repr(s) for s in m.gpu_name)}"
                               f"; found {', '.join(names) or 'no NVIDIA GPU'}")
        if m.chip:
            chip = hw.apple_chip or ""
            if not any(s.lower() in chip.lower() for s in m.chip):
                reasons.append(f"needs an Apple chip like {' or '.join(m.chip)}; "
                               f"found {chip or 'none'}")
        if m.os and hw.os not in m.os:
            reasons.append(f"needs OS {' or '.join(m.os)}; this is {hw.os}")
        mem = hw.accelerator_memory / GiB
        kind = {"nvidia": "VRAM", "apple": "unified memory"}.get(hw.vendor, "RAM")
        if m.min_memory_gib is not None and mem < m.min_memory_gib - 0.05:
            reasons.append(f"needs at least {m.min_memory_gib:g} GiB; this machine has "
                           f"{mem:.1f} GiB of {kind}")
        if m.max_memory_gib is not None and mem > m.max_memory_gib + 0.05:
            reasons.append(f"is for at most {m.max_memory_gib:g} GiB; this machine has "
                           f"{mem:.1f} GiB of {kind}")
        return reasons

    def matches(self, hw) -> bool:
        return not self.mismatch(hw)

    @property
    def specificity(self) -> int:
        m = self.match
        return (m.vendor != "any") + 2 * bool(m.gpu_name or m.chip) + \
            (m.min_memory_gib is not None) + (m.max_memory_gib is not None)

    # --- effective values -----------------------------------------------------------
    def tier_for(self, memory_bytes: int | None) -> Tier | None:
        if memory_bytes is None:
            return None
        gib = memory_bytes / GiB + 0.05  # a "24 GB" card reports 23.99 GiB
        fitting = [t for t in self.tiers if t.min_memory_gib <= gib]
        return max(fitting, key=lambda t: t.min_memory_gib) if fitting else None

    def values_for(self, hw=None) -> dict[str, Located]:
        """The profile's settings for `hw`: its own values with the matching tier on top."""
        out = dict(self.values)
        tier = self.tier_for(hw.accelerator_memory) if hw is not None else None
        if tier is not None:
            out.update(tier.values)
        return out

    def pairs_for(self, hw=None) -> tuple[str, ...]:
        tier = self.tier_for(hw.accelerator_memory) if hw is not None else None
        if tier is not None and tier.recommended_pairs is not None:
            return tier.recommended_pairs
        return self.recommended_pairs

    def cost_for(self, hw=None) -> dict[str, Any]:
        """Cost figures for `hw`: the base figures with the variant for its chip/GPU on top."""
        base = {k: v for k, v in self.cost.items() if k != "variants"}
        names = []
        if hw is not None:
            names = [hw.apple_chip or ""] + [g.name for g in hw.gpus]
        for key, variant in (self.cost.get("variants") or {}).items():
            if any(key.lower() in n.lower() for n in names if n):
                base.update(variant)
                base["variant"] = key
                break
        return base


def _describe(hw) -> str:
    if hw.vendor == "nvidia":
        return ", ".join(g.name for g in hw.nvidia_gpus)
    if hw.vendor == "apple":
        return hw.apple_chip or "Apple Silicon"
    return "no supported GPU"


# ------------------------------------------------------------------------------- parsing


def _str_list(value: Any, path, line, key) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ProfileError(path, line, key, f"must be a list of names, got {_show(value)}")
    return tuple(v.strip() for v in value)


def _number(value: Any, path, line, key, *, lo: float | None = 0.0, positive=False,
            allow_null=False) -> float | None:
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(path, line, key, f"must be a number, got {_show(value)}")
    if not math.isfinite(value):  # YAML's .nan and .inf: every comparison below would pass
        raise ProfileError(path, line, key, f"must be a finite number, got {value}")
    if positive and value <= 0 or lo is not None and value < lo:
        raise ProfileError(path, line, key,
                           f"must be {'> 0' if positive else f'>= {_num(lo)}'}, got {value}")
    return float(value) if isinstance(value, float) else value


def _parse_match(doc: Any, path, line) -> MatchRules:
    if not isinstance(doc, dict):
        raise ProfileError(path, line, "match", f"must be a mapping, got {_show(doc)}")
    kw: dict[str, Any] = {}
    for key, value in doc.items():
        kl = _line(doc, key)
        dotted = f"match.{key}"
        if key == "vendor":
            if not isinstance(value, str) or value.lower() not in VENDORS:
                raise ProfileError(path, kl, dotted,
                                   f"must be one of {', '.join(VENDORS)}, got {_show(value)}")
            kw["vendor"] = value.lower()
        elif key in ("gpu_name", "chip", "os"):
            kw[key] = _str_list(value, path, kl, dotted)
            if key == "os":
                kw[key] = tuple(v.lower() for v in kw[key])
        elif key in ("min_memory_gib", "max_memory_gib"):
            kw[key] = _number(value, path, kl, dotted)
        else:
            raise ProfileError(path, kl, dotted,
                               f"unknown key; match takes: {', '.join(MATCH_KEYS)}")
    rules = MatchRules(**kw)
    if rules.min_memory_gib is not None and rules.max_memory_gib is not None \
            and rules.min_memory_gib > rules.max_memory_gib:
        raise ProfileError(path, _line(doc, "max_memory_gib"), "match.max_memory_gib",
                           f"is below match.min_memory_gib ({rules.min_memory_gib:g}): "
                           "no machine can match")
    return rules


def _parse_cost(doc: Any, path, line, prefix="cost", allow_variants=True) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ProfileError(path, line, prefix, f"must be a mapping, got {_show(doc)}")
    out: dict[str, Any] = {}
    for key, value in doc.items():
        kl = _line(doc, key)
        dotted = f"{prefix}.{key}"
        if key == "source":
            if not isinstance(value, str):
                raise ProfileError(path, kl, dotted, f"must be text, got {_show(value)}")
            out[key] = value
        elif key in ("bandwidth_gbps", "bw_eff_gbps", "t0_ms", "t0_small_ms"):
            out[key] = _number(value, path, kl, dotted, positive=True, allow_null=True)
        elif key in ("eta", "draft_ratio"):
            v = _number(value, path, kl, dotted, positive=True, allow_null=True)
            if v is not None and v > 1.5:
                raise ProfileError(path, kl, dotted, f"must be a fraction (0..1.5), got {v}")
            out[key] = v
        elif key == "decode_ms":
            if not isinstance(value, dict):
                raise ProfileError(path, kl, dotted, f"must map model sizes to ms, got "
                                   f"{_show(value)}")
            out[key] = {str(k): _number(v, path, _line(value, k), f"{dotted}.{k}",
                                        positive=True, allow_null=True)
                        for k, v in value.items()}
        elif key == "verify_ratio":
            if not isinstance(value, dict) or not value:
                raise ProfileError(path, kl, dotted, "must map batch sizes (2, 4, 8, 16) to "
                                   f"cost ratios, got {_show(value)}")
            ratios = {}
            for n, r in value.items():
                nl = _line(value, n)
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ProfileError(path, nl, f"{dotted}.{n}",
                                       "batch size must be a whole number >= 1")
                r = _number(r, path, nl, f"{dotted}.{n}", positive=True)
                if r < 1.0:
                    raise ProfileError(path, nl, f"{dotted}.{n}",
                                       f"a batch of {n} cannot cost less than one token, got {r}")
                ratios[n] = r
            out[key] = dict(sorted(ratios.items()))
        elif key == "variants" and allow_variants:
            if not isinstance(value, dict):
                raise ProfileError(path, kl, dotted, f"must be a mapping, got {_show(value)}")
            out[key] = {str(name): _parse_cost(v, path, _line(value, name), f"{dotted}.{name}",
                                               allow_variants=False)
                        for name, v in value.items()}
        else:
            keys = COST_KEYS if allow_variants else COST_KEYS[:-1]
            raise ProfileError(path, kl, dotted, f"unknown key; cost takes: {', '.join(keys)}")
    return out


def _parse_tiers(doc: Any, path, line) -> tuple[Tier, ...]:
    if not isinstance(doc, list):
        raise ProfileError(path, line, "tiers", f"must be a list, got {_show(doc)}")
    tiers = []
    for i, item in enumerate(doc):
        where = f"tiers[{i}]"
        if not isinstance(item, dict):
            raise ProfileError(path, line, where, f"must be a mapping, got {_show(item)}")
        if "min_memory_gib" not in item:
            raise ProfileError(path, item.line if isinstance(item, LineDict) else line,
                               f"{where}.min_memory_gib", "is required")
        mem = _number(item["min_memory_gib"], path, _line(item, "min_memory_gib"),
                      f"{where}.min_memory_gib")
        pairs = None
        if "recommended_pairs" in item:
            pairs = _str_list(item["recommended_pairs"], path, _line(item, "recommended_pairs"),
                              f"{where}.recommended_pairs")
        note = item.get("note", "")
        if not isinstance(note, str):
            raise ProfileError(path, _line(item, "note"), f"{where}.note", "must be text")
        values = parse_setting_sections(item, path, skip=TIER_KEYS, prefix=f"{where}.")
        tiers.append(Tier(mem, MappingProxyType(values), pairs, note))
    mems = [t.min_memory_gib for t in tiers]
    if len(set(mems)) != len(mems):
        raise ProfileError(path, line, "tiers", "two tiers have the same min_memory_gib")
    return tuple(tiers)


def parse_profile(doc: Any, path: str | Path, name: str, origin: str = "builtin") -> Profile:
    """Validate one profile document (already merged with what it extends)."""
    if not isinstance(doc, dict):
        raise ProfileError(path, None, None, "a profile must be a YAML mapping")
    declared = doc.get("name")
    if declared is not None and declared != name:
        raise ProfileError(path, _line(doc, "name"), "name",
                           f"must match the file name ({name!r}), got {declared!r}")
    for key in ("match", "backend"):
        if key not in doc:
            raise ProfileError(path, None, key, "is required")
    desc = doc.get("description", "")
    if not isinstance(desc, str):
        raise ProfileError(path, _line(doc, "description"), "description", "must be text")
    prio = doc.get("priority", 0)
    if isinstance(prio, bool) or not isinstance(prio, int):
        raise ProfileError(path, _line(doc, "priority"), "priority",
                           f"must be a whole number, got {_show(prio)}")
    backend = doc["backend"]
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ProfileError(path, _line(doc, "backend"), "backend",
                           f"must be one of {', '.join(BACKENDS)}, got {_show(backend)}")
    match = _parse_match(doc["match"], path, _line(doc, "match"))
    pairs = _str_list(doc.get("recommended_pairs", []), path, _line(doc, "recommended_pairs"),
                      "recommended_pairs") if doc.get("recommended_pairs") is not None else ()
    tiers = _parse_tiers(doc["tiers"], path, _line(doc, "tiers")) if "tiers" in doc else ()
    cost = _parse_cost(doc["cost"], path, _line(doc, "cost")) if doc.get("cost") else {}
    notes = _str_list(doc["notes"], path, _line(doc, "notes"), "notes") \
        if doc.get("notes") else ()
    values = parse_setting_sections(doc, path, skip=PROFILE_KEYS)
    check_combination(values, path)
    for tier in tiers:
        check_combination({**values, **tier.values}, path)
    return Profile(name=name, path=str(path), description=desc, priority=prio, match=match,
                   backend=backend.lower(), values=MappingProxyType(values),
                   recommended_pairs=pairs, tiers=tiers, cost=MappingProxyType(cost),
                   notes=notes, origin=origin)


# ------------------------------------------------------------------------------ loading


def profiles_dir() -> Path:
    """Built-in profiles: $TANDEM_PROFILES_DIR, else <source tree>/profiles next to cli/
    (a checkout or an editable install), else <prefix>/share/tandem/profiles (a wheel
    installs them there, see pyproject.toml)."""
    env = os.environ.get("TANDEM_PROFILES_DIR")
    if env:
        return Path(env).expanduser()
    # cli/tandem/machine/profiles.py -> the repository root is three levels above
    source = Path(__file__).resolve().parents[3] / "profiles"
    if source.is_dir():
        return source
    import sys

    return Path(sys.prefix) / "share" / "tandem" / "profiles"


def user_profiles_dir() -> Path:
    from tandem.models.store import tandem_home

    return tandem_home() / "profiles"


_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def _yaml_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def _merge(base: Any, over: Any) -> Any:
    """Deep merge of YAML documents: mappings merge, everything else is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = LineDict(base)
        out.line = getattr(over, "line", 0)
        out.key_lines = {**getattr(base, "key_lines", {}), **getattr(over, "key_lines", {})}
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return over


def load_profiles(builtin_dir: Path | None = None, user_dir: Path | None = None,
                  include_user: bool = True) -> dict[str, Profile]:
    """All profiles by name: built-in ones, then the user's (which add or override)."""
    builtin_dir = builtin_dir or profiles_dir()
    files = _yaml_files(builtin_dir)
    if not files:
        raise ProfileError(builtin_dir, None, None, "no built-in profiles found (*.yaml)",
                           "set TANDEM_PROFILES_DIR to the profiles/ directory of a tandem "
                           "checkout, or reinstall with `pip install -e .` from the checkout")
    raw: dict[str, tuple[Any, Path]] = {}
    for path in files:
        raw[path.stem] = (load_yaml(path), path)
    profiles: dict[str, Profile] = {}
    for name, (doc, path) in raw.items():
        if "extends" in (doc or {}):
            raise ProfileError(path, _line(doc, "extends"), "extends",
                               "built-in profiles cannot extend others")
        profiles[name] = parse_profile(doc, path, name)
    if not include_user:
        return profiles
    user_dir = user_dir if user_dir is not None else user_profiles_dir()
    user_docs = {p.stem: (load_yaml(p), p) for p in _yaml_files(user_dir)}
    resolved: dict[str, Any] = {n: d for n, (d, _) in raw.items()}
    for name in user_docs:
        if not _NAME_RE.match(name):
            raise ProfileError(user_docs[name][1], None, None,
                               "profile file names must be lower-case letters, digits, '.', "
                               "'-' or '_'")
        profiles[name] = _load_user(name, user_docs, resolved, profiles, [])
    return profiles


def _load_user(name, user_docs, resolved, profiles, stack) -> Profile:
    doc, path = user_docs[name]
    if name in stack:
        raise ProfileError(path, _line(doc, "extends"), "extends",
                           f"profiles extend each other in a loop: {' -> '.join(stack + [name])}")
    if not isinstance(doc, dict):
        raise ProfileError(path, None, None, "a profile must be a YAML mapping")
    for key in doc:
        # user files are checked for unknown keys before merging, so errors name their line
        if key not in PROFILE_KEYS and key not in SECTIONS and key not in SCALARS:
            raise ProfileError(path, _line(doc, key), str(key),
                               "unknown key" + _suggest(key, PROFILE_KEYS))
    declared = doc.get("name")
    if declared is not None and declared != name:
        # checked here: merging with the profile it extends drops this file's `name`
        raise ProfileError(path, _line(doc, "name"), "name",
                           f"must match the file name ({name!r}), got {declared!r}",
                           f"rename the file to {declared}.yaml, or set name: {name}")
    base_name = doc.get("extends")
    origin = "user"
    if base_name is None and name in resolved:
        base_name, origin = name, "user override"
    if base_name is not None:
        if not isinstance(base_name, str) or (base_name not in resolved
                                              and base_name not in user_docs):
            raise ProfileError(path, _line(doc, "extends"), "extends",
                               f"unknown profile {base_name!r}; known: "
                               f"{', '.join(sorted(set(resolved) | set(user_docs)))}")
        if base_name in user_docs and base_name != name:
            _load_user(base_name, user_docs, resolved, profiles, stack + [name])
        base = resolved[base_name]
        merged = _merge(base, {k: v for k, v in doc.items() if k not in ("extends", "name")})
        merged.pop("name", None)  # the base's own name; this file's name is its stem
        if isinstance(merged.get("tiers"), list):
            # what the user set for the whole profile must not be undone by the base's tiers
            mine = parse_setting_sections(doc, path, skip=PROFILE_KEYS)
            merged["tiers"] = [_without(t, [FIELDS_BY_KEY[k].path for k in mine])
                               for t in merged["tiers"]]
        if isinstance(doc, LineDict):
            merged.key_lines.update(doc.key_lines)
    else:
        merged = doc
    profile = parse_profile(merged, path, name, origin)
    resolved[name] = merged
    return profile


def _without(tier: Any, paths: list[tuple[str, ...]]) -> Any:
    if not isinstance(tier, dict):
        return tier
    out = LineDict(tier)
    out.line, out.key_lines = getattr(tier, "line", 0), dict(getattr(tier, "key_lines", {}))
    for path in paths:
        if len(path) == 1:
            out.pop(path[0], None)
        elif isinstance(out.get(path[0]), dict):
            section = LineDict(out[path[0]])
            section.line = getattr(out[path[0]], "line", 0)
            section.key_lines = dict(getattr(out[path[0]], "key_lines", {}))
            section.pop(path[1], None)
            out[path[0]] = section
    return out


def select_profile(hw, profiles: Mapping[str, Profile]) -> tuple[Profile, str]:
    """The best matching profile for `hw` and why it was chosen."""
    matching = [p for p in profiles.values() if p.matches(hw)]
    if not matching:
        raise ProfileMismatchError(
            "no hardware profile matches this machine",
            "add a profile for it in <tandem home>/profiles/ (see docs/hardware.md), or pass "
            "--profile NAME")
    best = max(matching, key=lambda p: (p.priority, p.specificity, p.name))
    return best, f"matches {_describe(hw)}" + (
        f" ({hw.accelerator_memory / GiB:.0f} GiB)" if hw.vendor != "cpu" else
        f" ({hw.cpu.physical_cores} cores, {hw.ram_total / GiB:.0f} GiB RAM)")


def get_profile(name: str, hw=None, profiles: Mapping[str, Profile] | None = None,
                force: bool = False) -> tuple[Profile, list[str]]:
    """The profile called `name`, refused when it does not match `hw` unless `force`.

    Returns (profile, warnings); a forced mismatch is reported as a warning.
    """
    profiles = profiles if profiles is not None else load_profiles()
    key = name.strip().lower()
    if key not in profiles:
        raise UsageError(f"unknown profile {name!r}",
                         f"known profiles: {', '.join(sorted(profiles))}")
    profile = profiles[key]
    if hw is None:
        return profile, []
    reasons = profile.mismatch(hw)
    if reasons and not force:
        raise ProfileMismatchError(
            f"profile {profile.name!r} does not match this machine: {'; '.join(reasons)}",
            "omit --profile to use the detected one (see `tandem hw`), or force it with "
            "--force-profile (TANDEM_FORCE_PROFILE=1)")
    warnings = [f"profile {profile.name!r} forced although it does not match this machine: "
                f"{'; '.join(reasons)}"] if reasons else []
    return profile, warnings


__all__ = [
    "BACKENDS", "FIELDS_BY_KEY", "FIELDS_BY_PATH", "FLASH_ATTN", "Field", "KV_TYPES", "LineDict",
    "Located", "MatchRules", "Profile", "ProfileError", "ProfileMismatchError", "QUANTIZED_KV",
    "SETTING_FIELDS", "STRATEGIES", "Tier", "check_combination", "get_profile", "load_profiles",
    "load_yaml", "parse_profile", "parse_setting_sections", "profiles_dir", "select_profile",
    "user_profiles_dir",
]
