"""The conversation as /save writes it: JSON (each answer with its statistics) or markdown."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

from tandem import __version__
from tandem.engine.loop.stats import GenStats
from tandem.errors import TandemError


@dataclass
class Turn:
    user: str
    assistant: str = ""
    reason: str = ""  # eos | length | stop | context | interrupted
    strategy: str = "none"
    stats: GenStats | None = None
    started: float = 0.0  # time.perf_counter() when the answer began
    busy: float | None = None  # share of the CPU other processes took meanwhile (machine/load)


def to_dict(turns: Sequence[Turn], *, system: str | None, target: str, draft: str | None,
            plain_rate: float | None) -> dict:
    msgs: list[dict] = []
    if system:
        msgs.append({"role": "system", "content": system})
    for t in turns:
        msgs.append({"role": "user", "content": t.user})
        msgs.append({"role": "assistant", "content": t.assistant, "finish_reason": t.reason,
                     "strategy": t.strategy, "stats": t.stats.to_dict() if t.stats else None})
    return {
        "tandem": __version__,
        "saved": datetime.now().isoformat(timespec="seconds"),
        "target": target,
        "draft": draft,
        "messages": msgs,
        "plain_tokens_per_second": plain_rate,
    }


def to_markdown(turns: Sequence[Turn], *, system: str | None, target: str,
                draft: str | None) -> str:
    lines = [f"# Chat with {target}{f' + {draft}' if draft else ''}", "",
             f"_Saved by tandem {__version__} on "
             f"{datetime.now().isoformat(sep=' ', timespec='minutes')}._", ""]
    if system:
        lines += ["## System", "", system, ""]
    for t in turns:
        # an answer cut at the token limit may stop inside a code block: closed here, or the
        # rest of the file renders as code
        lines += ["## User", "", closed_fences(t.user), "",
                  "## Assistant", "", closed_fences(t.assistant) or "_(no text)_", ""]
        if t.stats is not None:
            lines += [f"_{turn_summary(t)}_", ""]
    return "\n".join(lines)


_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)$")


def open_fence(text: str) -> str | None:
    """The code fence a markdown text leaves open at its end (its marker: ``` or ~~~, as
    long as it was opened), or None. A fence closes with the same character, at least as
    many of them, and nothing after them (CommonMark)."""
    fence = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m is None:
            continue
        mark, rest = m.groups()
        if fence is None:
            if not (mark[0] == "`" and "`" in rest):  # ``` with a backtick after is inline
                fence = mark
        elif mark[0] == fence[0] and len(mark) >= len(fence) and not rest.strip():
            fence = None
    return fence


def closed_fences(text: str) -> str:
    """`text` with the code fence it leaves open, if any, closed on a line of its own."""
    fence = open_fence(text)
    return text if fence is None else text.rstrip("\n") + "\n" + fence


def save(path: Path, turns: Sequence[Turn], *, system: str | None, target: str,
         draft: str | None, plain_rate: float | None) -> Path:
    """`.json`: JSON; any other name: markdown."""
    if path.suffix.lower() == ".json":
        data = to_dict(turns, system=system, target=target, draft=draft, plain_rate=plain_rate)
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    else:
        text = to_markdown(turns, system=system, target=target, draft=draft)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise TandemError(f"cannot write {path}: {exc.strerror or exc}",
                          "check the directory exists and is writable") from exc
    return path


def turn_summary(turn: Turn) -> str:
    st = turn.stats
    parts = [f"{st.n_generated} tokens", f"{st.tokens_per_second:.1f} tok/s", turn.strategy]
    if st.drafted:
        parts.append(f"accepted {100 * st.acceptance_rate:.0f}% ({st.accepted}/{st.drafted})")
        parts.append(f"mean accepted length {st.mean_accepted_length:.2f}")
    if turn.reason and turn.reason != "eos":
        parts.append(f"stopped: {turn.reason}")
    return " · ".join(parts)
