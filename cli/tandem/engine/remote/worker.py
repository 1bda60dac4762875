"""A pair whose target sits on llama.cpp RPC servers, held by a worker process that the caller
supervises (RemotePair: the PairSession calls run and chat make, over a pipe, and `stream` for
work that needs the session itself: spec-bench's measurements run whole in the worker).

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

Over 400 lines because both ends of one pipe protocol live here (the parent's RemotePair and
the worker's loop): split, each half would only make sense beside the other.
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from tandem.engine.backend.fim import Chunk, FimTokens
from tandem.errors import RemoteError, TandemError, error_name, rebuild_error

if TYPE_CHECKING:  # the worker loads the engine; the parent only names its types
    from tandem.engine.drafting.drafters import DraftParams
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.pair import Event, PairSession, SessionOptions
    from tandem.engine.backend.sequences import Slot

# model loading calls back once per tensor; a heartbeat at most this often
BEAT_EVERY = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker loads: the pair and the session options (with .rpc)."""

    target: Path
    draft: tuple[Path, ...]  # spec-bench compares several drafts; run and chat load one
    options: SessionOptions  # .home: where the worker's files go


class RemotePair:
    """The Pair (engine/pair.py) served by a worker process that holds a PairSession (the
    target on RPC servers). Each call waits at most `stall` seconds for progress; a worker
    that dies or stalls is killed and the call raises RemoteError naming the endpoint(s).
    After that, every call raises it again."""

    tokenizes_aside = False  # one call at a time over the pipe: the scheduler's turn

    def __init__(self, target: Path, draft: Path | Sequence[Path] | None,
                 options: SessionOptions):
        self.options, self.target_path = options, Path(target)
        self.stall = options.rpc_timeout  # seconds without progress: a stalled server
        drafts = () if draft is None else (Path(draft),) if isinstance(draft, (str, Path)) \
            else tuple(Path(p) for p in draft)
        self.draft_path = drafts[0] if drafts else None
        # what callers read of the worker's session, as its latest reply left it
        self._n_ctx, self._cached, self._files = 0, (), ()
        # asked once: the vocabulary does not change
        self._fim: FimTokens | None = None
        self._props: dict | None = None
        self._job = WorkerSpec(self.target_path, drafts, options)
        self._dead: RemoteError | None = None
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter, no inherited state
        self._conn, child = ctx.Pipe(duplex=True)
        log = tempfile.NamedTemporaryFile(prefix="tandem-worker-", suffix=".log", delete=False)
        log.close()
        self._log = log.name
        self._proc = ctx.Process(target=_worker_main, args=(child, self._job, self._log),
                                 daemon=True, name="tandem-rpc-worker")
        self._started = time.time()
        self._proc.start()
        child.close()  # the worker holds the only other end: its death is EOF here
        try:
            self._wait_reply()  # loaded (model loading sends heartbeats)
        except BaseException:
            self.close()
            raise

    # ----- the Pair

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def cached_tokens(self) -> Sequence[int]:
        return self._cached

    @property
    def context_files(self) -> tuple[str, ...]:
        return self._files

    @property
    def fim_tokens(self) -> FimTokens:
        if self._fim is None:
            self._fim = self._call("fim_tokens")
        return self._fim

    def tokenize(self, text: str, add_special: bool = False,
                 parse_special: bool = False) -> list[int]:
        return self._call("tokenize", text, add_special, parse_special)

    def pieces(self, tokens: Sequence[int]) -> list[bytes]:
        return self._call("pieces", list(tokens))

    def props(self) -> dict:
        if self._props is None:
            self._props = self._call("props")
        return self._props

    def template_text(self, messages: Sequence[dict],
                      tools: Sequence[dict] | None = None) -> str:
        return self._call("template_text", list(messages), tools)

    def infill_tokens(self, prefix: str, suffix: str, extra: Sequence[Chunk] = (),
                      prompt: str = "") -> list[int]:
        return self._call("infill_tokens", prefix, suffix, list(extra), prompt)

    def prompt_tokens(self, messages: Sequence[dict], raw: bool = False,
                      tools: Sequence[dict] | None = None) -> list[int]:
        return self._call("prompt_tokens", list(messages), raw, tools)

    def add_context_file(self, path: str | Path, text: str | None = None) -> int:
        return self._call("add_context_file", str(path), text)

    def check_drafter(self, strategy: str, draft: DraftParams | None = None) -> None:
        self._call("check_drafter", strategy, draft)

    def generate(self, prompt: Sequence[int], gen: GenParams, strategy: str | None = None,
                 draft: DraftParams | None = None, record: bool = True,
                 slot: Slot | None = None) -> Iterator[Event]:
        if slot is not None:  # (a remote pair holds one sequence: serve gives it one slot)
            raise ValueError("a pair on RPC servers has no slots")
        self._send(("generate", (list(prompt), gen, strategy, draft, record)))
        yield from self._events(abandon=self._stop_generation)

    def stream(self, func: Callable[..., Iterator[Any]], *args: Any,
               should_stop: Callable[[], bool] | None = None) -> Iterator[Any]:
        """Run `func(session, *args, should_stop=..., tick=...)` in the worker on its loaded
        PairSession and yield what it yields, as it yields it: for work that needs the session
        itself (spec-bench sets context configurations, calibrates and reads logits), which
        cannot cross a pipe. `func` crosses by name: a module-level function, its arguments
        and items picklable. Once `should_stop()` (asked after each item) is true, the
        worker's should_stop() is too; the work ends where it checks it. Each generate()
        event of the session and each tick() is progress for the stall limit. Stopped
        reading early (a second Ctrl-C), the worker is killed: its work may run for minutes."""
        self._send(("stream", (func, args)))
        told = False

        def tell() -> None:  # at once, not after the run in progress: it may be long
            nonlocal told
            if should_stop is not None and not told and should_stop():
                told = True
                self._send(("stop", None))

        def kill() -> None:
            self._proc.kill()
            self._proc.join(5)
            self._dead = RemoteError("the worker holding the remote target was stopped "
                                     "in the middle of a call", None)

        yield from self._events(abandon=kill, between=tell)

    def _events(self, abandon: Callable[[], None],
                between: Callable[[], None] | None = None) -> Iterator[Any]:
        """The worker's events of the call in progress, until its reply; `between` runs while
        waiting and after each event. Left before the reply (the caller stopped reading), the
        call is ended with `abandon`; a TandemError from the worker has already ended it."""
        finished = False
        try:
            while True:
                try:
                    kind, payload = self._receive(between=between)
                except TandemError:
                    finished = True  # the worker's error ended the call (or the worker)
                    raise
                if kind == "event":
                    yield payload
                    if between is not None:
                        between()
                elif kind == "reply":
                    self._state(payload[1])
                    finished = True
                    return
        finally:
            if not finished and self._dead is None:
                abandon()

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        if proc.is_alive() and self._dead is None:
            try:
                self._conn.send(("quit", None))
                proc.join(5)
            except (OSError, ValueError):
                pass
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        self._conn.close()
        if self._dead is not None or proc.exitcode not in (0, None):
            _remove_partial_files(self._job, proc.pid, self._started)
        try:
            os.unlink(self._log)
        except OSError:
            pass
        self._proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- the pipe

    def _call(self, name: str, *args):
        self._send((name, args))
        return self._wait_reply()

    def _send(self, msg) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            self._conn.send(msg)
        except (OSError, ValueError):
            raise self._fail(_how_it_ended(self._proc)) from None

    def _wait_reply(self):
        while True:
            kind, payload = self._receive()
            if kind == "reply":
                value, state = payload
                self._state(state)
                return value

    def _receive(self, between: Callable[[], None] | None = None):
        """The next message that is not a heartbeat (`between()` after each heartbeat);
        RemoteError if none comes in time."""
        if self._dead is not None:
            raise self._dead
        while True:
            if not self._conn.poll(self.stall):
                raise self._fail(f"sent nothing for {self.stall:g} s", stalled=True)
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(2)
                raise self._fail(_how_it_ended(self._proc)) from None
            if kind == "error":
                raise rebuild_error(*payload)  # its class, message, hint and exit code
            if kind != "beat":
                return kind, payload
            if between is not None:
                between()

    def _stop_generation(self) -> None:
        """The caller stopped reading (Ctrl-C, a stop in the chat): the worker finishes the
        step it is in and stops; its events until then are dropped."""
        try:
            self._conn.send(("stop", None))
            while True:
                kind, payload = self._receive()
                if kind == "reply":
                    self._state(payload[1])
                    return
        except RemoteError:
            pass

    def _state(self, state) -> None:
        if state:
            self._n_ctx, self._cached, self._files = state

    def _fail(self, what: str, stalled: bool = False) -> RemoteError:
        self._dead = _failure(self._job, self._proc, self._log, what, stalled)
        return self._dead


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


