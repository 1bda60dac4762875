"""Shared pytest fixtures. Keep this file generic: feature-specific helpers live in their tests.

Every test gets its own TANDEM_HOME (a temporary directory), and the run fails if the real
home (the caller's TANDEM_HOME, else the default one) changed meanwhile: a test suite once left
its answers in the user's history, and the next `make demo` drafted from them.
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


def home_snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and mtime (ns); no hashing: a home may hold
    gigabytes of models, and any write changes one of the two."""
    out: dict[str, tuple[int, int]] = {}
    if not root.exists():
        return out
    if not root.is_dir():
        st = root.stat()
        return {".": (st.st_size, st.st_mtime_ns)}
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            try:
                st = p.lstat()
            except OSError:
                continue
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


# the model store's own files: the only part of the real home a fetch of the real pair (the
# `real_pair` fixture, when the pair is not there yet) may change
STORE_PARTS = ("models", "registry.json", "locks", "tmp")
REAL_HOME = _caller_home()
_REAL_HOME_BEFORE: dict[str, tuple[int, int]] = {}
_REAL_PAIR_FETCHED: list[bool] = []


def home_changes(before: dict, after: dict, store_fetched: bool = False) -> list[str]:
    """File names that appeared, vanished or changed between two snapshots (store files left
    out when the real pair was fetched into the store on purpose)."""
    names = sorted(set(before) | set(after))
    changed = [n for n in names if before.get(n) != after.get(n)]
    if store_fetched:
        changed = [n for n in changed if n.split(os.sep, 1)[0] not in STORE_PARTS]
    return changed


def pytest_sessionstart(session):
    _REAL_HOME_BEFORE.update(home_snapshot(REAL_HOME))


def pytest_sessionfinish(session, exitstatus):
    changed = home_changes(_REAL_HOME_BEFORE, home_snapshot(REAL_HOME), bool(_REAL_PAIR_FETCHED))
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = (f"the test run changed the real tandem home {REAL_HOME}: "
                + ", ".join(changed[:10]) + (" ..." if len(changed) > 10 else ""))
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
