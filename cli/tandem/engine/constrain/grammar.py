"""A grammar over the target's tokens: llguidance compiles GBNF or a JSON schema, and a
GrammarState follows the output, giving the allowed tokens at the next position, the
tokens the grammar forces there, and commit/rollback as tokens are decided.

llguidance is imported only when a grammar is used (`tandem run --help` and plain runs never
load it). Its tokenizer is built once per model from the bytes engine/backend/model.py
reads, and control tokens are marked special there, so grammar text never matches them:
a literal "<|im_end|>" in a grammar is written as plain text tokens.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from tandem import bounded_json
from tandem.engine.constrain import bounds
from tandem.errors import UsageError

if TYPE_CHECKING:
    from tandem.engine.backend.llama import Model
    from tandem.engine.loop.sampling import Dist

KINDS = ("gbnf", "json_schema", "lark")  # lark: llguidance's own syntax (tool-call grammars)
# Compact but natural separators with no free whitespace: the model writes json.dumps's own
# style, and every key, quote and separator is forced (a free draft). A schema's own
# "x-guidance" options override these.
# lenient: llguidance then compiles past what it does not implement and lists it as warnings;
# an unknown `format` is let through (JSON Schema makes `format` an annotation, and llama.cpp
# ignores the ones it does not know: real schemas carry "url", "path", "semver"), anything else
# listed is refused by name as before (_refused)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "lenient": True}
IGNORED_WARNINGS = ("Unknown format:",)
ONE_OF = "oneOf not fully supported"  # llguidance's warning where it would approximate
ANY_OBJECT = '{"type": "object"}'


class GrammarError(UsageError):
    """A grammar or schema that cannot be used, or an output it could not complete; `limit`
    names the GRAMMAR_LIMITS key it passed when that is why ("parser": llguidance's own)."""

    def __init__(self, message: str, hint: str | None = None, limit: str | None = None):
        super().__init__(message, hint)
        self.limit = limit


LIMITS_HINT = "docs/structured.md lists tandem's grammar limits; split or simplify it"
# llguidance recurses on the calling thread's native stack while it compiles: a 5,000-rule
# chain overflowed 8 MiB and killed the process; 20,000 rules fit in 64 MiB, 20x the bounds
NATIVE_STACK = 64 << 20
_STACK_LOCK = threading.Lock()


def on_native_stack(fn, *args):
    """fn(*args) on a fresh thread with NATIVE_STACK bytes of stack (reserved, touched only
    as used); its exception is raised here."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            out["error"] = exc

    with _STACK_LOCK:  # the size applies to threads created meanwhile: set it briefly
        old = threading.stack_size(NATIVE_STACK)
        try:
            worker = threading.Thread(target=run, name="tandem-grammar", daemon=True)
            worker.start()
        finally:
            threading.stack_size(old)
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def said(text: str, limit: int = 200) -> str:
    """llguidance's message, for a person: its first line (the lines after echo the parser's
    state and the grammar, up to megabytes), clipped."""
    line = text.strip().split("\n", 1)[0].strip()
    return line if len(line) <= limit else line[:limit] + "..."


def _llg():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise GrammarError(f"grammars need the llguidance package ({exc})",
                           "pip install 'llguidance>=1.9,<2' into tandem's environment") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` (KINDS), the grammar or schema `text`, and
    `origin`, how the user gave it (a flag or a file), for messages."""

    kind: str
    text: str
    origin: str = ""

    def compiled(self) -> str:
        """llguidance's grammar for this constraint; GrammarError naming the problem."""
        return _compile(self.kind, self.text, self.origin)


# compiled grammars by their text: a server sees the same schema request after request, and
# any text at all, so the cache is bounded (least recently used out) and shared by threads
COMPILED_CACHE = 64
_COMPILED: OrderedDict[tuple[str, str], str] = OrderedDict()
_COMPILED_LOCK = threading.Lock()


def _compile(kind: str, text: str, origin: str) -> str:
    key = (kind, text)
    with _COMPILED_LOCK:
        if key in _COMPILED:
            _COMPILED.move_to_end(key)
            return _COMPILED[key]
    grammar = _compile_new(kind, text, origin)
    with _COMPILED_LOCK:
        _COMPILED[key] = grammar
        while len(_COMPILED) > COMPILED_CACHE:
            _COMPILED.popitem(last=False)
    return grammar


def _compile_new(kind: str, text: str, origin: str) -> str:
    where = f" ({origin})" if origin else ""
    what = {"gbnf": "GBNF grammar", "json_schema": "JSON schema"}.get(kind, "grammar")
    # a schema's size is counted as llguidance gets it, re-serialized (not its indentation)
    over = bounds.in_gbnf(text) if kind == "gbnf" else \
        bounds.in_text(text) if kind != "json_schema" else None
    if over:
        raise GrammarError(f"the {what}{where} {over.says()}", LIMITS_HINT, over.limit.key)
    return on_native_stack(_compile_bounded, kind, text, where, what)


