"""What the commands share: option declarations (spelled as llama.cpp spells them), input
checks, and the path from flags to a pair prepared to load (prepare_pair).

Over 400 lines because the commands share all of it: the declarations, the choice of the
models (a pair, files, hub references and the draft found for them: prepare_pair), and
llama.cpp's spellings checked before click parses the command line (llama_args)."""
from __future__ import annotations

import math
import os
import re
import stat
import sys
from dataclasses import dataclass
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
System = Annotated[Optional[str], typer.Option("--system", "-s", "-sys", "--system-prompt", help="System prompt.")]
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
# offload and context details, as llama.cpp spells them (default: from the profile)
GpuLayers = setting_flag("target_gpu_layers", "-ngl", "--gpu-layers", metavar="N|all|auto", help="Target layers on the GPU, as llama.cpp counts them (all: every one; auto: as many as fit after the draft).")
GpuLayersDraft = setting_flag("draft_gpu_layers", "-ngld", "--gpu-layers-draft", metavar="N|all|auto", help="Draft layers on the GPU.")
FlashAttn = setting_flag("flash_attn", "-fa", metavar="on|off|auto", help="Flash attention (-fa alone: on).")
BatchSize = setting_flag("n_batch", "-b", help="Prompt tokens evaluated per decode call (logical batch).")
UBatchSize = setting_flag("n_ubatch", "-ub", help="Physical batch size, at most --batch-size.")
CacheTypeK = setting_flag("type_k", "-ctk", help="KV cache type of K: f16, f32, bf16, q8_0, q4_0, q4_1, q5_0, q5_1.")
CacheTypeV = setting_flag("type_v", "-ctv", help="KV cache type of V (a quantized one needs flash attention).")
NoMmap = setting_flag("mmap", type_=bool, help="Read both models' weights into memory instead of mapping their files (`mmap: off`).")
Mlock = setting_flag("mlock", type_=bool, help="Lock both models' weights in RAM so that they are never swapped out (`mlock: on`; without the privilege llama.cpp warns and goes on).")
# models named on the Hugging Face hub, as llama.cpp's -hf (resolved by models/refs.py)
HfRepo = Annotated[Optional[str], typer.Option("--hf-repo", "-hf", help="Target from the Hugging Face hub: user/repo[:QUANT] (QUANT default Q4_K_M), downloaded into the store; the draft is chosen for it (-hfd names one).")]
HfFile = Annotated[Optional[str], typer.Option("--hf-file", "-hff", help="The file of the -hf repository (instead of its :QUANT).")]
HfRepoDraft = Annotated[Optional[str], typer.Option("--hf-repo-draft", "-hfd", "-hfrd", help="Draft from the hub: user/repo[:QUANT] or user/repo/file.gguf.")]
Exact = setting_flag("mode", type_=bool, help="Exact mode: output bit-identical to plain decoding (unrepacked weights, q8_0 KV, verify batches of <= 7 tokens on a CPU; slower). Default (fast): llama.cpp's own kernels, greedy output equal to plain decoding up to floating-point rounding (a near-tie may flip).")
ContextFiles = Annotated[Optional[list[Path]], typer.Option("--context-file", readable=False, help="A text file for the model (repeatable): run and chat put its name and text in the prompt before your request; auto drafts from it too.")]
DraftFrom = Annotated[Optional[list[Path]], typer.Option("--draft-from", readable=False, help="A text file auto may draft from, not shown to the model (repeatable): code or notes the answer will quote.")]
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


def split_model_and_prompt(args: list[str]) -> tuple[str | None, str | None, str]:
    """`tandem run [PAIR|MODEL] [PROMPT]`: (pair, model reference, prompt). A first word that
    names a model (user/repo:QUANT, user/repo/file.gguf, a .gguf path, a catalog model) is the
    target, never prompt text: `tandem run bartowski/...:Q4_K_M "hi"` once answered with the
    default pair, the reference sent as text. A bare user/repo before more words reads both
    ways and is refused with the two ways to say it; the rest is split_pair_and_prompt's."""
    from tandem.models import catalog
    from tandem.models.refs import reference_form

    first = args[0] if args else ""
    if first and catalog.find_pair(first) is None:
        form = reference_form(first)
        if form == "model" or (form is None and catalog.get_model(first) is not None):
            return None, first, " ".join(args[1:])
        if form == "repo" and len(args) > 1:
            raise UsageError(f"{first!r} reads both as a hub repository (user/repo) and as the "
                             "prompt's first word",
                             f"for the model, write {first}:Q4_K_M (or -hf {first}); for prompt "
                             "text, quote the whole prompt as one argument")
    pair, prompt = split_pair_and_prompt(args)
    return pair, None, prompt


