"""What the commands share: option declarations (spelled as llama.cpp spells them), input
checks, and the path from flags to a pair prepared to load (prepare_pair)."""
from __future__ import annotations

import math
import os
import re
import stat
import sys
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional

import typer

from tandem.config.schema import FIELDS_BY_KEY
from tandem.errors import ModelError, TandemError, UsageError
from tandem.fsutil import decode_text, fmt_bytes, read_stream

_KIND_TYPES = {"int": int, "float": float}


def setting_flag(key: str, *spellings: str, help: str, type_: Any = None,
                 default: bool = False, **option: Any) -> Any:
    """The command-line option of a settings key: its flag as the settings schema spells it
    (config/schema.py), llama.cpp's other `spellings`, and `help` followed by the variable and
    config key that set it too (and the schema's default, with `default`). None (False for a
    bool) means not given: the settings decide. Typed as the schema's kind unless `type_`."""
    f = FIELDS_BY_KEY[key]
    more = f" Default {f.default}." if default and f.default not in ("", None) else ""
    text = f"{help}{more} Env {f.env}, config `{f.dotted}`."
    kind = type_ or _KIND_TYPES.get(f.kind, str)
    return Annotated[kind if kind is bool else Optional[kind],
                     typer.Option(f.flag, *spellings, help=text, show_default=False, **option)]


# The options run, chat, serve and spec-bench share (spelled as llama.cpp spells them), as
# typed aliases (huggingface_hub's CLI style): a command declares `n_max: DraftMax = None`.
# None (False for a switch) means not given: the settings, or SamplingParams for sampling,
# decide, so no default is written here or in a command.
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
TargetFile = Annotated[Optional[Path], typer.Option("--model", "-m", readable=False, help="Target GGUF path (instead of a pair name).")]
DraftFile = Annotated[Optional[Path], typer.Option("--model-draft", "-md", "--spec-draft-model", readable=False, help="Draft GGUF path.")]
Strategy = setting_flag("strategy", help="none | draft | ngram | hybrid | auto | mtp.")
DraftMax = setting_flag("n_max", "--spec-draft-n-max", help="Most tokens drafted per step.")
DraftMin = setting_flag("n_min", "--spec-draft-n-min", help="Drafts shorter than this are dropped.")
DraftPMin = setting_flag("p_min", "--spec-draft-p-min", help="Stop drafting below this draft probability.")
Temp = Annotated[Optional[float], typer.Option("--temp", help="Temperature; 0 is greedy.")]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Top-k (0: off).")]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Top-p (1: off).")]
MinP = Annotated[Optional[float], typer.Option("--min-p", help="Min-p (0: off).")]
RepeatPenalty = Annotated[Optional[float], typer.Option("--repeat-penalty", help="Repetition penalty (1: off).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling. none, draft, ngram and hybrid then reproduce their text exactly; auto's draft lengths follow measured timings, so at temperature > 0 its text is reproducible only in distribution.")]
# run/chat/serve: unset means "from the profile, tuned settings or config" (`tandem hw`)
CtxSize = setting_flag("n_ctx", "-c", help="Context size in tokens (default: from the hardware profile).")
Threads = setting_flag("n_threads", "-t", help="CPU threads (0: all cores; default: from the profile).")
Exact = setting_flag("mode", type_=bool, help="Exact mode: output bit-identical to plain decoding (unrepacked weights, q8_0 KV, verify batches of <= 7 tokens on a CPU; slower). Default (fast): llama.cpp's own kernels, greedy output equal to plain decoding up to floating-point rounding (a near-tie may flip).")
ContextFiles = Annotated[Optional[list[Path]], typer.Option("--context-file", readable=False, help="A text file auto may draft from (repeatable): code or notes the answer will quote.")]
NoHistory = setting_flag("history", type_=bool, help="Do not draft from earlier answers kept on disk, nor keep this one (`history: off`).")
Rpc = setting_flag("rpc", help="llama.cpp RPC servers for the target's layers, HOST:PORT[,HOST:PORT...] (start one with `tandem rpc-server`); the draft stays on this machine.")
RpcTimeout = setting_flag("rpc_timeout", default=True, help="Seconds without progress over --rpc before the request ends with exit 6.")
CtxCheckpoints = setting_flag("ctx_checkpoints", default=True, help="Copies of a hybrid or recurrent model's state kept to go back to (llama-server's --ctx-checkpoints): a draft model's steps and a shorter prompt restore the nearest.")
# what the output must match (at most one; config `structured:`, env TANDEM_GRAMMAR,
# TANDEM_JSON_SCHEMA...; docs/structured.md)
Grammar = setting_flag("grammar", help="A GBNF grammar the output must match (llama.cpp's syntax).")
GrammarFile = setting_flag("grammar_file", type_=Path, readable=False, help="A file holding the GBNF grammar.")
JsonSchema = setting_flag("json_schema", "-j", help="A JSON schema the output must follow; '{}' for any JSON value.")
JsonSchemaFile = setting_flag("json_schema_file", "-jf", type_=Path, readable=False, help="A file holding the JSON schema.")
JsonObject = setting_flag("json_object", type_=bool, help="The output is one JSON object (any keys).")
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log on stderr.")]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Download a pair that is not on disk without asking, whatever its size (without it, a download over 2 GB asks at a terminal and is refused elsewhere).")]

