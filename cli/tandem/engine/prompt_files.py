"""Files the user names for the model to read (--context-file, chat's /add): each as its name
and its text in a fenced block, before the request, inside the user message. The chat
template renders that message as any other: a file's text is data, never control tokens.

They stay draft sources too (Pair.add_context_file); --draft-from files are only that.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from tandem.errors import UsageError

_BACKTICKS = re.compile(r"`+")
CTX_STEP = 256  # a suggested --ctx-size is rounded up to this


def file_block(name: str, text: str) -> str:
    """`name` and `text` in a fence longer than any run of backticks in the text (a file of
    markdown cannot end the block early)."""
    longest = max((len(m) for m in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"File {name}:\n{fence}\n{text.rstrip(chr(10))}\n{fence}"


def with_files(request: str, files: Sequence[tuple[str, str]]) -> str:
    """The user message: each (name, text) file's block, then the request."""
    if not files:
        return request
    return "\n\n".join([*(file_block(name, text) for name, text in files), request])


def check_files_fit(n_prompt: int, n_ctx: int, room: int,
                    files: Sequence[tuple[str, int]]) -> None:
    """UsageError when a prompt that holds context files (name, tokens) leaves the answer
    no room: `n_prompt` counted by the target's tokenizer, `room` the answer's least."""
    if not files or n_prompt + room <= n_ctx:
        return
    sizes = ", ".join(f"{name} {n} tokens" for name, n in files)
    need = -(-(n_prompt + room) // CTX_STEP) * CTX_STEP
    raise UsageError(
        f"the prompt with its context files is {n_prompt} tokens ({sizes}), and the context "
        f"holds {n_ctx}: no room for {'an answer' if room <= 1 else f'{room} answer tokens'}",
        f"raise --ctx-size (-c {need} fits it), or name a smaller file or only the part "
        "that matters; --draft-from FILE lets auto draft from a file without the model "
        "reading it")
