"""Draft/target vocabulary compatibility, as llama.cpp decides it before speculating.

Mirrors `common_speculative_are_compatible` (common/speculative.cpp) and the defaults of
`llama_vocab::impl::load` (src/llama-vocab.cpp) in the llama.cpp vendored by
llama-cpp-python 0.3.36, computed from GGUF metadata alone so no model has to be loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.errors import GGUFFormatError, VocabMismatchError

if TYPE_CHECKING:
    from tandem.models.gguf_meta import GGUFHeader

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL

# enum llama_vocab_type (include/llama.h)
VOCAB_NONE, VOCAB_SPM, VOCAB_BPE, VOCAB_WPM = 0, 1, 2, 3
VOCAB_UGM, VOCAB_RWKV, VOCAB_PLAMO2, VOCAB_TEST = 4, 5, 6, 7
VOCAB_TYPE_NAMES = {
    VOCAB_NONE: "none", VOCAB_SPM: "SPM", VOCAB_BPE: "BPE", VOCAB_WPM: "WPM",
    VOCAB_UGM: "UGM", VOCAB_RWKV: "RWKV", VOCAB_PLAMO2: "PLaMo-2", VOCAB_TEST: "test",
}

# tokenizer.ggml.model -> (vocab type, default BOS id, default EOS id)
_TOKENIZER_MODELS: dict[str, tuple[int, int, int]] = {
    "llama": (VOCAB_SPM, 1, 2),
    "bert": (VOCAB_WPM, 101, TOKEN_NULL),
    "gpt2": (VOCAB_BPE, 11, 11),
    "hybriddna": (VOCAB_BPE, 11, 11),
    "whitespace": (VOCAB_BPE, 11, 11),
    "t5": (VOCAB_UGM, TOKEN_NULL, 1),
    "rwkv": (VOCAB_RWKV, TOKEN_NULL, TOKEN_NULL),
    "test": (VOCAB_TEST, TOKEN_NULL, TOKEN_NULL),
    "plamo2": (VOCAB_PLAMO2, 1, 2),
    "gemma4": (VOCAB_BPE, TOKEN_NULL, TOKEN_NULL),
}
# vocab type -> default (add_bos, add_eos); types not listed keep the member defaults (False).
_TYPE_ADD_DEFAULTS = {
    VOCAB_SPM: (True, False),
    VOCAB_WPM: (True, False),
    VOCAB_UGM: (False, True),
    VOCAB_RWKV: (False, False),
}
# BPE pre-tokenizers that switch add_bos on, or drop the default BOS id (llama-vocab.cpp).
_PRE_ADD_BOS = {
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "tekken", "chameleon",
}
_PRE_NO_BOS = {"chatglm-bpe", "glm4", "glm5"}
_PRE_GEMMA4 = {"gemma4", "granite-embed-multi-311m"}  # add_bos is forced on for these

_HINT = (
    "Pick a draft from the same model family; "
    "`tandem pairs suggest TARGET` lists compatible drafts."
)


@dataclass(frozen=True)
class VocabInfo:
    tokenizer_model: str
    vocab_type: int
    n_tokens: int
    tokens: tuple[str, ...]  # token texts as llama.cpp stores them; ids past the end are ""
    bos_id: int  # TOKEN_NULL when there is none
    eos_id: int
    add_bos: bool
    add_eos: bool
    tokenizer_pre: str | None = None

    @property
    def type_name(self) -> str:
        return VOCAB_TYPE_NAMES.get(self.vocab_type, str(self.vocab_type))

    @classmethod
    def from_header(cls, header: GGUFHeader) -> VocabInfo:
        md = header.metadata
        name = header.source_name
        model = md.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise GGUFFormatError(
                f"{name}: the model has no tokenizer (tokenizer.ggml.model is missing)",
                "Use a GGUF converted with its tokenizer; llama.cpp cannot load it otherwise.",
            )
        if model in ("no_vocab", "none"):
            # llama.cpp keeps only a count of empty dummy tokens and no special tokens; the
            # texts are left implicit so a hostile count cannot allocate anything.
            n = _uint(md.get(f"{header.architecture}.vocab_size")) or 0
            return cls(model, VOCAB_NONE, n, (), TOKEN_NULL, TOKEN_NULL, False, False)
        if model not in _TOKENIZER_MODELS:
            raise GGUFFormatError(
                f"{name}: unknown tokenizer '{model}'",
                "The model may need a newer llama.cpp than the one tandem ships.",
            )
        vocab_type, bos, eos = _TOKENIZER_MODELS[model]
        pre = md.get("tokenizer.ggml.pre")
        pre = pre if isinstance(pre, str) else None
        if model == "gemma4":
            pre = "gemma4"

        add_bos, add_eos = _TYPE_ADD_DEFAULTS.get(vocab_type, (False, False))
        if vocab_type == VOCAB_BPE:
            if pre in _PRE_ADD_BOS:
                add_bos = True
            if pre in _PRE_NO_BOS:
                bos = TOKEN_NULL

        tokens = _token_texts(md.get("tokenizer.ggml.tokens"), name)
        n = len(tokens)
        bos = _special_id(md.get("tokenizer.ggml.bos_token_id"), bos, n)
        eos = _special_id(md.get("tokenizer.ggml.eos_token_id"), eos, n)
        flag = md.get("tokenizer.ggml.add_bos_token")
        if isinstance(flag, bool):
            add_bos = flag
        flag = md.get("tokenizer.ggml.add_eos_token")
        if isinstance(flag, bool):
            add_eos = flag
        if vocab_type == VOCAB_BPE and pre in _PRE_GEMMA4:
            add_bos = True
        return cls(model, vocab_type, n, tokens, bos, eos, add_bos, add_eos, pre)


def _uint(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _special_id(value: Any, default: int, n_tokens: int) -> int:
    """A default id outside the vocab is disabled; a bad explicit id falls back to the default."""
    if default >= n_tokens:
        default = TOKEN_NULL
    new = _uint(value)
    if new is None or new >= n_tokens:
        return default
    return new


def _token_texts(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise GGUFFormatError(
            f"{name}: tokenizer.ggml.tokens is missing or is not a list of strings",
            "Use a GGUF converted with its tokenizer; llama.cpp cannot load it otherwise.",
        )
    if all(value):
        return tuple(value)
    # llama.cpp renames empty tokens so that every text is unique
    return tuple(t or f"[EMPTY_{i}]" for i, t in enumerate(value))


def _c_text(text: str) -> str:
    """llama.cpp compares texts with strcmp, which stops at the first NUL."""
    return text.split("\x00", 1)[0]


def _show(text: str, width: int = 40) -> str:
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 3] + "..."


def _special_problem(kind: str, t_add: bool, d_add: bool, t_id: int, d_id: int) -> str | None:
    if t_add != d_add:
        who_adds, who_not = ("target", "draft") if t_add else ("draft", "target")
        return f"the {who_adds} adds the {kind} token to prompts but the {who_not} does not"
    if t_add and t_id != d_id:
        return f"{kind} token ids differ (target {t_id}, draft {d_id})"
    return None


def _texts(vocab: VocabInfo, start: int, end: int) -> tuple[str, ...]:
    texts = vocab.tokens[start:end]
    missing = max(0, end - start) - len(texts)
    return texts + ("",) * missing if missing > 0 else texts


def _token_problem(target: VocabInfo, draft: VocabInfo) -> str | None:
    start = SPEC_VOCAB_CHECK_START_TOKEN_ID
    end = min(target.n_tokens, draft.n_tokens)
    if not target.tokens and not draft.tokens:  # two "no_vocab" models: all texts empty
        return None
    t_tokens, d_tokens = _texts(target, start, end), _texts(draft, start, end)
    if t_tokens == d_tokens:  # the common case, compared at C speed
        return None
    differing = [
        start + i
        for i, (a, b) in enumerate(zip(t_tokens, d_tokens))
        if a != b and _c_text(a) != _c_text(b)
    ]
    if not differing:
        return None
    first = differing[0]
    return (
        f"token {first} differs (target {_show(t_tokens[first - start])}, draft "
        f"{_show(d_tokens[first - start])}); {len(differing)} of {end - start} tokens "
        f"from id {start} differ"
    )


def compatibility_problems(target: VocabInfo, draft: VocabInfo) -> list[str]:
    """Every reason llama.cpp would refuse this pair; empty when it would accept it."""
    problems = []
    if target.vocab_type != draft.vocab_type:
        problems.append(
            f"vocabulary types differ (target {target.type_name} from '{target.tokenizer_model}', "
            f"draft {draft.type_name} from '{draft.tokenizer_model}')"
        )
    for problem in (
        _special_problem("BOS", target.add_bos, draft.add_bos, target.bos_id, draft.bos_id),
        _special_problem("EOS", target.add_eos, draft.add_eos, target.eos_id, draft.eos_id),
    ):
        if problem:
            problems.append(problem)
    diff = abs(target.n_tokens - draft.n_tokens)
    if diff > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(
            f"vocabulary sizes differ by {diff} tokens (target {target.n_tokens}, draft "
            f"{draft.n_tokens}; llama.cpp allows {SPEC_VOCAB_MAX_SIZE_DIFFERENCE})"
        )
    problem = _token_problem(target, draft)
    if problem:
        problems.append(problem)
    return problems


def check_compatible(
    target: VocabInfo, draft: VocabInfo, target_name: str = "target", draft_name: str = "draft"
) -> None:
    """Raise VocabMismatchError naming every problem if llama.cpp would refuse the pair."""
    problems = compatibility_problems(target, draft)
    if problems:
        raise VocabMismatchError(
            f"draft {draft_name} cannot speculate for target {target_name}: " + "; ".join(problems),
            _HINT,
        )


def longest_token_bytes(path: Path) -> int | None:
    """The longest token text of a GGUF's vocabulary in UTF-8 bytes: no token stands for more
    bytes of text (a byte-level BPE character or SPM's "<0x41>" and "\u2581" encode to at
    least the byte they stand for). None when the header holds no token list."""
    from tandem.models.gguf_meta import read_gguf_header

    tokens = read_gguf_header(path).get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        return None
    return max(len(t.encode("utf-8", "replace")) for t in tokens if isinstance(t, str))