def _compile_bounded(kind: str, text: str, where: str, what: str) -> str:
    llg = _llg()
    options: dict = {}  # a JSON schema's llguidance options (they say which warnings count)
    if kind == "gbnf":
        if not text.strip():
            raise GrammarError(f"the grammar{where} is empty", "write a GBNF grammar with a "
                               "root rule, e.g. root ::= \"yes\" | \"no\"")
        try:
            grammar = llg.grammar_from("gbnf", text)
        except ValueError as exc:
            msg = said(str(exc).removeprefix("Failed to convert the grammar from GBNF to Lark: "))
            raise GrammarError(f"invalid GBNF grammar{where}: {msg}",
                               "see llama.cpp's grammars/README.md for the syntax") from None
        hint = "see llama.cpp's grammars/README.md for the syntax"
    elif kind == "json_schema":
        try:
            schema = bounded_json.loads(text)
        except bounded_json.TooDeep as exc:
            raise GrammarError(f"the JSON schema{where} is nested more than {exc.limit} levels "
                               "deep", LIMITS_HINT, "json_depth") from None
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema{where} is not valid JSON: {exc.msg} at line "
                               f"{exc.lineno} column {exc.colno}",
                               "check the schema's quotes, commas and braces") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"the JSON schema{where} must be an object, got "
                               f"{type(schema).__name__}", "e.g. {\"type\": \"object\"}")
        over = bounds.in_schema(schema) or bounds.in_text(json.dumps(schema, ensure_ascii=False))
        if over:
            raise GrammarError(f"the JSON schema{where} {over.says()}", LIMITS_HINT,
                               over.limit.key)
        if isinstance(schema, dict):  # the schema's own options over tandem's
            own = schema.get("x-guidance")
            schema = {**schema, "x-guidance": {**JSON_OPTIONS,
                                               **(own if isinstance(own, dict) else {})}}
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except ValueError as exc:
            raise GrammarError(f"the JSON schema{where} cannot be used: {said(str(exc))}",
                               "check the schema") from None
        hint = ("tandem supports the JSON Schema subset llguidance implements "
                "(docs/structured.md); remove or rewrite that part")
        options = schema["x-guidance"] if isinstance(schema, dict) else {}
    elif kind == "lark":
        try:
            grammar = llg.LLMatcher.grammar_from_lark(text)
        except ValueError as exc:
            raise GrammarError(f"invalid grammar{where}: {said(str(exc))}",
                               "check the grammar") from None
        hint = "check the grammar"
    else:
        raise GrammarError(f"unknown grammar kind {kind!r}", f"use one of: {', '.join(KINDS)}")
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error and kind == "json_schema" and (messages := _refused(messages, options)):
        if messages[0].startswith(ONE_OF):
            hint = ("write anyOf, or let tandem approximate oneOf by anyOf: "
                    "\"x-guidance\": {\"coerce_one_of\": true} in the schema")
        is_error = True
    if is_error:
        problem = said(messages[0]) if messages else "unknown problem"
        if problem.startswith("Unsatisfiable"):
            hint = "no output can match it: relax the conflicting constraints"
        raise GrammarError(f"the {what}{where} cannot be used: {problem}", hint)
    return grammar


def _refused(messages: list[str], options: dict) -> list[str]:
    """Of a lenient compile's warnings, what it skipped that tandem does not let through
    (IGNORED_WARNINGS; oneOf approximated by anyOf only where the schema asks for it:
    coerce_one_of). A strict compile refuses by error, not by warning."""
    if not options.get("lenient"):
        return []
    let_through = IGNORED_WARNINGS + ((ONE_OF,) if options.get("coerce_one_of") else ())
    return [m for m in messages if not m.startswith(let_through)]


# one llguidance tokenizer per loaded model: building it reads 152k tokens (~1 s)
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def tokenizer_for(model: Model):
    tok = _TOKENIZERS.get(model)
    if tok is None:
        llg = _llg()
        pieces, special = model.vocab_bytes()
        # llguidance's convention: a leading 0xff byte marks a special token, which grammar
        # text can then never produce (user text is data, never a control token)
        pieces = [b"\xff" + p if s else p for p, s in zip(pieces, special)]
        eog = model.eog_tokens()
        entry = getattr(model, "tokenizer_entry", None)
        if entry is not None:
            vocab, tokenize = entry()
            tok = llg.LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=vocab,
                                                tokenize_fptr=tokenize, eos_token=eog,
                                                slices=None)
        else:  # a model without llama.cpp's tokenizer (tests' scripted models)
            tok = llg.LLTokenizer(llg.TokenizerWrapper(_Tokenize(model, pieces, eog)),
                                  eos_token=eog)
        _TOKENIZERS[model] = tok
    return tok


class _Tokenize:
    """What llguidance's TokenizerWrapper reads: the token bytes and a text tokenizer."""

    def __init__(self, model, pieces: list[bytes], eog: list[int]):
        self.tokens = pieces
        self.eos_token_id = eog[0] if eog else len(pieces) - 1
        self.bos_token_id = None
        self.special_token_ids = list(eog)
        self._model = model

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._model.tokenize(text, add_special=False, parse_special=False)


