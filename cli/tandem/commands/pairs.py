"""`tandem pairs [list|check|suggest]`: parse, call tandem.models.pairing, render.

Results go to stdout (tables, paths, JSON); progress, notes and errors go to stderr.
"""
from __future__ import annotations

import json
import shutil
import sys
import textwrap
from typing import Annotated, Any

import typer
from rich.console import Console

from tandem.commands.progress import stderr_console
from tandem.errors import EXIT_MODEL, VocabMismatchError
from tandem.fsutil import fmt_bytes
from tandem.models import catalog, memory_type
from tandem.models.store import Store
from tandem.models.vocab import VocabInfo

# a target whose memory type neither its header nor the catalog's arch gives
UNKNOWN = "unknown"
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]
WIDE_HELP = ("Every column, one line a pair: the target and draft files by hub reference "
             "and the target's memory type (the default table fits the terminal).")

app = typer.Typer(
    name="pairs",
    help="Known target/draft pairs: list them, check a pair, suggest drafts.",
    no_args_is_help=False,
    invoke_without_command=True,
)


# ------------------------------------------------------------------------ output


def _out() -> Console:
    # markup off: file names and token texts may contain [brackets]
    return Console(file=sys.stdout, highlight=False, markup=False, emoji=False, soft_wrap=True)


def _size(n: int | None, approx: bool = False) -> str:
    if n is None:
        return "?"
    return ("~" if approx else "") + fmt_bytes(n, decimal=True)


def _table(headers: tuple[str, ...], rows: list[tuple[str, ...]], width: int | None) -> None:
    """Aligned plain columns on stdout (grep/awk friendly). `width`: the last column wraps
    onto indented lines so that no line is longer (at least 20 characters of it a line);
    None: one line per row, however long."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    indent = sum(w + 2 for w in widths)
    last = None if width is None else max(20, width - indent)
    for row in [headers, *rows]:
        lead = "".join(cell.ljust(w + 2) for cell, w in zip(row, widths))
        lines = textwrap.wrap(row[-1], last) if last is not None else [row[-1]]
        sys.stdout.write((lead + (lines[0] if lines else "")).rstrip() + "\n")
        for more in lines[1:]:
            sys.stdout.write(" " * indent + more + "\n")


def _width() -> int:
    """The terminal's columns ($COLUMNS first); 80 when stdout is a pipe or a file."""
    return shutil.get_terminal_size((80, 24)).columns


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------- pairs


@app.callback()
def _pairs_default(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    wide: Annotated[bool, typer.Option("--wide", "-w", help=WIDE_HELP)] = False,
):
    """Known target/draft pairs: list them, check a pair, suggest drafts."""
    if ctx.invoked_subcommand is None:
        list_pairs(as_json=as_json, wide=wide)


