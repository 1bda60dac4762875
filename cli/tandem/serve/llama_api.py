"""llama-server's own wire format, without any HTTP: `/infill` and `/completion` bodies checked
into `Request`s, their response and stream-chunk shapes, `response_fields`, and the stopping
rules editors ask for (`n_indent`, `t_max_predict_ms`).

Fields as llama-server reads them (tools/server: server-context.cpp post_infill,
server-schema.cpp, server-task.cpp to_json_non_oaicompat); what an editor sends that only
tunes llama-server itself (`cache_prompt`, `id_slot`, `t_max_prompt_ms`, which llama-server
does not implement either; of `samplers` all but `infill`, whose rule tandem applies) is
accepted and ignored, as llama-server ignores an unknown field. A request tandem cannot
answer as asked is refused with a 4xx, never run otherwise than it says.
"""
from __future__ import annotations

import time

from tandem.engine.backend.fim import Chunk
from tandem.serve.api_errors import ApiError, bad, kind_of
from tandem.serve.protocol import Infill, Request, _common, _is_int
from tandem.serve.responses import tandem_stats, timings

MAX_CHUNKS = 256  # input_extra's chunks: llama.vim's ring holds 16, llama.vscode's 16
MAX_FIELDS = 64  # response_fields entries
MAX_PROMPT_IDS = 1 << 20  # a token prompt's length before it is compared with the context
STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit",
              "limit": "limit", "interrupted": "none"}


def _string(body: dict, key: str, required: bool = False) -> str:
    value = body.get(key)
    if value is None:
        if required:
            raise bad(f"'{key}' is required", key, "missing_required_parameter")
        return ""
    if not isinstance(value, str):
        raise bad(f"'{key}' must be a string, got {kind_of(value)}", key, "invalid_type")
    return value


def _chunks(body: dict) -> tuple[Chunk, ...]:
    extra = body.get("input_extra")
    if extra is None:
        return ()
    if not isinstance(extra, list):
        raise bad("'input_extra' must be an array of {\"filename\": string, \"text\": string}",
                  "input_extra", "invalid_type")
    if len(extra) > MAX_CHUNKS:
        raise bad(f"'input_extra' holds at most {MAX_CHUNKS} chunks, got {len(extra)}",
                  "input_extra")
    out = []
    for i, chunk in enumerate(extra):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad(f"{where} must be an object with a \"text\" string", where,
                      "invalid_type")
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise bad(f"{where}.filename must be a string, got {kind_of(name)}",
                      f"{where}.filename", "invalid_type")
        out.append(Chunk(chunk["text"], name))
    return tuple(out)


def _native_common(body: dict) -> dict:
    """The fields /infill and /completion share with the OpenAI routes, read llama-server's
    way: `n_predict` for the length (-1: the server's default; 0: evaluate the prompt only,
    an editor's warm-up), plus the stopping rules and `response_fields`."""
    n_predict = body.get("n_predict", body.get("max_tokens"))
    if isinstance(n_predict, float) and n_predict.is_integer():
        n_predict = int(n_predict)
    if n_predict is not None and (not _is_int(n_predict) or n_predict < -1):
        raise bad(f"'n_predict' must be an integer >= -1 (-1: the server's default), got "
                  f"{n_predict!r}"[:120], "n_predict")
    # the length is read here, `samplers` below; every other field as the OpenAI routes read
    # it (unknown ones, llama-server's own such as cache_prompt, id_slot, n_cmpl: ignored)
    shared = {k: v for k, v in body.items() if k not in ("n_predict", "max_tokens", "prompt")}
    common = _common(shared)
    if n_predict is not None and n_predict >= 0:
        common["max_tokens"] = n_predict
    fields = body.get("response_fields")
    if fields is not None and (not isinstance(fields, list) or len(fields) > MAX_FIELDS or
                               not all(isinstance(f, str) for f in fields)):
        raise bad(f"'response_fields' must be an array of at most {MAX_FIELDS} strings",
                  "response_fields", "invalid_type")
    limits = {}
    for key in ("n_indent", "t_max_predict_ms"):
        value = body.get(key, 0)
        if not _is_int(value) or value < 0:
            raise bad(f"'{key}' must be an integer >= 0, got {value!r}"[:120], key)
        limits[key] = value
    return dict(common, response_fields=tuple(fields or ()), native=True,
                infill_sampler=_names_infill(body.get("samplers")), **limits)


def _names_infill(samplers) -> bool:
    """Whether llama-server's `samplers` (names, or its one-letter string) holds `infill`,
    the one tandem applies (sampling.infill_pick); the others name what the sampling fields
    already say, in an order tandem does not follow."""
    if isinstance(samplers, str):
        return "i" in samplers
    if samplers is not None and not isinstance(samplers, list):
        raise bad("'samplers' must be an array of sampler names", "samplers", "invalid_type")
    return "infill" in (samplers or ())


