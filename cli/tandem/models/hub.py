"""The Hugging Face hub: settings from the environment, file metadata, repo listings, and
`HubSource`, the store's first source, which downloads through `hf_hub_download`.

All network access goes through `huggingface_hub` and its HTTP session, so its cache layout
(HF_HOME, HF_HUB_CACHE), token (HF_TOKEN), endpoint (HF_ENDPOINT), proxies and offline mode
(HF_HUB_OFFLINE) behave as in every other tool. huggingface_hub reads most of these once, at
import; tandem reads them on every call and passes them explicitly, so a setting changed
after start-up (or by a test) still applies.

The bytes of an LFS file (a model: its size and sha256 known from the hub) are fetched by
`_fetch_blob` into the cache's `blobs/<sha256>.incomplete` with HTTP Range requests, so a
pull interrupted by Ctrl-C, a kill or the network goes on at the next pull from the bytes on
disk (huggingface_hub 2.4 restarts from zero: each download writes a fresh temporary file);
`hf_hub_download` then finds the blob and only links it into the snapshot.

No printing: progress goes to the store's ProgressEvent callback.

Over 400 lines because it covers the hub's three uses (listings, ranged header reads,
resumable downloads) and the mapping of huggingface_hub's many exceptions to tandem's.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import (
    ChecksumError,
    DiskFullError,
    DownloadError,
    NetworkError,
    RemoteNotFoundError,
    TandemError,
)

from .catalog import ModelSpec
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
    sha256_file,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_LISTING = 20_000  # files per repo listing; GGUF repos have dozens
UNREACHABLE_TTL = 60.0  # seconds an unreachable endpoint is not retried within a process

NETWORK_HINT = (
    "check your network connection and proxy (HTTPS_PROXY); HF_ENDPOINT selects a hub "
    "mirror; with HF_HUB_OFFLINE=1 only files already in the Hugging Face cache are used"
)
CACHE_SPACE_HINT = ("free some space, or move the Hugging Face cache to a larger disk "
                    "(HF_HOME or HF_HUB_CACHE)")
NOT_FOUND_HINT = (
    "check the spelling (names are case-sensitive); private or gated repos need a token: "
    "set HF_TOKEN or run `hf auth login`"
)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubConfig:
    endpoint: str
    cache_dir: Path
    offline: bool
    timeout: float

    @classmethod
    def from_env(cls) -> HubConfig:
        """The settings huggingface_hub would use, read now (same variables, same order)."""
        env = os.environ
        endpoint = (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
        if not cache:
            home = env.get("HF_HOME") or os.path.join(
                env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                "huggingface",
            )
            cache = os.path.join(home, "hub")
        offline = _truthy(env.get("HF_HUB_OFFLINE")) or _truthy(env.get("TRANSFORMERS_OFFLINE"))
        try:
            timeout = float(env.get("HF_HUB_ETAG_TIMEOUT") or 10)
        except ValueError:
            timeout = 10.0
        return cls(
            endpoint=endpoint,
            cache_dir=Path(os.path.expandvars(os.path.expanduser(cache))).absolute(),
            offline=offline,
            timeout=timeout,
        )


# An endpoint that just failed to connect is not tried again for a while, so a pull of
# two files (and the header checks before it) pays a network timeout once, not four times.
_unreachable: dict[str, tuple[float, NetworkError]] = {}


def _check_reachable(cfg: HubConfig) -> None:
    seen = _unreachable.get(cfg.endpoint)
    if seen and time.monotonic() - seen[0] < UNREACHABLE_TTL:
        raise seen[1]


def reset_reachability() -> None:
    _unreachable.clear()


def offline_error(what: str, cfg: HubConfig) -> NetworkError:
    return NetworkError(
        f"HF_HUB_OFFLINE is set and {what} is not in the Hugging Face cache ({cfg.cache_dir})",
        "unset HF_HUB_OFFLINE to download it, or pull it once while online",
    )


def hub_error(exc: BaseException, what: str, cfg: HubConfig) -> TandemError:
    """The TandemError for an exception raised by huggingface_hub or its HTTP client."""
    import httpx2
    from huggingface_hub import errors as hf

    if isinstance(exc, TandemError):
        return exc
    if isinstance(exc, hf.GatedRepoError):
        return DownloadError(
            f"{what} is in a gated repository: its license must be accepted first",
            "accept the terms on the model's hub page, then set HF_TOKEN (or `hf auth login`)",
        )
    if isinstance(exc, hf.RepositoryNotFoundError):
        return RemoteNotFoundError(f"repository not found on {cfg.endpoint}: {what}",
                                   NOT_FOUND_HINT)
    if isinstance(exc, hf.RevisionNotFoundError):
        return RemoteNotFoundError(f"revision not found on {cfg.endpoint}: {what}",
                                   NOT_FOUND_HINT)
    if isinstance(exc, hf.RemoteEntryNotFoundError):
        return RemoteNotFoundError(
            f"file not found on {cfg.endpoint}: {what}",
            "check the file name, or use user/repo:QUANT to pick a file by its quantization",
        )
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return offline_error(what, cfg)
    if isinstance(exc, (httpx2.ConnectError, httpx2.ConnectTimeout,
                        hf.LocalEntryNotFoundError)):
        err = NetworkError(f"cannot reach the Hugging Face hub at {cfg.endpoint} "
                           f"({_short(exc)})", NETWORK_HINT)
        _unreachable[cfg.endpoint] = (time.monotonic(), err)
        return err
    if isinstance(exc, httpx2.TransportError):  # reached, then lost: not worth remembering
        return NetworkError(f"the connection to {cfg.endpoint} failed while reading {what} "
                            f"({_short(exc)})", NETWORK_HINT)
    if isinstance(exc, hf.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        if status == 404:
            return RemoteNotFoundError(f"not found on {cfg.endpoint}: {what}", NOT_FOUND_HINT)
        if status in (401, 403):
            return DownloadError(f"access denied by {cfg.endpoint} (HTTP {status}) for {what}",
                                 NOT_FOUND_HINT)
        return DownloadError(f"the hub answered HTTP {status} for {what}",
                             "the hub may be busy; try again in a minute")
    if isinstance(exc, hf.FileMetadataError):
        return DownloadError(f"{cfg.endpoint} did not answer like a Hugging Face hub for {what}",
                             "check HF_ENDPOINT and your proxy settings")
    if isinstance(exc, OSError) and is_disk_full(exc):
        return DiskFullError(f"disk full while downloading {what} into {cfg.cache_dir}; "
                             "partial file removed", CACHE_SPACE_HINT)
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return DownloadError(f"the download of {what} ended early (connection cut repeatedly); "
                             "partial data removed", "run the same command again")
    return DownloadError(f"download of {what} failed: {_short(exc)}", NETWORK_HINT)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


# ---------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class RemoteFile:
    repo: str
    path: str  # inside the repo
    revision: str
    url: str  # the resolve URL on the endpoint
    location: str  # where the bytes are served (a CDN after a redirect)
    size: int | None
    etag: str | None
    commit: str | None

    @property
    def sha256(self) -> str | None:
        """The hub's ETag of an LFS file is its sha256; other ETags are git blob ids."""
        return self.etag if self.etag and SHA256_RE.match(self.etag) else None


