"""Tests never write into the caller's tandem home: conftest gives every test its own
TANDEM_HOME and fails the run when the real home changed (a suite once left its answers in
the user's history, and the next `make demo` drafted from them)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest


def test_every_test_has_its_own_home(tmp_path_factory):
    home = Path(os.environ["TANDEM_HOME"])
    assert home != conftest.REAL_HOME
    assert str(home).startswith(str(tmp_path_factory.getbasetemp()))


def test_the_session_check_sees_a_change(tmp_path):
    (tmp_path / "history").mkdir()
    (tmp_path / "history" / "a.json").write_text("{}")
    before = conftest.home_snapshot(tmp_path)
    assert conftest.home_changes(before, conftest.home_snapshot(tmp_path)) == []
    (tmp_path / "history" / "b.json").write_text("{}")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_text("x")
    after = conftest.home_snapshot(tmp_path)
    assert conftest.home_changes(before, after) == [os.path.join("history", "b.json"),
                                                    os.path.join("models", "m.gguf")]
    # a fetch of the real pair may add to the store, and to nothing else
    assert conftest.home_changes(before, after, store_fetched=True) == [
        os.path.join("history", "b.json")]


def test_a_run_with_history_on_writes_under_the_tests_home(tiny_models):
    pytest.importorskip("llama_cpp")
    home = Path(os.environ["TANDEM_HOME"])
    real_before = conftest.home_snapshot(conftest.REAL_HOME)
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_HISTORY"}
    res = subprocess.run([sys.executable, "-m", "tandem", "run", "-m", str(tiny_models["target"]),
                          "--strategy", "auto", "-n", "12", "-t", "1", "--raw", "--no-stats",
                          "hello there"], env=env, capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    assert list((home / "history").glob("*.json")), "the answer was not recorded"
    assert conftest.home_changes(real_before, conftest.home_snapshot(conftest.REAL_HOME)) == []
