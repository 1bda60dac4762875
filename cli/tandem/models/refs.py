"""Model references as users type them, parsed without any network access:

    qwen2.5-coder-32b                 a catalog pair (its target or draft, by role)
    qwen2.5-coder-0.5b-instruct-q4_k_m   a catalog model
    user/repo:Q4_K_M                  a hub repo and a quantization, as llama.cpp's -hf
    user/repo                         the same with Q4_K_M, llama.cpp's default
    user/repo/file.gguf               one file of a hub repo (subfolders allowed)
    ./file.gguf, /abs/file.gguf       a local file (any existing path is local)

Also `pick_quant`, which chooses the file for a quantization from a repo listing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import ModelError, RemoteNotFoundError, UnsafePathError, UsageError

from . import catalog
from .catalog import ModelSpec

DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when no tag is given
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}"
_REPO_RE = re.compile(rf"^{_NAME}/{_NAME}$")
_QUANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_HUB_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/",
                 "hf.co/")
_FORMS_HINT = ("use a catalog name (`tandem pairs`), user/repo:QUANT, user/repo/file.gguf, "
               "or a path to a local .gguf file")


@dataclass(frozen=True)
class ModelRef:
    text: str  # as typed
    kind: str  # "local" | "catalog" | "hub_file" | "hub_quant"
    path: Path | None = None  # local
    spec: ModelSpec | None = None  # catalog, hub_file
    repo: str | None = None  # hub_quant
    quant: str | None = None  # hub_quant
    revision: str = "main"


def hub_spec(repo: str, path: str, revision: str = "main") -> ModelSpec:
    """A ModelSpec for any hub file (no size, hash or mirror known in advance)."""
    check_repo_path(path)
    folder, _, filename = path.rpartition("/")
    return ModelSpec(name=f"{repo}/{path}", repo=repo, filename=filename, subfolder=folder,
                     revision=revision)


def check_repo_path(path: str) -> None:
    """Reject file names that would escape the repo folder in the store or the hub cache."""
    parts = path.split("/")
    bad = (
        not path
        or len(path) > 1000
        or "\\" in path
        or "\x00" in path
        or any(p in ("", ".", "..") or len(p) > 255 for p in parts)
        or re.match(r"^[A-Za-z]:", path) is not None
    )
    if bad:
        raise UnsafePathError(
            f"unsafe file name {path!r}: it would point outside the model store",
            "file names are relative paths inside the repository, without '..' or '\\'",
        )


def parse_ref(text: str, role: str | None = None) -> ModelRef:
    """Parse a reference; `role` ("target"/"draft") picks that model of a catalog pair."""
    t = text.strip()
    if not t:
        raise UsageError("empty model reference", _FORMS_HINT)
    if "\x00" in t:
        raise UnsafePathError("model reference contains a NUL byte", _FORMS_HINT)
    local = _local(t)
    if local is not None:
        return local
    pair = catalog.find_pair(t)
    if pair is not None:
        if role not in ("target", "draft"):
            raise UsageError(f"'{t}' is a pair, not one model",
                             f"use its target ({pair.target.name})" + (
                                 f" or draft ({pair.draft.name})" if pair.draft else ""))
        if role == "draft" and pair.draft is None:
            raise UsageError(f"pair '{t}' has no draft model (it drafts from "
                             f"{catalog.NO_DRAFT_MODEL.split(' (')[0]})",
                             "name a draft model, or use the pair as a target")
        return ModelRef(t, "catalog", spec=pair.target if role == "target" else pair.draft)
    model = catalog.get_model(t)
    if model is not None:
        return ModelRef(t, "catalog", spec=model)
    return _hub(t)


def _local(t: str) -> ModelRef | None:
    path = Path(t).expanduser()
    explicit = t.startswith(("/", "./", "../", "~", ".\\")) or re.match(r"^[A-Za-z]:[\\/]", t)
    if not explicit and not path.exists():
        return None
    if not path.exists():
        raise ModelError(f"model file not found: {path}", "check the path")
    if path.is_dir():
        raise ModelError(f"{path} is a directory, not a GGUF file", "pass the .gguf file itself")
    if not path.is_file():  # a FIFO would block the header read waiting for a writer
        raise ModelError(f"{path} is not a regular file (a pipe or a device)",
                         "pass a .gguf file on disk")
    return ModelRef(t, "local", path=path.absolute())


def _hub(t: str) -> ModelRef:
    for prefix in _HUB_PREFIXES:
        if t.lower().startswith(prefix):
            t = t[len(prefix):]
            break
    repo, sep, quant = t.partition(":")
    if sep and _REPO_RE.match(repo):
        if not _QUANT_RE.match(quant):
            raise UsageError(f"bad quantization tag {quant!r} in {t!r}", "e.g. user/repo:Q4_K_M")
        return ModelRef(t, "hub_quant", repo=repo, quant=quant)
    if _REPO_RE.match(t):
        return ModelRef(t, "hub_quant", repo=t, quant=DEFAULT_QUANT)
    parts = t.split("/", 2)
    if len(parts) == 3 and _REPO_RE.match(f"{parts[0]}/{parts[1]}"):
        repo, path = f"{parts[0]}/{parts[1]}", parts[2]
        # "resolve/<rev>/" and "blob/<rev>/" come from pasted hub URLs
        m = re.match(r"^(?:resolve|blob)/([^/]+)/(.+)$", path)
        revision = "main"
        if m:
            revision, path = m.group(1), m.group(2)
        check_repo_path(path)
        if not path.lower().endswith(".gguf"):
            raise UsageError(f"{path!r} is not a .gguf file", _FORMS_HINT)
        if SPLIT_RE.search(path):
            raise UsageError(
                f"{path} is one part of a split GGUF; tandem needs a single-file GGUF",
                "pick a single-file quantization, or merge the parts with "
                "`llama-gguf-split --merge` and pass the local file",
            )
        return ModelRef(t, "hub_file", spec=hub_spec(repo, path, revision), repo=repo,
                        revision=revision)
    if "/" in t and ".." in t.split("/"):
        check_repo_path(t)
    raise UsageError(f"unknown model or pair '{t}'", _FORMS_HINT)


def reference_form(word: str) -> str | None:
    """How one word of a command line reads, from its form alone (no network, no disk):
    "model" (a path or hub file ending in .gguf, user/repo:QUANT, a hub URL), "repo" (a bare
    user/repo: llama.cpp's -hf without a quant, but prose too, such as and/or), or None."""
    t = word.strip()
    if not t or t != word or len(t) > 1000 or any(c.isspace() for c in t):
        return None
    if t.lower().startswith(_HUB_PREFIXES) or t.lower().endswith(".gguf"):
        return "model"
    repo, sep, quant = t.partition(":")
    if _REPO_RE.match(repo):
        return ("model" if _QUANT_RE.match(quant) else None) if sep else "repo"
    return None


# what a model family's names drop: sizes (7B, 0.5B, A3B, 270M), quantizations, the format
_NOT_FAMILY = re.compile(r"^(?:\d+(?:\.\d+)?[bm]|a\d+(?:\.\d+)?b|i?q\d.*|f16|bf16|f32|gguf)$")


def family(repo: str) -> str:
    """A model family from a hub repository's name: Qwen2.5-Coder-7B-Instruct-GGUF and
    Qwen2.5-Coder-0.5B-Instruct-GGUF are both "qwen2.5-coder-instruct" (whoever publishes
    them): the family a target's catalog draft is looked for in."""
    name = repo.rsplit("/", 1)[-1].lower()
    return "-".join(p for p in name.split("-") if p and not _NOT_FAMILY.match(p))


def _quant_label(path: str) -> str:
    name = SPLIT_RE.sub(".gguf", path.rsplit("/", 1)[-1])
    return re.split(r"[-.]", name[:-5])[-1]


def pick_quant(files: list[str], quant: str, repo: str) -> str:
    """The one GGUF file of `repo` for `quant` (case-insensitive, as llama.cpp's -hf tag):
    files whose name has the quant as a whole token win over ones that merely contain it."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")
             and not f.rsplit("/", 1)[-1].lower().startswith("mmproj")]
    q = quant.lower()

    def tokens(f: str) -> list[str]:
        return re.split(r"[-./]", f.lower()[:-5])

    found = [f for f in ggufs if q in tokens(f)] or [f for f in ggufs if q in f.lower()]
    if not found:
        quants = sorted({_quant_label(f) for f in ggufs})
        raise RemoteNotFoundError(
            f"no {quant} GGUF file in {repo}",
            f"available: {', '.join(quants[:20])}" if quants else f"{repo} has no GGUF files",
        )
    singles = [f for f in found if not SPLIT_RE.search(f)]
    if len(singles) == 1:
        return singles[0]
    if len(singles) > 1:
        shown = ", ".join(singles[:8])
        raise UsageError(f"{quant} matches {len(singles)} files in {repo}: {shown}",
                         f"name the file: {repo}/FILE.gguf")
    raise UsageError(
        f"{quant} in {repo} is split into {len(found)} files; tandem needs a single-file GGUF",
        "pick another quantization or repository, or merge the parts with "
        "`llama-gguf-split --merge` and pass the local file",
    )
