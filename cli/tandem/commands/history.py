"""`tandem history [show|clear]`: what auto drafts from besides the prompt, kept on disk.

The store holds earlier answers per target model (tandem.engine.drafting.history); `show` lists each
file's size and entries, `clear` deletes them all. Results on stdout, errors on stderr.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from tandem.errors import StorageError
from tandem.fsutil import blocking_file, fmt_bytes, storage_error
from tandem.engine.drafting.history import clear_histories, history_dir, list_histories
from tandem.models.store import tandem_home

app = typer.Typer(
    name="history",
    help="Earlier answers kept for drafting: show what is stored, or clear it.",
    no_args_is_help=False,
    invoke_without_command=True,
)


@app.callback()
def _default(ctx: typer.Context):
    """Earlier answers kept for drafting (turn off with `history: off` in the config,
    TANDEM_HISTORY=off or --no-history)."""
    if ctx.invoked_subcommand is None:
        show(as_json=False)


def _usable_home() -> Path:
    """TANDEM_HOME, refused when it (or the history folder) is a file: "no history stored"
    would hide that nothing can be stored there either."""
    home = tandem_home()
    blocker = blocking_file(history_dir(home))
    if blocker is not None:
        raise StorageError(f"the tandem home cannot hold a history: {blocker} is a file, "
                           "not a directory",
                           "set TANDEM_HOME to a directory (or move that file out of the way)")
    return home


@app.command("show")
def show(as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False):
    """List the stored histories: target model, answers, tokens and size on disk."""
    home = _usable_home()
    infos = list_histories(home)
    if as_json:
        # allow_nan=False: only finite times get this far (list_histories checks them), and
        # NaN is not JSON
        print(json.dumps({"dir": str(history_dir(home)), "histories": [
            {"path": str(i.path), "target": i.target, "entries": i.entries, "tokens": i.tokens,
             "bytes": i.bytes, "newest": i.newest} for i in infos]}, indent=1, allow_nan=False))
        return
    if not infos:
        print(f"no history stored (in {history_dir(home)})")
        return
    for i in infos:
        newest = time.strftime("%Y-%m-%d %H:%M", time.localtime(i.newest)) if i.newest else "?"
        print(f"{i.target}: {i.entries} answers, {i.tokens} tokens, {fmt_bytes(i.bytes, decimal=True)} "
              f"(latest {newest})  {i.path}")
    total = sum(i.bytes for i in infos)
    print(f"total {fmt_bytes(total, decimal=True)} in {history_dir(home)}")


@app.command("clear")
def clear():
    """Delete every stored history of this TANDEM_HOME."""
    home = _usable_home()
    try:
        n = clear_histories(home)
    except OSError as exc:
        raise storage_error(exc, "the history", Path(exc.filename or history_dir(home)),
                            home_hint=True) from None
    print(f"cleared {n} histor{'y' if n == 1 else 'ies'} from {history_dir(home)}")