@dataclass(frozen=True)
class ModelRefs:
    """Models named by reference rather than by path (models/refs.py's forms): the target
    from -hf/-hff or run's first word, the draft from -hfd."""

    target: str | None = None
    draft: str | None = None


def model_refs(hf_repo: str | None, hf_file: str | None = None, hf_repo_draft: str | None = None,
               first: str | None = None) -> ModelRefs:
    """The command's ModelRefs: -hf user/repo[:QUANT] (-hff FILE names the repo's file
    instead of a quant, as in llama.cpp), -hfd, and `first`, run's first word."""
    target = hf_repo
    if hf_file is not None:
        if hf_repo is None:
            raise UsageError("-hff/--hf-file names a file of the -hf repository, and no -hf "
                             "was given", "pass -hf user/repo with it")
        target = f"{hf_repo.partition(':')[0]}/{hf_file.lstrip('/')}"
    if target is not None and first is not None:
        raise UsageError(f"two targets: {first!r} and -hf {target}", "give one of them")
    return ModelRefs(target if target is not None else first, hf_repo_draft)


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


def resolve_models(pair: str | None, model, draft, progress_cb=None, note=None,
                   yes: bool | None = None) -> tuple[Path, Path | None]:
    """The pair's files: the user's own (-m, -md: paths), models named on the hub (-hf, -hfd:
    ModelSpecs, see referenced_models) and the catalog pair's for what neither names, from the
    store, downloaded first when missing (see confirm_download; `yes`: the command's --yes,
    None where it has none)."""
    from tandem.models import catalog
    from tandem.models.store import Store

    if isinstance(draft, Path):
        check_model_path(draft, "draft")
    if isinstance(model, Path):
        check_model_path(model, "target")
        if not isinstance(draft, catalog.ModelSpec):
            return model, draft
    spec = None
    if model is None:
        spec = catalog.get_pair(pair or catalog.DEFAULT_PAIR)
        model, hub_draft = spec.target, isinstance(draft, catalog.ModelSpec)
        draft = spec.draft if draft is None else draft
    fetched = {m.key: m for m in (model, draft) if isinstance(m, catalog.ModelSpec)}
    name, pull = (spec.name, None) if spec is not None else (" + ".join(fetched), None)
    if spec is None or hub_draft:  # a model named on the hub: `tandem pull -hf` fetches it
        pull = f"-hf {getattr(model, 'key', model)}" + (
            f" -hfd {draft.key}" if isinstance(draft, catalog.ModelSpec) else "")
    store = Store()
    for m in fetched.values():
        if note is not None and store.path_for(m).exists() and not store.is_present(m):
            note(f"{m.filename} in the store does not match its record (damaged or "
                 "incomplete): downloading it again")
    confirm_download(name, [m for m in fetched.values() if not store.is_present(m)],
                     store.models_dir, yes, note, pull)
    paths = {key: store.ensure(m, progress=progress_cb) for key, m in fetched.items()}
    return tuple(paths[m.key] if isinstance(m, catalog.ModelSpec) else m  # type: ignore[return-value]
                 for m in (model, draft))


def confirm_download(name: str, missing, where: Path, yes: bool | None, note=None,
                     pull: str | None = None) -> None:
    """Before fetching `missing` (catalog ModelSpecs) for `name`: say what it costs, and
    above CONFIRM_DOWNLOAD_BYTES (or of unknown size) go on only with --yes (`yes`; None:
    the command has no such flag) or a yes typed at a terminal; else UsageError (exit 2).
    `pull`: `tandem pull`'s arguments that fetch them (default: `name`, a pair)."""
    if not missing:
        return
    pull = pull or name
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
        raise UsageError(f"not downloading {name}", f"`tandem pull {pull}` fetches it when "
                         "you want it")
    flag = "pass --yes to download it, or run" if yes is not None else "run"
    limit = fmt_bytes(CONFIRM_DOWNLOAD_BYTES, decimal=True)
    raise UsageError(f"{what}; a download over {limit} or of unknown size needs a yes",
                     f"{flag} `tandem pull {pull}` first")


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


