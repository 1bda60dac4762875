"""The tandem command line: parse, call the core, render. main() maps errors to messages."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.exceptions
from typer._click import exceptions as _click  # typer 0.29 vendors its own click

from tandem import __version__
from tandem.errors import EXIT_INTERRUPTED, EXIT_USAGE, TandemError, UsageError

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
ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="Target GGUF path (instead of a pair name).")]
DraftOpt = Annotated[Optional[Path], typer.Option("--model-draft", "-md", "--spec-draft-model", help="Draft GGUF path.")]
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


def _split_pair_and_prompt(args: list[str]) -> tuple[str | None, str]:
    """`tandem run [PAIR] [PROMPT]`: the first word is a pair only if the catalog knows it."""
    from tandem import catalog

    if args and len(args[0]) < 80:
        try:
            catalog.get_pair(args[0])
            return args[0], " ".join(args[1:])
        except TandemError:
            pass
    return None, " ".join(args)


def _resolve_models(pair: str | None, model: Path | None, draft: Path | None,
                    progress_cb=None) -> tuple[Path, Path | None]:
    if model is not None:
        return model, draft
    from tandem import catalog
    from tandem.store import Store

    spec = catalog.get_pair(pair or catalog.DEFAULT_PAIR)
    store = Store()
    target_path = store.ensure(spec.target, progress=progress_cb)
    draft_path = draft or store.ensure(spec.draft, progress=progress_cb)
    return target_path, draft_path


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
    from tandem.engine.sampling import SamplingParams
    from tandem.engine.speculative import GenParams
    from tandem.session import PairSession

    pair, prompt = _split_pair_and_prompt(args or [])
    piped = _read_stdin()
    prompt = "\n\n".join(p for p in (piped, prompt) if p.strip())
    if not prompt.strip():
        raise UsageError("the prompt is empty", "pass a prompt argument or pipe text on stdin")
    sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, seed=seed)
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

    if model is not None and model_draft is None and strategy is None:
        strategy = "none"  # a lone -m means plain decoding unless a strategy is asked for
    cli = cli_values(strategy=strategy, draft_max=draft_max, draft_min=draft_min,
                     draft_p_min=draft_p_min, ctx_size=ctx_size, threads=threads, pair=pair,
                     mode="exact" if exact else None)
    prepared = prepare_session(cli, lambda name: _resolve_models(name, model, model_draft),
                               verbose=verbose)
    for warning in prepared.warnings:
        print(f"Warning: {warning}", file=sys.stderr)
    draft = prepared.draft
    if prepared.options.strategy == "none" and model is not None and model_draft is None:
        draft = None
    return prepared.target, draft, prepared.options


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


def main() -> None:
    """Entry point: every failure becomes `Error:`/`Hint:` on stderr and an exit code."""
    try:
        rc = app(standalone_mode=False)
    except TandemError as exc:
        _report(exc.message, exc.hint)
        sys.exit(exc.exit_code)
    except typer.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except _click.NoArgsIsHelpError:
        sys.exit(0)  # the help text is already printed
    except _click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_USAGE if exc.exit_code == 2 else exc.exit_code)
    except (KeyboardInterrupt, typer.exceptions.Abort):
        print("\nInterrupted.", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        # the reader went away (e.g. `| head`); stop quietly like other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        if os.environ.get("TANDEM_DEBUG"):
            raise
        _report(f"unexpected {type(exc).__name__}: {exc}",
                "rerun with TANDEM_DEBUG=1 for a traceback, and report it")
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


def _report(message: str, hint: str | None) -> None:
    print(f"Error: {message}", file=sys.stderr)
    if hint:
        print(f"Hint: {hint}", file=sys.stderr)