def _failure(job: WorkerSpec, proc, log_path: str, what: str, stalled: bool = False) -> RemoteError:
    """Which endpoint failed: the ones that no longer answer a handshake (after the worker is
    gone, a healthy server is free again), else all of them."""
    from tandem.engine.remote.rpc import broken

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


def _remove_partial_files(job: WorkerSpec, pid: int | None, started: float) -> None:
    """A worker killed mid-write leaves its temporary file (never a half-written real one):
    remove those it may have made."""
    if pid is None:
        return
    home = job.options.home
    if home is None:  # a session without a home writes no files
        return
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


def _worker_main(conn, job: WorkerSpec, log_path: str) -> None:
    """In the worker process: quiet, no core files, an abort ends it at once."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    os.environ["GGML_NO_BACKTRACE"] = "1"  # ggml would otherwise run gdb on abort
    if job.options.home is not None:
        os.environ["TANDEM_HOME"] = str(job.options.home)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    if not job.options.verbose:
        os.dup2(fd, 2)  # llama.cpp's abort message: read back by the parent
    os.close(fd)
    from tandem.engine.remote.ggml import exit_on_abort

    exit_on_abort()
    try:
        _serve(conn, job)
    except (EOFError, OSError):
        pass  # the parent went away
    finally:
        conn.close()


def _error(exc: BaseException) -> tuple:
    if isinstance(exc, TandemError):
        return ("error", (error_name(exc), exc.message, exc.hint, exc.exit_code))
    return ("error", (type(exc).__name__, f"unexpected {type(exc).__name__}: {exc}",
                      "rerun with TANDEM_DEBUG=1 and --verbose, and report it", 1))


def _serve(conn, job: WorkerSpec) -> None:
    """Load the pair, then answer calls until "quit" (or the parent's end of the pipe)."""
    from tandem.engine.pair import PairSession

    last = [0.0]

    def beat(what: str, fraction: float) -> None:
        now = time.monotonic()
        if now - last[0] >= BEAT_EVERY:
            last[0] = now
            conn.send(("beat", (what, fraction)))

    try:
        session = PairSession(job.target, job.draft, job.options, progress=beat)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, never printed
        conn.send(_error(exc))
        return

    def state() -> tuple:  # what RemotePair's properties read
        return (session.n_ctx, tuple(session.cached_tokens), session.context_files)

    # the calls RemotePair makes, by name; generate and stream send their events themselves
    calls: dict[str, Callable[..., Any]] = {
        "generate": partial(_generate, conn, session),
        "stream": partial(_stream, conn, session, beat),
        "tokenize": session.tokenize,
        "pieces": session.pieces,
        "props": session.props,
        "fim_tokens": lambda: session.fim_tokens,
        "template_text": session.template_text,
        "infill_tokens": session.infill_tokens,
        "prompt_tokens": session.prompt_tokens,
        "add_context_file": session.add_context_file,
        "check_drafter": session.check_drafter,
    }
    with session:
        conn.send(("reply", (None, state())))
        while True:
            name, args = conn.recv()
            if name == "quit":
                return
            if name == "stop":
                continue  # it came after its generation ended: that one has its reply
            try:
                call = calls.get(name)
                if call is None:
                    raise ValueError(f"unknown call {name!r}")
                value = call(*args)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                conn.send(_error(exc))
                continue
            conn.send(("reply", (value, state())))


def _stream(conn, session: PairSession, beat, func, args) -> None:
    """RemotePair.stream in the worker: func's items go out as events; a "stop" from the
    parent (the only message that can come meanwhile) turns should_stop() true. Every
    generate() event is progress already (the session was made with `beat`)."""
    stopped = [False]

    def should_stop() -> bool:
        if not stopped[0] and conn.poll():
            conn.recv()
            stopped[0] = True
        return stopped[0]

    for item in func(session, *args, should_stop=should_stop, tick=lambda: beat("work", 0.0)):
        conn.send(("event", item))
        should_stop()


def _generate(conn, session: PairSession, prompt, gen, strategy, draft, record) -> None:
    inner = session.generate(prompt, gen, strategy, draft, record=record)
    try:
        for ev in inner:
            conn.send(("event", ev))
            if conn.poll():  # the only message that can come now: stop
                conn.recv()
                break
    finally:
        inner.close()
