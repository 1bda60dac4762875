"""Files tandem reads back are untrusted input: a history or cost file damaged by hand, by
another version or by a disk gives one warning and a working run, is rewritten clean (never
carried forward), and stray temporary files of killed processes are swept. The CLI cases run
the real entry point on the tiny models (a subprocess each; `tandem history`, which loads
no model, through main() in this process)."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from tandem.engine.tuning import costs as costs_mod  # noqa: E402
from tandem.engine.backend.context_params import ContextParams  # noqa: E402
from tandem.engine.tuning.costs import CostModel  # noqa: E402
from tandem.engine.drafting.history import HistoryStore, read_entries, valid_entry  # noqa: E402
from tandem.errors import TandemWarning  # noqa: E402
from tandem.fsutil import atomic_write_text, sweep_stale_tmp, tmp_name  # noqa: E402
from tandem.statefile import FUTURE_SLACK_S  # noqa: E402

GOOD = {"time": 1_700_000_000.0, "tokens": list(range(20, 40))}


def _cli(args, home: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_HOME": str(home), "NO_COLOR": "1"}
    env.pop("TANDEM_HISTORY", None)
    return subprocess.run([sys.executable, "-m", "tandem", *args], env=env, capture_output=True,
                          text=True, timeout=120, **kw)


def _in_process(args, home: Path) -> subprocess.CompletedProcess:
    """_cli through main() in this process (tests/inprocess.py): for commands that load no
    model."""
    from inprocess import run_main

    res = run_main(args, home=home, env={"TANDEM_HISTORY": None})
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(),
                                       res.stderr.decode())


def _warnings(err: str, about: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("Warning: ") and about in line]


def _clean(err: str) -> None:
    assert "Traceback" not in err and "Error:" not in err, err


# -------------------------------------------------------------------------- history

BAD_HISTORIES = {
    "token-over-int32": {"entries": [GOOD, {"time": 1.7e9, "tokens": [1, 2, (1 << 31) + 5]}]},
    "token-outside-vocab": {"entries": [GOOD, {"time": 1.7e9, "tokens": [1, 2, 10_000_000]}]},
    "token-negative": {"entries": [GOOD, {"time": 1.7e9, "tokens": [1, -1, 3]}]},
    "token-bool-float": {"entries": [GOOD, {"time": 1.7e9, "tokens": [1, True, 2.5]}]},
    "time-string": {"entries": [GOOD, {"time": "yesterday", "tokens": [1, 2, 3]}]},
    "time-nan": {"entries": [GOOD, {"time": float("nan"), "tokens": [1, 2, 3]}]},
    "time-1e300": {"entries": [GOOD, {"time": 1e300, "tokens": [1, 2, 3]}]},
    "time-list": {"entries": [GOOD, {"time": [1], "tokens": [1, 2, 3]}]},
    "entry-not-a-dict": {"entries": [GOOD, 7]},
    "entries-an-int": {"entries": 5},
    "not-json": None,
}


def _write_history(home: Path, target: Path, content) -> Path:
    path = HistoryStore(home, target).path
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "{not json" if content is None else json.dumps({"format": 1, **content})
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(BAD_HISTORIES), ids=list(BAD_HISTORIES))
def test_a_damaged_history_is_dropped_with_one_warning_and_rewritten(case, tiny_models,
                                                                     tmp_path):
    home, target = tmp_path / "home", tiny_models["target"]
    path = _write_history(home, target, BAD_HISTORIES[case])
    # `tandem history` works on the damaged file and never prints NaN (it loads no model)
    shown = _in_process(["history", "show", "--json"], home)
    assert shown.returncode == 0, shown.stderr
    _clean(shown.stderr)
    assert "NaN" not in shown.stdout and "Infinity" not in shown.stdout
    listed = json.loads(shown.stdout)["histories"]
    # `history` loads no model: ids inside int32 but outside the vocabulary show as entries
    in_vocab_only = case == "token-outside-vocab"
    assert listed[0]["entries"] == {"entries-an-int": 0, "not-json": 0}.get(
        case, 2 if in_vocab_only else 1)
    assert len(_warnings(shown.stderr, "answer history")) == (0 if in_vocab_only else 1), \
        shown.stderr
    assert _in_process(["history"], home).returncode == 0
    # a run drafts from what is valid, says so once and rewrites the file clean
    res = _cli(["run", "-m", str(target), "--strategy", "auto", "-n", "12", "-t", "1", "--raw",
                "--no-stats", "hello there"], home)
    assert res.returncode == 0, res.stderr
    _clean(res.stderr)
    assert len(_warnings(res.stderr, "answer history")) == 1, res.stderr
    data = json.loads(path.read_text())
    assert isinstance(data["entries"], list)
    from tandem.engine.backend.llama import Model

    n_vocab = Model(target).n_vocab
    assert all(valid_entry(e, n_vocab) for e in data["entries"]), data
    if case not in ("entries-an-int", "not-json"):
        assert data["entries"][0]["tokens"] == GOOD["tokens"]  # nothing valid is lost
    # and the next run is quiet
    again = _cli(["run", "-m", str(target), "--strategy", "auto", "-n", "4", "-t", "1", "--raw",
                  "--no-stats", "hi"], home)
    assert again.returncode == 0 and not _warnings(again.stderr, "answer history"), again.stderr


def test_history_entries_are_checked_against_the_vocabulary(tmp_path):
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"entries": [GOOD, {"time": 1.7e9, "tokens": [5, 99]}]}))
    assert read_entries(path, n_vocab=100)[1] == 0
    entries, dropped, broken = read_entries(path, n_vocab=50)
    assert (len(entries), dropped, broken) == (1, 1, False)
    assert not valid_entry({"time": time.time() + 7 * 86400, "tokens": [1]})  # from the future
    assert not valid_entry({"time": 1.7e9, "tokens": []})


def test_an_in_process_store_warns_once_and_keeps_what_is_valid(tmp_path, tiny_models):
    home = tmp_path / "home"
    path = _write_history(home, tiny_models["target"], BAD_HISTORIES["token-negative"])
    store = HistoryStore(home, tiny_models["target"], n_vocab=1000)
    with pytest.warns(TandemWarning, match="1 invalid entry"):
        assert store.load() == [GOOD["tokens"]]
    assert store.append(list(range(50, 60)))
    assert [e["tokens"] for e in json.loads(path.read_text())["entries"]] == [
        GOOD["tokens"], list(range(50, 60))]


# ---------------------------------------------------------------------------- costs

_NOW = time.time()
BAD_COSTS = {
    "when-1e300": {"verify": {"1": 0.01}, "when": 1e300},
    "when-nan": {"verify": {"1": 0.01}, "when": float("nan")},
    "when-future": {"verify": {"1": 0.01}, "when": _NOW + 30 * 86400},
    "when-string": {"verify": {"1": 0.01}, "when": "today"},
    "key-negative": {"verify": {"1": 0.01, "-3": 0.001}, "when": _NOW},
    "key-zero": {"verify": {"1": 0.01, "0": 0.001}, "when": _NOW},
    "key-huge": {"verify": {"1": 0.01, "99999": 0.001}, "when": _NOW},
    "key-text": {"verify": {"1": 0.01, "two": 0.001}, "when": _NOW},
    "cost-zero": {"verify": {"1": 0.0}, "when": _NOW},
    "cost-inf": {"verify": {"1": float("inf")}, "when": _NOW},
    "cost-negative": {"verify": {"1": 0.01, "2": -0.5}, "when": _NOW},
    "draft-nan": {"verify": {"1": 0.01}, "draft_token": float("nan"), "when": _NOW},
    "busy-2": {"verify": {"1": 0.01}, "when": _NOW, "busy": 2.0},
    "verify-a-list": {"verify": [1, 2], "when": _NOW},
    "not-a-dict": [],
}


@pytest.mark.parametrize("case", list(BAD_COSTS), ids=list(BAD_COSTS))
def test_a_damaged_cost_file_is_ignored_with_a_warning(case, tmp_path):
    path = tmp_path / "costs" / "k.json"
    path.parent.mkdir()
    path.write_text(json.dumps(BAD_COSTS[case]))
    with pytest.warns(TandemWarning, match="ignored the cached costs"):
        assert CostModel.load(path) is None
    assert not path.exists()  # never read again; the next calibration takes its place


def test_a_valid_cost_file_still_loads(tmp_path):
    path = tmp_path / "k.json"
    CostModel({1: 0.01, 4: 0.02, 65: 0.3}, 0.003, "calibrated", _NOW, 0.1).save(path)
    loaded = CostModel.load(path)
    assert loaded.verify == {1: 0.01, 4: 0.02, 65: 0.3} and loaded.busy == 0.1
    assert loaded.describe().startswith("costs: calibrated")


def test_a_session_recalibrates_over_a_damaged_cost_file(tiny_models, tmp_path, monkeypatch):
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.0)  # quiet machine
    opts = SessionOptions(strategy="auto", target_ctx=ContextParams(n_ctx=256, n_threads=1),
                          home=tmp_path)
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as s:
        path = s.costs_path()
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"verify": {"1": 0.01, "0": 1e-9, "99999": 1e-9},
                                    "draft_token": 0.001, "when": 1e300}))
        with pytest.warns(TandemWarning, match="ignored the cached costs"):
            costs = s.costs()
        assert costs.source == "calibrated" and 0 < costs.when <= time.time()
        assert all(1 <= n <= 65 for n in costs.verify)
        costs.describe()  # 1e300 once raised OverflowError here
    saved = CostModel.load(path)  # replaced on save
    assert saved is not None and saved.when <= time.time()


# ------------------------------------------------------------------ stray temporary files


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporary_files_carry_the_pid_and_dead_ones_are_swept(tmp_path):
    target = tmp_path / "x.json"
    assert tmp_name(target).name == f"x.json.{os.getpid()}.tmp"
    atomic_write_text(target, "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    dead = _dead_pid()
    stale = [tmp_path / f"a.json.{dead}.tmp", tmp_path / f".registry.{dead}.k3j_x9.tmp"]
    mine = [tmp_path / f"b.json.{os.getpid()}.tmp", tmp_path / "new-legacy.tmp"]
    old_legacy = tmp_path / "old.tmp"
    for p in stale + mine + [old_legacy]:
        p.write_text("half")
    os.utime(old_legacy, (time.time() - 7200, time.time() - 7200))
    assert sweep_stale_tmp(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["x.json"] + [p.name for p in mine])


def test_stores_sweep_what_killed_processes_left(tiny_models, tmp_path):
    """SIGKILL mid-write leaves `<file>.<pid>.tmp`: the next run removes it."""
    home = tmp_path / "home"
    dead = _dead_pid()
    hist = HistoryStore(home, tiny_models["target"]).path
    for folder in (hist.parent, home / "costs"):
        folder.mkdir(parents=True)
        (folder / f"x.json.{dead}.tmp").write_text("half")
    (home / f".registry.{dead}.abcdefgh.tmp").write_text("half")
    res = _cli(["run", "-m", str(tiny_models["target"]), "--strategy", "auto", "-n", "12", "-t",
                "1", "--raw", "--no-stats", "hello there"], home)
    assert res.returncode == 0, res.stderr
    left = [str(p) for p in home.rglob("*.tmp")]
    assert not [p for p in left if "history" in p or "costs" in p], left
    from tandem.models.catalog import ModelSpec
    from tandem.models.store import Store
    from tandem.models.transfer import FetchResult

    Store(home)._register(ModelSpec(name="m", repo="org/r", filename="m.gguf"),
                          FetchResult(size=1, sha256="0" * 64, source="local"))
    assert list(home.rglob("*.tmp")) == []


def test_a_damaged_history_on_a_read_only_home_is_ignored(tiny_models, tmp_path):
    """The bad entries cannot be rewritten away: they are still never used, and said so."""
    home, target = tmp_path / "home", tiny_models["target"]
    path = _write_history(home, target, BAD_HISTORIES["token-over-int32"])
    before = path.read_bytes()
    faults = Path(__file__).with_name("cli_faults.py")
    env = {**os.environ, "TANDEM_HOME": str(home), "NO_COLOR": "1",
           "TANDEM_TEST_READONLY": str(home)}
    env.pop("TANDEM_HISTORY", None)
    res = subprocess.run([sys.executable, str(faults), "run", "-m", str(target), "--strategy",
                          "auto", "-n", "12", "-t", "1", "--raw", "--no-stats", "hello there"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    _clean(res.stderr)
    warned = _warnings(res.stderr, "answer history")
    assert len(warned) == 1 and "cannot rewrite it" in warned[0], res.stderr
    assert path.read_bytes() == before


def test_state_files_that_are_fifos_never_block(tiny_models, tmp_path):
    """A history, cost or registry file replaced by a named pipe would block every read."""
    home, target = tmp_path / "home", tiny_models["target"]
    hist = HistoryStore(home, target).path
    hist.parent.mkdir(parents=True)
    os.mkfifo(hist)
    os.mkfifo(home / "registry.json")
    (home / "costs").mkdir()
    os.mkfifo(home / "costs" / "k.json")
    assert CostModel.load(home / "costs" / "k.json") is None
    res = _cli(["run", "-m", str(target), "--strategy", "auto", "-n", "12", "-t", "1", "--raw",
                "--no-stats", "hello there"], home)
    assert res.returncode == 0, res.stderr
    _clean(res.stderr)
    assert hist.is_file() and json.loads(hist.read_text())["entries"]  # replaced, recorded
    res = _cli(["pairs"], home)
    assert res.returncode == 0 and "registry.json.bad" in res.stderr, res.stderr


# ------------------------------------------------- one reader, one clock rule, one policy

# statefile's one warning: `ignored WHAT PATH (REASON); WHAT WAS DONE`
SHAPE = re.compile(r"^ignored (?P<what>.+?) (?P<path>/\S+) \((?P<why>.+)\); (?P<done>.+)$")
_FUTURE = time.time() + 2 * FUTURE_SLACK_S  # beyond the one clock rule's tolerance
_FUTURE_ISO = datetime.datetime.fromtimestamp(_FUTURE, datetime.timezone.utc).isoformat()
DAMAGED = {  # kind -> (corrupt content, future-dated content)
    "costs": ("{\"verify\": {\"1\": 0.01", {"verify": {"1": 0.01}, "when": _FUTURE}),
    "knowledge": ("[1, 2", {"version": 1, "when": _FUTURE, "sources": [], "noise": {}}),
    "history": ("{not json", {"format": 1, "entries": [{"time": _FUTURE, "tokens": [1, 2, 3]}]}),
    "registry": ("{\"models\": 7}", {"version": 1, "models": {"x": {
        "path": "models/x.gguf", "size": 1, "sha256": "0" * 64, "when": _FUTURE_ISO}}}),
}


def _session(tiny_models, home):
    from tandem.engine.pair import PairSession, SessionOptions

    opts = SessionOptions(strategy="auto", target_ctx=ContextParams(n_ctx=256, n_threads=1),
                          home=home, history=True)
    return PairSession(tiny_models["target"], None, opts)


def _a_run(tiny_models, home) -> int:
    """One request through the pair, as `tandem run` makes it: the tokens it generated."""
    from tandem.engine.loop.events import DoneEvent
    from tandem.engine.loop.speculative import GenParams

    with _session(tiny_models, home) as s:
        events = list(s.generate([1, 20, 21, 22], GenParams(max_tokens=6, ignore_eos=True)))
    return [ev for ev in events if isinstance(ev, DoneEvent)][0].stats.n_generated


def _state_path(kind: str, tiny_models, home) -> Path:
    if kind == "registry":
        return home / "registry.json"
    if kind == "history":
        return HistoryStore(home, tiny_models["target"]).path
    with _session(tiny_models, home) as s:
        list(s.generate([1, 20, 21, 22], _gen_one()))  # the configuration's cost key is set
        return s.costs_path() if kind == "costs" else s.knowledge_path()


def _gen_one():
    from tandem.engine.loop.speculative import GenParams

    return GenParams(max_tokens=1, ignore_eos=True)


@pytest.mark.parametrize("damage", ["corrupt", "future"])
@pytest.mark.parametrize("kind", list(DAMAGED))
def test_a_damaged_state_file_is_said_once_in_one_shape_and_the_run_goes_on(
        kind, damage, tiny_models, tmp_path, monkeypatch):
    """Each kind of state file, corrupt or dated past the one clock rule: one warning of the
    same shape naming the file, and the run (or the store's answer) goes on without it."""
    import warnings

    from tandem.models.catalog import ModelSpec
    from tandem.models.store import Store

    home = tmp_path / "home"
    monkeypatch.setenv("TANDEM_HOME", str(home))
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.0)
    path = _state_path(kind, tiny_models, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    content = DAMAGED[kind][damage == "future"]
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "registry":
            spec = ModelSpec(name="x", repo="r/x", filename="x.gguf", size=1, sha256="0" * 64)
            store = Store(home)
            assert store.entry(spec) is None and store.entry(spec) is None  # read twice
        else:
            assert _a_run(tiny_models, home) == 6
            assert _a_run(tiny_models, home) == 6  # the file was dealt with: said once
    said = [str(w.message) for w in caught if issubclass(w.category, TandemWarning)]
    assert len(said) == 1, said
    shape = SHAPE.match(said[0])
    assert shape and shape["path"] == str(path), said
    if damage == "future":
        assert "in the future" in shape["why"], said
