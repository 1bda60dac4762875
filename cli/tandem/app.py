"""The tandem command line: parse, call the core, render. main() maps errors to messages."""
from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.exceptions
import typer.main
from typer._click import exceptions as _click  # typer 0.29 vendors its own click
from typer._click import utils as _click_utils

from tandem import __version__
from tandem.errors import (EXIT_INTERRUPTED, EXIT_USAGE, ModelError, OutputError, TandemError,
                           TandemWarning, UsageError)

app = typer.Typer(
    name="tandem",
    help="Faster local LLM generation with speculative decoding on llama.cpp.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        print(f"tandem {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version,
                                                    is_eager=True, help="Show the version.")] = None,
):
    """Faster local LLM generation with speculative decoding on llama.cpp."""


# Shared options, spelled as llama.cpp spells them where it has a spelling.
ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", readable=False, help="Target GGUF path (instead of a pair name).")]
DraftOpt = Annotated[Optional[Path], typer.Option("--model-draft", "-md", "--spec-draft-model", readable=False, help="Draft GGUF path.")]
StrategyOpt = Annotated[Optional[str], typer.Option("--strategy", help="none | draft | ngram | hybrid | auto.")]
DraftMaxOpt = Annotated[Optional[int], typer.Option("--draft-max", "--spec-draft-n-max", help="Most tokens drafted per step.")]
DraftMinOpt = Annotated[Optional[int], typer.Option("--draft-min", "--spec-draft-n-min", help="Drafts shorter than this are dropped.")]
DraftPMinOpt = Annotated[Optional[float], typer.Option("--draft-p-min", "--spec-draft-p-min", help="Stop drafting below this draft probability.")]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", help="Context size in tokens.")]
ThreadsOpt = Annotated[int, typer.Option("--threads", "-t", help="CPU threads (0: all cores).")]
# run/chat: unset means "from the profile, tuned settings or config" (see `tandem hw`)
OptCtxOpt = Annotated[Optional[int], typer.Option("--ctx-size", "-c", help="Context size in tokens (default: from the hardware profile).")]
OptThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (0: all cores; default: from the profile).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log on stderr.")]
ExactOpt = Annotated[bool, typer.Option("--exact", help="Exact mode: output bit-identical to plain decoding (unrepacked weights, q8_0 KV, verify batches of <= 7 tokens on a CPU; slower). Default (fast): llama.cpp's own kernels, greedy output equal to plain decoding up to floating-point rounding (a near-tie may flip).")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature; 0 is greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k (0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (1: off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p (0: off).")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Repetition penalty (1: off).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling. none, draft, ngram and hybrid then reproduce their text exactly; auto's draft lengths follow measured timings, so at temperature > 0 its text is reproducible only in distribution.")]


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        return ""
    data = sys.stdin.buffer.read()
    if b"\x00" in data:
        raise UsageError("stdin looks binary (it contains NUL bytes)",
                         "pipe text; for a binary file, pipe a text rendering of it instead")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"stdin is not UTF-8 text (byte {exc.start})",
                         "pipe text, or convert it with iconv first") from exc


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


def _split_pair_and_prompt(args: list[str]) -> tuple[str | None, str]:
    """`tandem run [PAIR] [PROMPT]`: the first word is a pair if the catalog knows it.

    A first word that only looks like one (`qwen2.5-coder-7bb "hi"`) is refused with the close
    matches rather than sent as prompt text: the default pair (gigabytes) would be downloaded
    for a typo. A prompt is never mistaken for it when quoted as one argument."""
    from tandem import catalog

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
    return None, " ".join(args)


def _close_pairs(word: str) -> list[str]:
    import difflib

    from tandem import catalog

    names = {}
    for name, spec in catalog.load_catalog().items():
        names[name.lower()] = name
        for alias in spec.aliases:
            names.setdefault(alias.lower(), name)
    close = difflib.get_close_matches(word.lower(), list(names), n=3, cutoff=0.75)
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


