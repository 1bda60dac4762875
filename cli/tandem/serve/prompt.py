"""A request's prompt, checked cheaply before it is expensive: its size in bytes against the
context first, then its tokens, out of the scheduler's threads where the pair allows it.

Why: tokenizing is not linear for every vocabulary (an SPM one took 25 s for 1.6 MB here), and
a request waiting for the tokenizer in the scheduler held up every other. A token stands
for at most `max_token_bytes` bytes of text, so a prompt of more than n_ctx x that many bytes
cannot fit and is refused without tokenizing; a larger-than-usual one is tokenized a prefix
first (enough text for the whole context at a few bytes a token) and refused if that prefix
alone fills the context.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from tandem.engine.backend.template import user_strings
from tandem.errors import ContextOverflowError

# below this many bytes a token, on average, text is unusual (long runs of one character):
# a prompt's prefix of n_ctx x this many bytes is tokenized first to find one over the context
PROBE_BYTES_PER_TOKEN = 8
UNKNOWN_TOKEN_BYTES = 1024  # a vocabulary whose longest token could not be read


@dataclass(frozen=True)
class PromptBudget:
    """What a prompt may hold: the target's context in tokens, and its vocabulary's longest
    token in UTF-8 bytes (models/vocab.py reads it off the GGUF header's token list)."""

    n_ctx: int
    max_token_bytes: int = UNKNOWN_TOKEN_BYTES


def _texts(req) -> list[str]:
    """The texts a prompt is made of whole. Of a fill-in-the-middle, only the typed `prompt`:
    its other parts are cut to their shares of the context (clip_infill, then
    engine/backend/fim.py), a file of any size fits."""
    if req.infill is not None:
        return [req.infill.prompt]
    if req.kind != "chat":
        return [req.prompt]
    return user_strings(req.messages, req.template_tools())


class PromptTooLong(ContextOverflowError):
    """A prompt (or a text to tokenize) over the context; `param` names the field."""

    def __init__(self, message: str, hint: str, param: str | None = None):
        super().__init__(message, hint)
        self.param = param


def _param(req) -> str:
    return "messages" if req.kind == "chat" else "prompt"


def _overflow(n_tokens: int | str, n_ctx: int, param: str | None = None) -> PromptTooLong:
    what = "the prompt" if param in (None, "messages", "prompt") else f"'{param}'"
    return PromptTooLong(
        f"{what} has {n_tokens} tokens but the context holds {n_ctx}",
        "send fewer or shorter messages, or restart tandem serve with a larger --ctx-size",
        param)


def check_size(req, budget: PromptBudget) -> None:
    """Refuse at once a prompt that cannot fit: more bytes than the context's tokens can
    stand for. No tokenizer is involved; this runs before the request is queued."""
    check_text_size(_texts(req), budget, _param(req))


def check_text_size(texts: Sequence[str], budget: PromptBudget, param: str) -> None:
    """The same check for any texts bound for the tokenizer (/tokenize's content): the
    tokenizer's cost is not linear in every vocabulary (an SPM one: 70 s for 1 MB of one
    word), so text that cannot fit a context is never tokenized."""
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > budget.n_ctx * budget.max_token_bytes:
        at_least = -(-size // budget.max_token_bytes)
        raise _overflow(f"at least {at_least} ({size} bytes)", budget.n_ctx, param)


def clip_infill(fim, budget: PromptBudget):
    """A fill-in-the-middle's texts cut, before any tokenizing, to what its prompt can keep:
    the prefix's tail, the suffix's head, the extra chunks nearest the cursor (the typed
    `prompt` is kept whole, as llama-server keeps it, and checked as a prompt is). The kept
    tokens span at most n_ctx x max_token_bytes characters, and twice that is kept, so the
    tokens near a cut (which may differ) are never among them: the prompt is the same."""
    span = 2 * budget.n_ctx * budget.max_token_bytes
    kept, room = [], span
    for chunk in reversed(fim.extra):
        if room <= 0:
            break
        kept.append(replace(chunk, text=chunk.text[-room:]))
        room -= len(chunk.text) + len(chunk.filename)
    return replace(fim, prefix=fim.prefix[-span:], suffix=fim.suffix[:span],
                   extra=tuple(reversed(kept)))


def prompt_tokens(pair, req, budget: PromptBudget, local: bool = True) -> list[int]:
    """The request's prompt tokens (the chat template for chat, the raw prompt for
    /v1/completions), refused once they reach the context. Thread-safe for a local
    PairSession (llama_tokenize reads the vocabulary only, as llama-server's HTTP threads use
    it); there a text much longer than the context holds has a prefix tokenized first
    (`local`: a remote pair tokenizes in its worker, whole)."""
    probe = budget.n_ctx * PROBE_BYTES_PER_TOKEN
    for text in _texts(req) if local else ():
        if len(text) > probe:  # characters: at least as many bytes
            head = pair.tokenize(text[:probe])
            if len(head) > budget.n_ctx:
                raise _overflow(f"more than {budget.n_ctx}", budget.n_ctx, _param(req))
    if req.infill is not None:
        req = replace(req, infill=clip_infill(req.infill, budget))
    tokens = tokens_of(pair, req)
    if len(tokens) >= budget.n_ctx:
        raise _overflow(len(tokens), budget.n_ctx, _param(req))
    return tokens


def request_tokens(pair, req, budget: PromptBudget,
                   local: bool = True) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's tokens (prompt_tokens) and the prediction's (plain text: data). A
    prediction drafts the answer, which the context bounds: of a longer one only the text
    the context's tokens could cover at PROBE_BYTES_PER_TOKEN is tokenized (1 MB of one
    word took an SPM vocabulary 70 s), and its first n_ctx tokens are kept."""
    tokens = prompt_tokens(pair, req, budget, local)
    if not req.prediction:
        return tokens, ()
    text = req.prediction[:budget.n_ctx * PROBE_BYTES_PER_TOKEN]
    return tokens, tuple(pair.tokenize(text)[:budget.n_ctx])


def tokens_of(pair, req) -> Sequence[int]:
    if req.infill is not None:
        fim = req.infill
        return pair.infill_tokens(fim.prefix, fim.suffix, fim.extra, fim.prompt)
    if req.prompt_ids:
        return list(req.prompt_ids)
    if req.kind == "chat":
        tools = req.template_tools()
        if tools:
            return pair.prompt_tokens(list(req.messages), tools=tools)
        return pair.prompt_tokens(list(req.messages))
    return pair.prompt_tokens([{"role": "user", "content": req.prompt}], raw=True)
