"""Fill-in-the-middle prompts from the model's own FIM tokens, laid out as llama-server lays
them out (tools/server/server-common.cpp, format_prompt_infill), so an editor plugin gets the
same prompt from tandem as from llama-server:

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n chunk0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

The prefix keeps its last 3/4 of a batch, the suffix its first 1/4 (less the prompt), the
extra chunks the context's rest (their tail, nearest the cursor). All text is data: it is
tokenized without parsing special tokens, so code that holds "<|fim_prefix|>" stays text.
Pure: the caller passes the tokenizer (no llama_cpp import here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.config.schema import FIELDS_BY_KEY

NULL = -1  # LLAMA_TOKEN_NULL: the vocabulary has no such token
# llama-server's default n_batch, which sizes its FIM budgets: the same prompt as its
INFILL_BATCH = 2048
REPO_NAME = "myproject\n"  # llama-server's fixed project name
CURRENT_FILE = "filename\n"  # and its fixed name for the file being edited
DEFAULT_CHUNK_NAME = "tmp"
# the context kept free for the answer, out of the extra chunks' share: llama.vim's n_predict
# (128) twice, as llama-server keeps 2 x its n_predict. The same for every request, so a
# warm-up (n_predict 0) lays out the prompt its completions will reuse
ANSWER_ROOM = 256
# a model without FIM_SEP gets chunks separated by this text ("\n\n--- snippet ---\n\n")
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's fill-in-the-middle tokens (NULL where it has none)."""

    pre: int = NULL
    suf: int = NULL
    mid: int = NULL
    rep: int = NULL
    sep: int = NULL
    pad: int = NULL

    def missing(self) -> list[str]:
        """The tokens an infill prompt needs and this vocabulary lacks."""
        return [name for name, tok in (("prefix", self.pre), ("suffix", self.suf),
                                       ("middle", self.mid)) if tok == NULL]


@dataclass(frozen=True)
class Chunk:
    """One of `input_extra`'s chunks: another file's text, or a part of one."""

    text: str
    filename: str = DEFAULT_CHUNK_NAME


def infill_prompt(tokenize: Callable[[str], list[int]], fim: FimTokens, bos: int | None,
                  prefix: str, suffix: str, extra: Sequence[Chunk] = (),
                  prompt: Sequence[int] = (), n_ctx: int = FIELDS_BY_KEY["n_ctx"].default,
                  room: int = ANSWER_ROOM,
                  n_batch: int | None = None) -> list[int]:
    """The FIM prompt's tokens. `tokenize`: plain text -> tokens (no BOS, no special tokens
    parsed); `bos`: the BOS to put first, None for a model that adds none; `prompt`: the
    tokens typed after the prefix on the cursor's line (llama-server's `prompt`). `room`: the
    tokens left for the answer, out of the extra chunks' share of the context. `n_batch` sizes
    the budgets: llama-server's 2048 by default, half the context where that is smaller (a
    context under 4096 tokens would not hold llama-server's prefix and suffix shares)."""
    if n_batch is None:
        n_batch = min(INFILL_BATCH, n_ctx // 2)
    extra_tokens: list[int] = []
    if fim.rep != NULL:
        extra_tokens += [fim.rep, *tokenize(REPO_NAME)]
    for chunk in extra:
        if fim.sep != NULL:
            extra_tokens += [fim.sep, *tokenize(chunk.filename + "\n")]
        else:
            extra_tokens += tokenize(CHUNK_SEPARATOR)
        extra_tokens += tokenize(chunk.text)
    if fim.sep != NULL:
        extra_tokens += [fim.sep, *tokenize(CURRENT_FILE)]

    pre, suf = tokenize(prefix), tokenize(suffix)
    n_pre = min(len(pre), 3 * (n_batch // 4))
    n_suf = min(len(suf), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - room), len(extra_tokens))

    out = [bos] if bos is not None else []
    out[:0] = extra_tokens[len(extra_tokens) - n_extra:]
    out += [fim.pre, *pre[len(pre) - n_pre:], *prompt]
    out += [fim.suf, *suf[:n_suf], fim.mid]
    return out