def _resolve_models(pair: str | None, model: Path | None, draft: Path | None,
                    progress_cb=None, note=None) -> tuple[Path, Path | None]:
    if draft is not None:
        check_model_path(draft, "draft")
    if model is not None:
        return check_model_path(model, "target"), draft
    from tandem import catalog
    from tandem.store import Store

    spec = catalog.get_pair(pair or catalog.DEFAULT_PAIR)
    store = Store()
    wanted = [spec.target] + ([] if draft else [spec.draft])
    for m in wanted:
        if note is not None and store.path_for(m).exists() and not store.is_present(m):
            note(f"{m.filename} in the store does not match its record (damaged or "
                 "incomplete): downloading it again")
    target_path = store.ensure(spec.target, progress=progress_cb)
    draft_path = draft or store.ensure(spec.draft, progress=progress_cb)
    return target_path, draft_path


def _finite(value: float | None, flag: str) -> None:
    if value is not None and not math.isfinite(value):
        raise UsageError(f"{flag} must be a finite number, got {value}", f"check {flag}")


def sampling_params(temp: float, top_k: int, top_p: float, min_p: float,
                    repeat_penalty: float, seed: int | None):
    """SamplingParams from the flags run and chat share. NaN slips through every range check
    (all comparisons with it are false), so it is refused here; llama.cpp's `--seed -1`
    means a random seed."""
    from tandem.engine.sampling import SamplingParams

    for value, flag in ((temp, "--temp"), (top_p, "--top-p"), (min_p, "--min-p"),
                        (repeat_penalty, "--repeat-penalty")):
        _finite(value, flag)
    if seed is not None and seed < -1:
        raise UsageError(f"--seed must be >= 0 (or -1 for a random seed), got {seed}",
                         "omit --seed (or pass -1) for a random seed")
    if seed is not None and seed >= 1 << 64:
        raise UsageError(f"--seed must be below 2^64, got {seed}", "pick a smaller seed")
    return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=None if seed == -1 else seed)


def check_max_tokens(max_tokens: int) -> None:
    if max_tokens < 1:
        raise UsageError(f"max tokens must be >= 1, got {max_tokens}",
                         "pass -n with a positive number of tokens")


@app.command(context_settings={"allow_interspersed_args": True})
def run(
    args: Annotated[Optional[list[str]], typer.Argument(help="[PAIR] [PROMPT]: a catalog pair name, then the prompt.", show_default=False)] = None,
    system: SystemOpt = None,
    model: ModelOpt = None,
    model_draft: DraftOpt = None,
    strategy: StrategyOpt = None,
    draft_max: DraftMaxOpt = None,
    draft_min: DraftMinOpt = None,
    draft_p_min: DraftPMinOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", "--n-predict", help="Most tokens to generate.")] = 256,
    temp: TempOpt = 0.0,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    seed: SeedOpt = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template: the prompt is sent as is.")] = False,
    ctx_size: OptCtxOpt = None,
    threads: OptThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text and statistics.")] = False,
    no_stream: Annotated[bool, typer.Option("--no-stream", help="Print the text once it is complete.")] = False,
    stats: Annotated[Optional[bool], typer.Option("--stats/--no-stats", help="Statistics on stderr (default: when stderr is a terminal).")] = None,
    exact: ExactOpt = False,
    verbose: VerboseOpt = False,
):
    """Generate a completion; text on stdout, statistics on stderr.

    Examples:

      tandem run "Write a Python function that reverses a string"

      git diff | tandem run -s "Write the commit message for this diff"

      tandem run -m target.gguf -md draft.gguf --draft-max 8 "hello"
    """
    from tandem.engine.events import DoneEvent, TokenEvent
    from tandem.engine.speculative import GenParams
    from tandem.session import PairSession

    pair, prompt = _split_pair_and_prompt(args or [])
    check_text(prompt, "the prompt")
    check_text(system, "the system prompt (-s)")
    for s in stop or ():
        check_text(s, "a --stop string")
    piped = _read_stdin()
    prompt = "\n\n".join(p for p in (piped, prompt) if p.strip())
    if not prompt.strip():
        raise UsageError("the prompt is empty", "pass a prompt argument or pipe text on stdin")
    check_max_tokens(max_tokens)
    sampling = sampling_params(temp, top_k, top_p, min_p, repeat_penalty, seed)
    gen = GenParams(max_tokens=max_tokens, sampling=sampling, stop=tuple(stop or ()))
    target_path, draft_path, opts = load_plan(pair, model, model_draft, strategy, draft_max,
                                              draft_min, draft_p_min, ctx_size, threads, verbose,
                                              exact=exact)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    show_stats = sys.stderr.isatty() if stats is None else stats
    done = None
    with PairSession(target_path, draft_path, opts) as session:
        tokens = session.prompt_tokens(messages, raw=raw)
        out = sys.stdout
        for ev in session.generate(tokens, gen):
            if isinstance(ev, TokenEvent) and not as_json and not no_stream and ev.text:
                out.write(ev.text)
                out.flush()
            elif isinstance(ev, DoneEvent):
                done = ev
    if as_json:
        print(json.dumps({"text": done.text, "finish_reason": done.reason,
                          "stats": done.stats.to_dict()}, ensure_ascii=False))
    else:
        if no_stream:
            out.write(done.text)
        if done.text and not done.text.endswith("\n"):
            out.write("\n")
        out.flush()
    if show_stats:
        print(done.stats.summary(), file=sys.stderr)


