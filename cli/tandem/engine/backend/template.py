"""Render chat messages into prompt text with the model's own (GGUF) chat template, and into
the prompt's tokens (prompt_tokens: the BOS handled once).

Templates are Jinja run in a sandbox, as transformers does; llama.cpp's built-in renderer
is the fallback for templates the sandbox cannot run, and a plain layout the last resort.
"""
from __future__ import annotations

import re
from datetime import datetime
from typing import Protocol, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.errors import UsageError


class TemplateModel(Protocol):
    def chat_template(self) -> str | None: ...
    def apply_builtin_template(self, template: str, messages: Sequence[dict]) -> str | None: ...
    def token_text(self, token: int) -> str: ...
    def is_special(self, token: int) -> bool: ...
    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]: ...

    bos: int
    eos: int


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(model: TemplateModel, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    template = model.chat_template()
    if template:
        try:
            return _env().from_string(template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=_text(model, model.bos),
                eos_token=_text(model, model.eos),
            )
        except (jinja2.TemplateError, TypeError, ValueError):
            builtin = model.apply_builtin_template(template, messages)
            if builtin is not None:
                return builtin
    return plain(messages)


def plain(messages: Sequence[dict]) -> str:
    """A template-free layout for models without a chat template (base models)."""
    return "\n\n".join(m["content"] for m in messages)


def _text(model: TemplateModel, token: int) -> str:
    return model.token_text(token) if token >= 0 else ""


# Private-use code points around each message's content while the template renders: where they
# land tells which characters of the prompt are the user's (they never reach the tokenizer).
OPEN, CLOSE = "\U000F0000", "\U000F0001"


def regions(model: TemplateModel, messages: Sequence[dict]) -> list[tuple[str, bool]] | None:
    """The rendered prompt as (text, is_content) runs: content is what the messages brought,
    the rest is the template's own text. Found by rendering each content between OPEN and
    CLOSE; None when that cannot be traced: the template moved, repeated or dropped a mark,
    or changed the content (a trim, a split), so that the marked rendering, marks removed,
    is not the plain one."""
    if any(OPEN in m["content"] or CLOSE in m["content"] for m in messages):
        return None
    marked = render(model, [{**m, "content": OPEN + m["content"] + CLOSE} for m in messages])
    runs: list[tuple[str, bool]] = []
    inside = False
    for i, part in enumerate(re.split(f"([{OPEN}{CLOSE}])", marked)):
        if i % 2:  # a mark: it must open outside and close inside
            if (part == OPEN) == inside:
                return None
            inside = not inside
        elif part:
            runs.append((part, inside))
    if inside or "".join(t for t, _ in runs) != render(model, messages):
        return None
    return runs


def _specials(model, text: str) -> list[tuple[int, int, int]]:
    """(start, end, token) of each special token llama.cpp's parser finds in `text` alone."""
    found, cursor = [], 0
    for tok in model.tokenize(text, add_special=False, parse_special=True):
        if model.is_special(tok):
            piece = model.token_text(tok)
            at = text.find(piece, cursor)
            if at < 0:
                continue
            found.append((at, at + len(piece), tok))
            cursor = at + len(piece)
    return found


def tokens_as_data(model, runs: Sequence[tuple[str, bool]]) -> list[int]:
    """The tokens of the whole prompt, special tokens parsed only in the template's runs.

    llama.cpp's own parser splits a text at its special tokens and tokenizes each piece of
    raw text between them on its own; this does the same with the specials of the template
    runs only, so a prompt without special-token text in its content gets exactly the tokens
    it got before, and special-token text in content stays text."""
    text = "".join(t for t, _ in runs)
    cuts: list[tuple[int, int, int]] = []
    offset = 0
    for run, is_content in runs:
        if not is_content:
            cuts += [(a + offset, b + offset, tok) for a, b, tok in _specials(model, run)]
        offset += len(run)
    tokens: list[int] = []
    pos = 0
    for a, b, tok in cuts:
        if a > pos:
            tokens += model.tokenize(text[pos:a], add_special=False, parse_special=False)
        tokens.append(tok)
        pos = b
    if pos < len(text):
        tokens += model.tokenize(text[pos:], add_special=False, parse_special=False)
    return tokens


def prompt_tokens(model, messages: Sequence[dict], raw: bool = False) -> list[int]:
    """The prompt's tokens: the messages rendered with the model's template (`raw`: the
    plain layout), with the model's BOS in front where it wants one and the template did not
    write it already (never a second one).

    With a template, message content is data: special-token text in it ("<|im_end|>",
    "</s>") is tokenized as text, never as control tokens. `raw` is a prompt the caller
    wrote whole (run --raw, /v1/completions): its special tokens are parsed, as llama.cpp's
    tools parse a raw prompt."""
    if raw:
        text = plain(messages)
        tokens = model.tokenize(text, add_special=False, parse_special=True)
    else:
        runs = regions(model, messages)
        if runs is None:
            text = render(model, messages)
            if any(_specials(model, m["content"]) for m in messages):
                raise UsageError(
                    "a message holds special-token text (such as the template's own "
                    "markers), and this model's chat template changes message content in a "
                    "way tandem cannot keep apart from its own",
                    "remove the special-token text from the message, or use --raw to write "
                    "the whole prompt yourself")
            tokens = model.tokenize(text, add_special=False, parse_special=True)
        else:
            text = "".join(t for t, _ in runs)
            tokens = tokens_as_data(model, runs)
    bos_text = _text(model, model.bos)
    add_bos = model.add_bos and not (bos_text and text.startswith(bos_text)
                                     and tokens[:1] == [model.bos])
    return [model.bos] + tokens if add_bos else tokens