def parse_infill(body: dict) -> Request:
    """POST /infill: input_prefix and input_suffix required, input_extra and prompt optional."""
    infill = Infill(prefix=_string(body, "input_prefix", True),
                    suffix=_string(body, "input_suffix", True), extra=_chunks(body),
                    prompt=_string(body, "prompt"))
    return Request(kind="text", infill=infill, **_native_common(body))


def parse_completion(body: dict, n_vocab: int) -> Request:
    """POST /completion: `prompt` a string (special tokens parsed: the client wrote the whole
    prompt, FIM tokens included, as llama-server reads it) or an array of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt of a batch
    common = _native_common(body)
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        return Request(kind="text", prompt=prompt, **common)
    if isinstance(prompt, list) and prompt:
        return Request(kind="text", prompt_ids=token_ids(prompt, n_vocab, "prompt"), **common)
    if prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    raise bad("'prompt' must be a string or an array of token ids", "prompt", "invalid_type")


def token_ids(value, n_vocab: int, param: str) -> tuple[int, ...]:
    """Token ids a client sent: integers of this vocabulary (an id beyond it would reach
    llama.cpp, which does not check it everywhere)."""
    if not isinstance(value, list) or len(value) > MAX_PROMPT_IDS:
        raise bad(f"'{param}' must be an array of token ids", param, "invalid_type")
    for i, t in enumerate(value):
        if not _is_int(t) or not 0 <= t < n_vocab:
            raise bad(f"{param}[{i}] must be a token id in 0..{n_vocab - 1}, got {t!r}"[:120],
                      param)
    return tuple(value)


# ----- stopping rules


class Limiter:
    """llama-server's editor stops, applied to the text as it is released. `n_indent`: a line
    after the first whose indentation is below n_indent ends the answer, cut where its text
    starts (an empty line too); `t_max_predict_ms`: past that time after the prompt, the
    answer ends at its next newline. A line's start is held back until its indentation is
    decided, so a stream never sends what the cut removes."""

    def __init__(self, n_indent: int = 0, t_max_predict_ms: int = 0):
        self.n_indent, self.t_max = n_indent, t_max_predict_ms / 1000.0
        self.text = ""  # released
        self._held = ""  # the current line's leading whitespace, undecided
        self._line_open = False  # after a newline, before the line's first other character
        self._t0: float | None = None
        self.stopped = False

    @property
    def active(self) -> bool:
        return bool(self.n_indent or self.t_max)

    def start(self) -> None:
        """The prompt is evaluated: the predict time runs from here."""
        self._t0 = time.monotonic()

    def feed(self, piece: str) -> str:
        """The part of `piece` to release now."""
        if self.stopped:
            return ""
        out = []
        for ch in piece:
            if self._line_open and self.n_indent:
                if ch in " \t":
                    self._held += ch
                    continue
                if len(self._held) < self.n_indent:
                    out.append(self._held)
                    self.stopped = True
                    break
                out.append(self._held)
                self._held, self._line_open = "", False
            out.append(ch)
            if ch == "\n":
                self._line_open = True
        released = "".join(out)
        self.text += released
        if not self.stopped and "\n" in piece and self.t_max and self._t0 is not None \
                and time.monotonic() - self._t0 > self.t_max:
            self.stopped = True
        return released

    def flush(self) -> str:
        """What is still held when the answer ends by itself."""
        held, self._held = self._held, ""
        self.text += held
        return held


# ----- responses


def stop_type(reason: str) -> str:
    return STOP_TYPES.get(reason, "none")


def final(req: Request, model: str, text: str, reason: str, stats, n_ctx: int,
          prompt_text: str | None, sampling: dict, tokens: list[int] | None = None) -> dict:
    """The last (or only) object of a /completion or /infill answer, llama-server's keys,
    cut to `response_fields` when the request names some. `tokens`: the answer's ids
    (return_tokens; streamed, they all come in this last object, the pieces' stay empty)."""
    out = {
        "index": 0, "content": text, "tokens": tokens or [], "id_slot": 0, "stop": True,
        "model": model, "tokens_predicted": stats.n_generated,
        "tokens_evaluated": stats.n_prompt,
        "generation_settings": dict(sampling, **speculative_json(req.n_max, req.n_min,
                                                                 req.p_min),
                                    n_predict=req.max_tokens or -1, n_ctx=n_ctx,
                                    stream=req.stream),
        "prompt": prompt_text if prompt_text is not None else "",
        "has_new_line": "\n" in text, "truncated": reason == "context",
        "stop_type": stop_type(reason), "stopping_word": "",
        "tokens_cached": stats.n_prompt + stats.n_generated,
        "timings": timings(stats), "tandem": tandem_stats(stats, req=req),
    }
    return pick(out, req.response_fields)


def partial(text: str, n_prompt: int, n_predicted: int) -> dict:
    """A streamed piece of text (llama-server's non-final chunk)."""
    return {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": 0,
            "tokens_predicted": n_predicted, "tokens_evaluated": n_prompt}


def pick(obj: dict, fields: tuple[str, ...]) -> dict:
    """llama-server's response_fields: each path ("timings/prompt_n") that exists, under its
    own name at the top level; all of `obj` when none is named."""
    if not fields:
        return obj
    out = {}
    for path in fields:
        value, found = obj, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            out[path] = value
    return out


def refusal_501(missing: list[str]) -> ApiError:
    return ApiError(501, "Infill is not supported by this model: "
                    + " ".join(f"{m} token is missing." for m in missing)
                    + " Use a model trained for fill-in-the-middle (e.g. Qwen2.5-Coder).",
                    type="not_supported_error", code="not_supported")


def sampling_json(sp) -> dict:
    """generation_settings' sampling keys, llama-server's names."""
    return {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
            "min_p": sp.min_p, "repeat_penalty": sp.repeat_penalty, "seed": sp.seed}


def speculative_json(n_max: int | None, n_min: int | None, p_min: float | None) -> dict:
    """The draft settings under llama-server's flat keys ("speculative.n_max"); none unknown."""
    values = {"n_max": n_max, "n_min": n_min, "p_min": p_min}
    return {f"speculative.{k}": v for k, v in values.items() if v is not None}


# ----- /tokenize, /detokenize, /props


def tokenize_request(body: dict) -> tuple[object, bool, bool, bool]:
    """/tokenize's fields: content (a string, or an array of strings and token ids),
    add_special (false), parse_special (true) and with_pieces (false), as llama-server's."""
    content = body.get("content", "")
    if not isinstance(content, (str, list)) or isinstance(content, list) and not all(
            isinstance(c, str) or _is_int(c) for c in content):
        raise bad("'content' must be a string or an array of strings and token ids",
                  "content", "invalid_type")
    flags = []
    for key, default in (("add_special", False), ("parse_special", True),
                         ("with_pieces", False)):
        value = body.get(key, default)
        if not isinstance(value, bool):
            raise bad(f"'{key}' must be a boolean, got {kind_of(value)}", key, "invalid_type")
        flags.append(value)
    return (content, *flags)


def tokenize_mixed(pair, content, add_special: bool, parse_special: bool) -> list[int]:
    """llama-server's tokenize_mixed: strings tokenized (the BOS only before a first string),
    ids kept as they are (checked against the vocabulary)."""
    if isinstance(content, str):
        return pair.tokenize(content, add_special=add_special, parse_special=parse_special)
    n_vocab = pair.props()["n_vocab"]
    out: list[int] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            out += pair.tokenize(part, add_special=add_special and i == 0,
                                 parse_special=parse_special)
        else:
            out += token_ids([part], n_vocab, f"content[{i}]")
    return out


def piece_json(raw: bytes):
    """A token's piece: its text when it is whole UTF-8, else its bytes (llama-server's)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def props(model: str, scheduler, facts: dict, sampling, max_tokens: int,
          drafting: tuple[str, object]) -> dict:
    """GET /props: the keys editors and web UIs read (n_ctx, the template, the model, the
    slots: `total_slots` any request may take, tandem's `reserved_slots` kept for short ones),
    and what a request that does not say drafts with (`drafting`: the server's strategy and
    DraftParams): llama-server's flat keys in `params`, and tandem's `speculative` object,
    the strategy and the draft model with them."""
    from tandem import __version__

    pair = scheduler.pair
    strategy, draft = drafting
    return {
        "default_generation_settings": {
            "params": dict(sampling_json(sampling), n_predict=max_tokens,
                           **speculative_json(draft.n_max, draft.n_min, draft.p_min)),
            "n_ctx": pair.n_ctx,
            "speculative": {"strategy": strategy, "n_max": draft.n_max, "n_min": draft.n_min,
                            "p_min": draft.p_min,
                            "draft_model": pair.draft_path.name if pair.draft_path else None}},
        "total_slots": scheduler.parallel,
        "reserved_slots": len(scheduler.slots) - scheduler.parallel,
        "model_alias": model, "model_path": str(pair.target_path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": facts.get("chat_template") or "",
        "bos_token": facts.get("bos_token", ""), "eos_token": facts.get("eos_token", ""),
        "build_info": f"tandem {__version__}", "is_sleeping": False,
        "infill": not pair.fim_tokens.missing(),
    }
