"""Shared pytest fixtures. Keep this file generic: feature-specific helpers live in their tests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# scripts/ is not a package; its generators are imported as plain modules by fixtures.
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny synthetic GGUFs: target, draft, draft_weak (noisier) and mismatch (other vocab)."""
    from make_tiny_models import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny-models"))
