"""Putting a target and a draft together: resolve references, read both GGUF headers
(from disk, or over HTTP range requests before anything is downloaded), apply llama.cpp's
vocabulary rules (tandem.models.vocab), suggest catalog drafts, and pull a pair into the store.

Core only: results are returned as data; progress and notes go through callbacks.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tandem.errors import NetworkError, TandemError, VocabMismatchError

from . import catalog
from .catalog import ModelSpec, PairSpec
from .gguf_meta import GGUFHeader, read_gguf_header
from .hub import HubConfig, list_files, read_remote_header
from .refs import ModelRef, hub_spec, parse_ref, pick_quant
from .store import ProgressFn, Store
from .vocab import VocabInfo, compatibility_problems

NoteFn = Callable[[str], None]

_VOCAB_HINT = ("pick a draft from the same model family; "
               "`tandem pairs suggest TARGET` lists compatible catalog drafts")


@dataclass(frozen=True)
class ResolvedModel:
    """A resolved reference: a local file, or a hub file (catalog or not) for the store."""

    label: str
    spec: ModelSpec | None = None
    path: Path | None = None

    @property
    def ref(self) -> str:
        """Full reference: the local path, or repo/file on the hub."""
        return str(self.path) if self.path else self.spec.key  # type: ignore[union-attr]


def resolve(text: str, role: str | None = None, cfg: HubConfig | None = None) -> ResolvedModel:
    """A ResolvedModel for what the user typed; `user/repo:QUANT` lists the repo to pick the
    file."""
    ref: ModelRef = parse_ref(text, role)
    if ref.kind == "local":
        return ResolvedModel(ref.path.name, path=ref.path)  # type: ignore[union-attr]
    if ref.kind == "hub_quant":
        files = [e.path for e in list_files(ref.repo, ref.revision, cfg)]  # type: ignore[arg-type]
        path = pick_quant(files, ref.quant, ref.repo)  # type: ignore[arg-type]
        spec = hub_spec(ref.repo, path, ref.revision)  # type: ignore[arg-type]
        return ResolvedModel(spec.key, spec=spec)
    spec = ref.spec
    assert spec is not None
    return ResolvedModel(spec.name if ref.kind == "catalog" else spec.key, spec=spec)


def pair_models(pair: PairSpec) -> tuple[ResolvedModel, ResolvedModel | None]:
    """The pair's target and draft (None: a pair without a draft model)."""
    return (ResolvedModel(pair.target.name, spec=pair.target),
            ResolvedModel(pair.draft.name, spec=pair.draft) if pair.draft else None)


def local_path(model: ResolvedModel, store: Store) -> Path | None:
    """Where the model is on disk now, or None if it must be downloaded."""
    if model.path is not None:
        return model.path
    assert model.spec is not None
    return store.path_for(model.spec) if store.is_present(model.spec) else None


@dataclass(frozen=True)
class HeaderRead:
    """A header and where it came from: "local" or "hub" (then what it cost)."""

    header: GGUFHeader
    where: str
    size: int | None  # file size when known
    requests: int = 0
    bytes_fetched: int = 0


def read_header(model: ResolvedModel, store: Store, cfg: HubConfig | None = None) -> HeaderRead:
    path = local_path(model, store)
    if path is not None:
        header = read_gguf_header(path)
        return HeaderRead(header, "local", path.stat().st_size)
    assert model.spec is not None
    spec = model.spec
    remote = read_remote_header(spec.repo, spec.hub_path, spec.revision, cfg)
    return HeaderRead(remote.header, "hub", remote.info.size, remote.requests,
                      remote.bytes_fetched)


@dataclass(frozen=True)
class Compat:
    target: ResolvedModel
    draft: ResolvedModel
    target_header: HeaderRead
    draft_header: HeaderRead
    problems: tuple[str, ...]

    @property
    def compatible(self) -> bool:
        return not self.problems

    def error(self) -> VocabMismatchError:
        return VocabMismatchError(
            f"draft {self.draft.label} cannot speculate for target {self.target.label}: "
            + "; ".join(self.problems),
            _VOCAB_HINT,
        )


def compare(target: ResolvedModel, draft: ResolvedModel, t: HeaderRead, d: HeaderRead) -> Compat:
    problems = tuple(compatibility_problems(VocabInfo.from_header(t.header),
                                            VocabInfo.from_header(d.header)))
    return Compat(target, draft, t, d, problems)