def file_info(repo: str, path: str, revision: str = "main",
              cfg: HubConfig | None = None) -> RemoteFile:
    """HEAD on the file's resolve URL: size, sha256 (LFS ETag), commit, download location."""
    cfg = cfg or HubConfig.from_env()
    what = f"{repo}/{path}"
    if cfg.offline:
        raise offline_error(what, cfg)
    _check_reachable(cfg)
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(repo, path, revision=revision, endpoint=cfg.endpoint)
    try:
        meta = get_hf_file_metadata(url, timeout=cfg.timeout, endpoint=cfg.endpoint)
    except Exception as exc:  # noqa: BLE001 - mapped to one clear error
        raise hub_error(exc, what, cfg) from None
    if not meta.commit_hash:
        raise DownloadError(f"{cfg.endpoint} did not answer like a Hugging Face hub for {what} "
                            "(no X-Repo-Commit header)", "check HF_ENDPOINT and your proxy")
    return RemoteFile(repo, path, revision, url, meta.location or url, meta.size,
                      meta.etag, meta.commit_hash)


@dataclass(frozen=True)
class RepoEntry:
    path: str
    size: int | None
    sha256: str | None


def list_files(repo: str, revision: str = "main", cfg: HubConfig | None = None) -> list[RepoEntry]:
    """Every file of a model repo (the tree API), or of its cached snapshot when offline."""
    cfg = cfg or HubConfig.from_env()
    if cfg.offline:
        return _cached_listing(repo, revision, cfg)
    _check_reachable(cfg)
    from urllib.parse import quote

    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url: str | None = f"{cfg.endpoint}/api/models/{repo}/tree/{quote(revision, safe='')}"
    params: dict[str, Any] | None = {"recursive": "true"}
    out: list[RepoEntry] = []
    try:
        session = get_session()
        for _ in range(50):  # pages
            if url is None:
                break
            resp = session.get(url, params=params, headers=build_hf_headers(),
                               timeout=cfg.timeout)
            hf_raise_for_status(resp)
            out.extend(_parse_tree(resp.json(), repo, cfg))
            if len(out) > MAX_LISTING:
                raise DownloadError(f"{repo} lists more than {MAX_LISTING} files",
                                    "name the file: user/repo/file.gguf")
            url, params = resp.links.get("next", {}).get("url"), None
    except ValueError:
        raise DownloadError(f"{cfg.endpoint} sent an unreadable file list for {repo}",
                            "check HF_ENDPOINT") from None
    except Exception as exc:  # noqa: BLE001
        raise hub_error(exc, repo, cfg) from None
    return out