@app.command("list")
def list_pairs(
    as_json: JsonOpt = False,
    wide: Annotated[bool, typer.Option("--wide", "-w", help=WIDE_HELP)] = False,
):
    """List the catalog: sizes, memory, what is on disk, each target's memory type, what
    drafts for it and what each pair is good for.

    The table fits the terminal (80 columns in a pipe): its last column (TYPE · DRAFT · GOOD
    FOR) wraps. `--wide` gives every column apart, with the target and draft files by hub
    reference, one line a pair.
    """
    store = Store()
    pairs = catalog.load_catalog()
    default = catalog.get_pair(None).name
    memory = _memory(pairs, store)
    if as_json:
        print_json({"pairs": [_pair_json(p, p.name == default, store, memory[p.name])
                              for p in pairs.values()],
                     "other_models": _others_json(store, pairs)})
        return
    if wide:
        headers = ("PAIR", "TARGET", "DRAFT", "SIZE", "MEMORY", "TYPE", "ON DISK", "GOOD FOR")
    else:
        headers = ("PAIR", "SIZE", "MEMORY", "ON DISK", "TYPE · DRAFT · GOOD FOR")
    rows = []
    for p in pairs.values():
        approx = any(m.size is None for m in p.models)
        size, mem = _size(p.approx_size, approx), _memory_text(*memory[p.name])
        if wide:
            rows.append((p.name + (" (default)" if p.name == default else ""), p.target.key,
                         _draft_text(p), size, mem, _memory_type(p.target, store) or UNKNOWN,
                         _on_disk(p, store), p.good_for))
        else:  # too narrow for more columns: type and drafter lead the wrapped one
            about = (_memory_type(p.target, store) or UNKNOWN, _drafter(p), p.good_for)
            rows.append((p.name + ("*" if p.name == default else ""), size, mem,
                         _on_disk(p, store, short=True), " · ".join(about)))
    _table(headers, rows, None if wide else _width())
    out = _out()
    others = _others_json(store, pairs)
    if others:
        out.print("Other models on disk:")
        for o in others:
            where = f"  {o['path']}" if wide else ""
            out.print(f"  {o['ref']}  {fmt_bytes(o['size'], decimal=True)}{where}")
    stderr_console().print(textwrap.fill(
        ("" if wide else "*: the default pair. ")
        + "MEMORY: both models' weights, KV caches and compute buffers as `tandem hw --pair "
        "PAIR` plans them with this machine's settings (its context size: profile, config or "
        "tuned); ~: estimated from the catalog, the rest from the files on disk. Sizes are "
        "approximate (~) where the catalog has no exact size, ? where it has none. "
        "TYPE: the target's memory (attention, sliding window, hybrid, recurrent: "
        f"docs/models.md says how each rolls drafts back; {UNKNOWN}: the catalog does not "
        "say). DRAFT: the draft model; n-gram: no draft model, `auto` drafts from n-grams, "
        "history and prompt copies; "
        f"{catalog.MTP_HEADS}: the target's own MTP heads draft (--strategy mtp). "
        + ("" if wide else "`tandem pairs --wide`: the target and draft files, one line a "
           "pair. ")
        + "`tandem pull PAIR` downloads a pair.", _width(), break_on_hyphens=False))


def _memory(pairs: dict[str, catalog.PairSpec], store: Store) -> dict[str, tuple[Any, bool]]:
    """{pair: (bytes or None, estimated)}: the planner's figure, the one `tandem hw` shows
    (commands.compose.pair_plan). Settings that cannot be resolved (a broken config.yaml) leave
    it unknown, said once on stderr: the catalog is still worth listing."""
    from tandem.commands.compose import needs, pair_plan
    from tandem.errors import TandemError
    from tandem.machine.hardware import detect
    from tandem.machine.profiles import load_profiles
    from tandem.models.store import tandem_home

    out: dict[str, tuple[Any, bool]] = {name: (None, True) for name in pairs}
    try:
        hardware = detect()
        profiles = load_profiles(user_dir=tandem_home() / "profiles")
        for name in pairs:
            plan = pair_plan(name, store, hardware=hardware, profiles=profiles)
            out[name] = (needs(plan), not all(m.exact for m in plan.models))
    except TandemError as exc:
        stderr_console().print(f"Note: memory not planned ({exc.message})")
    return out


def _draft_text(p: catalog.PairSpec) -> str:
    """What drafts for the pair: its draft model's hub reference, the target's own MTP
    heads, or none (n-grams and copies)."""
    if p.mtp:
        return catalog.MTP_HEADS
    if p.draft is None:
        return "none (n-gram, history, prompt)"
    return p.draft.key


def _drafter(p: catalog.PairSpec) -> str:
    """What drafts for the pair in the default table's words: the draft model's catalog
    name, the target's own MTP heads, or n-gram (n-grams and copies, the legend says)."""
    return "n-gram" if p.draft is None and not p.mtp else p.drafted_by


def _memory_type(m: catalog.ModelSpec, store: Store) -> str | None:
    """A catalog model's memory type: from its header when on disk, else its catalog arch."""
    if store.is_present(m):
        from tandem.errors import TandemError
        from tandem.models.gguf_meta import read_gguf_header

        try:
            return memory_type.describe(read_gguf_header(store.path_for(m)))[0]
        except (TandemError, OSError):
            pass
    return memory_type.of_catalog(m.arch)


def _memory_text(n: int | None, estimated: bool) -> str:
    return "?" if n is None else ("~" if estimated else "") + fmt_bytes(n)


def _on_disk(p: catalog.PairSpec, store: Store, short: bool = False) -> str:
    """yes / target only / draft only / -, with the bytes on disk unless `short`."""
    present = [m for m in p.models if store.is_present(m)]
    if not present:
        return "-"
    which = "yes" if len(present) == len(p.models) else (
        f"{'target' if present[0] is p.target else 'draft'} only")
    if short:
        return which
    size = fmt_bytes(sum(store.path_for(m).stat().st_size for m in present), decimal=True)
    return f"{which}, {size}"


