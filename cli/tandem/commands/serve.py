"""`tandem serve`: the OpenAI-compatible HTTP API on the same engine as run and chat.

Thin on purpose: the flags go through the same settings path as `run` (commands/options.py:
prepare_pair), the server lives in tandem.serve, and Starlette/uvicorn are imported only once this
command runs (`tandem run` does not pay for them).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from functools import partial
from typing import Annotated, Optional

import typer

from tandem.commands import options
from tandem.commands.options import (
    history_note,
    prepare_pair,
    read_context_files,
    sampling_params,
    setting_flag,
    setting_flags,
)
from tandem.config.schema import SERVE_MAX_TOKENS, check_max_tokens
from tandem.errors import UsageError


app = typer.Typer()


@app.command()
def serve(
    *,
    pair: Annotated[Optional[str], typer.Argument(help="Catalog pair name (default: the default pair).", show_default=False)] = None,
    host: setting_flag("host", default=True, help="Address to listen on. Beyond loopback, set --api-key.") = None,
    port: setting_flag("port", default=True, help="TCP port (0: any free port; the address is printed on stderr).") = None,
    api_key: setting_flag("api_key", help="Require 'Authorization: Bearer KEY' (the variable keeps it out of the process list).") = None,
    queue: setting_flag("queue", default=True, help="Requests that may wait while one is generated; beyond, 429 with Retry-After.") = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No line per request on stderr (route, tokens, time, tok/s, acceptance, status).")] = False,
    timeout: setting_flag("timeout", default=True, help="Seconds a client has to send a request's headers, and again its body; beyond, 408 and the connection closed.") = None,
    cache_reuse: setting_flag("cache_reuse", default=True, help="Move cached runs of at least N tokens that a new prompt holds at another position, instead of evaluating them again (llama-server's --cache-reuse; an editor's keystrokes); 0: off. Never in --exact mode.") = None,
    parallel: setting_flag("parallel", "-np", default=True, help="Slots: requests decoded together, one batch per step, each with its own drafts (llama-server's -np); -1 or 0: auto, 4 where memory allows, 1 with --rpc, --exact, MTP heads or a hybrid or recurrent model. With 2 or more, one slot more is kept for short requests (an editor's keystroke), each slot holding --ctx-size tokens.") = None,
    cache_ram: setting_flag("cache_ram", "-cram", default=True, help="MiB of RAM for the conversations idle slots held, put back when a request continues one (llama-server's --cache-ram); 0: off.") = None,
    cors: setting_flag("cors", help="Origins whose web pages may call the API from a browser, comma-separated (e.g. http://localhost:3000); off by default.") = None,
    no_webui: Annotated[bool, typer.Option("--no-webui", help="No chat page at / (llama-server's flag): the page streams answers with their tokens/s and the accepted drafts marked.")] = False,
    model: options.TargetFile = None, model_draft: options.DraftFile = None, strategy: options.Strategy = None,
    hf_repo: options.HfRepo = None, hf_file: options.HfFile = None, hf_repo_draft: options.HfRepoDraft = None,
    model_alias: Annotated[Optional[str], typer.Option("--model-alias", "--alias", "-a", help="The model's name in /v1/models, /props and answers (default: the target file's name).")] = None,
    target_gpu_layers: options.GpuLayers = None, draft_gpu_layers: options.GpuLayersDraft = None,
    flash_attn: options.FlashAttn = None, n_batch: options.BatchSize = None, n_ubatch: options.UBatchSize = None, type_k: options.CacheTypeK = None, type_v: options.CacheTypeV = None, no_mmap: options.NoMmap = False, mlock: options.Mlock = False,
    n_max: options.DraftMax = None, n_min: options.DraftMin = None, p_min: options.DraftPMin = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", "--n-predict", help="Most tokens per answer when a request does not say (max_tokens).")] = SERVE_MAX_TOKENS,
    temp: options.Temp = None, top_k: options.TopK = None, top_p: options.TopP = None, min_p: options.MinP = None,
    repeat_penalty: options.RepeatPenalty = None, n_ctx: options.CtxSize = None, n_threads: options.Threads = None,
    exact: options.Exact = False, draft_from: options.DraftFrom = None, no_history: options.NoHistory = False,
    rpc: options.Rpc = None, rpc_timeout: options.RpcTimeout = None, ctx_checkpoints: options.CtxCheckpoints = None,
    verbose: options.Verbose = False,
):
    """Serve the OpenAI API (chat/completions, completions, models, responses), Anthropic's Messages API and a chat page on the local pair.

    Several requests at once (--parallel slots, decoded in one batch per step, each with its own drafts); a request goes to the slot whose cache shares most of its prompt (a client's turn 2 evaluates only its new tokens). The sampling flags are the defaults of requests that do not set temperature, top_p, top_k...

    Examples:

      tandem serve

      tandem serve --port 8081 --strategy auto --draft-from app.py

      TANDEM_API_KEY=secret tandem serve --host 0.0.0.0

      tandem serve --rpc 192.168.1.20:50052      # the target's layers on that server

    Then point a client at http://127.0.0.1:8080/v1 (any API key unless --api-key is set; Anthropic's and OpenAI's Responses clients too), or a browser at http://127.0.0.1:8080 for the chat page.
    """
    from tandem.commands.compose import open_pair, serve_slots
    from tandem.serve import listening

    check_max_tokens(max_tokens)
    if model_alias is not None and not model_alias.strip():
        raise UsageError("--model-alias is empty", "pass the name clients see, or leave it out")
    # the flags checked before any download, and again once env and config.yaml are read
    cors_origins(cors, checked_key(api_key, "--api-key"))
    sampling = sampling_params(temp, top_k, top_p, min_p, repeat_penalty, None)
    contexts = read_context_files(draft_from)  # drafts only: clients' prompts are their own
    flags = setting_flags(locals())
    prepared = prepare_pair(pair, model, model_draft, flags, verbose,
                            refs=options.model_refs(hf_repo, hf_file, hf_repo_draft))
    s = prepared.settings  # flags > env > config.yaml > profile > the schema's defaults
    host, port, queue, timeout = s.host, s.port, s.queue, s.timeout
    api_key = checked_key(s.api_key or None, s.origin("api_key"))
    origins = cors_origins(s.cors or None, api_key)
    target_path, draft_path, opts = prepared.target, prepared.draft, prepared.options
    slots, slots_note = serve_slots(prepared, s.parallel)
    if slots_note:
        listening.warn(slots_note)
    # the one plan both sides follow: the engine holds its sequences, the scheduler keeps
    # the plan's kept ones for short requests
    opts = replace(opts, cache_reuse=s.cache_reuse, sequences=slots.total)

    from tandem.serve import routes as server  # Starlette and uvicorn: only now
    from tandem.models.vocab import longest_token_bytes
    from tandem.serve.scheduler import Defaults, Scheduler
    from tandem.serve.prompt import UNKNOWN_TOKEN_BYTES, PromptBudget

    sock = listening.bind(host, port)  # before the models load: a busy port fails fast
    if not listening.is_loopback(host) and api_key is None:
        listening.warn(f"listening on {host} without --api-key: anyone who can reach this "
                    "machine can use it")
    try:
        with open_pair(target_path, draft_path, opts) as session:
            scheduler = Scheduler(session, strategy=opts.strategy, draft=opts.draft,
                                  queue_size=queue, plan=slots,
                                  cache_ram_mib=s.cache_ram)
            _start_up(scheduler, contexts, opts.strategy)
            budget = PromptBudget(session.n_ctx,
                            longest_token_bytes(target_path) or UNKNOWN_TOKEN_BYTES)
            config = server.ServeConfig(
                model_id=model_alias or target_path.stem, api_key=api_key, budget=budget, timeout=timeout,
                quiet=quiet, notice=partial(history_note, opts), cors=origins, webui=not no_webui,
                defaults=Defaults(max_tokens=max_tokens, sampling=sampling))
            draft = f" + {draft_path.name}" if draft_path else ""
            print(f"tandem serve: {listening.listen_note(host, sock)} · {target_path.name}{draft} · "
                  f"strategy {opts.strategy} · context {session.n_ctx} · "
                  f"{_slots_words(scheduler)} · queue {queue} · Ctrl-C stops", file=sys.stderr, flush=True)
            server.serve(scheduler, config, sock, verbose=verbose)
    finally:
        sock.close()


def _start_up(scheduler, contexts, strategy: str) -> None:
    """The context files indexed, then what the first request would wait for measured
    before the server listens, each said on stderr with what it took (engine/pair.py:
    warm_up), on the engine thread that decodes every request after (Scheduler.relay)."""
    from tandem.engine.pair import warm_up

    for path, text in contexts:
        scheduler.pair.add_context_file(path, text)
    stopping = scheduler.stopping
    try:
        for step in scheduler.relay(lambda pair: pair.stream(warm_up, strategy,
                                                             should_stop=stopping)):
            if step.seconds is None:
                print(f"tandem serve: measuring the {step.what} before the first request ...",
                      file=sys.stderr, flush=True)
            else:
                print(f"tandem serve: {step.what} in {step.seconds:.2f} s: {step.result}",
                      file=sys.stderr, flush=True)
    except BaseException:  # (Ctrl-C) the engine thread lets go of the models first
        scheduler.stop()
        raise


def _slots_words(scheduler) -> str:
    kept = len(scheduler.slots) - scheduler.parallel
    return (f"{scheduler.parallel} slot" + ("s" if scheduler.parallel > 1 else "")
            + (f" + {kept} for short requests" if kept else ""))


def checked_key(key: str | None, where: str) -> str | None:
    """The API key, or None; one no client could send is refused."""
    if key is None:
        return None
    if not key.strip():
        raise UsageError(f"the API key ({where}) is empty", "pass a key, or leave it out")
    if key != key.strip():
        raise UsageError(f"the API key ({where}) starts or ends with whitespace, which no "
                         "client can send (HTTP drops it from the header)",
                         "pass the key without it")
    return key


def cors_origins(value: str | None, api_key: str | None) -> tuple[str, ...]:
    """--cors: explicit origins (scheme://host[:port]), "*" only without a key: a page on
    any site must not be able to use a key the browser holds for this server."""
    if value is None:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    if not origins:
        raise UsageError("--cors is empty", "pass origins such as http://localhost:3000")
    for origin in origins:
        if origin == "*":
            if api_key is not None:
                raise UsageError("--cors '*' with --api-key would let any web page use the key",
                                 "name the origins that may call, e.g. --cors "
                                 "http://localhost:3000")
            continue
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
            raise UsageError(f"--cors origin {origin!r} is not scheme://host[:port]",
                             "e.g. --cors http://localhost:3000,https://chat.example.org")
    return origins