def _parse_tree(doc: Any, repo: str, cfg: HubConfig) -> Iterator[RepoEntry]:
    if not isinstance(doc, list):
        raise DownloadError(f"{cfg.endpoint} sent an unexpected file list for {repo}",
                            "check HF_ENDPOINT")
    for item in doc:
        if not isinstance(item, dict) or item.get("type") != "file":
            continue
        path = item.get("path")
        if not isinstance(path, str):
            continue
        size = item.get("size") if isinstance(item.get("size"), int) else None
        lfs = item.get("lfs") if isinstance(item.get("lfs"), dict) else {}
        oid = lfs.get("oid") if isinstance(lfs.get("oid"), str) else None
        yield RepoEntry(path, lfs.get("size", size), oid if oid and SHA256_RE.match(oid) else None)


def _storage_folder(repo: str, cfg: HubConfig) -> Path:
    return cfg.cache_dir / ("models--" + repo.replace("/", "--"))


def _cached_listing(repo: str, revision: str, cfg: HubConfig) -> list[RepoEntry]:
    """Files of the cached snapshot of `revision` (what offline mode can offer)."""
    folder = _storage_folder(repo, cfg)
    commit = revision
    ref = folder / "refs" / revision
    with contextlib.suppress(OSError):
        commit = ref.read_text(encoding="utf-8").strip()[:64]
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        raise offline_error(repo, cfg)
    out = []
    for p in sorted(snapshot.rglob("*"))[:MAX_LISTING]:
        if p.is_file():
            out.append(RepoEntry(p.relative_to(snapshot).as_posix(), p.stat().st_size, None))
    return out


