"""Settings files (profiles, the config file, tuned results): YAML read with the line of each
key, and their setting sections validated against the schema, so every error names the file,
the line and the dotted key."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from tandem.config.schema import (
    FIELDS_BY_KEY,
    FIELDS_BY_PATH,
    SCALARS,
    SECTIONS,
    Field,
    broken_rules,
    show,
)
from tandem.errors import UsageError


class SettingsFileError(UsageError):
    """A settings file (config.yaml, a profile, a tuned result) is invalid: `path`, `line` and
    `key` say where. machine.profiles.ProfileError is the profiles' own kind of it."""

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
        line = line_at(doc, key)
        dotted = f"{prefix}{key}"
        if key in SCALARS:
            out.update(_one(FIELDS_BY_PATH[(key,)], value, path, line, dotted))
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise SettingsFileError(path, line, dotted, f"must be a mapping, got {show(value)}")
            for sub, subval in value.items():
                f = FIELDS_BY_PATH.get((key, sub))
                if f is None:
                    known = [p[1] for p in FIELDS_BY_PATH if p[0] == key]
                    raise SettingsFileError(path, line_at(value, sub), f"{dotted}.{sub}",
                                       f"unknown key; {key} takes: {', '.join(known)}")
                out.update(_one(f, subval, path, line_at(value, sub), f"{dotted}.{sub}"))
        else:
            raise SettingsFileError(path, line, dotted, "unknown key" + suggest(key, skip))
    return out


def _one(f: Field, value: Any, path, line, dotted) -> dict[str, Located]:
    v, problem = f.check(value)
    if problem:
        raise SettingsFileError(path, line, dotted, problem)
    return {f.key: Located(v, str(path), line)}


def line_at(doc: Any, key: Any) -> int | None:
    return doc.line_of(key) if isinstance(doc, LineDict) else None


def suggest(key: Any, own: Iterable[str] = ()) -> str:
    """Close matches among the keys of this kind of file: the setting sections plus `own`
    (a profile's keys, or the config file's profile/pair/force_profile)."""
    known = sorted(SECTIONS | SCALARS | set(own))
    close = difflib.get_close_matches(str(key), known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f"; known keys: {', '.join(known)}"


def check_rules(values: Mapping[str, Located], path: str | Path) -> None:
    """The schema's rules across keys, for the values of one file."""
    plain = {k: v.value for k, v in values.items()}
    for rule in broken_rules(plain):
        raise SettingsFileError(path, values[rule.key].line, FIELDS_BY_KEY[rule.key].dotted,
                           rule.problem(plain))
