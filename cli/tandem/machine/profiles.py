"""Hardware profiles: load and validate profiles/*.yaml (and the user's), match them to a machine.

A profile says how tandem should run on one kind of machine: backend, offload of target and
draft, flash attention, KV cache types, context, batch sizes, threads, speculative defaults,
the catalog pairs worth recommending for its memory, and the cost figures (docs/hardware.md) that
speedup predictions use. docs/hardware.md documents every key.

Every file is validated on load by msgspec against the Structs below (their settings built from
tandem.config.schema), and an error names the file, the line and the dotted key.

Where profiles come from: $TANDEM_PROFILES_DIR, else the profiles/ directory of the source tree
this package sits in (an editable install keeps it there). User profiles live in
<tandem_home>/profiles/*.yaml: a new name adds a profile, a built-in name overrides just the
keys it sets, and `extends: NAME` starts a new profile from another one.

Over 400 lines because a profile file has more than settings (match rules, memory tiers,
cost figures, `extends` across user files), each declared as a msgspec Struct.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Mapping, Optional, Union

import msgspec
from msgspec import UNSET, Meta, Struct

from tandem.config.files import (
    LineDict,
    Located,
    SettingsFileError,
    check_rules,
    convert,
    line_at,
    load_yaml,
    normalized,
    settings_struct,
    suggest,
    values_of,
)
from tandem.config.schema import FIELDS_BY_KEY, SCALARS, SECTIONS, one_of
from tandem.config.settings import Setting
from tandem.errors import UsageError
from tandem.fsutil import fmt_bytes

GiB = 1 << 30
BACKENDS = ("cuda", "metal", "cpu")
VENDORS = ("nvidia", "apple", "cpu", "any")


class ProfileError(SettingsFileError):
    """A profile file (or the set of them) is invalid: `path`, `line` and `key` say where."""


class ProfileMismatchError(UsageError):
    """The requested profile does not fit this machine."""


# ------------------------------------------------------------------------------ profile


# the shapes of a profile's parts, checked by msgspec (config.files.convert words its errors)
_Name = Annotated[str, Meta(pattern=r"\S")]
_Names = Annotated[Union[_Name, list[_Name]], Meta(extra={"says": "must be a list of names"})]
# at most the largest finite float: YAML's .inf is refused, as .nan is by any bound
_GiB = Annotated[float, Meta(ge=0, le=sys.float_info.max, extra={"range": "must be >= 0"})]
_Positive = Annotated[float, Meta(gt=0, le=sys.float_info.max, extra={"range": "must be > 0"})]
_Fraction = Annotated[float, Meta(gt=0, le=1.5, extra={"range": "must be a fraction (0..1.5)"})]


def _names(value: Any) -> tuple[str, ...]:
    return tuple(v.strip() for v in ([value] if isinstance(value, str) else value or ()))


class MatchRules(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    section: ClassVar[str] = "match"
    vendor: one_of(VENDORS) = "any"
    gpu_name: _Names = ()
    chip: _Names = ()
    os: _Names = ()
    min_memory_gib: Optional[_GiB] = None
    max_memory_gib: Optional[_GiB] = None

    def __post_init__(self):  # a bare name is a list of one; OS names compare lower-case
        for key in ("gpu_name", "chip", "os"):
            names = _names(getattr(self, key))
            msgspec.structs.force_setattr(self, key, tuple(
                n.lower() for n in names) if key == "os" else names)


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


class _CostFigures(Struct, forbid_unknown_fields=True, kw_only=True):
    section: ClassVar[str] = "cost"
    source: str = UNSET
    bandwidth_gbps: Optional[_Positive] = UNSET
    bw_eff_gbps: Optional[_Positive] = UNSET
    eta: Optional[_Fraction] = UNSET
    t0_ms: Optional[_Positive] = UNSET
    t0_small_ms: Optional[_Positive] = UNSET
    decode_ms: Annotated[dict[Union[str, int], Optional[_Positive]],
                         Meta(extra={"says": "must map model sizes to ms"})] = UNSET
    verify_ratio: Annotated[
        dict[Annotated[int, Meta(ge=1, extra={"says": "batch size must be a whole number >= 1"})],
             Annotated[float, Meta(ge=1, extra={
                 "range": "a batch of {key} cannot cost less than one token"})]],
        Meta(min_length=1, extra={"says": "must map batch sizes (2, 4, 8, 16) to cost ratios"})
    ] = UNSET
    draft_ratio: Optional[_Fraction] = UNSET


class _Cost(_CostFigures, forbid_unknown_fields=True, kw_only=True):
    variants: dict[Union[str, int], _CostFigures] = UNSET


_Pairs = ("recommended_pairs", Optional[_Names], None)
_Tier = settings_struct("tier", [("min_memory_gib", _GiB), _Pairs, ("note", str, "")])
_Profile = settings_struct("profile", [
    ("name", str, UNSET), ("description", str, ""), ("priority", int, 0), ("extends", str, UNSET),
    ("match", MatchRules), ("backend", one_of(BACKENDS)), _Pairs, ("tiers", list[_Tier], []),
    ("cost", Optional[_Cost], None), ("notes", Optional[_Names], None)])
PROFILE_KEYS = tuple(f.name for f in msgspec.structs.fields(_Profile)
                     if f.name not in SECTIONS | SCALARS)


def _figures(cost: _CostFigures) -> dict[str, Any]:
    out = {f: v for f in cost.__struct_fields__ if (v := getattr(cost, f)) is not UNSET}
    if "decode_ms" in out:
        out["decode_ms"] = {str(k): v for k, v in out["decode_ms"].items()}
    if "verify_ratio" in out:
        out["verify_ratio"] = dict(sorted(out["verify_ratio"].items()))
    if "variants" in out:
        out["variants"] = {str(k): _figures(v) for k, v in out["variants"].items()}
    return out


def parse_profile(doc: Any, path: str | Path, name: str, origin: str = "builtin") -> Profile:
    """Validate one profile document (already merged with what it extends)."""
    if not isinstance(doc, dict):
        raise ProfileError(path, None, None, "a profile must be a YAML mapping")
    declared = doc.get("name")
    if declared is not None and declared != name:
        raise ProfileError(path, line_at(doc, "name"), "name",
                           f"must match the file name ({name!r}), got {declared!r}")
    shape = dict(normalized(doc))
    if isinstance(shape.get("backend"), str):  # case-insensitive words
        shape["backend"] = shape["backend"].strip().lower()
    if isinstance(shape.get("match"), dict) and isinstance(shape["match"].get("vendor"), str):
        shape["match"] = {**shape["match"], "vendor": shape["match"]["vendor"].strip().lower()}
    p = convert(shape, _Profile, path, ProfileError, doc)
    m = p.match
    if m.min_memory_gib is not None and m.max_memory_gib is not None \
            and m.min_memory_gib > m.max_memory_gib:
        raise ProfileError(path, line_at(doc["match"], "max_memory_gib"), "match.max_memory_gib",
                           f"is below match.min_memory_gib ({m.min_memory_gib:g}): "
                           "no machine can match")
    tiers = tuple(Tier(t.min_memory_gib, MappingProxyType(
        values_of(t, raw, path, f"tiers[{i}].", ProfileError)),
        _names(t.recommended_pairs) if t.recommended_pairs is not None else None, t.note)
        for i, (t, raw) in enumerate(zip(p.tiers, doc.get("tiers") or [])))
    if len({t.min_memory_gib for t in tiers}) != len(tiers):
        raise ProfileError(path, line_at(doc, "tiers"), "tiers",
                           "two tiers have the same min_memory_gib")
    values = values_of(p, doc, path, "", ProfileError)
    check_rules(values, path, ProfileError)
    for tier in tiers:
        check_rules({**values, **tier.values}, path, ProfileError)
    return Profile(name=name, path=str(path), description=p.description, priority=p.priority,
                   match=m, backend=p.backend, values=MappingProxyType(values),
                   recommended_pairs=_names(p.recommended_pairs), tiers=tiers,
                   cost=MappingProxyType(_figures(p.cost) if p.cost else {}),
                   notes=_names(p.notes), origin=origin)


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
    return Path(sys.prefix) / "share" / "tandem" / "profiles"


def user_profiles_dir() -> Path:
    from tandem.models.store import tandem_home

    return tandem_home() / "profiles"


_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")  # fullmatch: "$" would take a final "\n"


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
                           "reinstall tandem with pip (its wheel carries them to "
                           "<prefix>/share/tandem/profiles), or set TANDEM_PROFILES_DIR to a "
                           "folder of profile files")
    raw: dict[str, tuple[Any, Path]] = {}
    for path in files:
        raw[path.stem] = (load_yaml(path), path)
    profiles: dict[str, Profile] = {}
    for name, (doc, path) in raw.items():
        if "extends" in (doc or {}):
            raise ProfileError(path, line_at(doc, "extends"), "extends",
                               "built-in profiles cannot extend others")
        profiles[name] = parse_profile(doc, path, name)
    if not include_user:
        return profiles
    user_dir = user_dir if user_dir is not None else user_profiles_dir()
    user_docs = {p.stem: (load_yaml(p), p) for p in _yaml_files(user_dir)}
    resolved: dict[str, Any] = {n: d for n, (d, _) in raw.items()}
    for name in user_docs:
        if not _NAME_RE.fullmatch(name):
            raise ProfileError(user_docs[name][1], None, None,
                               "profile file names must be lower-case letters, digits, '.', "
                               "'-' or '_'")
        profiles[name] = _load_user(name, user_docs, resolved, profiles, [])
    return profiles


def _load_user(name, user_docs, resolved, profiles, stack) -> Profile:
    doc, path = user_docs[name]
    if name in stack:
        raise ProfileError(path, line_at(doc, "extends"), "extends",
                           f"profiles extend each other in a loop: {' -> '.join(stack + [name])}")
    if not isinstance(doc, dict):
        raise ProfileError(path, None, None, "a profile must be a YAML mapping")
    for key in doc:
        # user files are checked for unknown keys before merging, so errors name their line
        if key not in PROFILE_KEYS and key not in SECTIONS and key not in SCALARS:
            raise ProfileError(path, line_at(doc, key), str(key),
                               "unknown key" + suggest(key, PROFILE_KEYS))
    declared = doc.get("name")
    if declared is not None and declared != name:
        # checked here: merging with the profile it extends drops this file's `name`
        raise ProfileError(path, line_at(doc, "name"), "name",
                           f"must match the file name ({name!r}), got {declared!r}",
                           f"rename the file to {declared}.yaml, or set name: {name}")
    base_name = doc.get("extends")
    origin = "user"
    if base_name is None and name in resolved:
        base_name, origin = name, "user override"
    if base_name is not None:
        if not isinstance(base_name, str) or (base_name not in resolved
                                              and base_name not in user_docs):
            raise ProfileError(path, line_at(doc, "extends"), "extends",
                               f"unknown profile {base_name!r}; known: "
                               f"{', '.join(sorted(set(resolved) | set(user_docs)))}")
        if base_name in user_docs and base_name != name:
            _load_user(base_name, user_docs, resolved, profiles, stack + [name])
        base = resolved[base_name]
        merged = _merge(base, {k: v for k, v in doc.items() if k not in ("extends", "name")})
        merged.pop("name", None)  # the base's own name; this file's name is its stem
        if isinstance(merged.get("tiers"), list):
            # what the user set for the whole profile must not be undone by the base's tiers
            sections = {k: v for k, v in doc.items() if isinstance(v, dict)}
            mine = [f.path for f in FIELDS_BY_KEY.values()
                    if f.path[-1] in (doc if len(f.path) == 1 else sections.get(f.path[0], ()))]
            merged["tiers"] = [_without(t, mine) for t in merged["tiers"]]
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
        f" ({fmt_bytes(hw.accelerator_memory)})" if hw.vendor != "cpu" else
        f" ({hw.cpu.physical_cores} cores, {fmt_bytes(hw.ram_total)} RAM)")


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


# ------------------------------------------------------------------------------ choice


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a command runs with, and what config.settings.resolve_settings takes from
    it: `setting` (its name, the source that chose it and why), `values` (its settings for
    this machine, each Located at the profile and tier it came from); `backend` is what will
    run (effective_backend) and `warnings` say when it was forced."""

    profile: Profile
    setting: Setting
    reason: str
    values: Mapping[str, Located]
    backend: str
    warnings: tuple[str, ...] = ()


