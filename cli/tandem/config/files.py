"""Settings files (profiles, the config file, tuned results): YAML read with the line of each
key, and validated by msgspec against Structs built from the schema, its errors translated so
that every one names the file, the line and the dotted key."""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Iterable, Mapping, Union, get_args, get_origin

import msgspec
import yaml

from tandem.config.schema import (
    FIELDS_BY_KEY,
    SCALARS,
    SECTIONS,
    SETTING_FIELDS,
    broken_rules,
    check_endpoints,
    explain,
)
from tandem.errors import UsageError


class SettingsFileError(UsageError):
    """A settings file (config.yaml, a profile, a tuned result) is invalid: `path`, `line` and
    `key` say where. machine.profiles.ProfileError, its subclass, is raised for profiles alone
    (config.yaml and tuned files raise this class itself)."""

    def __init__(self, path: str | Path, line: int | None, key: str | None, problem: str,
                 hint: str | None = None):
        where = str(path) + (f", line {line}" if line else "")
        what = f"key '{key}': " if key else ""
        super().__init__(f"{where}: {what}{problem}",
                         hint or f"fix {Path(str(path)).name} (see docs/hardware.md for every key)")
        self.path, self.line, self.key, self.problem = str(path), line, key, problem



class LineDict(dict):
    """A dict that remembers the line of each key (and of itself) in its YAML file."""

    line: int = 0
    key_lines: dict

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


# Anchors and aliases are YAML's way to repeat a value; settings files need few if any. An
# alias bomb (billion laughs: `pair: *i`, each level ten aliases of the last) once took 49 s
# and 5.5 GB before Python died, and the message printed the expanded value. With at most
# MAX_ALIASES aliases no file can expand by more than a few hundred times.
MAX_ALIASES = 16
MAX_SETTINGS_BYTES = 1 << 20  # settings files are a few hundred bytes


class _TooManyAliases(yaml.YAMLError):
    def __init__(self, line: int):
        super().__init__(f"more than {MAX_ALIASES} YAML aliases")
        self.line = line


class _Loader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0

    def compose_node(self, parent, index):
        # counted while composing, before anything is expanded or constructed
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _TooManyAliases(self.peek_event().start_mark.line + 1)
        return super().compose_node(parent, index)


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
    """Parse YAML keeping line numbers; syntax errors become SettingsFileError with the line."""
    if text is None:
        try:
            if Path(path).stat().st_size > MAX_SETTINGS_BYTES:
                raise SettingsFileError(path, None, None,
                                   f"is over {MAX_SETTINGS_BYTES >> 20} MiB: not a settings file",
                                   "check that the path names a settings file")
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise SettingsFileError(path, None, None, f"cannot read: {exc.strerror or exc}",
                               "check that the file exists and is readable") from None
        except UnicodeDecodeError:
            raise SettingsFileError(path, None, None, "is not UTF-8 text") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except _TooManyAliases as exc:  # never shows the value: it may be an expansion bomb
        raise SettingsFileError(path, exc.line, None,
                           f"uses more than {MAX_ALIASES} YAML aliases (*name)",
                           "write the values out instead of repeating them through anchors "
                           "(&name) and aliases (*name)") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise SettingsFileError(path, line, None, f"YAML syntax error: {problem}",
                           "fix the YAML syntax at that line (indentation, a missing ':' or "
                           "quote)") from None
    except yaml.YAMLError as exc:
        raise SettingsFileError(path, None, None, f"YAML error: {exc}") from None
    except RecursionError:  # PyYAML composes recursively; a nesting bomb ends here
        raise SettingsFileError(path, None, None, "is nested too deeply to be a settings file") \
            from None


@dataclass(frozen=True)
class Located:
    """A validated value and where it was written."""

    value: Any
    path: str
    line: int | None


# ---------------------------------------------------------------------- validation (msgspec)
#
# A file's shape is a msgspec.Struct; msgspec.convert checks the YAML-loaded mapping against
# it. Its error (" - at `$.tiers[1].batch.n_batch`") is translated into the file's line, the
# dotted key and a problem worded by schema.explain from the declared type.


