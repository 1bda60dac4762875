"""`tandem chat`: a terminal chat with a live throughput panel.

The loop only wires things: ChatSession (tandem.chat.conversation) does the work and yields data, ChatView
(tandem.chat.tui) shows it. Ctrl-C during an answer stops that answer; Ctrl-C twice or Ctrl-D exits.
"""
import signal
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from tandem.commands import options
from tandem.errors import RemoteError, TandemError, UsageError

app = typer.Typer()


@app.command()
def chat(
    *,
    pair: Annotated[Optional[str], typer.Argument(help="Catalog pair name (default: the default pair).", show_default=False)] = None,
    system: options.System = None, model: options.TargetFile = None,
    model_draft: options.DraftFile = None, strategy: options.Strategy = None,
    hf_repo: options.HfRepo = None, hf_file: options.HfFile = None, hf_repo_draft: options.HfRepoDraft = None,
    n_max: options.DraftMax = None, n_min: options.DraftMin = None, p_min: options.DraftPMin = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", "--n-predict", help="Most tokens per answer.")] = 1024,
    temp: options.Temp = None, top_k: options.TopK = None, top_p: options.TopP = None,
    min_p: options.MinP = None, repeat_penalty: options.RepeatPenalty = None,
    seed: options.Seed = None, n_ctx: options.CtxSize = None, n_threads: options.Threads = None,
    target_gpu_layers: options.GpuLayers = None, draft_gpu_layers: options.GpuLayersDraft = None, flash_attn: options.FlashAttn = None,
    n_batch: options.BatchSize = None, n_ubatch: options.UBatchSize = None, type_k: options.CacheTypeK = None, type_v: options.CacheTypeV = None, no_mmap: options.NoMmap = False, mlock: options.Mlock = False,
    show_draft: Annotated[bool, typer.Option("--show-draft", help="Colour the tokens the target accepted from the draft.")] = False,
    plain_probe: Annotated[int, typer.Option("--plain-probe", help="Tokens of plain decoding measured at start for the speedup figure (0: off; plain turns also count).")] = 16,
    exact: options.Exact = False, context_file: options.ContextFiles = None,
    draft_from: options.DraftFrom = None,
    no_history: options.NoHistory = False, rpc: options.Rpc = None,
    rpc_timeout: options.RpcTimeout = None, ctx_checkpoints: options.CtxCheckpoints = None,
    grammar: options.Grammar = None, grammar_file: options.GrammarFile = None,
    json_schema: options.JsonSchema = None, json_schema_file: options.JsonSchemaFile = None,
    json_object: options.JsonObject = False, verbose: options.Verbose = False,
    yes: options.Yes = False,
):
    """Chat in the terminal, with live tokens/s, draft acceptance and speedup.

    Slash commands: /help /stats /strategy NAME /draft N /temp X /max-tokens N /system TEXT
    /add FILE /reset /save FILE /exit. Ctrl-C stops an answer; Ctrl-C twice or Ctrl-D exits.

    Examples:

      tandem chat

      tandem chat -m target.gguf -md draft.gguf --draft-max 6 --show-draft

      tandem chat --rpc 192.168.1.20:50052     # the target's layers on that rpc-server

      tandem chat --json-object                # every answer is one JSON object
    """
    from tandem.chat.conversation import ChatSession
    from tandem.commands.constraint import constraint_flags, settings_constraint
    from tandem.chat.tui import ChatView, make_console, plain_banner
    from tandem.config.schema import check_max_tokens
    from tandem.commands.compose import open_pair
    from tandem.engine.loop.speculative import GenParams

    refs = options.model_refs(hf_repo, hf_file, hf_repo_draft)
    options.check_pair_or_files(pair, model, model_draft, refs)
    if plain_probe < 0:
        raise UsageError(f"--plain-probe must be >= 0, got {plain_probe}",
                         "pass 0 to turn the probe off")
    check_max_tokens(max_tokens)
    options.check_text(system, "the system prompt (-s)")
    sampling = options.sampling_params(temp, top_k, top_p, min_p, repeat_penalty, seed)
    shown = options.read_context_files(context_file)  # the model reads them; auto drafts too
    drafted = options.read_context_files(draft_from)
    # checked and compiled now: a bad schema ends the chat before any model loads
    structured = constraint_flags(grammar, grammar_file, json_schema, json_schema_file,
                                  json_object)
    _read_lines_leniently()
    view = ChatView(make_console(), show_draft=show_draft)
    # no spinner here: a download on the way draws its own progress on stderr
    prepared = options.prepare_pair(
        pair, model, model_draft, options.setting_flags(locals(), **structured),
        verbose, yes, refs)
    target_path, draft_path, opts = prepared.target, prepared.draft, prepared.options
    # every answer follows the constraint (the flags' or config.yaml's)
    gen = GenParams(max_tokens=max_tokens, sampling=sampling,
                    constraint=settings_constraint(prepared.settings))
    names = target_path.name + (f" + {Path(draft_path).name}" if draft_path else "")
    with view.loading(f"Loading {names}…"):
        # with --rpc a worker holds the pair: a broken link must not abort the chat
        session = open_pair(target_path, draft_path, opts)
    with session:
        for path, text in drafted:
            session.add_context_file(path, text)
        chat = ChatSession(session, system=system, gen=gen, strategy=opts.strategy,
                           draft=opts.draft, files=[(str(p), text) for p, text in shown])
        if plain_probe > 0 and chat.strategy != "none":
            with view.loading(f"Measuring plain decoding on this machine ({plain_probe} tokens)…"):
                chat.measure_plain(plain_probe)
        _show_plain(view, chat)
        lines = [f"strategy {chat.strategy} · draft ≤ {chat.draft.n_max} · context {chat.n_ctx} tokens"]
        if gen.constraint is not None:
            lines.append(f"every answer follows {gen.constraint.origin or 'the grammar'}")
        if chat.latest_plain is not None:
            lines.append(plain_banner(chat.latest_plain))
        lines.append("/help for commands · Ctrl-C stops an answer · Ctrl-D exits")
        view.banner(f"tandem chat · {names}", lines)
        _loop(chat, view)


