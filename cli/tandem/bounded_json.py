"""JSON read with a bound on its nesting: a request body, a schema sent as text, a tool
call's arguments. Python's parser recurses once per level and raises RecursionError near
1,000 levels; anything that walks the value afterwards (json.dumps, a schema compiler)
recurses too. So every JSON text from a user is read here, and a value nested deeper than
GRAMMAR_LIMITS["json_depth"] is refused with the path where it goes too deep.
"""
from __future__ import annotations

import json
import re
from typing import Any

from tandem.config.schema import GRAMMAR_LIMITS

DEPTH = GRAMMAR_LIMITS["json_depth"].value


class TooDeep(ValueError):
    """A JSON value nested more than `limit` deep; `path` says where ("a.b[0]", "" the top)."""

    def __init__(self, path: str, limit: int):
        self.path, self.limit = path, limit
        super().__init__(f"{path or 'the value'} is nested more than {limit} levels deep")


def loads(text: str | bytes, limit: int = DEPTH, **kwargs) -> Any:
    """json.loads(text), or TooDeep; other problems are json's own ValueError."""
    try:
        value = json.loads(text, **kwargs)
    except RecursionError:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        raise TooDeep(_path_in_text(text, limit), limit) from None
    check_depth(value, limit)
    return value


def check_depth(value: Any, limit: int = DEPTH, path: str = "") -> None:
    """TooDeep when `value` holds containers nested more than `limit` deep (the top one is
    level 1). Iterative: the value may be deeper than Python's recursion allows."""
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    while stack:
        item, depth, trail = stack.pop()
        if isinstance(item, dict):
            if depth > limit:
                raise TooDeep(_join(path, trail), limit)
            stack += [(v, depth + 1, (trail, k)) for k, v in item.items()]
        elif isinstance(item, list):
            if depth > limit:
                raise TooDeep(_join(path, trail), limit)
            stack += [(v, depth + 1, (trail, i)) for i, v in enumerate(item)]


def _join(path: str, trail) -> str:
    """The path of a (parent, key-or-index) trail, as the API names fields: a.b[0].c."""
    parts: list = []
    while trail is not None:
        trail, key = trail
        parts.append(key)
    out = path
    for key in reversed(parts):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


# strings (escapes included) and the characters that open, close and separate containers
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[][{},:]')


def _path_in_text(text: str, limit: int) -> str:
    """Where the text's nesting passes `limit`, found by scanning it (it is too deep for
    Python's parser to read at all)."""
    frames: list[list] = []  # per open container: [key or index, is_array]
    last = '""'
    for m in _TOKENS.finditer(text):
        tok = m.group()
        if tok[0] == '"':
            last = tok
        elif tok in "[{":
            if len(frames) >= limit:
                break
            frames.append([0, True] if tok == "[" else ["", False])
        elif not frames:
            continue
        elif tok == ":":  # the string before names the object's next value
            try:
                frames[-1][0] = json.loads(last)
            except ValueError:
                frames[-1][0] = "?"
        elif tok == ",":
            if frames[-1][1]:
                frames[-1][0] += 1
        else:
            frames.pop()
    trail = None
    for key, _ in frames:
        trail = (trail, key)
    return _join("", trail)