def check_pair_or_files(pair: str | None, model: Path | None, model_draft: Path | None,
                        refs: ModelRefs = ModelRefs()) -> None:
    """A pair name or your own files (-m, -md) or hub models (-hf, -hfd), never both, and one
    way to name each model: the one check, for every command."""
    if pair is not None and (model is not None or model_draft is not None
                             or refs.target is not None or refs.draft is not None):
        raise UsageError(f"give a pair name ({pair}) or --model/--model-draft (or -hf/-hfd), "
                         "not both", "drop the pair name to use your own files, or drop "
                         "-m/-md/-hf/-hfd")
    for flag, path, ref, hub in (("-m", model, refs.target, "-hf"),
                                 ("-md", model_draft, refs.draft, "-hfd")):
        if path is not None and ref is not None:
            raise UsageError(f"two models for one role: {flag} {path} and {ref}",
                             f"give {flag} (a file) or {hub} (the hub), not both")


def referenced_models(refs: ModelRefs, model: Path | None, model_draft: Path | None,
                      note) -> tuple[str | None, Any, Any, str | None]:
    """The models `refs` name, resolved (a hub repo listed for its quant, nothing downloaded):
    (pair, target, draft, strategy), target and draft each a Path, a ModelSpec for the store
    or None (the pair's). A target that is a catalog pair's target takes that pair; another
    hub target is given its family's catalog draft where the GGUF headers show the same
    vocabulary (family_draft), else none: strategy auto then drafts from n-grams and copies,
    as for a catalog pair without a draft. `note(text)` says which and why."""
    from tandem.models import catalog, pairing
    from tandem.models.hub import HubConfig
    from tandem.models.store import Store

    cfg, store = HubConfig.from_env(), Store()
    draft = model_draft
    if refs.draft is not None:
        d = pairing.resolve(refs.draft, "draft", cfg)
        draft = d.path or _sized(d.spec, store, cfg)
    if refs.target is None:
        return None, model, draft, None
    t = pairing.resolve(refs.target, "target", cfg)
    if t.path is not None:
        return None, t.path, draft, None
    target = _sized(t.spec, store, cfg)
    if draft is not None:
        return None, target, draft, None
    owner, found, why = chosen_draft(t, store, cfg)
    note(why)
    if owner is not None:
        return owner.name, None, None, None
    return None, target, _sized(found.spec, store, cfg) if found else None, \
        None if found else "auto"


def chosen_draft(target, store, cfg):
    """(the catalog pair whose target `target` is, or None; the draft, a pairing.ResolvedModel
    or None; why, in words) for a hub model (pairing.ResolvedModel) named without a draft:
    the pair's own draft, else family_draft's."""
    from tandem.models import catalog

    for pair in catalog.load_catalog().values():
        if pair.target.key == target.spec.key:
            from tandem.models.pairing import pair_models

            return pair, pair_models(pair)[1], (f"{target.label} is the target of the catalog "
                                                f"pair {pair.name}: drafting with "
                                                f"{pair.drafted_by}")
    return (None, *family_draft(target, store, cfg))


def family_draft(target, store, cfg):
    """(the catalog draft for hub model `target`, a pairing.ResolvedModel, or None; why, in
    words): the drafts of catalog pairs whose target or draft is of target's family
    (models/refs.py: family), the first whose vocabulary, read from both GGUF headers (over
    HTTP for files not on disk), is compatible (models/vocab.py's rules)."""
    from tandem.models import catalog, pairing
    from tandem.models.refs import family

    kin = family(target.spec.repo)
    candidates = {p.draft.key: p.draft for p in catalog.load_catalog().values()
                  if p.draft is not None and p.draft.key != target.spec.key
                  and kin in (family(p.target.repo), family(p.draft.repo))}
    fallback = ("drafting from n-grams, history and prompt copies (--strategy auto); -hfd or "
                "-md names a draft model")
    if not candidates:
        return None, f"no catalog draft is of {target.label}'s family ({kin}): {fallback}"
    head = pairing.read_header(target, store, cfg)  # unreadable: the download would fail too
    for spec in candidates.values():
        draft = pairing.ResolvedModel(spec.name, spec=spec)
        try:
            compat = pairing.compare(target, draft, head, pairing.read_header(draft, store, cfg))
        except TandemError:
            continue
        if compat.compatible:
            return draft, (f"drafting {target.label} with {spec.name}, the catalog's draft of "
                           f"its family ({kin}; vocabularies checked from the GGUF headers)")
    return None, (f"no catalog draft of {target.label}'s family ({kin}) has its vocabulary: "
                  f"{fallback}")


