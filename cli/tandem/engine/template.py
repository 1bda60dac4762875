"""Render chat messages into prompt text with the model's own (GGUF) chat template, and into
the prompt's tokens (prompt_tokens: the BOS handled once).

Templates are Jinja run in a sandbox, as transformers does; llama.cpp's built-in renderer
is the fallback for templates the sandbox cannot run, and a plain layout the last resort.
"""
from __future__ import annotations

from datetime import datetime
from typing import Protocol, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateModel(Protocol):
    def chat_template(self) -> str | None: ...
    def apply_builtin_template(self, template: str, messages: Sequence[dict]) -> str | None: ...
    def token_text(self, token: int) -> str: ...

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


def prompt_tokens(model, messages: Sequence[dict], raw: bool = False) -> list[int]:
    """The prompt's tokens: the messages rendered with the model's template (`raw`: the
    plain layout), with the model's BOS in front where it wants one and the template did not
    write it already (never a second one)."""
    text = plain(messages) if raw else render(model, messages)
    bos_text = _text(model, model.bos)
    add_bos = model.add_bos and not (bos_text and text.startswith(bos_text))
    tokens = model.tokenize(text, add_special=False, parse_special=True)
    return [model.bos] + tokens if add_bos else tokens
