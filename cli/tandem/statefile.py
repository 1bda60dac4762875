"""tandem's own state files, read one way: the cost cache (engine/tuning/costs.py), the kept knowledge
(engine/tuning/knowledge.py), the answer history (engine/drafting/history.py) and the model registry
(models/store.py).

They are untrusted input (a hand edit, another version, a bad disk can leave anything in
them), so each is read the same way: never from a named pipe or a device (the read would
block), with a size bound, parsed as JSON and checked by msgspec against the kind's Struct
(as config/files.py checks the settings files), then by the kind's own `check`. One clock
rule: a time stamp more than FUTURE_SLACK_S ahead of this machine's clock is damage, whatever
the kind. One failure policy: a damaged file is said once (`warn_damaged`: a TandemWarning,
which the command shows as `Warning: ignored ...` on stderr; this module never prints), the
kind's repair runs (remove, rewrite or set aside), and the run goes on without the file.
Nothing here raises for a damaged file.
"""
from __future__ import annotations

import json
import stat
import time
import warnings
from pathlib import Path
from typing import Callable, TypeVar

import msgspec

from tandem.errors import TandemWarning
from tandem.fsutil import fmt_bytes

# The one clock rule: clocks drift and a laptop's may be set back, but a state file dated
# more than an hour ahead was not written by this machine's tandem: it is damaged.
FUTURE_SLACK_S = 3600.0
MAX_BYTES = 16 * 1024 * 1024  # a history at its bounds is ~1 MiB; anything far larger is not ours

T = TypeVar("T")


class Damaged(ValueError):
    """A state file that is not what tandem writes; the message says why (one line)."""


def check_time(when: float, what: str = "its time stamp", now: float | None = None) -> None:
    """The clock rule: Damaged when `when` is more than FUTURE_SLACK_S ahead of now."""
    if when > (time.time() if now is None else now) + FUTURE_SLACK_S:
        raise Damaged(f"{what} is in the future")


def in_future(when: float, now: float | None = None) -> bool:
    try:
        check_time(when, now=now)
    except Damaged:
        return True
    return False


def load_state(path: Path, kind: type[T], max_bytes: int = MAX_BYTES,
               check: Callable[[T], None] | None = None) -> T | None:
    """The file as a `kind`, None if there is none; Damaged (the reason) for a file that is
    there but cannot be one. An OSError other than a missing file is the caller's (the
    registry's is a storage error, exit 7)."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise Damaged("not a regular file")
    if st.st_size > max_bytes:
        raise Damaged(f"larger than {fmt_bytes(max_bytes)}")
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # a nesting bomb is as unreadable as bad JSON
        raise Damaged(f"not JSON: {str(exc)[:120] or type(exc).__name__}") from None
    try:
        value = msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise Damaged(str(exc)[:200]) from None
    if check is not None:
        check(value)
    return value


_said: set[tuple] = set()


def file_key(path: Path, what: str) -> tuple:
    """One damaged file as it is now (a file damaged again later is said again)."""
    try:
        st = path.stat()
        return (str(path), what, st.st_mtime_ns, st.st_size)
    except OSError:
        return (str(path), what)


def warn_damaged(path: Path, what: str, reason: str, done: str, key: tuple | None = None) -> None:
    """The one warning of a damaged state file, said once per file and content in a process:
    `ignored WHAT PATH (REASON); DONE`. `key`: the file as it was before a repair changed it."""
    key = key or file_key(path, what)
    if key in _said:
        return
    _said.add(key)
    warnings.warn(TandemWarning(f"ignored {what} {path} ({reason}); {done}"), stacklevel=3)


def read_state(path: Path, kind: type[T], what: str, repair: Callable[[], str],
               max_bytes: int = MAX_BYTES, check: Callable[[T], None] | None = None,
               io_errors: bool = False) -> T | None:
    """`load_state` with the failure policy: a damaged file is said once (warn_damaged),
    `repair()` runs (it returns what it did, for the warning) and the result is None, as for
    no file. An OSError while reading is no file too, unless `io_errors`: then it is raised."""
    try:
        return load_state(path, kind, max_bytes, check)
    except Damaged as exc:
        reason = str(exc)
    except OSError as exc:
        if io_errors:
            raise
        reason = f"unreadable: {exc.strerror or exc}"
    key = file_key(path, what)
    warn_damaged(path, what, reason, repair(), key)
    return None