class GrammarState:
    """The grammar's state after the tokens committed so far. The mask of the next position
    is computed once per state (at most one llguidance call per verified row), as a bit
    array: a single token's test reads one byte, a row's mask unpacks it once."""

    def __init__(self, constraint: Constraint, model: Model):
        llg = _llg()
        self.n_vocab = model.n_vocab
        self.n_committed = 0
        # the matcher compiles the grammar again: on the stack the bounds were sized for
        self.matcher = on_native_stack(partial(llg.LLMatcher, log_level=0),
                                       tokenizer_for(model), constraint.compiled())
        self._check()
        words = (self.n_vocab + 31) // 32
        self._bits = np.zeros(words * 4, dtype=np.uint8)
        self._fresh = False  # _bits holds the current state's mask
        self._bool: np.ndarray | None = None

    def _check(self) -> None:
        if self.matcher.is_error():
            raise self._failed()

    def _failed(self) -> GrammarError:
        """The matcher's error as a person reads it: a grammar past what llguidance's parser
        holds (too many items in a row, lexer fuel), or one no output can follow."""
        problem = said(self.matcher.get_error())
        at = f" at output token {self.n_committed + 1}"
        if "max is" in problem or "limit" in problem or "fuel" in problem:
            return GrammarError(f"the grammar is too large for the grammar engine{at}: "
                                f"{problem}", LIMITS_HINT, "parser")
        return GrammarError(f"the grammar failed{at}: {problem}", "check the grammar or schema")

    def _mask_bits(self) -> np.ndarray:
        if not self._fresh:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self._check()
            self._fresh, self._bool = True, None
        return self._bits

    def allowed(self, token: int) -> bool:
        """Whether `token` may come next."""
        if not 0 <= token < self.n_vocab:
            return False
        return bool(self._mask_bits()[token >> 3] >> (token & 7) & 1)

    def mask(self) -> np.ndarray:
        """The allowed tokens at the next position, as booleans over the vocabulary."""
        if self._bool is None or not self._fresh:
            bits = self._mask_bits()
            self._bool = np.unpackbits(bits, bitorder="little")[:self.n_vocab].view(bool)
            if not self._bool.any():
                raise GrammarError("the grammar allows no token at this point of the output",
                                   "the grammar needs text this model's tokens cannot spell")
        return self._bool

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of a logits row with the disallowed tokens at -inf."""
        return np.where(self.mask(), logits, np.float32(-np.inf))

    def greedy(self, logits: np.ndarray) -> int:
        """The masked argmax: the row's argmax when the grammar allows it (most rows), else
        the argmax over the allowed tokens."""
        tok = int(logits.argmax())
        if self.allowed(tok):
            return tok
        return int(self.masked(logits).argmax())

    def restrict(self, dist: Dist) -> Dist:
        """`dist` conditioned on the allowed tokens (a draft's q under the grammar)."""
        from tandem.engine.loop.sampling import Dist

        mask = self.mask()
        if dist.ids is None:
            probs = np.where(mask[:len(dist.probs)], dist.probs.astype(np.float64), 0.0)
            return Dist(ids=None, probs=probs / probs.sum())
        keep = mask[dist.ids]
        probs = dist.probs[keep]
        return Dist(ids=dist.ids[keep], probs=probs / probs.sum())

    def commit(self, token: int) -> None:
        """Advance past `token` (one the mask allowed)."""
        if not self.matcher.consume_token(token):
            if self.matcher.is_error():  # the parser gave up (a limit), not a wrong token
                raise self._failed()
            raise GrammarError(f"the grammar refused token {token}, which its mask allowed",
                               "this is a bug in tandem: please report it")
        self.n_committed += 1
        self._fresh = False

    def rollback(self, n: int) -> None:
        """Forget the last `n` committed tokens."""
        if n <= 0:
            return
        if n > self.n_committed or not self.matcher.rollback(n):
            raise GrammarError(f"the grammar could not roll back {n} tokens",
                               "this is a bug in tandem: please report it")
        self.n_committed -= n
        self._fresh = False

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (its fast-forward tokens): the canonical
        tokenization of the bytes every continuation starts with."""
        tokens = list(self.matcher.compute_ff_tokens())
        self._check()  # computing them may pass the parser's limits
        return tokens

    def first_step(self) -> None:
        """Take the grammar's first step without a model: the mask, the forced tokens, and
        one token committed (the first forced one, else the first allowed one). Where a
        grammar compiles but its parser gives up at once, this raises before any answer
        starts (a server's 4xx instead of a stream that fails after its 200)."""
        forced = self.forced()
        token = forced[0] if forced else int(np.flatnonzero(self.mask())[0])
        self.commit(token)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match."""
        return self.matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """Complete, and nothing but the end may follow."""
        return self.matcher.is_stopped()
