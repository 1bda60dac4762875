"""Shared pytest fixtures. Keep this file generic: feature-specific helpers live in their tests.

Every test gets its own TANDEM_HOME (a temporary directory), and the run fails if a test, or
a Python process a test started, wrote into the real home (the caller's TANDEM_HOME, else the
default one): a test suite once left its answers in the user's history, and the next `make
demo` drafted from them. Writes by other processes (a user's tandem meanwhile) do not count.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# scripts/ is on the path through pyproject.toml's pytest `pythonpath`: its generators
# (make_tiny_models...) are imported as plain modules by fixtures.


@pytest.fixture(autouse=True)
def _no_hub_access(monkeypatch, tmp_path_factory):
    """Tests never reach the real Hugging Face hub nor touch the user's HF cache: offline
    mode with a throwaway HF_HOME (tests of the hub source point HF_ENDPOINT at a local
    fake hub and turn offline mode off themselves)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)


def _caller_home() -> Path:
    """The home tandem would use for the caller (their TANDEM_HOME, else the default)."""
    from tandem.models.store import tandem_home

    return tandem_home()


# The guard: an audit hook records every write under the real home made by this process,
# and by the Python processes its tests start (home_guard/sitecustomize.py, on their
# PYTHONPATH, appends theirs to a log). Writes by processes the suite did not start (a
# user's tandem running beside `make test`) are not seen, so never blamed on the suite.
GUARD_DIR = Path(__file__).resolve().parent / "home_guard"
# the model store's own files: the only part of the real home a fetch of the real pair (the
# `real_pair` fixture, when the pair is not there yet) may change ("." : creating the home)
STORE_PARTS = ("models", "registry.json", "locks", "tmp", ".")
REAL_HOME = _caller_home()
_REAL_PAIR_FETCHED: list[bool] = []
_WRITES: list[tuple[str, str, str, str]] = []  # (test, event, path under the home, process)
_CURRENT_TEST = ["(outside any test)"]
_GUARD_LOG: list[Path] = []


def guard_env(real_home: Path, log: Path) -> dict[str, str]:
    """The environment that makes a Python subprocess record its writes under `real_home`
    into `log` (the session sets it in os.environ for every test's subprocesses)."""
    from home_guard import home_audit

    path = os.environ.get("PYTHONPATH", "")
    return {home_audit.ENV_HOME: str(real_home), home_audit.ENV_LOG: str(log),
            "PYTHONPATH": os.pathsep.join(p for p in (str(GUARD_DIR), path) if p)}


def logged_writes(log: Path) -> list[tuple[str, str, str, str]]:
    """The writes the guarded subprocesses appended to `log`."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    return [tuple((line.split("\t") + ["", "", "", ""])[:4]) for line in lines if line]


def blamed_writes(writes, store_fetched: bool = False) -> list[tuple[str, str, str, str]]:
    """The writes that fail the run, the first of each test's to each path: all of them,
    but the store's own files when the real pair was fetched into the store on purpose."""
    if store_fetched:
        writes = [w for w in writes if w[2].split(os.sep, 1)[0] not in STORE_PARTS]
    first = {}
    for w in writes:
        first.setdefault((w[0], w[2]), w)
    return list(first.values())


def pytest_sessionstart(session):
    import tempfile

    from home_guard import home_audit

    log = Path(tempfile.mkdtemp(prefix="tandem-home-guard-")) / "writes.log"
    _GUARD_LOG.append(log)
    os.environ.update(guard_env(REAL_HOME, log))
    sys.addaudithook(home_audit.HomeAudit(str(REAL_HOME), lambda event, rel: _WRITES.append(
        (_CURRENT_TEST[0], event, rel, f"pid {os.getpid()} (the test session)"))))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Writes (and those of the subprocesses a test starts) are named by the test."""
    from home_guard import home_audit

    _CURRENT_TEST[0] = item.nodeid
    os.environ[home_audit.ENV_TEST] = item.nodeid
    yield
    _CURRENT_TEST[0] = "(outside any test)"
    os.environ.pop(home_audit.ENV_TEST, None)


def pytest_sessionfinish(session, exitstatus):
    import shutil

    writes = _WRITES + (logged_writes(_GUARD_LOG[0]) if _GUARD_LOG else [])
    blamed = blamed_writes(writes, bool(_REAL_PAIR_FETCHED))
    if _GUARD_LOG:
        shutil.rmtree(_GUARD_LOG[0].parent, ignore_errors=True)
    if blamed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        shown = [f"{rel} ({event} by {test}, {proc})" for test, event, rel, proc in blamed[:10]]
        text = (f"the test run wrote into the real tandem home {REAL_HOME}: "
                + "; ".join(shown) + (" ..." if len(blamed) > 10 else ""))
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line("ERROR: " + text, red=True)
        else:
            print("ERROR: " + text, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _session_tandem_home(tmp_path_factory):
    """Module- and session-scoped fixtures are set up before a test's own home exists: they
    get this one (a module-scoped real-pair session once wrote its history into the real
    home, between two tests' monkeypatched homes)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_HOME", str(tmp_path_factory.mktemp("tandem-session-home")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _own_tandem_home(monkeypatch, tmp_path_factory):
    """Each test writes (history, costs, tuned files, the store) into its own home, never
    the caller's: the subprocesses it starts inherit TANDEM_HOME too."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path_factory.mktemp("tandem-home")))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny synthetic GGUFs: target, draft, draft_weak (noisier) and mismatch (other vocab)."""
    from make_tiny_models import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny-models"))


def _real_models_home() -> Path:
    """Where the real default pair lives: TANDEM_REAL_MODELS_HOME, else the user's store.

    Read once at import, before any test points TANDEM_HOME at a temporary directory.
    """
    import os

    from tandem.models.store import tandem_home

    explicit = os.environ.get("TANDEM_REAL_MODELS_HOME")
    return Path(explicit) if explicit else tandem_home()


REAL_MODELS_HOME = _real_models_home()


@pytest.fixture(scope="session")
def real_pair() -> tuple[Path, Path]:
    """The real default pair (Qwen2.5-Coder 1.5B + 0.5B Q4_K_M), fetched once via the store.

    Set TANDEM_SKIP_REAL=1 to skip the tests that need it (no download).
    """
    import os

    if os.environ.get("TANDEM_SKIP_REAL") == "1":
        pytest.skip("TANDEM_SKIP_REAL=1")
    from tandem.models.catalog import get_pair
    from tandem.models.store import Store

    store = Store(REAL_MODELS_HOME)
    pair = get_pair()
    if not (store.is_present(pair.target) and store.is_present(pair.draft)):
        # `make test` on a fresh clone fetches the pair once, into the store only
        _REAL_PAIR_FETCHED.append(True)
    return store.ensure(pair.target), store.ensure(pair.draft)