# a pair download larger than this (bytes), or of unknown size, needs --yes or a yes at a
# terminal: `tandem run qwen2.5-coder-3b hi` once started a 2.5 GB download unannounced. The
# default pair (1.6 GB) is below it; `tandem pull` asks nothing (pulling is the request).
CONFIRM_DOWNLOAD_BYTES = 2 * 10**9


def read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        return ""
    # bounded: 50 MB piped in once took 35 s and 5.5 GB before the context-size refusal
    return decode_text(read_stream(sys.stdin.buffer, "stdin"), "stdin",
                       "pipe text; for a binary file, pipe a text rendering of it instead",
                       "pipe text, or convert it with iconv first")


def check_text(text: str | None, what: str) -> str | None:
    """UsageError when `text` cannot be encoded as UTF-8: argv bytes that are not UTF-8 arrive
    as lone surrogates, and llama.cpp's tokenizer would fail on them after the models load."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{what} is not valid UTF-8 (character {exc.start + 1})",
                         "pass UTF-8 text (check the terminal's locale, or convert the text "
                         "with iconv)") from None
    return text


# a word that reads as a pair or model name rather than prose: one token with a '-' in it
_PAIR_LIKE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]*-[A-Za-z0-9_.-]*[A-Za-z0-9]$")


def split_pair_and_prompt(args: list[str]) -> tuple[str | None, str]:
    """`tandem run [PAIR] [PROMPT]`: the first word is a pair if the catalog knows it.

    A first word that only looks like one (`qwen2.5-coder-7bb "hi"`) is refused with the close
    matches rather than sent as prompt text: the default pair (gigabytes) would be downloaded
    for a typo. A prompt is never mistaken for it when quoted as one argument."""
    from tandem.models import catalog

    if not args or len(args[0]) >= 80:
        return None, " ".join(args)
    first = args[0]
    try:
        catalog.get_pair(first)
        return first, " ".join(args[1:])
    except TandemError:
        pass
    close = _close_pairs(first)
    if _PAIR_LIKE.match(first) and (len(args) > 1 or close):
        shown = f"did you mean {' or '.join(close)}? " if close else ""
        raise UsageError(f"unknown pair {first!r}",
                         f"{shown}`tandem pairs` lists the pairs; to send it as prompt text, "
                         "quote the whole prompt as one argument")
    prompt = " ".join(args)
    if len(args) > 1 and _name_like(first):
        # sent as text, but said first: `tandem run nosuchpair hello` once answered the
        # prompt "nosuchpair hello" without a word
        near = _close_pairs(first, PAIR_NOTE_CUTOFF)
        shown = f" (close pairs: {', '.join(near)})" if near else ""
        print(f"Warning: {first!r} is not a pair name{shown}: the prompt is {prompt!r}. "
              "`tandem pairs` lists the pairs; a quoted prompt is never taken for one.",
              file=sys.stderr)
    return None, prompt


# a first word this close to a catalog name (difflib's ratio) is refused when it has a '-' in
# it (PAIR_REFUSE_CUTOFF), and otherwise sent as prompt text with a warning
PAIR_REFUSE_CUTOFF = 0.75
PAIR_NOTE_CUTOFF = 0.65
# English words with "pair" in them, which start prompts ("repair this function")
_PAIR_WORDS = {"pair", "pairs", "paired", "pairing", "repair", "repairs", "repaired",
               "repairing", "despair", "impair", "impaired", "unpaired"}


def _name_like(word: str) -> bool:
    """A first word that reads as a pair name: close to a catalog name, or a made-up word
    with "pair" in it (`nosuchpair`, `mypair`)."""
    lowered = word.lower()
    if not re.fullmatch(r"[a-z][a-z0-9_.-]*", lowered):
        return False
    return bool(_close_pairs(word, PAIR_NOTE_CUTOFF)) or (
        "pair" in lowered and lowered not in _PAIR_WORDS)


def _close_pairs(word: str, cutoff: float = PAIR_REFUSE_CUTOFF) -> list[str]:
    import difflib

    from tandem.models import catalog

    names = {}
    for name, spec in catalog.load_catalog().items():
        names[name.lower()] = name
        for alias in spec.aliases:
            names.setdefault(alias.lower(), name)
    close = difflib.get_close_matches(word.lower(), list(names), n=3, cutoff=cutoff)
    return list(dict.fromkeys(names[c] for c in close))


def check_model_path(path: Path, role: str) -> Path:
    """A user-given model file, checked before anything opens it: a named pipe or a
    process substitution (`<(cat x.gguf)`) would block or be read once, and llama.cpp needs
    a file it can map."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ModelError(f"{role} model file not found: {path}", "check the path") from None
    except OSError as exc:
        raise ModelError(f"cannot use the {role} model {path}: {exc.strerror or exc}",
                         "check the path and its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelError(f"the {role} model {path} is a directory, not a GGUF file",
                         "pass the .gguf file itself")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a pipe (a named pipe, or <(...))" if stat.S_ISFIFO(st.st_mode)
                else "not a regular file")
        raise ModelError(f"the {role} model {path} is {kind}",
                         "pass a .gguf file on disk: llama.cpp maps the file, so a pipe or "
                         "<(...) cannot work")
    return path


