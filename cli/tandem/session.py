"""Load a target/draft pair once and run generate() with a chosen strategy.

`run`, `chat` and `spec-bench` all go through PairSession.generate, so a benchmark measures
exactly what users run.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

from tandem import chat_template
from tandem.engine.costs import CostModel, calibrate
from tandem.engine.drafters import (DraftModelDrafter, Drafter, HybridDrafter, NgramDrafter,
                                    NoDrafter)
from tandem.engine.llama import Context, ContextParams, Model
from tandem.engine.speculative import GenParams, generate
from tandem.errors import UsageError

STRATEGIES = ("none", "draft", "ngram", "hybrid", "auto")


@dataclass(frozen=True)
class DraftParams:
    n_max: int = 4
    n_min: int = 0
    p_min: float = 0.5

    def __post_init__(self):
        if not 0 <= self.n_min <= self.n_max:
            raise UsageError(f"draft min must be in 0..draft max ({self.n_max}), got {self.n_min}",
                             None)
        if not 0.0 <= self.p_min <= 1.0:
            raise UsageError(f"draft p-min must be in [0, 1], got {self.p_min}", None)


@dataclass(frozen=True)
class SessionOptions:
    strategy: str = "draft"
    draft: DraftParams = DraftParams()
    target_ctx: ContextParams = ContextParams()
    draft_ctx: ContextParams | None = None  # None: same as the target's
    target_gpu_layers: int = 0
    draft_gpu_layers: int = 0
    verbose: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise UsageError(f"unknown strategy {self.strategy!r}",
                             f"choose one of: {', '.join(STRATEGIES)}")


def check_pair(target_path: Path, draft_path: Path) -> None:
    """llama.cpp's vocabulary rules, from the GGUF headers, before any weights are loaded."""
    from tandem.gguf_meta import read_gguf_header
    from tandem.vocab import VocabInfo, check_compatible

    target = VocabInfo.from_header(read_gguf_header(target_path))
    draft = VocabInfo.from_header(read_gguf_header(draft_path))
    check_compatible(target, draft, target_path.name, draft_path.name)


class PairSession:
    def __init__(self, target_path: str | Path, draft_path: str | Path | None,
                 options: SessionOptions = SessionOptions()):
        self.options = options
        self.target_path = Path(target_path)
        self.draft_path = Path(draft_path) if draft_path else None
        if options.strategy == "draft" and self.draft_path is None:
            raise UsageError(f"strategy {options.strategy!r} needs a draft model",
                             "pass --model-draft PATH, a pair name, or --strategy ngram")
        if self.draft_path is not None:
            check_pair(self.target_path, self.draft_path)
        self.target = Model(self.target_path, options.target_gpu_layers, verbose=options.verbose)
        self.target_ctx = Context(self.target, options.target_ctx)
        self.draft = self.draft_ctx = None
        self._costs: CostModel | None = None
        if self.draft_path is not None:
            self.draft = Model(self.draft_path, options.draft_gpu_layers, verbose=options.verbose)
            self.draft_ctx = Context(self.draft, options.draft_ctx or options.target_ctx)

    def close(self) -> None:
        for obj in (self.draft_ctx, self.draft, self.target_ctx, self.target):
            if obj is not None:
                obj.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def drafter(self, strategy: str | None = None, draft: DraftParams | None = None) -> Drafter:
        strategy = strategy or self.options.strategy
        draft = draft or self.options.draft
        if strategy not in STRATEGIES:
            raise UsageError(f"unknown strategy {strategy!r}",
                             f"choose one of: {', '.join(STRATEGIES)}")
        if strategy == "none":
            return NoDrafter()
        if strategy == "ngram":
            return NgramDrafter()
        model = None
        if self.draft_ctx is not None:
            model = DraftModelDrafter(self.draft_ctx, draft.n_min, draft.p_min)
        if strategy == "draft":
            if model is None:
                raise UsageError("strategy 'draft' needs a draft model",
                                 "pass --model-draft PATH, or use --strategy ngram")
            return model
        if strategy == "hybrid":
            return HybridDrafter(model, n_min=draft.n_min, n_max=draft.n_max)
        # auto: adaptive lengths from this machine's measured costs, plus the plain fallback
        return HybridDrafter(model, costs=self.costs(), n_min=draft.n_min, n_max=draft.n_max,
                             adaptive=True, guard=True, name="auto")

    def costs(self) -> CostModel:
        """This pair's cost model on this machine: cached, else calibrated once (seconds)."""
        if self._costs is None:
            path = self._costs_path()
            cached = CostModel.load(path) if path else None
            if cached is None or not cached.verify:
                probe = self.target.tokenize("def main():\n    print('calibrating')\n",
                                             add_special=False, parse_special=False)
                cached = calibrate(self.target_ctx, self.draft_ctx, probe)
                if path:
                    try:
                        cached.save(path)
                    except OSError:
                        pass  # a read-only home only costs a recalibration next time
            self._costs = cached
        return self._costs

    def _costs_path(self) -> Path | None:
        import hashlib
        import platform

        from tandem.store import tandem_home

        parts = [platform.node(), platform.machine(), str(self.options.target_ctx.n_threads),
                 str(self.options.target_gpu_layers), str(self.options.draft_gpu_layers)]
        for p in (self.target_path, self.draft_path):
            if p is not None:
                parts += [p.name, str(p.stat().st_size)]
        key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        return tandem_home() / "costs" / f"{key}.json"

    def prompt_tokens(self, messages: Sequence[dict], raw: bool = False) -> list[int]:
        text = chat_template.plain(messages) if raw else chat_template.render(self.target, messages)
        bos_text = self.target.token_text(self.target.bos) if self.target.bos >= 0 else ""
        # templates often write the BOS themselves; never add a second one
        add_bos = self.target.add_bos and not (bos_text and text.startswith(bos_text))
        tokens = self.target.tokenize(text, add_special=False, parse_special=True)
        if add_bos:
            tokens = [self.target.bos] + tokens
        return tokens

    def generate(self, prompt: Sequence[int], gen: GenParams, strategy: str | None = None,
                 draft: DraftParams | None = None) -> Iterator:
        draft = draft or self.options.draft
        drafter = self.drafter(strategy, draft)
        if drafter.name == "none":
            gen = replace(gen, n_max=0)
        else:
            gen = replace(gen, n_max=draft.n_max)
        return generate(self.target_ctx, prompt, drafter, gen)
