"""The tandem command line: parse, call the core, render. main() maps errors to messages."""
from __future__ import annotations

import errno
import os
import signal
import sys
import warnings
from typing import Annotated, Optional

import typer
import typer.main

from tandem import __version__
from tandem.errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    OutputError,
    TandemError,
    TandemWarning,
    UsageError,
)

app = typer.Typer(
    name="tandem",
    help="Faster local LLM generation with speculative decoding on llama.cpp.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        print(f"tandem {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version,
                                                    is_eager=True, help="Show the version.")] = None,
):
    """Faster local LLM generation with speculative decoding on llama.cpp."""


def _add_commands() -> None:
    """Every command module declares its commands on its own `app` (a typer.Typer); each is
    added here the same way, in the order `tandem --help` lists them. A module's Typer without
    a name merges its commands into this one; one with a name (pairs, history) is a group."""
    from tandem.commands import bench, chat, history, hw, pairs, pull, rpc_server, run, serve

    for module in (run, pull, hw, chat, serve, bench, rpc_server, pairs, history):
        app.add_typer(module.app)


_add_commands()


class _PipeClosed(Exception):
    """The reader of stdout went away. Not an OSError on purpose: click turns an EPIPE
    OSError into a silent exit 1 before main() could see it."""


class _Stdout:
    """sys.stdout as main() runs a command: a write that fails becomes _PipeClosed (reader
    gone) or OutputError (full device...), and it remembers whether the last character
    written ended a line (an interrupted answer gets its newline)."""

    def __init__(self, stream):
        self._stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        if text:  # before the write: a Ctrl-C can land the moment it returns
            self.at_line_start = text.endswith("\n")
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise _output_error(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise _output_error(exc) from None

    def __getattr__(self, name):  # isatty, fileno, encoding, buffer...
        return getattr(self._stream, name)


class _Terminated(BaseException):
    """SIGTERM arrived (`kill PID`, a service manager stopping tandem). A BaseException that is
    no KeyboardInterrupt: the chat's Ctrl-C handling (stop the answer, go on) must not catch it,
    while every `finally` still runs (no half-written file, contexts freed)."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def _output_error(exc: OSError) -> Exception:
    if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE:
        return _PipeClosed()
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return OutputError("cannot write the output: stdout's device is full",
                           "free some space, or redirect stdout elsewhere")
    return OutputError(f"cannot write the output to stdout: {exc.strerror or exc}",
                       "check where stdout is redirected")


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """TandemWarnings as `Warning: ...` lines; any other warning as Python shows it."""
    if issubclass(category, TandemWarning):
        print(f"Warning: {message}", file=sys.stderr)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main() -> None:
    """Entry point: every failure becomes `Error:`/`Hint:` on stderr and an exit code."""
    if sys.stderr is None or not _fd_open(2):
        # stderr closed (`2>&-`): errors and notes are dropped, never sent to stdout instead
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    stdout_closed = sys.stdout is None or not _fd_open(1)
    if not stdout_closed:
        sys.stdout = _Stdout(sys.stdout)
    warnings.showwarning = _show_warning
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main thread (an embedding): leave it alone
        pass
    try:
        if stdout_closed:
            raise UsageError("stdout is closed, so the output would be lost",
                             "run tandem with stdout open, or send it to /dev/null "
                             "(>/dev/null) if you want no output")
        rc = _invoke()
        sys.stdout.flush()  # a failed final flush is reported here, not at exit
    except OutputError as exc:
        _report(exc.message, exc.hint)
        _drop_stdout()
        sys.exit(exc.exit_code)
    except TandemError as exc:
        _report(exc.message, exc.hint)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.TyperException as exc:  # what typer refuses while parsing: bad flags, values
        _report(exc.format_message(), _usage_hint(exc))
        sys.exit(EXIT_USAGE)
    except (KeyboardInterrupt, typer.Abort):
        _interrupted()
    except _Terminated:
        _interrupted("Terminated.", EXIT_TERMINATED)
    except (_PipeClosed, BrokenPipeError):
        _quiet_exit()
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        if os.environ.get("TANDEM_DEBUG"):
            raise
        _report(f"unexpected {type(exc).__name__}: {exc}",
                "rerun with TANDEM_DEBUG=1 for a traceback, and report it")
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


def _invoke():
    """Parse and run the command. Not through typer's own main loop (Command.main): it turns
    Ctrl-C into a bare exit code and EPIPE into a silent exit 1 before main() could report
    either. No arguments: the help, on stdout, exit 0. llama.cpp's spellings are checked
    first (commands/options.py: llama_args), so that `-ngl` is never read as `-n gl`."""
    from tandem.commands.options import llama_args

    command = typer.main.get_command(app)
    args = llama_args(command, sys.argv[1:])
    with command.make_context(_program_name(), args, resilient_parsing=not args) as ctx:
        if not args:
            text = ctx.get_help()  # typer's rich help prints itself and returns ""
            if text:
                print(text)
            return 0
        return command.invoke(ctx)


def _program_name() -> str:
    """The name the usage lines show: `tandem` from the entry point, `python -m tandem` when
    run as a module (what click's own main loop would choose)."""
    main_module = sys.modules.get("__main__")
    package = getattr(main_module, "__package__", None)
    if not package:
        return os.path.basename(sys.argv[0])
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return f"python -m {package if name == '__main__' else f'{package}.{name}'}"


def _usage_hint(exc: Exception) -> str:
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "tandem"
    return f"`{command} --help` lists the arguments and options"


def _interrupted(message: str = "Interrupted.", code: int = EXIT_INTERRUPTED) -> None:
    """Ctrl-C (or SIGTERM): end the partial answer's line, say so, exit 130 (143)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM while ending: just end
    try:
        if isinstance(sys.stdout, _Stdout) and not sys.stdout.at_line_start:
            sys.stdout.write("\n")
            sys.stdout.flush()
    except (_PipeClosed, OutputError):
        pass
    print(message, file=sys.stderr)
    sys.exit(code)


def _quiet_exit() -> None:
    """The reader went away (e.g. `| head`): stop quietly with 0, like other Unix tools."""
    _drop_stdout()
    sys.exit(0)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is still buffered
    cannot fail again with a second message."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _report(message: str, hint: str | None) -> None:
    print(f"Error: {message}", file=sys.stderr)
    if hint:
        print(f"Hint: {hint}", file=sys.stderr)