def cached_file(spec: ModelSpec, cfg: HubConfig) -> Path | None:
    """The file's path in the Hugging Face cache, if it is there (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(spec.repo, spec.hub_path, cache_dir=cfg.cache_dir,
                                       revision=spec.revision)
    except Exception:  # noqa: BLE001 - a malformed cache entry is just a miss
        return None
    return Path(found) if isinstance(found, str) and os.path.isfile(found) else None


# ---------------------------------------------------------------------- progress


def progress_bar_class(progress: ProgressFn | None, model: str) -> type:
    """A tqdm look-alike for hf_hub_download's `tqdm_class` that reports ProgressEvents."""

    class _Bar:
        def __init__(self, *args: Any, total: int | None = None, initial: int = 0,
                     **kwargs: Any) -> None:
            self.total = total
            self.n = initial
            self.format_dict: dict[str, Any] = {}
            self._emit()

        def _emit(self) -> None:
            emit(progress, ProgressEvent("download", model, self.n, self.total))

        def update(self, n: int | float = 1) -> None:
            self.n = max(0, self.n + int(n))  # negative after a restart from zero
            self._emit()

        def update_transfer(self, n: int | float = 1) -> None:
            """Xet's network counter: defining it keeps Xet on one bar (`update`)."""

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None: ...

        def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None: ...

        def set_description(self, *args: Any, **kwargs: Any) -> None: ...

        def refresh(self, *args: Any, **kwargs: Any) -> None: ...

        def close(self) -> None: ...

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.close()

    return _Bar


# ------------------------------------------------------------------------ source


class HubSource:
    """`Source` that fetches a catalog or hub file into the Hugging Face cache and links it
    into the store (symlink, else hard link, else copy), after checking its sha256."""

    name = "hub"

    def available_for(self, spec: ModelSpec) -> bool:
        cfg = HubConfig.from_env()
        return not cfg.offline or cached_file(spec, cfg) is not None

    def fetch(self, spec: ModelSpec, dest: Path, tmp_root: Path,
              progress: ProgressFn | None) -> FetchResult:
        cfg = HubConfig.from_env()
        what = spec.key
        info: RemoteFile | None = None
        blob: Path | None = None
        if cfg.offline:
            blob = cached_file(spec, cfg)
            if blob is None:
                raise offline_error(what, cfg)
        else:
            try:
                info = file_info(spec.repo, spec.hub_path, spec.revision, cfg)
            except NetworkError:
                blob = cached_file(spec, cfg)  # like huggingface_hub: fall back to the cache
                if blob is None:
                    raise
        if info is not None:
            if spec.sha256 and info.sha256 and info.sha256 != spec.sha256.lower():
                raise ChecksumError(
                    f"{what} on the hub has sha256 {info.sha256} but the catalog expects "
                    f"{spec.sha256}; nothing was downloaded",
                    "the file changed upstream; update tandem, or report it",
                )
            blob = self._download(spec, info, cfg, progress)
        assert blob is not None
        digest = self._verify(spec, blob, info, progress)
        self._place(blob, dest, spec)
        commit = (info.commit or "")[:12] if info else "cache"
        return FetchResult(size=dest.stat().st_size, sha256=digest,
                           source=f"hub:{spec.repo}@{commit}")

    def _download(self, spec: ModelSpec, info: RemoteFile, cfg: HubConfig,
                  progress: ProgressFn | None) -> Path:
        from huggingface_hub import hf_hub_download

        if info.size and info.etag:
            blob = _storage_folder(spec.repo, cfg) / "blobs" / info.etag
            if not blob.exists():
                kept = _incomplete(blob).stat().st_size if _incomplete(blob).exists() else 0
                try:
                    check_free_space(cfg.cache_dir, info.size - min(kept, info.size),
                                     spec.filename)
                except DiskFullError as exc:
                    raise DiskFullError(exc.message, CACHE_SPACE_HINT) from None
            if info.sha256:  # resumable: the bytes by Range, the snapshot's link by hf
                _fetch_blob(spec, info, cfg, progress)
        try:
            pointer = hf_hub_download(
                spec.repo, spec.hub_path, revision=spec.revision, cache_dir=cfg.cache_dir,
                endpoint=cfg.endpoint, etag_timeout=cfg.timeout,
                tqdm_class=progress_bar_class(progress, spec.name),
            )
        except Exception as exc:  # noqa: BLE001 - KeyboardInterrupt passes through
            raise hub_error(exc, spec.key, cfg) from None
        return Path(pointer)

    def _verify(self, spec: ModelSpec, path: Path, info: RemoteFile | None,
                progress: ProgressFn | None) -> str:
        """Hash the cached file; a mismatch removes it from the cache too."""
        blob = path.resolve()
        expected = spec.sha256 or (info.sha256 if info else None)
        if expected is None and SHA256_RE.match(blob.name):
            expected = blob.name  # the cache names LFS blobs by their sha256
        total = blob.stat().st_size
        emit(progress, ProgressEvent("verify", spec.name, 0, total))
        digest = sha256_file(blob, progress, spec.name)
        if expected is not None and digest != expected.lower():
            remove_quietly(blob)
            if path != blob:
                remove_quietly(path)
            raise ChecksumError(
                f"{spec.key} from the hub has sha256 {digest}, expected {expected}; "
                "file removed from the Hugging Face cache",
                "run the command again; if it persists the upload is corrupt, please report it",
            )
        return digest

    @staticmethod
    def _place(path: Path, dest: Path, spec: ModelSpec) -> None:
        """Atomically put the cached file at `dest`: no second copy where links work."""
        blob = path.resolve()
        partial = partial_path(dest)
        remove_quietly(partial)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            try:
                os.symlink(blob, partial)
            except (OSError, NotImplementedError):
                try:
                    os.link(blob, partial)
                except OSError:
                    check_free_space(dest.parent, blob.stat().st_size, spec.filename)
                    shutil.copyfile(blob, partial)
            os.replace(partial, dest)
        except OSError as exc:
            remove_quietly(partial)
            if is_disk_full(exc):
                raise disk_full_error(spec.filename, dest.parent) from None
            raise DownloadError(f"cannot place {spec.filename} in {dest.parent}: {exc}",
                                "check that directory's permissions, or set TANDEM_HOME") from None
        except BaseException:
            remove_quietly(partial)
            raise


