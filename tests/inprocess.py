"""`tandem ARGS` through the app's main() in the test's own process: what a subprocess of
`python -m tandem` returns (exit code, stdout, stderr as bytes), without starting an
interpreter. For commands that load no model (refusals before the load, `history`,
`pairs`): a model load fails the test. The real entry point keeps subprocess tests of its
own (tests/test_bad_inputs.py's smoke cases)."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest


class _Kept(io.BytesIO):
    """What a stream wrote, kept after the wrapper main() put around it is gone."""

    def close(self) -> None:
        pass


def run_main(argv: list, *, home: Path, cwd: Path | None = None, stdin: bytes = b"",
             env: dict | None = None) -> subprocess.CompletedProcess:
    """main() with its own argv (bytes decoded as the interpreter does), stdin, stdout,
    stderr, environment (TANDEM_HOME=home, NO_COLOR, no FORCE_COLOR, `env` on top: a None
    value unsets) and working directory, all restored after (sys, the environment, the directory, the SIGTERM handler)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _run_main(argv, home, cwd, stdin, env, monkeypatch)


def _run_main(argv, home, cwd, stdin, env, monkeypatch) -> subprocess.CompletedProcess:
    from tandem.commands.app import main
    from tandem.engine.backend import llama

    loaded: list = []

    def no_load(self, path, *a, **k):
        loaded.append(path)
        raise AssertionError(f"a model loaded in process: {path}")

    monkeypatch.setattr(llama.Model, "__init__", no_load)
    monkeypatch.setenv("TANDEM_HOME", str(home))
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    for key, value in (env or {}).items():  # None: unset
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    argv = [os.fsdecode(a) for a in argv]
    out, err = _Kept(), _Kept()
    saved = (sys.argv, sys.stdin, sys.stdout, sys.stderr, warnings.showwarning,
             signal.getsignal(signal.SIGTERM))
    sys.argv = ["tandem", *argv]
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        (sys.argv, sys.stdin, sys.stdout, sys.stderr, warnings.showwarning, term) = saved
        signal.signal(signal.SIGTERM, term)
    assert loaded == [], f"{argv} loaded a model: run it as a subprocess"
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
