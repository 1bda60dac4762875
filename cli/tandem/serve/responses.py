"""The OpenAI wire format's answers, without any HTTP: the response and stream-chunk shapes of
both routes, usage (with Predicted Outputs' counts), llama-server's `timings`, tandem's own
figures, and the server's log line. Requests are checked in serve/protocol.py."""
from __future__ import annotations

import json

from tandem.serve import structured
from tandem.serve.api_errors import clip
from tandem.serve.protocol import Request

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
          "interrupted": "stop"}


class Piece(str):
    """A piece of an answer's text as the scheduler releases it (a str) that says whether
    its token was a draft the target accepted: chunk() marks those, and the chat page shows
    them as the terminal chat does."""

    from_draft: bool = False

    def __new__(cls, text: str, from_draft: bool) -> Piece:
        piece = super().__new__(cls, text)
        piece.from_draft = from_draft
        return piece


def usage(stats) -> dict:
    """OpenAI's usage, with the prompt tokens the KV cache already held as cached_tokens."""
    cached = max(stats.n_prompt - stats.n_prompt_eval, 0)
    out = {"prompt_tokens": stats.n_prompt, "completion_tokens": stats.n_generated,
           "total_tokens": stats.n_prompt + stats.n_generated,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if stats.prediction is not None:
        accepted, rejected = stats.prediction
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": rejected}
    return out


def timings(stats) -> dict:
    """llama-server's `timings` with its meanings: prompt_n = prompt tokens evaluated (the
    cached ones are cache_n), predicted_n = tokens generated, times in milliseconds; draft_n /
    draft_n_accepted as llama-server counts them in speculative mode."""
    prompt_ms = stats.t_prefill * 1000.0
    predicted_ms = stats.t_decode * 1000.0
    prompt_n, predicted_n = stats.n_prompt_eval, stats.n_generated
    return {
        "cache_n": max(stats.n_prompt - prompt_n, 0),
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / stats.t_prefill if stats.t_prefill > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": predicted_n / stats.t_decode if stats.t_decode > 0 else 0.0,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
    }


def tandem_stats(stats, tokens: list[int] | None = None, req: Request | None = None) -> dict:
    """What tandem adds to llama-server's figures: acceptance, the steps that drafted and the
    longest draft of a step, per draft source, notes, the draft settings the answer ran with
    (the request's `speculative` or the server's, as `req` holds them once queued), and the
    answer's token ids where the request asked for them (returned_tokens)."""
    out = {"strategy": stats.strategy, "acceptance_rate": stats.acceptance_rate,
           "mean_accepted_length": stats.mean_accepted_length,
           "verify_steps": stats.n_steps, "drafted_steps": stats.n_steps_drafted,
           "longest_draft": len(stats.drafted_at),
           "by_source": {k: {"drafted": v[0], "accepted": v[1]}
                         for k, v in stats.by_source.items()},
           "notes": list(stats.notes)}
    if req is not None and req.n_max is not None:
        out.update(n_max=req.n_max, n_min=req.n_min, p_min=req.p_min)
    if tokens is not None:
        out["tokens"] = tokens
    return out


def returned_tokens(req: Request, answer) -> list[int] | None:
    """The answer's token ids (chat.answer.Answer.generated; one an editor's stopping rule
    ended: those it got to) if the request set llama-server's `return_tokens`, else None."""
    return list(answer.generated) if req.return_tokens else None


def completion(req: Request, rid: str, created: int, model: str, text: str, reason: str,
               stats, tokens: list[int] | None = None) -> dict:
    """The non-streamed response of either route."""
    finish = FINISH.get(reason, "stop")
    if req.kind == "chat":
        message, finish = structured.message(req, text, finish)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(stats), "timings": timings(stats),
            "tandem": tandem_stats(stats, tokens, req)}


def chunk(req: Request, rid: str, created: int, model: str, *, text: str | None = None,
          role: bool = False, reason: str | None = None, stats=None,
          usage_only: bool = False, calls: list[dict] | None = None,
          tokens: list[int] | None = None) -> dict:
    """One server-sent event's object. The chat's first chunk carries the role; the last one
    the finish reason and timings; with include_usage a final chunk has no choices and the
    usage, as OpenAI sends it. A piece of text whose token the draft gave (and the target
    accepted) has tandem's `"tandem": {"from_draft": 1}`."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model}
    if usage_only:
        out["choices"] = []
        out["usage"] = usage(stats)
        return out
    finish = (reason if reason in ("tool_calls",) else FINISH.get(reason, "stop")) \
        if reason is not None else None
    if req.kind == "chat":
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if calls:  # each call whole in one chunk, with its index among the answer's calls
            delta["tool_calls"] = calls
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out["choices"] = [choice]
    if isinstance(text, Piece) and text.from_draft:
        out["tandem"] = {"from_draft": 1}
    if stats is not None:
        out["timings"] = timings(stats)
        out["tandem"] = tandem_stats(stats, tokens, req)
    if req.include_usage:
        out["usage"] = None  # OpenAI: null on every chunk but the last
    return out


def log_line(method: str, path: str, status: int, seconds: float, stats=None,
             slot: int | None = None) -> str:
    """The server's line for one request: what was asked, what it cost, how it went.
    `POST /v1/chat/completions 200 · slot 1 · prompt 120 (98 cached) · 64 tokens · 1.92 s ·
    33.3 tok/s · drafts 41/60 accepted`."""
    parts = [f"{method} {clip(path, 80)} {status}"]
    if slot is not None:
        parts.append(f"slot {slot}")
    if stats is not None:
        cached = max(stats.n_prompt - stats.n_prompt_eval, 0)
        parts.append(f"prompt {stats.n_prompt} ({cached} cached)")
        parts.append(f"{stats.n_generated} tokens")
    parts.append(f"{seconds:.2f} s")
    if stats is not None:
        if stats.t_decode > 0 and stats.n_generated:
            parts.append(f"{stats.n_generated / stats.t_decode:.1f} tok/s")
        if stats.drafted:
            parts.append(f"drafts {stats.accepted}/{stats.drafted} accepted")
    return "tandem serve: " + " · ".join(parts)


# one encoder for every event: json.dumps with options builds a new JSONEncoder per call, a
# quarter of an event's encoding, once a streamed token (encode() keeps no state between calls)
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj) -> bytes:
    return b"data: " + _ENCODE(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