def load_plan(pair, model, model_draft, strategy, draft_max, draft_min, draft_p_min, ctx_size,
              threads, verbose, exact=False):
    """Settings (flags > env > config > tuned > profile > defaults) -> model files -> memory
    plan -> SessionOptions; warnings go to stderr. Shared by run and chat."""
    from tandem.settings import cli_values, prepare_session

    if pair is not None and (model is not None or model_draft is not None):
        raise UsageError(f"give a pair name ({pair}) or --model/--model-draft, not both",
                         "drop the pair name to use your own files, or drop -m/-md")
    _finite(draft_p_min, "--draft-p-min")
    if model is not None and model_draft is None and strategy is None:
        strategy = "none"  # a lone -m means plain decoding unless a strategy is asked for
    cli = cli_values(strategy=strategy, draft_max=draft_max, draft_min=draft_min,
                     draft_p_min=draft_p_min, ctx_size=ctx_size, threads=threads, pair=pair,
                     mode="exact" if exact else None)
    view = download_view()
    try:
        prepared = prepare_session(
            cli, lambda name: _resolve_models(name, model, model_draft, view, view.note),
            verbose=verbose)
    finally:
        view.close()
    for warning in prepared.warnings:
        print(f"Warning: {warning}", file=sys.stderr)
    draft = prepared.draft
    if prepared.options.strategy == "none" and model is not None and model_draft is None:
        draft = None
    return prepared.target, draft, prepared.options


def download_view():
    """Download progress on stderr: Rich bars on a terminal, periodic lines otherwise, so a
    model fetched on the way (run, chat, spec-bench) is never a silent wait."""
    from tandem.cmd_pairs import ProgressView, _bars_wanted, _err

    return ProgressView(_err(), _bars_wanted())