def resolve_models(pair: str | None, model: Path | None, draft: Path | None,
                    progress_cb=None, note=None, yes: bool | None = None) -> tuple[Path, Path | None]:
    """The pair's files: the user's own (-m, -md), else the catalog pair's from the store,
    downloaded first when missing (see confirm_download; `yes`: the command's --yes, None
    where it has none)."""
    if draft is not None:
        check_model_path(draft, "draft")
    if model is not None:
        return check_model_path(model, "target"), draft
    from tandem.models import catalog
    from tandem.models.store import Store

    spec = catalog.get_pair(pair or catalog.DEFAULT_PAIR)
    store = Store()
    wanted = list(spec.models) if draft is None else [spec.target]
    for m in wanted:
        if note is not None and store.path_for(m).exists() and not store.is_present(m):
            note(f"{m.filename} in the store does not match its record (damaged or "
                 "incomplete): downloading it again")
    confirm_download(spec.name, [m for m in wanted if not store.is_present(m)],
                     store.models_dir, yes, note)
    target_path = store.ensure(spec.target, progress=progress_cb)
    draft_path = draft or (store.ensure(spec.draft, progress=progress_cb) if spec.draft else None)
    return target_path, draft_path


def confirm_download(name: str, missing, where: Path, yes: bool | None, note=None) -> None:
    """Before fetching `missing` (catalog ModelSpecs) for `name`: say what it costs, and
    above CONFIRM_DOWNLOAD_BYTES (or of unknown size) go on only with --yes (`yes`; None:
    the command has no such flag) or a yes typed at a terminal; else UsageError (exit 2)."""
    if not missing:
        return
    sizes = [m.display_size for m in missing]
    total = sum(n for n in sizes if n)
    approx = any(m.size is None for m in missing)
    download = ("a download of unknown size" if None in sizes else
                f"a {'~' if approx else ''}{fmt_bytes(total, decimal=True)} download")
    files = ", ".join(m.filename for m in missing)
    if yes or (None not in sizes and total <= CONFIRM_DOWNLOAD_BYTES):
        if note is not None:
            note(f"{name} is not on disk: {download} ({files}) into {where}")
        return
    what = f"{name} is not on disk and needs {download} ({files})"
    if sys.stdin is not None and sys.stdin.isatty() and sys.stderr.isatty():
        if typer.confirm(f"{what} into {where}. Download it now?", default=False, err=True):
            return
        raise UsageError(f"not downloading {name}", f"`tandem pull {name}` fetches it when "
                         "you want it")
    flag = "pass --yes to download it, or run" if yes is not None else "run"
    limit = fmt_bytes(CONFIRM_DOWNLOAD_BYTES, decimal=True)
    raise UsageError(f"{what}; a download over {limit} or of unknown size needs a yes",
                     f"{flag} `tandem pull {name}` first")


def _finite(value: float | None, flag: str) -> None:
    if value is not None and not math.isfinite(value):
        raise UsageError(f"{flag} must be a finite number, got {value}", f"check {flag}")


def sampling_params(temp: float | None, top_k: int | None, top_p: float | None,
                    min_p: float | None, repeat_penalty: float | None, seed: int | None):
    """SamplingParams from the flags run and chat share (None: SamplingParams' default). NaN
    slips through every range check (all comparisons with it are false), so it is refused
    here; llama.cpp's `--seed -1` means a random seed."""
    from tandem.engine.loop.sampling import SEED, SamplingParams, seed_value

    for value, flag in ((temp, "--temp"), (top_p, "--top-p"), (min_p, "--min-p"),
                        (repeat_penalty, "--repeat-penalty")):
        if value is not None:
            _finite(value, flag)
    if seed is not None and SEED.problem(seed):
        raise UsageError(f"--seed {SEED.problem(seed)} (-1: a random seed), got {seed}",
                         SEED.hint)
    given = {"temperature": temp, "top_k": top_k, "top_p": top_p, "min_p": min_p,
             "repeat_penalty": repeat_penalty}
    return SamplingParams(**{k: v for k, v in given.items() if v is not None},
                          seed=seed_value(seed))


