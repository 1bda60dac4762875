"""Code-completion workloads from real code (CPython's own files, cli/tandem/data/code): holes
of 1-5 lines cut from function bodies, filled in the middle with the rest of the file around
them and sibling files as extra chunks; and a typing session, one function typed line by
line, as the requests llama.vim sends while it is typed.

llama.vim's request (tests/data/clients/llama_vim_infill.json, its source's defaults): up to
256 lines above the cursor as input_prefix, the cursor line's left part as prompt, its right
part and up to 64 lines below as input_suffix, a ring of up to 16 chunks of 64 lines from
other files as input_extra, n_predict 128, n_indent the line's indentation, t_max_predict_ms
250 (first request at a place); a warm-up (n_predict 0, the ring only) while idle. It sends one
request at a time (the next waits), so a replay in order is what a server sees. One change:
`temperature` 0 (llama.vim sends none, so llama-server samples at its 0.8): both servers then
answer greedily, and their answers can be compared.
"""
from __future__ import annotations

import ast
import random
from dataclasses import dataclass, field
from importlib import resources

N_PREFIX, N_SUFFIX = 256, 64  # llama.vim's g:llama_config.n_prefix / n_suffix
RING_CHUNK, RING_SIZE = 64, 16  # its ring_chunk_size / ring_n_chunks
N_PREDICT = 128


def code_files() -> dict[str, str]:
    """The shipped source files by name (textwrap.py, shlex.py, ...)."""
    root = resources.files("tandem") / "data" / "code"
    return {p.name[:-len(".txt")]: p.read_text(encoding="utf-8")
            for p in sorted(root.iterdir(), key=lambda p: p.name) if p.name.endswith(".py.txt")}


@dataclass
class Completion:
    """One request with what a good answer starts with. `expected`: the true text from the
    cursor to the end of its line (the first line an editor shows), `repeats`: that line's
    text appears elsewhere in the prompt (the file or the chunks: a copy source has it)."""

    id: str
    kind: str  # "fim" (a hole), "typing" (a keystroke's completion), "warmup"
    body: dict
    expected: str = ""
    repeats: bool = False
    extra: dict = field(default_factory=dict)


def _functions(text: str) -> list[ast.FunctionDef]:
    tree = ast.parse(text)
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and len(n.body) >= 3]


def _body_lines(fn, lines: list[str]) -> list[int]:
    """0-based indices of the function's body lines that hold code (not blank, no docstring)."""
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        start = first.end_lineno
    else:
        start = first.lineno - 1
    return [i for i in range(start, fn.end_lineno) if lines[i].strip()]


def _chunks(files: dict[str, str], skip: str, n: int) -> list[dict]:
    """The first RING_CHUNK lines of `n` other files, as input_extra chunks."""
    out = []
    for name, text in files.items():
        if name != skip and len(out) < n:
            out.append({"filename": name,
                        "text": "".join(text.splitlines(keepends=True)[:RING_CHUNK])})
    return out


def _repeats(line: str, *texts: str) -> bool:
    line = line.strip()
    return len(line) >= 8 and any(text.count(line) for text in texts)


def fim_cases(files: dict[str, str] | None = None, per_file: int = 4, seed: int = 0,
              n_extra: int = 2) -> list[Completion]:
    """Holes of 1-5 lines in function bodies, `per_file` a file, chosen with `seed`."""
    files = files or code_files()
    rng = random.Random(seed)
    out = []
    for name, text in files.items():
        lines = text.splitlines(keepends=True)
        fns = _functions(text)
        rng.shuffle(fns)
        for fn in fns[:per_file]:
            body = _body_lines(fn, lines)
            if not body:
                continue
            size = rng.randint(1, min(5, len(body)))
            at = rng.randint(0, len(body) - size)
            lo, hi = body[at], body[at + size - 1] + 1
            prefix, hole, suffix = "".join(lines[:lo]), "".join(lines[lo:hi]), "".join(lines[hi:])
            extra = _chunks(files, name, n_extra)
            first = hole.splitlines()[0] if hole else ""
            out.append(Completion(
                id=f"{name}:{lo + 1}-{hi}", kind="fim",
                body={"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
                      "prompt": "", "n_predict": N_PREDICT, "temperature": 0,
                      "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True},
                expected=first,
                repeats=_repeats(first, prefix, suffix, *(c["text"] for c in extra)),
                extra={"hole": hole, "lines": size}))
    return out


def typing_session(files: dict[str, str] | None = None, name: str = "textwrap.py",
                   warmup_every: int = 4) -> list[Completion]:
    """The requests llama.vim sends while the longest function of `name` is typed line by
    line: at each line's start (after its indentation) and halfway through it, the file
    above as typed so far, the rest of the file below, the ring growing by one chunk of
    another file every few lines (as it gathers chunks from the buffers the user visits),
    and a warm-up with the ring every `warmup_every` requests."""
    files = files or code_files()
    text = files[name]
    lines = text.splitlines(keepends=True)
    fn = max(_functions(text), key=lambda f: f.end_lineno - f.lineno)
    body = _body_lines(fn, lines)
    after = "".join(lines[fn.end_lineno:fn.end_lineno + N_SUFFIX])
    others = [(n, t.splitlines(keepends=True)) for n, t in files.items() if n != name]
    ring: list[dict] = []
    out: list[Completion] = []
    for k, i in enumerate(body):
        if k % 3 == 0 and others:  # a new chunk from the next file (the ring keeps 16)
            other, olines = others[(k // 3) % len(others)]
            start = (k // (3 * len(others))) * RING_CHUNK
            ring = (ring + [{"filename": other,
                             "text": "".join(olines[start:start + RING_CHUNK])}])[-RING_SIZE:]
        line = lines[i].rstrip("\n")
        indent = line[:len(line) - len(line.lstrip())]
        above = "".join(lines[max(0, i - N_PREFIX):i])
        for cut in (len(indent), len(indent) + (len(line) - len(indent)) // 2):
            if out and len(out) % (warmup_every + 1) == warmup_every:
                out.append(Completion(
                    id=f"{name}:{i + 1}:warmup", kind="warmup",
                    body={"input_prefix": "", "input_suffix": "", "prompt": "",
                          "input_extra": list(ring), "n_predict": 0, "temperature": 0.0,
                          "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
                          "t_max_predict_ms": 1, "response_fields": [""]}))
            typed, rest = line[:cut], line[cut:]
            out.append(Completion(
                id=f"{name}:{i + 1}:{cut}", kind="typing",
                body={"input_prefix": above, "input_suffix": rest + "\n" + after,
                      "input_extra": list(ring), "prompt": typed, "n_predict": N_PREDICT,
                      "n_indent": len(indent), "top_k": 40, "top_p": 0.9, "temperature": 0,
                      "samplers": ["top_k", "top_p", "infill"], "stream": False,
                      "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
                      "id_slot": 0},
                expected=rest, repeats=_repeats(rest, above, after, *(c["text"] for c in ring)),
                extra={"line": i + 1}))
    return out


def first_line(text: str) -> str:
    return text.split("\n", 1)[0]


def agrees(completion: str, expected: str) -> bool:
    """The completion's first line is the expected one (spaces at its end aside)."""
    return first_line(completion).rstrip() == expected.rstrip()