def _model_json(m: catalog.ModelSpec, store: Store) -> dict[str, Any]:
    present = store.is_present(m)
    return {
        "name": m.name, "repo": m.repo, "file": m.hub_path, "size": m.size,
        "approx_size": m.approx_size, "sha256": m.sha256,
        "mirrors": [mi.kind for mi in m.mirrors], "on_disk": present,
        "path": str(store.path_for(m)) if present else None,
        "arch": m.arch, "memory_type": _memory_type(m, store),
    }


def _pair_json(p: catalog.PairSpec, is_default: bool, store: Store,
               memory: tuple[Any, bool]) -> dict[str, Any]:
    return {
        "name": p.name, "aliases": list(p.aliases), "default": is_default,
        "description": p.description, "good_for": p.good_for,
        "memory": memory[0], "memory_estimated": memory[1],
        "approx_size": p.approx_size,
        "target": _model_json(p.target, store),
        "draft": _model_json(p.draft, store) if p.draft is not None else None,
        "drafted_by": p.drafted_by, "mtp": p.mtp,
    }


def _others_json(store: Store, pairs: dict[str, catalog.PairSpec]) -> list[dict[str, Any]]:
    known = {m.key for p in pairs.values() for m in p.models}
    return [{"ref": e.key, "size": e.size, "path": str(e.path), "source": e.source}
            for e in store.list() if e.key not in known and e.present]


@app.command("check")
def check_pair(
    target: Annotated[str, typer.Argument(help="Target: pair name, catalog model, user/repo:QUANT, user/repo/file.gguf or a path.")],
    draft: Annotated[str, typer.Argument(help="Draft, in the same forms.")],
    as_json: JsonOpt = False,
):
    """Can DRAFT speculate for TARGET? Exit 0: yes, 3: no (reasons on stderr).

    Reads only the GGUF headers: from disk, or with HTTP range requests
    for files not downloaded yet (no weights are fetched).

    Examples:

      tandem pairs check qwen2.5-coder-32b qwen2.5-coder-0.5b-instruct-q4_k_m

      tandem pairs check unsloth/Qwen3-8B-GGUF:Q4_K_M ./my-draft.gguf
    """
    from tandem.models import pairing
    from tandem.models.hub import HubConfig

    cfg = HubConfig.from_env()
    t = pairing.resolve(target, "target", cfg)
    d = pairing.resolve(draft, "draft", cfg)
    compat = pairing.check(t, d, Store(), cfg)
    if as_json:
        print_json({
            "compatible": compat.compatible, "problems": list(compat.problems),
            "target": _header_json(t, compat.target_header, "target"),
            "draft": _header_json(d, compat.draft_header, "draft"),
        })
        if not compat.compatible:
            raise typer.Exit(EXIT_MODEL)
        return
    out = _out()
    for role, model, h in (("target", t, compat.target_header), ("draft", d, compat.draft_header)):
        kind, rollback = memory_type.describe(h.header, role)
        out.print(f"{role:<7} {model.ref}  [{_vocab_summary(h)}; {kind} memory; "
                  f"{_header_source(h)}]")
        if kind != memory_type.ATTENTION:  # the usual case needs no words
            out.print(f"        {kind} memory: {rollback}")
        state = _state_memory(h.header)
        if state["state_bytes"]:
            snaps = (f"llama.cpp's snapshots {fmt_bytes(state['snapshots'])} (n_rs_seq "
                     f"{state['n_rs_seq']})" if state["n_rs_seq"] else "no snapshots")
            out.print(f"        recurrent state: {fmt_bytes(state['state_bytes'])} a copy; "
                      f"{snaps}, context checkpoints up to "
                      f"{fmt_bytes(state['checkpoints'])} in RAM ({state['n_checkpoints']} "
                      "copies, --ctx-checkpoints); at the defaults, `tandem hw` plans yours")
    if not compat.compatible:
        raise compat.error()
    out.print(f"compatible: {d.label} can draft for {t.label}")


