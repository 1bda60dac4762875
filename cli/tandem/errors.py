"""Exception types that carry a user-facing message, a hint and an exit code.

The core raises these; only `tandem.commands.app.main` turns them into `Error:`/`Hint:` lines.
"""
from __future__ import annotations

# Exit codes, documented in docs/errors.md (a test holds the two together)
EXIT_OK = 0
EXIT_ERROR = 1  # unexpected failure
EXIT_USAGE = 2  # bad flags or parameter values
EXIT_MODEL = 3  # model file missing, truncated, not GGUF, incompatible pair
EXIT_DOWNLOAD = 4  # download, mirror, checksum, no room for a download
EXIT_CONTEXT = 5  # prompt does not fit the context
EXIT_REMOTE = 6  # an RPC server or the link to it failed (refused, foreign, version, died, stalled)
EXIT_STORAGE = 7  # tandem's own files (TANDEM_HOME, reports) cannot be written or read
EXIT_OUTPUT = 8  # stdout cannot take the result (a full device, an I/O error)
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM (128 + 15), as shells report it


class TandemError(Exception):
    """Base class: `message` is one line for the user, `hint` says what to do next."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(TandemError):
    exit_code = EXIT_USAGE


class ModelError(TandemError):
    """A model file is missing, truncated, not GGUF or cannot be loaded."""

    exit_code = EXIT_MODEL


class GGUFFormatError(ModelError):
    """A GGUF header is malformed or hostile (bounded reads reject it)."""


class VocabMismatchError(ModelError):
    """The draft's vocabulary cannot be used with the target's."""


class DownloadError(TandemError):
    exit_code = EXIT_DOWNLOAD


class ChecksumError(DownloadError):
    pass


class ContextOverflowError(TandemError):
    exit_code = EXIT_CONTEXT


class RemoteError(TandemError):
    """An RPC server (--rpc) cannot be used or failed: nobody listening, a port speaking
    something else, another protocol version, a server that died or stalled mid-request."""

    exit_code = EXIT_REMOTE


class RemoteNotFoundError(DownloadError):
    """A repository, revision or file does not exist on the hub (or is private)."""


class NetworkError(DownloadError):
    """The hub cannot be reached (no network, proxy, offline mode)."""


class DiskFullError(DownloadError):
    """Not enough disk space for a download (checked up front, or ENOSPC while writing)."""


class StorageError(TandemError):
    """tandem's own files cannot be written or read: TANDEM_HOME is a file or read-only, a
    directory in it is a file, the disk is full, an output directory is unusable. Its own code:
    nothing was downloaded, and a script should not retry a download for it."""

    exit_code = EXIT_STORAGE


class OutputError(TandemError):
    """stdout cannot take the result (on a full device, or failing). Its own code: tandem's
    files are fine, the fix is where stdout goes."""

    exit_code = EXIT_OUTPUT


def error_classes() -> dict[str, type[TandemError]]:
    """This module's TandemError classes by name: what an error is called when it crosses a
    process boundary (the RPC worker, engine/remote/worker.py)."""
    found: dict[str, type[TandemError]] = {"TandemError": TandemError}
    todo = [TandemError]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__ == __name__:
                found[sub.__name__] = sub
    return found


def error_name(exc: BaseException) -> str:
    """The name `rebuild_error` knows `exc` by: its own class if this module defines it, else
    the nearest base class that it does (a SettingsFileError crosses as a UsageError)."""
    known = error_classes()
    return next((c.__name__ for c in type(exc).__mro__ if known.get(c.__name__) is c),
                type(exc).__name__)


def rebuild_error(name: str, message: str, hint: str | None, exit_code: int) -> TandemError:
    """The error `error_name` named, on this side of the boundary: the same class, message,
    hint and exit code. A name this module does not define is a TandemError with the code
    that was sent."""
    err = error_classes().get(name, TandemError)(message, hint)
    if err.exit_code != exit_code:
        err.exit_code = exit_code
    return err


class TandemWarning(UserWarning):
    """Something the user should know that stops nothing (a damaged file set aside, a
    surprising setting). The core warns with it; `tandem.commands.app.main` prints `Warning: ...`."""


class UnsafePathError(UsageError):
    """A file name that would escape the model store or the hub cache."""
