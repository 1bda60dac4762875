"""`tandem run`: one completion, text on stdout, statistics on stderr."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from tandem.commands import options
from tandem.commands.options import (
    check_text,
    history_note,
    model_refs,
    prepare_pair,
    read_context_files,
    read_stdin,
    sampling_params,
    setting_flags,
    split_model_and_prompt,
)
from tandem.commands.constraint import constraint_flags, incomplete_error, settings_constraint
from tandem.config.schema import check_max_tokens, check_prompt
from tandem.engine.prompt_files import check_files_fit, with_files
from tandem.errors import RemoteError


app = typer.Typer()


@app.command(context_settings={"allow_interspersed_args": True})
def run(
    *,
    args: Annotated[Optional[list[str]], typer.Argument(help="[PAIR|MODEL] [PROMPT]: a catalog pair name or a model (user/repo:QUANT, user/repo/file.gguf, a .gguf file), then the prompt.", show_default=False)] = None,
    system: options.System = None, model: options.TargetFile = None, model_draft: options.DraftFile = None,
    hf_repo: options.HfRepo = None, hf_file: options.HfFile = None, hf_repo_draft: options.HfRepoDraft = None,
    strategy: options.Strategy = None, n_max: options.DraftMax = None, n_min: options.DraftMin = None,
    p_min: options.DraftPMin = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", "--n-predict", help="Most tokens to generate.")] = 256,
    temp: options.Temp = None, top_k: options.TopK = None, top_p: options.TopP = None, min_p: options.MinP = None,
    repeat_penalty: options.RepeatPenalty = None, seed: options.Seed = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template: the prompt is sent as is.")] = False,
    n_ctx: options.CtxSize = None, n_threads: options.Threads = None,
    target_gpu_layers: options.GpuLayers = None, draft_gpu_layers: options.GpuLayersDraft = None,
    flash_attn: options.FlashAttn = None, n_batch: options.BatchSize = None, n_ubatch: options.UBatchSize = None,
    type_k: options.CacheTypeK = None, type_v: options.CacheTypeV = None, no_mmap: options.NoMmap = False, mlock: options.Mlock = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text and statistics.")] = False,
    no_stream: Annotated[bool, typer.Option("--no-stream", help="Print the text once it is complete.")] = False,
    stats: Annotated[Optional[bool], typer.Option("--stats/--no-stats", help="Statistics on stderr (default: when stderr is a terminal).")] = None,
    exact: options.Exact = False, context_file: options.ContextFiles = None,
    draft_from: options.DraftFrom = None, no_history: options.NoHistory = False,
    rpc: options.Rpc = None, rpc_timeout: options.RpcTimeout = None, ctx_checkpoints: options.CtxCheckpoints = None,
    grammar: options.Grammar = None, grammar_file: options.GrammarFile = None, json_schema: options.JsonSchema = None,
    json_schema_file: options.JsonSchemaFile = None, json_object: options.JsonObject = False,
    verbose: options.Verbose = False, yes: options.Yes = False,
    prediction: Annotated[Optional[Path], typer.Option("--prediction", readable=False, help="A file holding the answer you expect (an edit's current code): auto drafts from it; the output is the model's own either way.", show_default=False)] = None,
):
    """Generate a completion; text on stdout, statistics on stderr.

    Examples:

      tandem run "Write a Python function that reverses a string"

      git diff | tandem run -s "Write the commit message for this diff"

      tandem run -m target.gguf -md draft.gguf --draft-max 8 "hello"

      tandem run bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M -ngl 99 "hello"

      tandem run --context-file app.py "Add logging to the load() function in app.py"

      tandem run --rpc 192.168.1.20:50052 "hello"     # the target's layers on that server

      tandem run -j '{"type":"object","properties":{"name":{"type":"string"}},"required":["name"]}' "Who wrote Hamlet?"

      tandem run --prediction app.py "Rename load() to read_config() in:" < app.py
    """
    from tandem.engine.loop.events import DoneEvent, TokenEvent
    from tandem.engine.loop.speculative import GenParams

    pair, first, prompt = split_model_and_prompt(args or [])
    refs = model_refs(hf_repo, hf_file, hf_repo_draft, first)
    check_text(prompt, "the prompt")
    check_text(system, "the system prompt (-s)")
    for s in stop or ():
        check_text(s, "a --stop string")
    piped = read_stdin()
    prompt = "\n\n".join(p for p in (piped, prompt) if p.strip())
    check_prompt(prompt)
    check_max_tokens(max_tokens)
    sampling = sampling_params(temp, top_k, top_p, min_p, repeat_penalty, seed)
    shown = read_context_files(context_file)  # the model reads them, and auto drafts from them
    contexts = shown + read_context_files(draft_from)
    expected = read_context_files([prediction] if prediction else [])
    structured = constraint_flags(grammar, grammar_file, json_schema, json_schema_file,
                                  json_object)
    flags = setting_flags(locals(), **structured)
    prepared = prepare_pair(pair, model, model_draft, flags, verbose, yes, refs)
    gen = GenParams(max_tokens=max_tokens, sampling=sampling, stop=tuple(stop or ()),
                    constraint=settings_constraint(prepared.settings))
    target_path, draft_path, opts = prepared.target, prepared.draft, prepared.options
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": with_files(prompt, [(str(p), t) for p, t in shown])}]
    show_stats = sys.stderr.isatty() if stats is None else stats
    done = None
    out = sys.stdout
    wrote = ""  # the last text streamed: a failure mid-answer still ends its line
    try:
        for ev in _events(target_path, draft_path, opts, contexts, messages, gen, raw,
                          expected[0][1] if expected else None, len(shown)):
            if isinstance(ev, TokenEvent) and not as_json and not no_stream and ev.text:
                out.write(ev.text)
                out.flush()
                wrote = ev.text
            elif isinstance(ev, DoneEvent):
                done = ev
    except RemoteError:
        if wrote and not wrote.endswith("\n"):
            out.write("\n")
            out.flush()
        raise
    _finish(done, out, as_json=as_json, no_stream=no_stream, show_stats=show_stats,
            n_ctx=opts.target_ctx.n_ctx, max_tokens=max_tokens,
            gpu_layers={"target": opts.target_gpu_layers,
                        "draft": opts.draft_gpu_layers if draft_path else None})
    note = history_note(opts)
    if note:
        print(f"Note: {note}", file=sys.stderr)
    if done.complete is False:
        raise incomplete_error(done.reason, done.stats.n_generated, max_tokens)


def _finish(done, out, *, as_json: bool, no_stream: bool, show_stats: bool, n_ctx: int,
            max_tokens: int, gpu_layers: dict | None = None) -> None:
    """The answer's end: the JSON object or the text's last part on stdout, then a warning
    when the context cut it and the statistics on stderr. `gpu_layers`: the llama.cpp
    n_gpu_layers each model loaded with (-1: all), for the JSON object."""
    if as_json:
        answer = {"text": done.text, "finish_reason": done.reason, "gpu_layers": gpu_layers}
        if done.complete is not None:  # under a grammar: whether the text matches it
            answer["complete"] = done.complete
        print(json.dumps({**answer, "stats": done.stats.to_dict()}, ensure_ascii=False))
    else:
        if no_stream:
            out.write(done.text)
        if done.text and not done.text.endswith("\n"):
            out.write("\n")
        out.flush()
    if done.reason == "context":
        # otherwise a cut answer looks complete: -n asked for more than the context held
        print(f"Warning: the answer stopped at the end of the context ({n_ctx} "
              f"tokens) after {done.stats.n_generated} of the {max_tokens} tokens asked for; "
              "raise --ctx-size (-c) for a longer answer", file=sys.stderr)
    if show_stats:
        print(done.stats.summary(), file=sys.stderr)


def _events(target_path, draft_path, opts, contexts, messages, gen, raw, prediction=None,
            n_shown=0):
    """generate()'s events: in this process, or, with --rpc, from a supervised worker
    process (llama.cpp aborts the process that holds a broken RPC connection; see
    engine/remote/worker.py). `prediction`: the expected answer's text; the first `n_shown`
    of `contexts` are in the prompt too (--context-file), the others only drafted from."""
    from tandem.commands.compose import open_pair

    session = open_pair(target_path, draft_path, opts)
    with session:
        sizes = [(str(path), session.add_context_file(path, text)) for path, text in contexts]
        tokens = session.prompt_tokens(messages, raw=raw)
        check_files_fit(len(tokens), session.n_ctx, 1, sizes[:n_shown])
        if prediction:
            gen = replace(gen, prediction=tuple(session.tokenize(prediction)))
        if opts.strategy == "auto":
            _say_start_up(session)
        yield from session.generate(tokens, gen)


def _say_start_up(session) -> None:
    """auto's cost calibration on a machine that has no saved costs (seconds, once), measured
    before the answer (after the thread count, as the answer would) and said on stderr with
    what it took, instead of a silent wait."""
    from tandem.engine.pair import warm_up

    for step in session.stream(warm_up, "auto", True):
        if step.what != "drafting costs":
            continue  # the thread count: the stats line and --json say it
        if step.seconds is None:
            print(f"tandem: measuring this machine's {step.what} before the first answer "
                  "(once) ...", file=sys.stderr, flush=True)
        elif step.result.startswith("calibrated"):
            print(f"tandem: {step.what} in {step.seconds:.1f} s: {step.result}",
                  file=sys.stderr, flush=True)