# ------------------------------------------------------------- resumed downloads


DOWNLOAD_RETRIES = 5  # dropped connections within one pull, each resumed where it broke


def _incomplete(blob: Path) -> Path:
    """Where a blob's bytes gather (the name huggingface_hub itself resumed from until 2.3)."""
    return blob.with_name(blob.name + ".incomplete")


def _transfer_headers(info: RemoteFile, cfg: HubConfig) -> dict[str, str]:
    """huggingface_hub's headers (the token) for the hub itself; none for a CDN it redirects to."""
    from urllib.parse import urlsplit

    from huggingface_hub.utils import build_hf_headers

    same_host = urlsplit(info.location).netloc == urlsplit(cfg.endpoint).netloc
    return build_hf_headers() if same_host else {}


def _fetch_blob(spec: ModelSpec, info: RemoteFile, cfg: HubConfig,
                progress: ProgressFn | None) -> None:
    """An LFS file's bytes into the cache's blobs/<sha256>, going on from the bytes an earlier
    pull left in its .incomplete file (HTTP Range). Under huggingface_hub's lock for the
    blob; a failure keeps the bytes for the next pull, but for a full disk."""
    from huggingface_hub.utils import WeakFileLock

    folder = _storage_folder(spec.repo, cfg)
    blob = folder / "blobs" / str(info.etag)
    partial = _incomplete(blob)
    lock = cfg.cache_dir / ".locks" / folder.name / f"{info.etag}.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        blob.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(str(lock)):
            if not blob.exists():
                _ranged_download(info, partial, cfg, progress, spec)
                os.replace(partial, blob)
    except OSError as exc:
        if is_disk_full(exc):
            remove_quietly(partial)
        raise hub_error(exc, spec.key, cfg) from None