def _show_plain(view, chat) -> None:
    """The latest plain measurement, for the view to compare answers with."""
    m = chat.latest_plain
    if m is None:
        view.set_plain_rate(None)
    else:
        view.set_plain_rate(m.rate, m.source, m.when, m.busy)


def _read_lines_leniently() -> None:
    """A typed or piped line that is not UTF-8 must not end the chat: read it with its bad
    bytes kept as surrogates, so the loop can refuse that one line (check_text) and go on."""
    import sys

    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")


def _loop(chat, view) -> None:
    from tandem.chat.conversation import message_text

    armed = False  # a Ctrl-C was just pressed: another one exits
    while True:
        try:
            line = view.ask()
        except EOFError:
            view.console.print()
            break
        except KeyboardInterrupt:
            view.console.print()
            if armed:
                break
            armed = True
            view.notice("Ctrl-C again or Ctrl-D to exit")
            continue
        armed = False
        try:
            options.check_text(line, "that line")
            result = chat.command(line)
            if result is not None:
                if result.action == "exit":
                    break
                _show_result(view, result)
                continue
            text = message_text(line)
            if not text.strip():
                view.notice("(empty message: type some text, or /help)")
                continue
            stopped = _answer(chat, view, text)
            note = options.history_note(chat.pair.options)
            if note:
                view.notice(note)
        except RemoteError:
            view.abort()  # the worker is gone with the link: the chat cannot go on
            raise
        except TandemError as exc:
            view.abort()
            view.error(exc.message, exc.hint)
            continue
        except KeyboardInterrupt:  # a second Ctrl-C while an answer was stopping
            view.abort()
            view.console.print()
            break
        _show_plain(view, chat)
        armed = stopped
    view.goodbye()


def _show_result(view, result) -> None:
    if result.action == "help":
        view.show_help(result.data["commands"])
    elif result.action == "stats":
        view.show_stats(result.data)
    else:
        view.info(result.message)


class _CtrlC:
    """While an answer streams: the first Ctrl-C asks it to stop, the second one exits."""

    def __init__(self):
        self.hits = 0
        self._old = None

    def _handler(self, signum, frame):  # noqa: ARG002
        self.hits += 1
        if self.hits >= 2:
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _answer(chat, view, text: str) -> bool:
    """Stream one answer into the view; True when Ctrl-C stopped it."""
    from tandem.chat.conversation import Notice

    stream = chat.send(text)
    view.start_answer(chat.strategy, chat.draft.n_max)
    stopped = False
    after = []  # said under the finished answer, not inside its streamed text
    try:
        with _CtrlC() as ctrl_c:
            for ev in stream:
                if isinstance(ev, Notice) and ev.kind == "incomplete":
                    after.append(ev.message)
                elif isinstance(ev, Notice):
                    view.notice(ev.message)
                else:
                    view.event(ev)
                if ctrl_c.hits:
                    stopped = True
                    break
            stream.close()  # keeps the partial answer in the conversation
    except BaseException:
        view.abort()
        raise
    view.finish(interrupted=stopped)
    for message in after:
        view.notice(message)
    return stopped
