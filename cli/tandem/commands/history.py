"""`tandem history [show|clear]`: what auto drafts from besides the prompt, kept on disk.

The store holds earlier answers per target model (tandem.engine.history); `show` lists each
file's size and entries, `clear` deletes them all. Results on stdout, errors on stderr.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from tandem.fsutil import storage_error
from tandem.engine.history import clear_histories, history_dir, list_histories
from tandem.models.store import tandem_home
from tandem.models.transfer import human_size

history_app = typer.Typer(
    help="Earlier answers kept for drafting: show what is stored, or clear it.",
    no_args_is_help=False,
    invoke_without_command=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(history_app, name="history")


@history_app.callback()
def _default(ctx: typer.Context):
    """Earlier answers kept for drafting (turn off with `history: off` in the config,
    TANDEM_HISTORY=off or --no-history)."""
    if ctx.invoked_subcommand is None:
        show(as_json=False)


@history_app.command("show")
def show(as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False):
    """List the stored histories: target model, answers, tokens and size on disk."""
    home = tandem_home()
    infos = list_histories(home)
    if as_json:
        print(json.dumps({"dir": str(history_dir(home)), "histories": [
            {"path": str(i.path), "target": i.target, "entries": i.entries, "tokens": i.tokens,
             "bytes": i.bytes, "newest": i.newest} for i in infos]}, indent=1))
        return
    if not infos:
        print(f"no history stored (in {history_dir(home)})")
        return
    for i in infos:
        newest = time.strftime("%Y-%m-%d %H:%M", time.localtime(i.newest)) if i.newest else "?"
        print(f"{i.target}: {i.entries} answers, {i.tokens} tokens, {human_size(i.bytes)} "
              f"(latest {newest})  {i.path}")
    total = sum(i.bytes for i in infos)
    print(f"total {human_size(total)} in {history_dir(home)}")


@history_app.command("clear")
def clear():
    """Delete every stored history of this TANDEM_HOME."""
    home = tandem_home()
    try:
        n = clear_histories(home)
    except OSError as exc:
        raise storage_error(exc, "the history", Path(exc.filename or history_dir(home)),
                            home_hint=True) from None
    print(f"cleared {n} histor{'y' if n == 1 else 'ies'} from {history_dir(home)}")
