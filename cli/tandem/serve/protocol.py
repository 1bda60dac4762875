"""The OpenAI wire format, without any HTTP: request bodies checked into `Request`s, and the
response and stream-chunk shapes, with usage and llama-server's `timings` object.

Everything a client can get wrong raises ApiError (an HTTP status and OpenAI's error object),
so the routes in serve/routes.py never see a malformed value. What tandem does not implement
(n > 1, logprobs, penalties other than llama.cpp's repeat penalty) is refused by name rather
than silently ignored. Structured outputs and tools are checked in serve/structured.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem import bounded_json
from tandem.config.schema import FIELDS_BY_KEY
from tandem.engine.backend.fim import Chunk
from tandem.engine.drafting.drafters import DraftParams
from tandem.engine.loop.sampling import LIMITS, SEED, seed_value
from tandem.errors import UsageError
from tandem.serve import structured
# the API's errors, used here and by the routes through this module
from tandem.serve.api_errors import ApiError, bad, clip, kind_of, too_deep  # noqa: F401

MAX_STOPS = 16  # OpenAI allows 4; llama-server any number: a bound keeps stop matching cheap
MAX_STOP_CHARS = 1000
# llama-server's per-request draft settings: flat keys ("speculative.n_max", as its
# /completion reads them) or tandem's object ("speculative": {"n_max": ...})
SPECULATIVE = ("n_max", "n_min", "p_min")
# the request keys that set its drafting: the other APIs' bodies pass them to the chat path
DRAFTING_KEYS = ("strategy", "speculative", *(f"speculative.{k}" for k in SPECULATIVE))
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


@dataclass(frozen=True)
class Infill:
    """What a fill-in-the-middle prompt is made of (engine/backend/fim.py lays it out)."""

    prefix: str
    suffix: str
    extra: tuple[Chunk, ...] = ()
    prompt: str = ""  # the cursor's line left of the cursor, after the prefix


@dataclass(frozen=True)
class Request:
    """A checked completion request. `messages` for /v1/chat/completions, `prompt` for
    /v1/completions; None for a sampling field means "the server's default"."""

    kind: str  # "chat" | "text"
    model: str | None
    messages: tuple[dict, ...] = ()
    prompt: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    constraint: object = None  # engine.constrain.grammar.Constraint: what the output matches
    constraint_param: str | None = None  # the field it came from (for a compile error)
    tools: tuple = ()  # engine.constrain.tools.Tool
    tool_choice: str = "none"  # "none" | "auto" | "required" | a tool's name
    prediction: str | None = None  # OpenAI's Predicted Outputs: the expected answer
    return_tokens: bool = False  # llama-server's: the answer's token ids come back too
    # llama-server's own routes (serve/llama_api.py): a token prompt, a fill-in-the-middle,
    # its response shape and the editors' stopping rules
    prompt_ids: tuple[int, ...] = ()
    infill: Infill | None = None
    native: bool = False
    n_indent: int = 0
    t_max_predict_ms: int = 0
    response_fields: tuple[str, ...] = ()
    infill_sampler: bool = False  # `samplers` names llama.cpp's infill sampler
    # drafting for this request (llama-server's `speculative` settings, tandem's strategy):
    # None is the server's; completion_flow puts the effective values in before queueing
    strategy: str | None = None
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None

    def template_tools(self) -> list[dict] | None:
        """The tools for the chat template (none when tool_choice is "none")."""
        if self.tool_choice == "none" or not self.tools:
            return None
        return [t.as_openai() for t in self.tools]


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object. NaN and Infinity are not JSON (Python's parser would take
    them); a body nested deeper than the JSON depth limit is refused naming where. Every
    string in it, keys included, must be encodable text: JSON's escapes can carry lone
    surrogates ("\\ud800") that no tokenizer takes; this is the one place that checks it."""
    def constant(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        text = raw.decode("utf-8")
        body = bounded_json.loads(text, parse_constant=constant)
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8", code="invalid_json") from None
    except bounded_json.TooDeep as exc:
        raise too_deep(exc.path, exc.limit, exc.path.split(".")[0].split("[")[0] or None) \
            from None
    except ValueError as exc:
        raise bad(f"the request body is not valid JSON: {clip(str(exc))}",
                  code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {kind_of(body)}",
                  code="invalid_json")
    where = _unencodable(body, "")
    if where is not None:
        raise bad(f"{where or 'a key'} is not valid Unicode (a lone surrogate)", where or None)
    return body


def _unencodable(value, path: str) -> str | None:
    """The path of the first string (or key) in `value` that UTF-8 cannot encode; None if
    all can. Iterative: the parser's nesting limit already bounds the depth."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            for key, sub in item.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return where
                stack.append((sub, f"{where}.{key}" if where else key))
        elif isinstance(item, list):
            stack += [(sub, f"{where}[{i}]") for i, sub in enumerate(item)]
    return None


def parse_chat(body: dict) -> Request:
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad(f"'messages' must be an array, got {kind_of(messages)}", "messages",
                  "invalid_type")
    if not messages:
        raise bad("'messages' must hold at least one message", "messages", "empty_array")
    out: list[dict] = []
    open_ids: set[str] = set()  # the calls of the last assistant message, for tool results
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object, got {kind_of(m)}", where, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{where}.role must be a string (one of {', '.join(ROLES)}), got "
                      f"{kind_of(role)}", f"{where}.role", "invalid_type")
        if role == "function" or m.get("function_call"):
            raise bad(f"{where}: 'function' messages and function_call are the API's older "
                      "spelling, not supported by tandem serve: use tool_calls and 'tool' "
                      "messages", f"{where}.role", "unsupported_value")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {clip(repr(role))}",
                      f"{where}.role")
        msg: dict = {"role": ROLES[role]}
        if m.get("tool_calls") and role != "assistant":
            raise bad(f"{where}: only assistant messages carry tool_calls",
                      f"{where}.tool_calls")
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = structured.tool_calls_of(m["tool_calls"], where)
            content = m.get("content")
            msg["content"] = _content(content, where) or None if content is not None else None
            open_ids = {c["id"] for c in msg["tool_calls"]}
        else:
            if role == "tool":
                msg["tool_call_id"] = structured.check_tool_message(m, where, open_ids)
            else:
                open_ids = set()
            msg["content"] = _content(m.get("content"), where)
        out.append(msg)
    tools, choice, parallel = structured.tools_of(body)
    common = _common(body)
    if choice != "none" and common["constraint"] is not None:
        raise bad(f"'{common['constraint_param']}' and tools cannot be used together: the "
                  "output follows one grammar (or set tool_choice to \"none\")",
                  "tool_choice", "conflicting_parameters")
    if choice != "none":
        common["constraint"] = structured.tool_constraint(tools, choice, parallel)
        common["constraint_param"] = "tools"
    return Request(kind="chat", messages=tuple(out), tools=tools, tool_choice=choice, **common)


def parse_text(body: dict) -> Request:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # the SDK's one-prompt batch
    if prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if not isinstance(prompt, str):
        raise bad("'prompt' must be a string (one prompt per request)", "prompt", "invalid_type")
    if not prompt:
        raise bad("'prompt' is empty", "prompt")
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise bad("tools need the chat template: use /v1/chat/completions", "tools",
                  "unsupported_parameter")
    for key in ("echo",):
        if body.get(key):
            raise bad(f"'{key}' is not supported by tandem serve", key, "unsupported_parameter")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad(f"'suffix' must be a string, got {kind_of(suffix)}", "suffix",
                  "invalid_type")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad("'best_of' must be 1: tandem serve answers one completion per request",
                  "best_of", "unsupported_value")
    if suffix:  # fill-in-the-middle: the prompt is the text before the hole
        return Request(kind="text", infill=Infill(prefix=prompt, suffix=suffix),
                       **_common(body))
    return Request(kind="text", prompt=prompt, **_common(body))


def _content(content, where: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        raise bad(f"{where}.content is required", f"{where}.content",
                  "missing_required_parameter")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}] must be a text part "
                          "({\"type\": \"text\", \"text\": ...}); images and audio are not "
                          "supported", f"{where}.content", "unsupported_value")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{where}.content must be a string or an array of text parts, got "
              f"{kind_of(content)}", f"{where}.content", "invalid_type")


def _common(body: dict) -> dict:
    """The fields both routes share, checked; refusals of what is not implemented."""
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad(f"'n' must be 1: tandem serve answers one choice per request (got {clip(repr(n))})",
                  "n", "unsupported_value")
    constraint, constraint_param = structured.constraint_of(body)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad("logprobs are not supported by tandem serve", "logprobs",
                  "unsupported_parameter")
    for key in ("presence_penalty", "frequency_penalty"):
        value = _number(body, key)
        if value not in (None, 0.0):
            raise bad(f"'{key}' is not supported by tandem serve (use repeat_penalty)", key,
                      "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported by tandem serve", "logit_bias",
                  "unsupported_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {kind_of(model)}", "model", "invalid_type")
    max_tokens = _int(body, "max_completion_tokens", 1, 1 << 31)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 1 << 31)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"'stream' must be a boolean, got {kind_of(stream)}", "stream", "invalid_type")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("'stream_options.include_usage' must be a boolean",
                      "stream_options.include_usage", "invalid_type")
    return_tokens = body.get("return_tokens", False)
    if not isinstance(return_tokens, bool):
        raise bad(f"'return_tokens' must be a boolean, got {kind_of(return_tokens)}",
                  "return_tokens", "invalid_type")
    sampling = {key: _sampling(body, key, limit) for key, limit in LIMITS.items()}
    if sampling["top_k"] is not None:
        sampling["top_k"] = _int(body, "top_k", 0, int(LIMITS["top_k"].hi))
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1)
    if seed is not None and SEED.problem(seed):  # the CLI's rule: -1 is random, no other < 0
        raise bad(f"'seed' {SEED.problem(seed)} (-1: a random seed), got {seed}", "seed")
    return dict(model=model, max_tokens=max_tokens, seed=seed_value(seed),
                stop=_stops(body.get("stop")), stream=stream, include_usage=include_usage,
                constraint=constraint, constraint_param=constraint_param,
                prediction=_prediction(body.get("prediction")), return_tokens=return_tokens,
                **sampling, **_speculative(body))


def _speculative(body: dict) -> dict:
    """The request's drafting: `strategy` and the draft settings, each given as llama-server's
    flat key or in the `speculative` object, checked by its setting's own rule
    (config.schema); None where the request does not say (the server's)."""
    given = body.get("speculative")
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise bad("'speculative' must be an object ({\"n_max\": ..., \"n_min\": ..., "
                  f"\"p_min\": ...}}), got {kind_of(given)}", "speculative", "invalid_type")
    for key in given:  # a misspelt setting would be ignored silently
        if key not in SPECULATIVE:
            raise bad(f"'speculative.{clip(key)}' is not a draft setting (n_max, n_min, "
                      "p_min)", f"speculative.{clip(key)}", "unsupported_parameter")
    out = {}
    for key in SPECULATIVE:
        param, flat, nested = f"speculative.{key}", body.get(f"speculative.{key}"), given.get(key)
        if flat is not None and nested is not None and flat != nested:
            raise bad(f"'{param}' is given twice with different values ({clip(repr(flat))} "
                      f"and {clip(repr(nested))})", param, "conflicting_parameters")
        out[key] = _setting(key, nested if flat is None else flat, param)
    out["strategy"] = _setting("strategy", body.get("strategy"), "strategy")
    if out["n_max"] is not None and out["n_min"] is not None:
        _draft_params(out["n_max"], out["n_min"], FIELDS_BY_KEY["p_min"].default)
    return out


def _setting(key: str, value, param: str):
    """A value for the setting `key` (config.schema's field: its type and range), or None."""
    if value is None:
        return None
    setting = FIELDS_BY_KEY[key]
    if setting.kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)  # 4.0 is an integer in JSON's eyes
    good, problem = setting.check(value)
    if problem:
        wrong_kind = not isinstance(value, str) if setting.kind == "choice" else \
            isinstance(value, bool) or not isinstance(value, (int, float))
        raise bad(f"'{param}' {problem}", param, "invalid_type" if wrong_kind else "invalid_value")
    return good


def _draft_params(n_max: int, n_min: int, p_min: float) -> DraftParams:
    """The draft settings together (n_min at most n_max: DraftParams' rule), or a 400."""
    try:
        return DraftParams(n_max=n_max, n_min=n_min, p_min=p_min)
    except UsageError:  # (each value alone passed its setting's check)
        raise bad(f"'speculative.n_min' must be at most the draft max ({n_max}), got {n_min}",
                  "speculative.n_min") from None


def drafting(req: Request, strategy: str, draft: DraftParams) -> tuple[str, DraftParams]:
    """The request's strategy and draft settings: its own, else the server's (`strategy`,
    `draft`). A draft min the request leaves to the server never exceeds the max it asks for
    (llama-server's clamp); one it asks for above the max is a 400."""
    n_max = draft.n_max if req.n_max is None else req.n_max
    n_min = min(draft.n_min, n_max) if req.n_min is None else req.n_min
    p_min = draft.p_min if req.p_min is None else req.p_min
    return req.strategy or strategy, _draft_params(n_max, n_min, p_min)


def _prediction(value) -> str | None:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content":
        raise bad("'prediction' must be {\"type\": \"content\", \"content\": ...}",
                  "prediction", "invalid_type")
    return _content(value.get("content"), "prediction") or None


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(stop) > MAX_STOPS:
        raise bad(f"'stop' holds at most {MAX_STOPS} strings, got {len(stop)}", "stop")
    for s in stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad(f"each stop string must hold 1..{MAX_STOP_CHARS} characters", "stop")
    return tuple(stop)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 256.0 is an integer in JSON's eyes
    if not _is_int(value):
        raise bad(f"'{key}' must be an integer, got {kind_of(value)}", key, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"'{key}' must be in {lo}..{hi}, got {value}", key)
    return value


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{key}' must be a number, got {kind_of(value)}", key, "invalid_type")
    return float(value)


def _sampling(body: dict, key: str, limit) -> float | None:
    """A sampling field, checked against the one statement of its values (engine/sampling)."""
    value = _number(body, key)
    if value is not None and limit.problem(value):
        raise bad(f"'{key}' {limit.problem(value)}, got {value}", key)
    return value
