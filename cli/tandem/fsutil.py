"""Writing tandem's own files safely, and saying clearly why a file system refused.

Every file tandem writes goes through `atomic_write_text` (a temporary file next to the target,
then os.replace), so a full disk never leaves a half-written file nor a stray `*.tmp`. A killed
process can leave its temporary file: it is named `<file>.<pid>.tmp`, and `sweep_stale_tmp`
(run by each store before it writes) removes those of processes that are gone. `storage_error` turns the OSError of a failed read or write into a StorageError
whose message names the path that is in the way and whose hint says what to change.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from pathlib import Path

from tandem.errors import StorageError

_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def tmp_name(path: Path) -> Path:
    """This process's temporary file for `path`: `<name>.<pid>.tmp`, so that two processes
    never share one and a sweep can tell whose it is."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


# <name>.<pid>.tmp (atomic_write_text), .registry.<pid>.<random>.tmp (the model registry)
_TMP_PID = re.compile(r"^(?:\.registry\.(\d+)\..*|.*\.(\d+))\.tmp$")
LEGACY_TMP_AGE_S = 3600  # a *.tmp without a pid (older versions) this old is surely stale


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0 and not isinstance(pid, bool)  # exists, someone else's
    return True


def sweep_stale_tmp(folder: Path) -> int:
    """Remove the `*.tmp` files in `folder` left by processes that are gone (killed mid-write:
    SIGKILL, a power cut); those without a pid only once over an hour old. How many went.
    Never raises: a sweep that cannot remove something leaves it for the next one."""
    n = 0
    try:
        names = [p for p in Path(folder).iterdir() if p.name.endswith(".tmp")]
    except OSError:
        return 0
    now = time.time()
    for p in names:
        m = _TMP_PID.match(p.name)
        try:
            if not p.is_file() or p.is_symlink():
                continue
            if m:
                if _alive(int(m.group(1) or m.group(2))):
                    continue
            elif now - p.stat().st_mtime < LEGACY_TMP_AGE_S:
                continue
            p.unlink()
            n += 1
        except (OSError, ValueError):
            continue
    return n


def atomic_write_text(path: Path, text: str, tmp: Path | None = None) -> Path:
    """Write `text` to `path` through `tmp` (default `<path>.<pid>.tmp`); on any failure the
    temporary file is removed and the exception propagates (the old `path` is untouched)."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else tmp_name(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def decode_text(raw: bytes, what: str, binary_hint: str, encoding_hint: str) -> str:
    """`raw` as UTF-8 text, or a UsageError naming `what`: NUL bytes mean a binary file
    (they would reach the tokenizer as garbage), other bad bytes a foreign encoding."""
    from tandem.errors import UsageError

    if b"\x00" in raw:
        raise UsageError(f"{what} looks binary (it contains NUL bytes)", binary_hint)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} is not UTF-8 text (byte {exc.start})", encoding_hint) from None


TEXT_INPUT_MAX_BYTES = 4 << 20  # a prompt, stdin, a context file: far beyond any context


def check_input_file(path: Path, what: str, limit: int = TEXT_INPUT_MAX_BYTES) -> os.stat_result:
    """The stat of `path`, a regular file of at most `limit` bytes, or a UsageError naming it:
    a FIFO would block forever and /dev/zero never ends, so both are refused before a byte is
    read (and before any model loads)."""
    import stat as _stat

    from tandem.errors import UsageError

    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UsageError(f"{what} not found: {path}", "check the path") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}",
                         "check the path and its permissions") from None
    if _stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{what} {path} is a directory", "name a text file")
    if not _stat.S_ISREG(st.st_mode):
        kind = ("a named pipe (FIFO)" if _stat.S_ISFIFO(st.st_mode) else
                "a device" if _stat.S_ISCHR(st.st_mode) or _stat.S_ISBLK(st.st_mode) else
                "a socket" if _stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise UsageError(f"{what} {path} is {kind}, not a regular file",
                         "name a regular text file (to pass piped text, save it to a file "
                         "first, or pipe it on stdin)")
    if st.st_size > limit:
        raise UsageError(f"{what} {path} is {st.st_size / (1 << 20):.1f} MiB; the limit is "
                         f"{limit >> 20} MiB", "name the parts that matter, not a whole tree")
    return st


def read_input_file(path: Path, what: str, limit: int = TEXT_INPUT_MAX_BYTES) -> bytes:
    """The bytes of a text input file, checked by `check_input_file` and read with a bound
    (a file that grew past `limit` since the check is refused too)."""
    from tandem.errors import UsageError

    check_input_file(path, what, limit)
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}",
                         "check the path and its permissions") from None
    if len(raw) > limit:
        raise UsageError(f"{what} {path} is over {limit >> 20} MiB",
                         "name the parts that matter, not a whole tree")
    return raw


def read_stream(stream, what: str, limit: int = TEXT_INPUT_MAX_BYTES) -> bytes:
    """At most `limit` bytes of a binary stream (stdin), or a UsageError once it holds more:
    50 MB piped in are refused after reading `limit` + 1 bytes, not all of them."""
    from tandem.errors import UsageError

    raw = stream.read(limit + 1)
    if len(raw) > limit:
        raise UsageError(f"{what} holds over {limit >> 20} MiB of text; the limit is "
                         f"{limit >> 20} MiB", "pipe only the part that matters (a context "
                         "of that size would not fit any model)")
    return raw


def blocking_file(path: Path) -> Path | None:
    """The first existing ancestor of `path` (or `path` itself) that is not a directory:
    the file that makes `path` impossible to create."""
    path = Path(path)
    for p in reversed([path, *path.parents]):
        if not p.exists():
            return None
        if not p.is_dir():
            return p
    return None


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing ancestor: the directory whose permissions matter."""
    for p in [path, *path.parents]:
        if p.exists():
            return p
    return path


