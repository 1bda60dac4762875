"""Tests never write into the caller's tandem home: conftest gives every test its own
TANDEM_HOME and fails the run when a test, or a Python process a test started, wrote into
the real home (a suite once left its answers in the user's history, and the next `make demo`
drafted from them). Writes by processes the suite did not start (a user's tandem running
beside `make test`) do not fail it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import conftest
import pytest
from home_guard import home_audit

TESTS = Path(__file__).resolve().parent


def test_every_test_has_its_own_home(tmp_path_factory):
    home = Path(os.environ["TANDEM_HOME"])
    assert home != conftest.REAL_HOME
    assert str(home).startswith(str(tmp_path_factory.getbasetemp()))


def test_the_hook_sees_writes_under_the_home_and_nothing_else(tmp_path):
    home, other = tmp_path / "home", tmp_path / "home2"  # a sibling sharing its prefix
    (home / "history").mkdir(parents=True)
    (home / "history" / "old.json").write_text("{}")
    other.mkdir()
    seen: list[tuple[str, str]] = []
    on = [True]  # an audit hook cannot be removed: it goes quiet after this test
    sys.addaudithook(home_audit.HomeAudit(str(home), lambda e, r: on[0] and seen.append((e, r))))
    try:
        (home / "history" / "old.json").read_text()  # reads are not writes
        (other / "x.json").write_text("{}")
        os.symlink(home / "history" / "old.json", other / "link")  # a link to it, elsewhere
        (home / "costs").mkdir()
        (home / "costs" / "a.json").write_text("{}")
        fd, tmp = tempfile.mkstemp(dir=home / "costs")
        os.close(fd)
        os.replace(tmp, home / "costs" / "b.json")
        (home / "history" / "old.json").unlink()
        shutil.rmtree(home / "costs")
    finally:
        on[0] = False
    names = [r for _, r in seen]
    costs, tmp_name = os.path.join("costs", ""), os.path.join("costs", Path(tmp).name)
    assert ("os.mkdir", "costs") in seen and ("open", costs + "a.json") in seen
    assert ("open", tmp_name) in seen and ("os.rename", costs + "b.json") in seen
    assert ("os.remove", os.path.join("history", "old.json")) in seen
    assert ("shutil.rmtree", "costs") in seen
    assert not any(n.startswith(("..", os.sep)) or "home2" in n for n in names), names
    assert sum(n == os.path.join("history", "old.json") for n in names) == 1  # the unlink


def test_only_a_real_pair_fetch_excuses_the_store():
    writes = [("t::a", "open", os.path.join("history", "b.json"), "p"),
              ("t::b", "open", os.path.join("models", "m.gguf"), "p"),
              ("t::b", "os.mkdir", ".", "p")]
    assert conftest.blamed_writes(writes) == writes
    assert conftest.blamed_writes(writes, store_fetched=True) == writes[:1]


def test_a_run_with_history_on_writes_under_the_tests_home(tiny_models, request):
    pytest.importorskip("llama_cpp")
    home = Path(os.environ["TANDEM_HOME"])
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_HISTORY"}
    res = subprocess.run([sys.executable, "-m", "tandem", "run", "-m", str(tiny_models["target"]),
                          "--strategy", "auto", "-n", "12", "-t", "1", "--raw", "--no-stats",
                          "hello there"], env=env, capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    assert list((home / "history").glob("*.json")), "the answer was not recorded"
    # the subprocess was guarded (the session's PYTHONPATH) and wrote nothing under the real home
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(conftest.GUARD_DIR)
    mine = [w for w in conftest.logged_writes(conftest._GUARD_LOG[0])
            if w[0] == request.node.nodeid]
    assert mine == []


# ------------------------------------------------------------ a whole session, as `make test`


def _session(tmp_path: Path, real_home: Path, test_code: str) -> subprocess.CompletedProcess:
    """A pytest session of `test_code` under this suite's conftest and guard, whose caller's
    real home is `real_home`; its output and exit code."""
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    shutil.copytree(TESTS / "home_guard", suite / "home_guard",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_inner.py").write_text(textwrap.dedent(test_code))
    env = {**os.environ, "TANDEM_HOME": str(real_home)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'basetemp'}", str(suite)], cwd=suite,
                          env=env, capture_output=True, text=True, timeout=300)


WRITER = """
import sys, time
from pathlib import Path
home, stop = Path(sys.argv[1]), Path(sys.argv[2])
for part in ("costs", "history", "locks"):
    (home / part).mkdir(parents=True, exist_ok=True)
n = 0
while not stop.exists():
    n += 1
    (home / "history" / "other.json").write_text(str(n))
    (home / "costs" / "pair.knowledge.json").write_text(str(n))
    (home / "locks" / "pair.lock").write_text("")
    time.sleep(0.02)
"""


def test_writes_by_another_process_meanwhile_do_not_fail_the_run(tmp_path):
    """A user's tandem writing its costs, history and locks while the suite runs (issue 51:
    `1346 passed` and then exit 1 for files the suite never wrote)."""
    real = tmp_path / "real-home"
    stop = tmp_path / "stop"
    # started here, outside the session and without the guard: like a process of the user's
    env = {k: v for k, v in os.environ.items()
           if k not in (home_audit.ENV_HOME, home_audit.ENV_LOG, "PYTHONPATH")}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(real), str(stop)], env=env)
    try:
        res = _session(tmp_path, real, """
            import time
            import conftest

            def test_the_other_process_writes_during_this_test():
                f = conftest.REAL_HOME / "history" / "other.json"
                deadline = time.monotonic() + 60
                while not f.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                first = f.read_text()
                while f.read_text() == first and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert f.read_text() != first
        """)
    finally:
        stop.write_text("")
        writer.wait(timeout=30)
    assert (real / "costs" / "pair.knowledge.json").exists()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed" in res.stdout and "real tandem home" not in res.stdout + res.stderr


def test_a_test_writing_into_the_real_home_fails_the_run(tmp_path):
    """In the session's process and in a Python subprocess a test starts: both are named,
    with the test that wrote."""
    real = tmp_path / "real-home"
    res = _session(tmp_path, real, """
        import subprocess, sys
        import conftest

        def test_writes_here():
            (conftest.REAL_HOME / "history").mkdir(parents=True, exist_ok=True)
            (conftest.REAL_HOME / "history" / "mine.json").write_text("{}")

        def test_writes_in_a_subprocess():
            code = ("import sys, pathlib; p = pathlib.Path(sys.argv[1]) / 'costs'; "
                    "p.mkdir(parents=True, exist_ok=True); (p / 'x.json').write_text('1')")
            subprocess.run([sys.executable, "-c", code, str(conftest.REAL_HOME)], check=True)

        def test_reads_only():
            assert not (conftest.REAL_HOME / "nothing").exists()
    """)
    out = res.stdout + res.stderr
    assert res.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "3 passed" in res.stdout
    assert "ERROR: the test run wrote into the real tandem home" in out
    assert f"{os.path.join('history', 'mine.json')} (open by test_inner.py::test_writes_here" in out
    assert (f"{os.path.join('costs', 'x.json')} (open by test_inner.py::"
            "test_writes_in_a_subprocess") in out
    assert "test_reads_only" not in out.split("ERROR:")[-1]
