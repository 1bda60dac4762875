"""A generation whose target sits on llama.cpp RPC servers, run in a worker process that the
caller supervises.

Why a process: llama.cpp ends the whole process with GGML_ABORT when an RPC connection breaks
(ggml-rpc.cpp: RPC_STATUS_ASSERT in rpc_dispatcher::work) and waits forever on a server that
stops answering (its socket has no timeout). Neither can be caught in-process. The worker
loads the pair and streams generate()'s events over a pipe; the caller sees them as they come.
If the worker dies, or sends nothing for `stall` seconds (model loading reports progress, so a
slow upload of weights is not a stall), it is killed and a RemoteError names the endpoint(s)
that no longer answer. The text already streamed stays with the caller.

Nothing is left half-written: the worker writes its files (costs, history) through a
temporary file and os.replace, and a temporary file of a killed worker is removed here; the
worker's core dumps are off and llama.cpp's abort() ends it with _exit (no core file).
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from tandem.errors import RemoteError, TandemError

# model loading calls back once per tensor; a heartbeat at most this often
BEAT_EVERY = 0.5


@dataclass(frozen=True)
class Job:
    """What one supervised request needs: the pair, the session options, the request."""

    target: Path
    draft: Path | None
    options: Any  # engine.session.SessionOptions (with .rpc)
    messages: tuple[dict, ...]
    gen: Any  # engine.speculative.GenParams
    raw: bool = False
    contexts: tuple[tuple[Path, str], ...] = ()
    home: str | None = None  # TANDEM_HOME for the worker's files (costs, history)


@dataclass(frozen=True)
class LoadedEvent:
    """The worker has both models loaded and the request's prompt tokenized."""

    n_prompt: int


def run_supervised(job: Job, stall: float = 60.0) -> Iterator[Any]:
    """generate()'s events from a worker process (plus one LoadedEvent). Raises RemoteError
    when the worker dies or stalls, and the worker's own TandemError when it fails cleanly."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited llama.cpp state
    receiver, sender = ctx.Pipe(duplex=False)
    log = tempfile.NamedTemporaryFile(prefix="tandem-worker-", suffix=".log", delete=False)
    log.close()
    proc = ctx.Process(target=_worker_main, args=(sender, job, log.name), daemon=True,
                       name="tandem-rpc-worker")
    started = time.time()
    proc.start()
    sender.close()  # the worker holds the only writing end: its death is EOF here
    finished = False
    try:
        while True:
            if not receiver.poll(stall):
                raise _failure(job, proc, log.name, f"sent nothing for {stall:g} s", stalled=True)
            try:
                kind, payload = receiver.recv()
            except (EOFError, OSError):
                proc.join(2)
                raise _failure(job, proc, log.name, _how_it_ended(proc)) from None
            if kind == "event":
                yield payload
            elif kind == "error":
                cls, message, hint, code = payload
                err = TandemError(message, hint)
                err.exit_code = code
                raise err
            elif kind == "end":
                finished = True
                return
            # "beat": loading progress, only resets the stall clock
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        receiver.close()
        if not finished:
            _remove_partial_files(job, proc.pid, started)
        try:
            os.unlink(log.name)
        except OSError:
            pass


def _how_it_ended(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "closed its pipe"
    if code == 6 or code == -6:
        return "was aborted by llama.cpp (a broken RPC connection)"
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _failure(job: Job, proc, log_path: str, what: str, stalled: bool = False) -> RemoteError:
    """Which endpoint failed: the ones that no longer answer a handshake (after the worker is
    gone, a healthy server is free again), else all of them."""
    from tandem.engine.rpc import broken

    if proc.is_alive():
        proc.kill()
        proc.join(5)
    eps = tuple(job.options.rpc)
    bad = broken(eps, timeout=2.0)
    names = ", ".join(ep for ep, _ in bad) or ", ".join(eps)
    said = _llama_said(log_path)
    why = f"; now: {bad[0][1]}" if bad else ""
    message = (f"the RPC link to {names} failed during the request: the engine "
               f"{what}{why}" + (f" (llama.cpp: {said})" if said else ""))
    if stalled:
        hint = ("the server or the network stopped answering; check it, or raise the stall "
                "limit (--rpc-timeout, TANDEM_RPC_TIMEOUT) for a slow link")
    else:
        hint = "restart the server there (`tandem rpc-server`) and run the request again"
    return RemoteError(message, hint)


def _llama_said(log_path: str) -> str:
    """llama.cpp's last error line from the worker's stderr (GGML_ABORT's message)."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            lines = [ln.strip() for ln in fh.read()[-4000:].splitlines() if ln.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if "GGML_ABORT" in line or "error" in line.lower() or "failed" in line.lower() or \
                "crashed" in line.lower():
            return line.split(": ", 1)[-1][:200] if ".cpp:" in line else line[:200]
    return ""


def _remove_partial_files(job: Job, pid: int | None, started: float) -> None:
    """A worker killed mid-write leaves its temporary file (never a half-written real one):
    remove those it may have made."""
    if pid is None:
        return
    home = Path(job.home) if job.home else None
    if home is None:
        from tandem.models.store import tandem_home

        home = tandem_home()
    for pattern, where in ((f"*.{pid}.tmp", "history"), ("*.tmp", "costs")):
        folder = home / where
        if not folder.is_dir():
            continue
        for path in folder.glob(pattern):
            try:
                if path.stat().st_mtime >= started - 1:
                    path.unlink()
            except OSError:
                pass


# ------------------------------------------------------------------------------ the worker


def _worker_main(conn, job: Job, log_path: str) -> None:
    """In the worker process: quiet, no core files, an abort ends it at once."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills it
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    os.environ["GGML_NO_BACKTRACE"] = "1"  # ggml would otherwise run gdb on abort
    if job.home:
        os.environ["TANDEM_HOME"] = job.home
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    if not job.options.verbose:
        os.dup2(fd, 2)  # llama.cpp's abort message: read back by the parent
    os.close(fd)
    from tandem.engine.ggml import exit_on_abort

    exit_on_abort()
    try:
        _serve(conn, job)
        conn.send(("end", None))
    except TandemError as exc:
        conn.send(("error", (type(exc).__name__, exc.message, exc.hint, exc.exit_code)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, not printed
        conn.send(("error", (type(exc).__name__, f"unexpected {type(exc).__name__}: {exc}",
                             "rerun with TANDEM_DEBUG=1 and --verbose, and report it", 1)))
    finally:
        conn.close()


def _serve(conn, job: Job) -> None:
    from tandem.engine.session import PairSession

    last = [0.0]

    def beat(what: str, fraction: float) -> None:
        now = time.monotonic()
        if now - last[0] >= BEAT_EVERY:
            last[0] = now
            conn.send(("beat", (what, fraction)))

    with PairSession(job.target, job.draft, job.options, progress=beat) as session:
        for path, text in job.contexts:
            session.add_context_file(path, text)
        tokens = session.prompt_tokens(list(job.messages), raw=job.raw)
        conn.send(("event", LoadedEvent(len(tokens))))
        for ev in session.generate(tokens, job.gen):
            conn.send(("event", ev))