def storage_error(exc: OSError, what: str, path: Path, home_hint: bool = False) -> StorageError:
    """A StorageError for `exc`, raised while writing or reading `what` at `path`.

    `home_hint`: the path is under TANDEM_HOME, so moving TANDEM_HOME is a way out."""
    path = Path(path)
    elsewhere = " or set TANDEM_HOME to another directory" if home_hint else ""
    code = exc.errno
    if code in _FULL:
        return StorageError(f"disk full while writing {what} ({path})",
                            f"free some space{elsewhere}")
    if code in (errno.ENOTDIR, errno.EEXIST) or isinstance(exc, (NotADirectoryError,
                                                                 FileExistsError)):
        blocker = blocking_file(path) or path
        return StorageError(f"cannot write {what}: {blocker} is a file, not a directory",
                            f"move {blocker} out of the way{elsewhere}")
    if code == errno.EISDIR:
        return StorageError(f"cannot use {what}: {path} is a directory, not a file",
                            f"move {path} out of the way{elsewhere}")
    if code in _DENIED:
        reason = "is on a read-only file system" if code == errno.EROFS else "is not writable"
        where = _existing(Path(exc.filename or path))
        return StorageError(f"cannot write {what}: {where} {reason}",
                            f"check the permissions of {where}{elsewhere}")
    return StorageError(f"cannot write {what} ({path}): {exc.strerror or exc}",
                        f"check {path}{elsewhere}")


def machine_key(*parts: object) -> str:
    """A stable 16-hex key of this machine (host name, architecture) and `parts`, for the
    files tandem keys by machine: calibrated costs and tuned settings."""
    import hashlib
    import platform

    text = "|".join([platform.node(), platform.machine(), *map(str, parts)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fmt_bytes(n: int | None, decimal: bool = False) -> str:
    """The one byte formatter. Memory in binary units, the way llama.cpp and nvidia-smi count
    it (`1.5 GiB`, `512 MiB`); `decimal`: file and download sizes in SI units, as registries
    and file managers show them (`1.1 GB`)."""
    if n is None:
        return "?"
    sign, f = ("-" if n < 0 else ""), float(abs(n))
    if decimal:
        for unit in ("B", "KB", "MB", "GB", "TB"):
            if f < 1000 or unit == "TB":
                return f"{sign}{f:.0f} {unit}" if unit == "B" else f"{sign}{f:.1f} {unit}"
            f /= 1000
    if f >= 1 << 30:
        return f"{sign}{f / (1 << 30):.1f} GiB"
    if f >= 1 << 20:
        return f"{sign}{f / (1 << 20):.0f} MiB"
    return f"{sign}{f / 1024:.0f} KiB"
