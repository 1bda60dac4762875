"""What a grammar or a JSON schema asks of llguidance, counted before it compiles anything:
rules, alternatives, repetition counts and nesting of a GBNF grammar; $refs and enum or
anyOf sizes of a schema; the text's size. The limits are GRAMMAR_LIMITS (config/schema.py);
past one, llguidance crashed the process, took seconds, or failed at the first token.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tandem.config.schema import GRAMMAR_LIMITS, GrammarLimit


@dataclass(frozen=True)
class Exceeded:
    """A limit a grammar passes: `found` of what the limit counts, at most `limit.value`."""

    limit: GrammarLimit
    found: int

    def says(self) -> str:
        return self.limit.says(self.found)


def _over(key: str, found: int) -> Exceeded | None:
    limit = GRAMMAR_LIMITS[key]
    return Exceeded(limit, found) if found > limit.value else None


def in_text(text: str) -> Exceeded | None:
    """The text's size in UTF-8 bytes (at most 4 a character: a cheap bound first)."""
    if len(text) * 4 <= GRAMMAR_LIMITS["text_bytes"].value:
        return None
    return _over("text_bytes", len(text.encode("utf-8", "surrogatepass")))


# GBNF's lexemes that matter here; strings, character classes and comments are skipped whole
# (a '|' or '(' inside them is text)
_GBNF = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*|::=|\{[^}]*\}|[|()]')


def in_gbnf(text: str) -> Exceeded | None:
    """The first limit a GBNF grammar passes, or None."""
    over = in_text(text)
    if over:
        return over
    rules = alternatives = depth = deepest = repeat = 0
    for m in _GBNF.finditer(text):
        tok = m.group()
        if tok == "::=":
            rules += 1
        elif tok == "|":
            alternatives += 1
        elif tok == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif tok == ")":
            depth = max(depth - 1, 0)
        elif tok[0] == "{":
            # a count too long to be a number is past any limit (int() refuses 4,300 digits)
            repeat = max([repeat, *(int(d) if len(d) < 10 else 1 << 40
                                    for d in re.findall(r"\d+", tok))])
    return (_over("rules", rules) or _over("alternatives", alternatives)
            or _over("nesting", deepest) or _over("repeat", repeat))


_BRANCHES = ("anyOf", "oneOf", "allOf", "enum")


def in_schema(schema: Any) -> Exceeded | None:
    """The first limit a parsed JSON schema passes, or None. Its nesting is bounded already
    (tandem/bounded_json.py), so this walk is short; it is iterative all the same."""
    refs = 0
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                refs += 1
            for key in _BRANCHES:
                if isinstance(item.get(key), list):
                    # an enum of strings and numbers is one lexeme, bounded by the text alone;
                    # its objects and arrays, like a union's branches, are parser items
                    found = item[key] if key != "enum" else \
                        [v for v in item[key] if isinstance(v, (dict, list))]
                    over = _over("branches", len(found))
                    if over:
                        return over
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return _over("refs", refs)