@lru_cache(maxsize=None)
def _setting_fields() -> tuple[tuple[str, Any, Any], ...]:
    """The settings as msgspec Struct fields, one per key of schema.SETTING_FIELDS: a scalar
    (context) or a section Struct (batch: n_batch, n_ubatch), each optional."""
    places: dict[str, list] = {}
    for f in SETTING_FIELDS:
        places.setdefault(f.path[0], []).append(f)
    return tuple((name, fs[0].type if len(fs[0].path) == 1 else msgspec.defstruct(
        name, [(f.path[1], f.type, msgspec.UNSET) for f in fs], forbid_unknown_fields=True,
        kw_only=True), msgspec.UNSET) for name, fs in places.items())


def settings_struct(name: str, own: Iterable[tuple] = ()) -> type:
    """A Struct for a file of settings: its `own` fields ((name, type[, default]) as for
    msgspec.defstruct) and every setting; unknown keys are errors."""
    return msgspec.defstruct(name, [*own, *_setting_fields()], forbid_unknown_fields=True,
                             kw_only=True)


def normalized(doc: Any) -> Any:
    """A copy of a mapping (and of the mappings in its lists: a profile's tiers) with the
    settings' values adjusted by Field.normal (case, YAML 1.1 booleans): msgspec checks the
    copy, errors show the original."""
    if not isinstance(doc, dict):
        return doc
    out = {k: dict(v) if k in SECTIONS and isinstance(v, dict) else
           [normalized(i) for i in v] if isinstance(v, list) else v for k, v in doc.items()}
    for f in SETTING_FIELDS:
        node = out if len(f.path) == 1 else out.get(f.path[0])
        if isinstance(node, dict) and f.path[-1] in node:
            node[f.path[-1]] = f.normal(node[f.path[-1]])
    return out


def convert(doc: Any, kind: type, path: str | Path, error: type = SettingsFileError,
            shown: Any = None) -> Any:
    """`doc` (from load_yaml) as a `kind`, checked by msgspec once normalized(); what is
    wrong names the file, the line and the dotted key (raised as `error`). `shown`: the
    document as written, when `doc` is a copy adjusted further."""
    try:
        return msgspec.convert(normalized(doc), kind)
    except msgspec.ValidationError as exc:
        line, key, problem = translate(str(exc), doc if shown is None else shown, kind)
        raise error(path, line, key, problem) from None


_AT = re.compile(r"^(.*?)(?: - at `(.*?)`(?: in `(.*)`)?)?$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def translate(message: str, doc: Any, kind: Any, key: str = "", line: int | None = None
              ) -> tuple[int | None, str | None, str]:
    """msgspec's ValidationError message for `doc` converted to `kind` -> (line, dotted key,
    problem). msgspec writes a mapping's entry as `[...]` and a bad key as `key` in `$...`:
    that entry is found by converting each one alone."""
    what, at, within = _AT.match(message).groups()
    raw = doc
    for name, index in _STEP.findall((within or at or "$")[1:]):
        kind = _member(kind, raw)
        if name:  # a Struct field
            kind = next(f.type for f in msgspec.structs.fields(kind) if f.name == name)
            line = line_at(raw, name) or line
            raw, key = raw.get(name), _join(key, name)
        elif index != "...":  # a list item
            kind, raw, key = get_args(kind)[0], raw[int(index)], f"{key}[{index}]"
        else:  # a mapping's entry: the first one msgspec refuses alone
            value_type = get_args(kind)[1]
            for k, v in raw.items():
                try:
                    msgspec.convert(v, value_type)
                except msgspec.ValidationError as exc:
                    return translate(str(exc), v, value_type, _join(key, k),
                                     line_at(raw, k) or line)
            return line, key or None, what  # not refused alone: msgspec's own words
    declared, kind = kind, _member(kind, raw)
    if within is not None:  # a key msgspec refuses
        struct = msgspec.inspect.is_struct_type(kind)
        for k in raw:
            key_type = str if struct else get_args(kind)[0]
            try:
                msgspec.convert(k, key_type)
            except msgspec.ValidationError as exc:
                return line_at(raw, k) or line, _join(key, k), _unknown(k, kind) if struct \
                    else explain(msgspec.inspect.type_info(key_type), k, str(exc), key=k)
    field = re.match(r"Object (contains unknown|missing required) field `(.*)`", what)
    if field and field.group(1) == "missing required":
        return (raw.line if key and isinstance(raw, LineDict) else line), \
            _join(key, field.group(2)), "is required"
    if field:
        return line_at(raw, field.group(2)) or line, _join(key, field.group(2)), \
            _unknown(field.group(2), kind)
    return line, key or None, explain(msgspec.inspect.type_info(declared), raw, what,
                                      key=key.rpartition(".")[2])