def choose_profile(named: Setting | None, hw, profiles: Mapping[str, Profile],
                   force: bool = False) -> ProfileChoice:
    """The profile named (cli > env > config: config.settings.Sources.profile), else the one
    detected for `hw`. A named profile that does not match `hw` is refused with the reason, and
    with where its name came from when that was not the command line (it may be long
    forgotten), unless `force`: then it is used with a warning."""
    if named is None:
        profile, reason = select_profile(hw, profiles)
        setting, warnings = Setting("profile", profile.name, "detected", reason), []
    else:
        try:
            profile, warnings = get_profile(named.value, hw, profiles, force=force)
        except ProfileMismatchError as exc:
            if named.source != "cli":
                exc.message = f"{exc.message} (profile set by {named.origin})"
                exc.args = (exc.message,)
            raise
        reason = f"chosen with {named.origin}"
        setting = Setting("profile", profile.name, named.source, named.origin)
    tier = profile.tier_for(hw.accelerator_memory)
    values = {k: Located(loc.value, profile.name + (
        f" (tier >= {tier.min_memory_gib:g} GiB)" if tier is not None and k in tier.values
        else ""), loc.line) for k, loc in profile.values_for(hw).items()}
    return ProfileChoice(profile, setting, reason, MappingProxyType(values),
                         effective_backend(profile, hw), tuple(warnings))


def effective_backend(profile: Profile, hw) -> str:
    """The backend that will run: the profile's, if the installed binding can offload."""
    if profile.backend == "cpu" or hw is None:
        return profile.backend if hw is None else "cpu"
    binding = hw.backend.name if hw.backend is not None else "unknown"
    if binding in ("cpu", "unknown"):
        return "cpu"
    return binding if binding in ("cuda", "metal") else profile.backend