def check_pair_or_files(pair: str | None, model: Path | None, model_draft: Path | None) -> None:
    """A pair name or your own files (-m, -md), never both: the one check, for every command."""
    if pair is not None and (model is not None or model_draft is not None):
        raise UsageError(f"give a pair name ({pair}) or --model/--model-draft, not both",
                         "drop the pair name to use your own files, or drop -m/-md")


def prepare_pair(pair, model, model_draft, flags: dict, verbose: bool, yes: bool | None = None):
    """The command's pair prepared to load (commands.compose.Prepared): settings (flags > env >
    config > tuned > profile > defaults) -> model files -> memory plan -> SessionOptions;
    warnings go to stderr. `flags`: {settings key: value or None}. A lone -m runs plain
    decoding, so its Prepared has no draft. Shared by run, chat, serve and spec-bench.
    `yes`: the command's --yes for a large download (None: it has no such flag)."""
    from dataclasses import replace

    from tandem.commands.compose import prepare_session

    check_pair_or_files(pair, model, model_draft)
    _finite(flags.get("p_min"), "--draft-p-min")
    if model is not None and model_draft is None and flags.get("strategy") is None:
        flags = {**flags, "strategy": "none"}  # a lone -m: plain decoding unless asked
    if (pair is not None and model_draft is None and flags.get("strategy") is None
            and not os.environ.get(FIELDS_BY_KEY["strategy"].env)):
        from tandem.models import catalog

        spec = catalog.find_pair(pair)
        if spec is not None and spec.mtp:  # the target's own heads draft
            flags = {**flags, "strategy": "mtp"}
        elif spec is not None and spec.draft is None:  # no draft model: n-grams and copies
            flags = {**flags, "strategy": "auto"}  # over a profile's (or config's) draft
    from tandem.commands.progress import download_view

    view = download_view()
    try:
        prepared = prepare_session(
            {**flags, "pair": pair},
            lambda name: resolve_models(name, model, model_draft, view, view.note, yes),
            verbose=verbose)
    finally:
        view.close()
    for warning in prepared.warnings:
        print(f"Warning: {warning}", file=sys.stderr)
    if prepared.options.strategy == "none" and model is not None and model_draft is None:
        prepared = replace(prepared, draft=None)
    return prepared


def setting_flags(params: Mapping[str, Any], **given: Any) -> dict:
    """The settings a command's flags give, collected by the schema's keys: each parameter
    named as a settings key (None: not given), --exact as the mode and --no-history as the
    history; then `given`, values the command computed (the checked constraint flags)."""
    flags = {k: v for k, v in params.items() if k in FIELDS_BY_KEY}
    if "exact" in params:
        flags["mode"] = "exact" if params["exact"] else None
    if "no_history" in params:
        flags["history"] = "off" if params["no_history"] else None
    return {**flags, **given}


# under <home>/history/: the first answer kept for drafting has been announced (`tandem
# history clear` deletes the answers, not this)
HISTORY_NOTED = ".noted"


def history_note(opts) -> str | None:
    """Once per home, after the first answer was kept for drafting (SessionOptions `opts`
    with the history on): where it is and how to turn it off; the marker file is written
    then. None otherwise (and when nothing was stored: answers under 8 tokens are not)."""
    from tandem.engine.drafting.history import history_dir
    from tandem.fsutil import atomic_write_text

    if not opts.history or opts.home is None:
        return None
    folder = history_dir(opts.home)
    marker = folder / HISTORY_NOTED
    if marker.exists() or not any(folder.glob("*.json")):
        return None
    try:
        atomic_write_text(marker, "the first kept answer was announced\n")
    except OSError:
        pass  # an unwritable home says it again next time, nothing worse
    return (f"tandem keeps its answers in {folder} so that `auto` can draft from text "
            "repeated later (said once). --no-history (or `history: off` in config.yaml, "
            "TANDEM_HISTORY=off) turns it off; `tandem history clear` deletes them.")


def read_context_files(paths) -> list[tuple[Path, str]]:
    """--context-file's files, read and checked before any model loads."""
    from tandem.engine.drafting.history import read_context_file

    return [(Path(p), read_context_file(Path(p))) for p in paths or ()]