def _state_memory(header: Any) -> dict[str, int]:
    """What a model's recurrent state takes at the default settings, from its header: one
    copy, llama.cpp's n_rs_seq snapshots (where the architecture keeps them) and the context
    checkpoints' copies (machine/placement.py plans the same for `tandem hw`)."""
    from tandem.config.schema import FIELDS_BY_KEY, MAX_DRAFT
    from tandem.engine.backend.context_params import ROLLBACK_TOKENS
    from tandem.machine.shapes import ModelShape

    shape = ModelShape.from_gguf(header)
    n_rs = max(ROLLBACK_TOKENS, min(FIELDS_BY_KEY["n_max"].default, MAX_DRAFT))
    n_rs = n_rs if shape.snapshots else 0
    copies = FIELDS_BY_KEY["ctx_checkpoints"].default
    return {"state_bytes": shape.state_bytes, "n_rs_seq": n_rs,
            "snapshots": n_rs * shape.state_bytes, "n_checkpoints": copies,
            "checkpoints": copies * shape.state_bytes}


def _vocab_summary(h: Any) -> str:
    v = VocabInfo.from_header(h.header)
    arch = h.header.architecture or "?"
    return f"{arch}, {v.type_name} vocabulary of {v.n_tokens} tokens"


def _header_source(h: Any) -> str:
    if h.where == "local":
        return "on disk"
    return f"hub: {fmt_bytes(h.bytes_fetched, decimal=True)} of {_size(h.size)} read in {h.requests} requests"


def _header_json(model: Any, h: Any, role: str) -> dict[str, Any]:
    v = VocabInfo.from_header(h.header)
    return {
        "ref": model.ref, "architecture": h.header.architecture, "name": h.header.name,
        "vocab_type": v.type_name, "n_tokens": v.n_tokens, "where": h.where,
        "memory": {**dict(zip(("type", "rollback"), memory_type.describe(h.header, role))),
                   **_state_memory(h.header)},
        "size": h.size, "bytes_fetched": h.bytes_fetched, "requests": h.requests,
    }


@app.command("suggest")
def suggest(
    target: Annotated[str, typer.Argument(help="Target: pair name, catalog model, user/repo:QUANT, user/repo/file.gguf or a path.")],
    show_all: Annotated[bool, typer.Option("--all", help="Also list incompatible drafts, with the reasons.")] = False,
    as_json: JsonOpt = False,
):
    """Catalog drafts whose vocabulary fits TARGET (any GGUF, hub or disk).

    Reads only GGUF headers. Exit 0 when a draft fits, 3 when none does.

    Example:

      tandem pairs suggest bartowski/Qwen2.5-14B-Instruct-GGUF:Q4_K_M
    """
    from tandem.models import pairing
    from tandem.models.hub import HubConfig

    cfg = HubConfig.from_env()
    t = pairing.resolve(target, "target", cfg)
    t_header, results = pairing.suggest(t, Store(), cfg)
    good = [s for s in results if s.compatible]
    failed = [(s, s.error) for s in results if s.error is not None]
    if as_json:
        print_json({
            "target": _header_json(t, t_header, "target"),
            "drafts": [{"name": s.draft.label, "ref": s.draft.ref, "pairs": list(s.pairs),
                        "compatible": s.compatible, "problems": list(s.problems),
                        "error": s.error.message if s.error else None} for s in results],
        })
        if not good:
            raise typer.Exit(failed[0][1].exit_code if failed else EXIT_MODEL)
        return
    out, err = _out(), stderr_console()
    for s in good:
        spec = s.draft.spec
        size = _size(spec.display_size, spec.size is None) if spec else "?"
        out.print(f"{s.draft.label}  {size}  {s.draft.ref}  (pairs: {', '.join(s.pairs)})")
    if show_all:
        for s in results:
            if not s.compatible and s.error is None:
                out.print(f"incompatible: {s.draft.label}: {'; '.join(s.problems)}")
    for s, exc in failed:
        err.print(f"Note: could not check {s.draft.label}: {exc.message}")
    if good:
        return
    if len(failed) == len(results) and failed:
        raise failed[0][1]
    vocab = VocabInfo.from_header(t_header.header)
    raise VocabMismatchError(
        f"no catalog draft is compatible with {t.label} "
        f"({vocab.type_name} vocabulary of {vocab.n_tokens} tokens)",
        "use a small model of the same family as the draft: "
        "tandem pull --target TARGET --draft user/repo:QUANT",
    )