def _join(key: str, name: Any) -> str:
    return f"{key}.{name}" if key else str(name)


def _member(kind: Any, raw: Any) -> Any:
    """The declared type without Annotated and, in a union (a value or nothing, a name or a
    list of names), the member a mapping or a list is meant for."""
    while True:
        if get_origin(kind) is Annotated:
            kind = get_args(kind)[0]
        elif get_origin(kind) is Union:
            want = dict if isinstance(raw, dict) else list
            fit = [t for t in get_args(kind) if
                   (msgspec.inspect.is_struct_type(_member(t, raw)) and want is dict)
                   or get_origin(_member(t, raw)) is want]
            if not fit:
                return kind
            kind = fit[0]
        else:
            return kind


def _unknown(name: Any, struct: type) -> str:
    """An unknown key: close matches among a settings file's keys, or what a section takes."""
    own = [f.name for f in msgspec.structs.fields(struct)]
    if SCALARS <= set(own):  # a file of settings (with its own keys)
        return "unknown key" + suggest(name, set(own) - SECTIONS - SCALARS)
    section = getattr(struct, "section", struct.__name__)
    return f"unknown key; {section} takes: {', '.join(own)}"


def read_settings(doc: Any, path: str | Path) -> dict[str, Located]:
    """The settings of a mapping of settings alone (a tuned file): {flat key: Located}."""
    return values_of(convert(doc, _settings_only(), path), doc, path)


@lru_cache(maxsize=None)
def _settings_only() -> type:
    return settings_struct("settings")


def values_of(obj: Any, doc: Mapping, path: str | Path, prefix: str = "",
              error: type = SettingsFileError) -> dict[str, Located]:
    """{flat key: Located} of the settings a converted Struct holds; the line is the key's in
    `doc`. The endpoint syntax is the one check msgspec cannot make."""
    out: dict[str, Located] = {}
    for f in SETTING_FIELDS:
        value, node = obj, doc
        for part in f.path:
            value = getattr(value, part)
            if value is msgspec.UNSET:
                break
            container, node = node, node.get(part)
        else:
            line = line_at(container, f.path[-1])
            if f.kind == "endpoints":
                value, problem = check_endpoints(value)
                if problem:
                    raise error(path, line, prefix + f.dotted, problem)
            out[f.key] = Located(value, str(path), line)
    return out


def line_at(doc: Any, key: Any) -> int | None:
    return doc.line_of(key) if isinstance(doc, LineDict) else None


def suggest(key: Any, own: Iterable[str] = ()) -> str:
    """Close matches among the keys of this kind of file: the setting sections plus `own`
    (a profile's keys, or the config file's profile/pair/force_profile)."""
    known = sorted(SECTIONS | SCALARS | set(own))
    close = difflib.get_close_matches(str(key), known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f"; known keys: {', '.join(known)}"


def check_rules(values: Mapping[str, Located], path: str | Path,
                error: type = SettingsFileError) -> None:
    """The schema's rules across keys, for the values of one file."""
    plain = {k: v.value for k, v in values.items()}
    for rule in broken_rules(plain):
        raise error(path, values[rule.key].line, FIELDS_BY_KEY[rule.key].dotted,
                    rule.problem(plain))