def _sized(spec, store, cfg):
    """A hub ModelSpec with its size from the hub (one HEAD request), so that the download
    can be announced and, over 2 GB, asked for; as it is when on disk, known, or offline."""
    from dataclasses import replace

    from tandem.models.hub import file_info

    if spec.display_size is not None or cfg.offline or store.is_present(spec):
        return spec
    return replace(spec, approx_size=file_info(spec.repo, spec.hub_path, spec.revision,
                                               cfg).size)


def prepare_pair(pair, model, model_draft, flags: dict, verbose: bool, yes: bool | None = None,
                 refs: ModelRefs = ModelRefs()):
    """The command's pair prepared to load (commands.compose.Prepared): settings (flags > env >
    config > tuned > profile > defaults) -> model files -> memory plan -> SessionOptions;
    warnings go to stderr. `flags`: {settings key: value or None}. A lone -m runs plain
    decoding, so its Prepared has no draft. Shared by run, chat, serve and spec-bench.
    `yes`: the command's --yes for a large download (None: it has no such flag); `refs`: the
    models named by reference (-hf, -hfd, run's first word: referenced_models)."""
    from dataclasses import replace

    from tandem.commands.compose import prepare_session
    from tandem.commands.progress import download_view

    check_pair_or_files(pair, model, model_draft, refs)
    _finite(flags.get("p_min"), "--draft-p-min")
    strategy_set = flags.get("strategy") is not None or bool(
        os.environ.get(FIELDS_BY_KEY["strategy"].env))
    view = download_view()
    try:
        if refs.target is not None or refs.draft is not None:
            pair, model, model_draft, strategy = referenced_models(refs, model, model_draft,
                                                                   view.note)
            if strategy is not None and not strategy_set:
                flags = {**flags, "strategy": strategy}
        if isinstance(model, Path) and model_draft is None and flags.get("strategy") is None:
            flags = {**flags, "strategy": "none"}  # a lone -m: plain decoding unless asked
        if pair is not None and model_draft is None and not strategy_set:
            from tandem.models import catalog

            spec = catalog.find_pair(pair)
            if spec is not None and spec.mtp:  # the target's own heads draft
                flags = {**flags, "strategy": "mtp"}
            elif spec is not None and spec.draft is None:  # no draft model: n-grams and copies
                flags = {**flags, "strategy": "auto"}  # over a profile's (or config's) draft
        prepared = prepare_session(
            {**flags, "pair": pair},
            lambda name: resolve_models(name, model, model_draft, view, view.note, yes),
            verbose=verbose)
    finally:
        view.close()
    for warning in prepared.warnings:
        print(f"Warning: {warning}", file=sys.stderr)
    if prepared.options.strategy == "none" and isinstance(model, Path) and model_draft is None:
        prepared = replace(prepared, draft=None)
    return prepared


def setting_flags(params: Mapping[str, Any], **given: Any) -> dict:
    """The settings a command's flags give, collected by the schema's keys: each parameter
    named as a settings key (None: not given), each switch as the value it sets (_SWITCHES);
    then `given`, values the command computed (the checked constraint flags)."""
    flags = {k: v for k, v in params.items() if k in FIELDS_BY_KEY}
    for param, key, value in _SWITCHES:
        if param in params:
            flags[key] = value if params[param] else None
    return {**flags, **given}


# the switches: (parameter, settings key, the value it sets when given); absent: not given
_SWITCHES = (("exact", "mode", "exact"), ("no_history", "history", "off"),
             ("no_mmap", "mmap", "off"), ("mlock", "mlock", "on"))


# options whose value llama.cpp lets one leave out (`-fa` alone): the value put in its place
_OPTIONAL_VALUE = {"-fa": ("on", FIELDS_BY_KEY["flash_attn"].choices),
                   "--flash-attn": ("on", FIELDS_BY_KEY["flash_attn"].choices)}
