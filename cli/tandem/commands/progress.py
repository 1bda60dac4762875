"""Download progress on stderr: Rich bars on a terminal, periodic plain lines otherwise, so a
model fetched on the way (pull, run, chat, spec-bench) is never a silent wait."""
from __future__ import annotations

import os
import sys
import time

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TaskID, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)

from tandem.fsutil import fmt_bytes
from tandem.models.transfer import ProgressEvent


def stderr_console() -> Console:
    return Console(file=sys.stderr, highlight=False, markup=False, emoji=False, soft_wrap=True)


def bars_wanted() -> bool:
    """Live bars only on a terminal, and not when NO_COLOR or TERM=dumb asks for plain text."""
    return (sys.stderr.isatty() and not os.environ.get("NO_COLOR")
            and os.environ.get("TERM") != "dumb")


class ProgressView:
    """Renders store ProgressEvents on stderr: Rich bars on a terminal, else plain lines
    (one when a file starts, then every 25% or LINE_EVERY_S seconds, whichever comes first:
    a slow download of a large file must still show that it moves)."""

    LINE_EVERY_S = 30.0

    def __init__(self, console: Console, bars: bool, clock=None):
        self.console = console
        self.bars = bars
        self.clock = clock or time.monotonic
        self._progress: Progress | None = None
        self._tasks: dict[tuple[str, str], TaskID] = {}
        self._plain: dict[tuple[str, str], int] = {}  # last quarter printed
        self._last_line: dict[tuple[str, str], float] = {}

    def __call__(self, ev: ProgressEvent) -> None:
        kind = "verify" if ev.phase == "verify" else "fetch"
        verb = "Verifying" if kind == "verify" else "Downloading"
        parts = f" (part {ev.part}/{ev.parts})" if ev.parts > 1 and kind == "fetch" else ""
        key = (ev.model, kind)
        if self.bars:
            self._bar(key, f"{verb} {ev.model}{parts}", ev)
        else:
            self._line(key, verb, ev)

    def _bar(self, key: tuple[str, str], desc: str, ev: ProgressEvent) -> None:
        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
            )
            self._progress.start()
        if key not in self._tasks:
            self._tasks[key] = self._progress.add_task(desc, total=ev.total)
        self._progress.update(self._tasks[key], description=desc, completed=ev.done,
                              total=ev.total)

    def _line(self, key: tuple[str, str], verb: str, ev: ProgressEvent) -> None:
        now = self.clock()
        if key not in self._plain:
            self._plain[key] = 0
            self._last_line[key] = now
            size = f" ({fmt_bytes(ev.total, decimal=True)})" if ev.total else ""
            self.console.print(f"{verb} {ev.model}{size}...")
        quarter = min(4, ev.done * 4 // ev.total) if ev.total else 0
        if quarter > self._plain[key]:
            self._plain[key] = quarter
            self._last_line[key] = now
            self.console.print(f"  {ev.model}: {quarter * 25}%")
        elif now - self._last_line[key] >= self.LINE_EVERY_S:
            self._last_line[key] = now
            of = f" of {fmt_bytes(ev.total, decimal=True)}" if ev.total else ""
            pct = f" ({100 * ev.done // ev.total}%)" if ev.total else ""
            self.console.print(f"  {ev.model}: {fmt_bytes(ev.done, decimal=True)}{of}{pct}")

    def note(self, message: str) -> None:
        self.console.print(f"Note: {message}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None




def download_view() -> ProgressView:
    """The view run, chat, spec-bench and pull report downloads to."""
    return ProgressView(stderr_console(), bars_wanted())