def check(target: ResolvedModel, draft: ResolvedModel, store: Store,
          cfg: HubConfig | None = None) -> Compat:
    """Compare the two vocabularies, reading headers locally or over HTTP (no weights)."""
    t = read_header(target, store, cfg)
    d = read_header(draft, store, cfg)
    return compare(target, draft, t, d)


# ------------------------------------------------------------------------ suggest


@dataclass(frozen=True)
class Suggestion:
    draft: ResolvedModel
    pairs: tuple[str, ...]  # catalog pairs that use this draft
    problems: tuple[str, ...] = ()
    error: TandemError | None = None  # the draft's header could not be read
    header: HeaderRead | None = None

    @property
    def compatible(self) -> bool:
        return self.error is None and not self.problems


def catalog_drafts() -> list[tuple[ModelSpec, tuple[str, ...]]]:
    """Distinct draft models of the catalog, with the pairs using each."""
    by_key: dict[str, tuple[ModelSpec, list[str]]] = {}
    for pair in catalog.load_catalog().values():
        if pair.draft is not None:
            by_key.setdefault(pair.draft.key, (pair.draft, []))[1].append(pair.name)
    return [(spec, tuple(names)) for spec, names in by_key.values()]


def suggest(target: ResolvedModel, store: Store, cfg: HubConfig | None = None,
            workers: int = 4) -> tuple[HeaderRead, list[Suggestion]]:
    """Every catalog draft checked against `target` (header range reads run in parallel)."""
    t = read_header(target, store, cfg)
    drafts = [(spec, names) for spec, names in catalog_drafts()
              if target.spec is None or spec.key != target.spec.key]

    def one(item: tuple[ModelSpec, tuple[str, ...]]) -> Suggestion:
        spec, names = item
        model = ResolvedModel(spec.name, spec=spec)
        try:
            d = read_header(model, store, cfg)
        except TandemError as exc:
            return Suggestion(model, names, error=exc)
        return Suggestion(model, names, compare(target, model, t, d).problems, header=d)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return t, list(pool.map(one, drafts))


# --------------------------------------------------------------------------- pull


@dataclass
class PullResult:
    target: Path
    draft: Path | None  # None: a pair without a draft model
    checked_before_download: bool
    compat: Compat | None = None
    fetched: list[str] = field(default_factory=list)  # labels of models downloaded now


def pull(target: ResolvedModel, draft: ResolvedModel | None, store: Store,
         cfg: HubConfig | None = None, *,
         progress: ProgressFn | None = None, note: NoteFn | None = None,
         precheck: bool = True) -> PullResult:
    """Check the vocabularies from the headers, download what is missing, check again.

    The first check reads headers over HTTP, so an incompatible pair is refused before any
    weights are downloaded. If the hub cannot be reached but every missing file has a
    mirror, the check is done after the download instead. Without a draft (a pair with no
    draft model) only the target is fetched and there is nothing to compare.
    """
    cfg = cfg or HubConfig.from_env()
    say = note or (lambda _msg: None)
    before: Compat | None = None
    if precheck and draft is not None:
        try:
            before = check(target, draft, store, cfg)
        except NetworkError as exc:
            missing = [m for m in (target, draft) if local_path(m, store) is None]
            if not all(m.spec is not None and m.spec.mirrors for m in missing):
                raise
            say(f"vocabularies not checked before download ({exc.message}); "
                "they are checked once the files are on disk")
        else:
            if not before.compatible:
                raise before.error()
    fetched = []
    paths: dict[str, Path | None] = {"draft": None}
    for role, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        path = local_path(model, store)
        if path is None:
            assert model.spec is not None
            path = store.ensure(model.spec, progress=progress)
            fetched.append(model.label)
        paths[role] = path
    after = before
    if draft is not None and (before is None or fetched):  # check what will actually be loaded
        after = check(ResolvedModel(target.label, path=paths["target"]),
                      ResolvedModel(draft.label, path=paths["draft"]), store, cfg)
        if not after.compatible:
            raise after.error()
    return PullResult(paths["target"], paths["draft"], before is not None, after, fetched)  # type: ignore[arg-type]