_NUMBER = re.compile(r"^-\.?\d")


def llama_args(root, args: list[str]) -> list[str]:
    """The command line, llama.cpp's spellings checked before click parses it (`root`: the
    app's click group), so that each option is named in its own error: click read `-ngl 99`
    as `-n gl` (-n takes a value) and `-hf` as -h -f. An option the command does not declare
    is refused (UsageError, exit 2) when data/llama_options.yaml lists it (what tandem has
    instead, or why nothing), when another command declares it (which do), or when it is a
    run of letters click would split; one the table marks implied is dropped on its
    commands. `-fa` without a value gets `on`. The rest goes to click as it is."""
    cmd, path, out, i = root, [], [], 0
    declared = _declared(cmd)
    while i < len(args):
        tok = args[i]
        i += 1
        if tok == "--":
            return out + [tok] + args[i:]
        if not tok.startswith("-") or tok == "-" or _NUMBER.match(tok):
            sub = getattr(cmd, "commands", {}).get(tok)
            if sub is not None:
                cmd, declared = sub, _declared(sub)
                path.append(tok)
            out.append(tok)
            continue
        name, eq, _ = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if name in declared:
            out.append(tok)
            if name in _OPTIONAL_VALUE and not eq and (i == len(args) or args[i].lower()
                                                       not in _OPTIONAL_VALUE[name][1]):
                out.append(_OPTIONAL_VALUE[name][0])
            elif declared[name] and not eq and i < len(args):
                out.append(args[i])
                i += 1
            continue
        where = " ".join(["tandem", *path])
        entry = _llama_options().get(name)
        if entry is not None and entry.get("implied") and path and path[-1] in entry["commands"]:
            continue  # what the command always does
        if entry is not None:
            raise _llama_error(name, entry, where)
        others = [c for c, opts in _all_declared(root) if name in opts]
        if others:
            raise UsageError(f"{name} is not an option of `{where}`",
                             _INSTEAD.get((where, name), f"it is one of `{'`, `'.join(others)}`"))
        if re.fullmatch(r"-[A-Za-z]{2,}", name) and not all(
                declared.get(f"-{c}") is False for c in name[1:]):
            raise UsageError(f"no such option: {name}",
                             f"`{where} --help` lists the options (a value is written after "
                             f"a space: {name[:2]} VALUE)")
        out.append(tok)
    return out


# a tandem option another command spells otherwise: what to use there instead
_INSTEAD = {("tandem serve", "--context-file"): "use --draft-from FILE: auto drafts from it "
            "(a server puts no file into its clients' prompts)"}


def _declared(cmd) -> dict[str, bool]:
    """A click command's option spellings, each with whether it takes a value."""
    out = {"-h": False, "--help": False}
    for p in getattr(cmd, "params", ()):
        if getattr(p, "param_type_name", "") == "option":
            takes = not (getattr(p, "is_flag", False) or getattr(p, "count", False))
            out.update({o: takes for o in (*p.opts, *p.secondary_opts)})
    return out


def _all_declared(root, path: str = "tandem"):
    """(`tandem COMMAND`, its option spellings) for every command and group under `root`."""
    for name, cmd in getattr(root, "commands", {}).items():
        yield f"{path} {name}", _declared(cmd)
        yield from _all_declared(cmd, f"{path} {name}")


def _llama_options() -> dict[str, dict]:
    """data/llama_options.yaml by spelling."""
    from importlib import resources

    import yaml

    text = resources.files("tandem").joinpath("data/llama_options.yaml").read_text("utf-8")
    return {s: entry for entry in yaml.safe_load(text) for s in entry["spellings"]}


def _llama_error(name: str, entry: dict, where: str) -> UsageError:
    what = f"in llama.cpp: {entry['what']}"
    if entry.get("none"):
        return UsageError(f"tandem does not support {name} ({what}): {entry['none']}",
                          entry.get("use") or f"`{where} --help` lists the options")
    if entry.get("implied"):  # the commands where it goes without saying
        return UsageError(f"{name} ({what}) is not an option of `{where}`",
                          f"{entry['implied']}; drop it here")
    return UsageError(f"{name} ({what}) is not an option of `{where}`", entry["use"])


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
