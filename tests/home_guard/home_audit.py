"""Records writes under the caller's real tandem home made by this Python process: an audit
hook (sys.addaudithook) on the events that create, change or remove files.

The test session installs it in its own process (tests/conftest.py) and, through
sitecustomize.py beside this file on PYTHONPATH, in every Python subprocess its tests start
(`python -m tandem ...`, pip): those append what they wrote to a log the session reads at the
end. A process the suite did not start (a user's tandem running beside `make test`) has no
hook, so its writes are never blamed on the suite, unlike a before/after snapshot of the home.
"""
from __future__ import annotations

import os
import sys

# the environment a test subprocess reads: the home to guard, the log, the running test
ENV_HOME = "HOME_GUARD_HOME"
ENV_LOG = "HOME_GUARD_LOG"
ENV_TEST = "HOME_GUARD_TEST"

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# event -> the positions of the paths it changes (os.symlink and os.link only create the
# link: their target is read, not written)
_EVENTS = {
    "os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,),
    "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,), "os.chmod": (0,),
    "os.chown": (0,), "os.utime": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
    "shutil.rmtree": (0,), "shutil.move": (0, 1), "shutil.copyfile": (1,),
}
# the dir_fd argument's position: a path relative to an open directory cannot be placed
# (shutil.rmtree's own event names its top directory)
_DIR_FD = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 2, "os.symlink": 2, "os.chmod": 2,
           "os.chown": 3, "os.utime": 3, "os.mkfifo": 2, "os.mknod": 3, "os.rename": 2}


def _writes(event: str, args: tuple) -> list:
    """The paths an audited event writes to (str, bytes or PathLike; never an fd)."""
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, 0))[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        return [path] if writing else []
    where = _EVENTS.get(event)
    if where is None:
        return []
    fd = _DIR_FD.get(event)
    if fd is not None and len(args) > fd and isinstance(args[fd], int) and args[fd] >= 0:
        return []
    return [args[i] for i in where if i < len(args)]


class HomeAudit:
    """The hook: `record(event, path)` is called for each write under `home` (a path given
    relative to the home's parent directories, resolved against the current directory)."""

    def __init__(self, home: str, record):
        self.homes = {os.path.normpath(home), os.path.realpath(home)}
        self.record = record
        self._busy = False  # recording (a log write) raises events of its own

    def under_home(self, path) -> str | None:
        """`path` relative to the guarded home, or None when it is elsewhere."""
        if isinstance(path, int) or path is None:
            return None
        try:
            text = os.path.abspath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None
        for home in self.homes:
            if text == home:
                return "."
            if text.startswith(home + os.sep):
                return text[len(home) + 1:]
        return None

    def __call__(self, event: str, args: tuple) -> None:
        if self._busy or (event != "open" and event not in _EVENTS):
            return
        self._busy = True
        try:
            for path in _writes(event, args):
                rel = self.under_home(path)
                if rel is not None:
                    self.record(event, rel)
        except Exception:  # noqa: BLE001 - a guard must never break the code it watches
            pass
        finally:
            self._busy = False


def install_from_env() -> None:
    """In a test's subprocess: guard the home the session named, appending to its log."""
    home, log = os.environ.get(ENV_HOME), os.environ.get(ENV_LOG)
    if not home or not log:
        return

    def record(event: str, rel: str) -> None:
        line = "\t".join((os.environ.get(ENV_TEST, "?"), event, rel,
                          f"pid {os.getpid()}: {' '.join(sys.argv)[:200]}"))
        with open(log, "a", encoding="utf-8") as f:
            f.write(line.replace("\n", " ") + "\n")

    sys.addaudithook(HomeAudit(home, record))
