"""Shared pytest fixtures. Keep this file generic: feature-specific helpers live in their tests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# scripts/ is not a package; its generators are imported as plain modules by fixtures.
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(autouse=True)
def _no_hub_access(monkeypatch, tmp_path_factory):
    """Tests never reach the real Hugging Face hub nor touch the user's HF cache: offline
    mode with a throwaway HF_HOME (tests of the hub source point HF_ENDPOINT at a local
    fake hub and turn offline mode off themselves)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)


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
    return store.ensure(pair.target), store.ensure(pair.draft)