def _register_commands() -> None:
    """Command groups live in their own modules (cmd_*.py), each with register(app)."""
    import importlib

    for name in ("cmd_pairs", "cmd_hw", "cmd_chat", "cmd_bench"):
        try:
            module = importlib.import_module(f"tandem.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tandem.{name}":
                raise
            continue
        module.register(app)


_register_commands()


class _PipeClosed(Exception):
    """The reader of stdout went away. Not an OSError on purpose: click turns an EPIPE
    OSError into a silent exit 1 before main() could see it."""


class _Stdout:
    """sys.stdout as main() runs a command: a write that fails becomes _PipeClosed (reader
    gone) or OutputError (full device...), and it remembers whether the last character
    written ended a line (an interrupted answer gets its newline)."""

    def __init__(self, stream):
        self._stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        if text:  # before the write: a Ctrl-C can land the moment it returns
            self.at_line_start = text.endswith("\n")
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise _output_error(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise _output_error(exc) from None

    def __getattr__(self, name):  # isatty, fileno, encoding, buffer...
        return getattr(self._stream, name)


def _output_error(exc: OSError) -> Exception:
    if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE:
        return _PipeClosed()
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return OutputError("cannot write the output: stdout's device is full",
                           "free some space, or redirect stdout elsewhere")
    return OutputError(f"cannot write the output to stdout: {exc.strerror or exc}",
                       "check where stdout is redirected")


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """TandemWarnings as `Warning: ...` lines; any other warning as Python shows it."""
    if issubclass(category, TandemWarning):
        print(f"Warning: {message}", file=sys.stderr)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main() -> None:
    """Entry point: every failure becomes `Error:`/`Hint:` on stderr and an exit code."""
    if sys.stderr is None or not _fd_open(2):
        # stderr closed (`2>&-`): errors and notes are dropped, never sent to stdout instead
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    stdout_closed = sys.stdout is None or not _fd_open(1)
    if not stdout_closed:
        sys.stdout = _Stdout(sys.stdout)
    warnings.showwarning = _show_warning
    try:
        if stdout_closed:
            raise UsageError("stdout is closed, so the output would be lost",
                             "run tandem with stdout open, or send it to /dev/null "
                             "(>/dev/null) if you want no output")
        rc = _invoke()
        sys.stdout.flush()  # a failed final flush is reported here, not at exit
    except OutputError as exc:
        _report(exc.message, exc.hint)
        _drop_stdout()
        sys.exit(exc.exit_code)
    except TandemError as exc:
        _report(exc.message, exc.hint)
        sys.exit(exc.exit_code)
    except typer.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except _click.NoArgsIsHelpError:
        sys.exit(0)  # the help text is already printed
    except _click.ClickException as exc:
        _report(exc.format_message(), _usage_hint(exc))
        sys.exit(EXIT_USAGE)
    except (KeyboardInterrupt, typer.exceptions.Abort):
        _interrupted()
    except (_PipeClosed, BrokenPipeError):
        _quiet_exit()
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        if os.environ.get("TANDEM_DEBUG"):
            raise
        _report(f"unexpected {type(exc).__name__}: {exc}",
                "rerun with TANDEM_DEBUG=1 for a traceback, and report it")
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


def _invoke():
    """Parse and run the command. Not through typer's own main loop: it turns Ctrl-C into a
    bare exit code and EPIPE into a silent exit 1 before main() could report either."""
    command = typer.main.get_command(app)
    with command.make_context(_click_utils._detect_program_name(), sys.argv[1:]) as ctx:
        return command.invoke(ctx)


def _usage_hint(exc: Exception) -> str:
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "tandem"
    return f"`{command} --help` lists the arguments and options"


def _interrupted() -> None:
    """Ctrl-C: end the partial answer's line, say so, exit 130."""
    try:
        if isinstance(sys.stdout, _Stdout) and not sys.stdout.at_line_start:
            sys.stdout.write("\n")
            sys.stdout.flush()
    except (_PipeClosed, OutputError):
        pass
    print("Interrupted.", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)


def _quiet_exit() -> None:
    """The reader went away (e.g. `| head`): stop quietly with 0, like other Unix tools."""
    _drop_stdout()
    sys.exit(0)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is still buffered
    cannot fail again with a second message."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _report(message: str, hint: str | None) -> None:
    print(f"Error: {message}", file=sys.stderr)
    if hint:
        print(f"Hint: {hint}", file=sys.stderr)