def _ranged_download(info: RemoteFile, partial: Path, cfg: HubConfig,
                     progress: ProgressFn | None, spec: ModelSpec) -> None:
    """Append to `partial` until it holds the file's `info.size` bytes; a dropped connection
    is asked again from where it broke, DOWNLOAD_RETRIES times."""
    import httpx2
    from huggingface_hub.utils import get_session

    headers = {**_transfer_headers(info, cfg), "Accept-Encoding": "identity"}
    size = int(info.size or 0)
    drops = 0
    with open(partial, "ab") as out:
        while True:
            if out.tell() > size:  # not this file's bytes
                out.truncate(0)
            if out.tell() == size:
                return
            emit(progress, ProgressEvent("download", spec.name, out.tell(), size))
            try:
                _append_rest(get_session(), info, headers, out, cfg, progress, spec)
            except httpx2.TransportError as exc:
                drops += 1
                if drops > DOWNLOAD_RETRIES:
                    raise hub_error(exc, spec.key, cfg) from None
            except OSError:
                raise  # the disk's: _fetch_blob decides what stays
            except Exception as exc:  # noqa: BLE001 - KeyboardInterrupt passes through
                raise hub_error(exc, spec.key, cfg) from None


def _append_rest(session: Any, info: RemoteFile, headers: dict[str, str], out: Any,
                 cfg: HubConfig, progress: ProgressFn | None, spec: ModelSpec) -> None:
    """One GET of the bytes `out` lacks (Range from its end), appended as they come."""
    from huggingface_hub.utils import hf_raise_for_status

    start = out.tell()
    ask = {**headers, "Range": f"bytes={start}-"} if start else headers
    with session.stream("GET", info.location, headers=ask, timeout=cfg.timeout,
                        follow_redirects=True) as resp:
        hf_raise_for_status(resp)
        if start and resp.status_code == 200:  # the server ignores Range: all of it again
            out.truncate(0)
        elif start and not resp.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
            raise DownloadError(
                f"{cfg.endpoint} answered a resumed download of {spec.key} with bytes "
                f"{resp.headers.get('Content-Range') or '(no Content-Range)'}, not from {start}",
                "run the command again; if it persists, use another endpoint (HF_ENDPOINT)")
        for chunk in resp.iter_bytes():
            out.write(chunk)
            emit(progress, ProgressEvent("download", spec.name, out.tell(), info.size))


# ---------------------------------------------------------------- remote headers


@dataclass(frozen=True)
class RemoteHeader:
    header: Any  # tandem.models.gguf_meta.GGUFHeader (metadata only)
    info: RemoteFile
    requests: int
    bytes_fetched: int


def read_remote_header(repo: str, path: str, revision: str = "main",
                       cfg: HubConfig | None = None) -> RemoteHeader:
    """The GGUF metadata of a hub file, read with Range requests: never a weight byte."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    from .gguf_meta import read_gguf_header
    from .http_range import RangeReader

    cfg = cfg or HubConfig.from_env()
    info = file_info(repo, path, revision, cfg)
    headers = _transfer_headers(info, cfg)  # the token goes to the hub only, never to a CDN
    what = f"{repo}/{path}"
    import httpx2

    reader = RangeReader(
        info.location, get_session(), headers=headers, size=info.size, timeout=cfg.timeout,
        name=what, raise_for_status=hf_raise_for_status,
        on_error=lambda exc: hub_error(exc, what, cfg),
        retry_on=(httpx2.TransportError,),
    )
    header = read_gguf_header(reader, exact=True, tensors=False)
    header.source_name = what
    return RemoteHeader(header, info, reader.requests, reader.bytes_fetched)
