"""Loading a pair: the vocabularies checked from the GGUF headers first, then the models, and
the contexts made on demand and kept for reuse (spec-bench sweeps batch sizes and threads)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.backend.llama import Context, Model


def check_pair(target_path: Path, draft_path: Path) -> None:
    """llama.cpp's vocabulary rules, from the GGUF headers, before any weights are loaded."""
    from tandem.models.gguf_meta import read_gguf_header
    from tandem.models.vocab import VocabInfo, check_compatible

    target = VocabInfo.from_header(read_gguf_header(target_path))
    draft = VocabInfo.from_header(read_gguf_header(draft_path))
    check_compatible(target, draft, target_path.name, draft_path.name)


def draft_paths(draft_path: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """One draft path, several (spec-bench compares drafts), or none, as a list."""
    if draft_path is None:
        return []
    if isinstance(draft_path, (str, Path)):
        return [Path(draft_path)]
    return [Path(p) for p in draft_path]


def load_drafts(paths: Sequence[Path], load: Callable[[Path, str], Model]
                ) -> tuple[dict[str, Model], dict[str, Path]]:
    """The draft models by label (the file name; `name#2` for a second file of that name)
    and their paths. `load(path, label)` loads one."""
    models: dict[str, Model] = {}
    files: dict[str, Path] = {}
    for p in paths:
        label = p.name if p.name not in models else f"{p.name}#{len(models) + 1}"
        models[label] = load(p, label)
        files[label] = p
    return models, files


class ContextCache:
    """Contexts by (owner, ContextParams), made on demand; per owner the least recently used
    ones beyond `limit` are closed, unless one is in use (`in_use()`)."""

    def __init__(self, limit: int, in_use: Callable[[], Sequence[Context | None]]):
        self.limit = limit
        self._in_use = in_use
        self._contexts: dict[tuple, Context] = {}

    def get(self, owner: str, model: Model, params: ContextParams) -> Context:
        key = (owner, params)
        ctx = self._contexts.pop(key, None)
        if ctx is None:
            mine = [k for k in self._contexts if k[0] == owner]
            busy = self._in_use()
            for old in mine[:max(0, len(mine) - self.limit + 1)]:
                if self._contexts[old] not in busy:
                    self._contexts.pop(old).close()
            from tandem.engine.backend.llama import Context  # the backend, loaded with a model

            ctx = Context(model, params)
        self._contexts[key] = ctx  # re-inserted: most recently used last
        return ctx

    def close(self) -> None:
        for ctx in self._contexts.values():
            ctx.close()
        self._contexts.clear()
