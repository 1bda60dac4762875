"""The output constraint of a command: one of --grammar, --grammar-file, -j/--json-schema,
-jf/--json-schema-file, --json-object (or their config keys and TANDEM_* variables), read,
checked and compiled before any model loads. llguidance loads only when one is given."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from tandem.config.schema import CONSTRAINT_KEYS, FIELDS_BY_KEY
from tandem.config.settings import SOURCES
from tandem.errors import UsageError

GRAMMAR_FILE_MAX_BYTES = 1 << 20  # a grammar or a schema: far larger than any written by hand
_KINDS = {"grammar": "gbnf", "grammar_file": "gbnf", "json_schema": "json_schema",
          "json_schema_file": "json_schema", "json_object": "json_schema"}


def constraint_flags(grammar, grammar_file, json_schema, json_schema_file,
                     json_object: bool) -> dict[str, Any]:
    """The flags as settings values (None: not given), checked at once: two of them together
    are refused, and the one given is compiled, before anything is downloaded or loaded."""
    flags = {"grammar": grammar, "grammar_file": None if grammar_file is None else str(grammar_file),
             "json_schema": json_schema,
             "json_schema_file": None if json_schema_file is None else str(json_schema_file),
             "json_object": "on" if json_object else None}
    given = [k for k, v in flags.items() if v is not None]
    _one_of(given, {k: FIELDS_BY_KEY[k].flag for k in given})
    if given:
        constraint_from(given[0], flags[given[0]], FIELDS_BY_KEY[given[0]].flag).compiled()
    return flags


def _one_of(keys: list[str], where: Mapping[str, str]) -> None:
    if len(keys) > 1:
        names = " and ".join(where[k] for k in keys)
        raise UsageError(f"{names} cannot be used together: the output follows one grammar",
                         "give one of --grammar, --grammar-file, --json-schema, "
                         "--json-schema-file or --json-object")


def _given(settings, key: str) -> bool:
    value = getattr(settings, key)
    return value == "on" if key == "json_object" else bool(value)


def settings_constraint(settings):
    """The resolved settings' constraint (engine.constrain.grammar.Constraint), or None. The
    strongest source that gives one decides (a flag over the config file); one source
    giving two is refused."""
    given = [k for k in CONSTRAINT_KEYS if _given(settings, k)]
    if not given:
        return None
    rank = {k: SOURCES.index(settings.source(k)) if settings.source(k) in SOURCES else 0
            for k in given}
    best = min(rank.values())
    top = [k for k in given if rank[k] == best]
    _one_of(top, {k: settings.origin(k) or FIELDS_BY_KEY[k].where for k in top})
    key = top[0]
    constraint = constraint_from(key, getattr(settings, key),
                                 settings.origin(key) or FIELDS_BY_KEY[key].where)
    constraint.compiled()
    return constraint


def constraint_from(key: str, value: str, origin: str):
    """A Constraint from a setting's value: its text, or the file it names read as UTF-8."""
    from tandem.engine.constrain.grammar import ANY_OBJECT, Constraint

    kind = _KINDS[key]
    if key == "json_object":
        return Constraint(kind, ANY_OBJECT, origin)
    if key.endswith("_file"):
        from tandem.fsutil import decode_text, read_input_file

        path = Path(value).expanduser()
        what = "grammar file" if kind == "gbnf" else "JSON schema file"
        raw = read_input_file(path, what, GRAMMAR_FILE_MAX_BYTES)
        text = decode_text(raw, f"{what} {path}", f"name a text file holding the "
                           f"{'GBNF grammar' if kind == 'gbnf' else 'schema'}",
                           "save it as UTF-8")
        return Constraint(kind, text, f"{origin} {path}")
    return Constraint(kind, value, origin)


def incomplete_error(reason: str, n_generated: int, max_tokens: int) -> UsageError:
    """The refusal for an output the grammar did not complete (what the user can change)."""
    from tandem.engine.constrain.grammar import GrammarError

    if reason == "context":
        cause, hint = "at the end of the context", "raise --ctx-size (-c)"
    elif reason == "stop":
        cause, hint = "at a --stop string", "drop the --stop string: the grammar decides the end"
    else:
        cause, hint = (f"at the token limit ({n_generated} of -n {max_tokens})",
                       "raise -n (--max-tokens), or ask for a shorter output")
    return GrammarError(f"the output stopped {cause} before the grammar was complete: it "
                        "does not match the grammar or schema", hint)
