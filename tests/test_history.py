"""Drafting from what was already said: the suffix index, the on-disk history (bounded,
crash-safe, cleared, opt-out), context files, and auto drafting from them losslessly."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from engine_helpers import auto_drafter  # noqa: E402
from tandem.engine.drafting.history import (
    HistoryStore,
    Library,
    clear_histories,
    list_histories,
    read_context_file,
)
from tandem.engine.drafting.suffix import BULK, KEY_SIZES, SuffixIndex
from tandem.engine.loop.events import DoneEvent, StepEvent
from tandem.engine.loop.sampling import SamplingParams
from tandem.engine.tuning.costs import CostModel
from tandem.errors import UsageError

# ------------------------------------------------------------------ the index


def test_longest_match_wins_and_continuations_are_frequency_weighted():
    idx = SuffixIndex()
    idx.add([1, 2, 3, 9, 9])
    idx.add([7, 2, 3, 4, 5])
    idx.add([8, 2, 3, 4, 5])
    idx.add([6, 1, 2, 3, 9, 8])
    # [1, 2, 3] occurs twice (3 tokens), [2, 3] four times: the longest match decides
    cont, match = idx.draft([5, 1, 2, 3], 3)
    assert match == 3 and cont[:2] == [9, 8]  # ties: the most recent occurrence
    # [2, 3] alone: 4 continues it twice, 9 twice; of equal counts the most recent (9) wins,
    # then the draft follows the occurrences that agree
    cont, match = idx.draft([0, 2, 3], 3)
    assert match == 2 and cont[0] == 9
    idx.add([5, 2, 3, 4, 5])
    cont, match = idx.draft([0, 2, 3], 3)
    assert cont == [4, 5] and match == 2  # 3 of 5 occurrences say 4; no document crosses SEP


def test_matches_longer_than_the_key_are_measured():
    idx = SuffixIndex()
    idx.add(list(range(100, 140)) + [1, 2])
    cont, match = idx.draft(list(range(100, 130)), 4)
    assert match == 30 and cont == [130, 131, 132, 133]
    assert idx.draft([5, 6, 7], 4) == ([], 0)
    assert idx.draft([138, 139], 4, min_match=3) == ([], 0)


def test_sync_follows_one_sequence_and_restarts_when_rewritten():
    idx = SuffixIndex()
    idx.sync([1, 2, 3, 4, 1, 2])
    assert idx.draft([1, 2], 4) == ([3, 4, 1, 2], 2)
    idx.sync([1, 2, 3, 4, 1, 2, 3])
    assert idx.draft([1, 2, 3], 2)[0] == [4, 1]
    idx.sync([9, 9, 5])  # a new request
    assert len(idx) == 3 and idx.draft([1, 2], 2) == ([], 0)


# ------------------------------------------------------------------ the store


def test_step_by_step_indexing_builds_the_same_chains_as_bulk():
    """A decode step indexes its new tokens in Python, a loaded history in numpy: both must
    give the same hash chains, or a lookup would miss (or find) different occurrences."""
    import numpy as np
    from tandem.engine.drafting import suffix

    rng = np.random.default_rng(3)
    seq = [int(t) for t in rng.integers(0, 7, 400)]  # a small alphabet: many repeats
    bulk, steps = SuffixIndex(), SuffixIndex()
    bulk.sync(seq)  # one call: numpy's bulk path
    for end in range(1, len(seq) + 1):  # one token at a time: the Python path
        steps.sync(seq[:end])
    assert bulk._head == steps._head
    assert {n: list(a) for n, a in bulk._prev.items()} == {n: list(a) for n, a in steps._prev.items()}
    grams = rng.integers(0, 152_000, (4, 50))
    assert [suffix._hash_one(list(col)) for col in grams.T] == suffix._hash(grams).tolist()
    assert steps.draft(seq[-40:], 6) == bulk.draft(seq[-40:], 6)


def test_history_is_bounded_by_tokens_and_entries(tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"x" * 10)
    store = HistoryStore(tmp_path / "home", target, max_tokens=100, max_entries=5)
    for i in range(30):
        store.append([i] * 30)
    kept = store.load()
    assert sum(map(len, kept)) <= 100 and len(kept) <= 5
    assert kept[-1] == [29] * 30  # the newest stay, the oldest went
    store = HistoryStore(tmp_path / "home", target, max_tokens=1000, max_entries=5)
    for i in range(30):
        store.append([i] * 10)
    assert [a[0] for a in store.load()] == [25, 26, 27, 28, 29]
    store.append([26] * 10)  # stored again: moved to the end, not twice
    assert [a[0] for a in store.load()] == [25, 27, 28, 29, 26]
    assert not store.append([1, 2])  # too short to be worth keeping


def test_a_crash_mid_write_leaves_the_old_history_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"x")
    store = HistoryStore(tmp_path / "home", target)
    store.append(list(range(20)))
    before = store.path.read_bytes()

    real_write = type(store.path).write_text

    def half_then_crash(self, text, *a, **kw):
        real_write(self, text[:len(text) // 2], *a, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(store.path), "write_text", half_then_crash)
    with pytest.raises(OSError):
        store.append(list(range(50, 80)))
    monkeypatch.undo()
    assert store.path.read_bytes() == before
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]
    assert store.load() == [list(range(20))]
    # the library swallows the failure: a lost write costs only later drafts
    monkeypatch.setattr(type(store.path), "write_text", half_then_crash)
    lib = Library(store)
    lib.record(list(range(100, 130)))
    assert len(lib.history) > 0


def test_clear_empties_it_and_damaged_files_read_as_empty(tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"x")
    home = tmp_path / "home"
    store = HistoryStore(home, target)
    store.append(list(range(20)))
    infos = list_histories(home)
    assert len(infos) == 1 and infos[0].entries == 1 and infos[0].tokens == 20
    assert infos[0].target == "t.gguf" and infos[0].bytes == store.path.stat().st_size
    (store.path.parent / "stray.json.123.tmp").write_text("{")
    assert clear_histories(home) == 1
    assert list(store.path.parent.iterdir()) == [] and store.load() == []
    store.path.write_text("{not json")
    assert store.load() == []
    store.append(list(range(20)))  # a damaged file is replaced
    assert store.load() == [list(range(20))]


def test_history_never_crosses_target_models_or_homes(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"1")
    b.write_bytes(b"22")
    HistoryStore(tmp_path / "h1", a).append(list(range(20)))
    assert HistoryStore(tmp_path / "h1", b).load() == []
    assert HistoryStore(tmp_path / "h2", a).load() == []


def test_context_files_are_checked(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        read_context_file(tmp_path / "missing.py")
    (tmp_path / "bin").write_bytes(b"\x7fELF\x00\x01")
    with pytest.raises(UsageError, match="binary"):
        read_context_file(tmp_path / "bin")
    (tmp_path / "latin").write_bytes(b"caf\xe9")
    with pytest.raises(UsageError, match="UTF-8"):
        read_context_file(tmp_path / "latin")
    with pytest.raises(UsageError, match="directory"):
        read_context_file(tmp_path)
    (tmp_path / "ok.py").write_text("def f():\n    return 1\n")
    assert read_context_file(tmp_path / "ok.py").startswith("def f")


# ------------------------------------------------------------------ auto drafts from them


def _flat_costs():
    return CostModel(verify={n: 0.1 for n in range(1, 18)})


def test_auto_drafts_from_history_and_says_so():
    lib = Library(None, remember=False)
    lib.history.add([5, 6, 7, 8, 9, 10, 11, 12])
    auto = auto_drafter(None, _flat_costs(), n_max=4, library=lib)
    sp, rng = SamplingParams(), np.random.default_rng(0)
    auto.prefill([1, 5, 6, 7])
    d = auto.propose([1, 5, 6, 7], 8, sp, rng, False)
    assert d.source == "history" and d.tokens[:3] == [8, 9, 10]
    auto.observe(StepEvent(0, len(d.tokens), 2, 8, 0.0, 0.1, 0.0))
    assert auto.step_sources == (("history", len(d.tokens), 2),)
    # the prompt wins a tie in match length: it is about this very request
    d = auto.propose([1, 5, 6, 7, 1, 5, 6, 7], 8, sp, rng, False)
    assert d.source == "prompt"


def test_pair_session_records_answers_reports_sources_and_opt_out_writes_nothing(
        tiny_models, tmp_path, monkeypatch):
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.drafting.adaptive import LengthController
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.pair import PairSession, SessionOptions

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    ctx = ContextParams(n_ctx=256, n_threads=1)
    gen = GenParams(max_tokens=24, ignore_eos=True)
    prompt = [1, 20, 21, 22, 23, 24]
    runs = {}
    for history in (False, True):
        opts = SessionOptions(strategy="auto", target_ctx=ctx, history=history,
                              home=tmp_path / "home")
        with PairSession(tiny_models["target"], None, opts) as s:
            for strategy in ("none", "auto"):
                done = [ev for ev in s.generate(prompt, gen, strategy=strategy)
                        if isinstance(ev, DoneEvent)][0]
                runs[(history, strategy)] = done
    # history on: the answers are on disk; the next session drafts the same answer from them
    infos = list_histories(tmp_path / "home")
    assert len(infos) == 1 and infos[0].entries >= 1
    opts = SessionOptions(strategy="auto", target_ctx=ctx, history=True, home=tmp_path / "home")
    with PairSession(tiny_models["target"], None, opts) as s:
        for b in range(3, 9):  # as if earlier requests had learnt that history copies pay
            s.knowledge().learn(("history", b), [1.0] * 16, 10)
        # ...and this request had confirmed it (else its drafts wait for the probe budget)
        monkeypatch.setattr(LengthController, "on_trial", property(lambda self: False))
        done = [ev for ev in s.generate(prompt, gen) if isinstance(ev, DoneEvent)][0]
    assert done.tokens == runs[(True, "none")].tokens  # greedy: the same as plain decoding
    assert done.stats.by_source["history"][1] > 0, done.stats.by_source


def test_opt_out_reads_and_writes_nothing(tiny_models, tmp_path, monkeypatch):
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.pair import PairSession, SessionOptions

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    opts = SessionOptions(strategy="auto", target_ctx=ContextParams(n_ctx=256, n_threads=1),
                          history=False, home=tmp_path / "home")
    with PairSession(tiny_models["target"], None, opts) as s:
        for _ in s.generate([1, 20, 21, 22], GenParams(max_tokens=16, ignore_eos=True)):
            pass
        assert s.library.store is None
    assert not (tmp_path / "home" / "history").exists()


def test_cli_run_no_history_and_history_commands(tiny_models, tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    base = [sys.executable, "-m", "tandem", "run", "-m", str(tiny_models["target"]),
            "--strategy", "auto", "-n", "12", "-t", "1", "--raw", "--no-stats"]
    r = subprocess.run(base + ["--no-history", "hello there"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "home" / "history").exists()
    r = subprocess.run(base + ["hello there"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    shown = subprocess.run([sys.executable, "-m", "tandem", "history", "show", "--json"],
                           env=env, capture_output=True, text=True, timeout=60)
    data = json.loads(shown.stdout)
    assert len(data["histories"]) == 1 and data["histories"][0]["entries"] == 1
    cleared = subprocess.run([sys.executable, "-m", "tandem", "history", "clear"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert cleared.returncode == 0 and "cleared 1 history" in cleared.stdout
    assert list_histories(tmp_path / "home") == []
    bad = subprocess.run(base + ["--context-file", str(tmp_path / "nope.py"), "hi"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "Error: context file not found" in bad.stderr and "Hint:" in bad.stderr


def test_auto_drafts_a_prediction_from_the_answers_first_step():
    """Predicted Outputs: the expected answer is drafted from the very first step (it is
    indexed behind the prompt's last tokens), and wins a tie in match length."""
    auto = auto_drafter(None, _flat_costs(), n_max=4)
    sp, rng = SamplingParams(), np.random.default_rng(0)
    prompt, prediction = [1, 30, 31, 32], [40, 41, 42, 43, 44, 45, 46, 47, 48]
    auto.expect(prediction)
    auto.prefill(prompt)
    d = auto.propose(prompt, 8, sp, rng, False)
    assert d.source == "prediction" and d.tokens == prediction[:len(d.tokens)] and d.tokens
    auto.observe(StepEvent(0, len(d.tokens), len(d.tokens), 8, 0.0, 0.1, 0.0))
    assert auto.step_sources == (("prediction", len(d.tokens), len(d.tokens)),)
    # further on, where the answer departed from it and came back, the match finds its place
    d = auto.propose(prompt + [40, 41, 99, 43, 44, 45], 8, sp, rng, False)
    assert d.source == "prediction" and d.tokens[:2] == [46, 47]
    # without one, nothing of it remains (a drafter is per request)
    fresh = auto_drafter(None, _flat_costs(), n_max=4)
    fresh.prefill(prompt)
    assert fresh.propose(prompt, 8, sp, rng, False).source != "prediction"


class _PeerLooksOnPublish(dict):
    """A chain head table that runs another slot's lookup the moment new heads are published:
    the interleaving two serve slots' threads can meet (issue 52)."""

    def __init__(self, index, suffix):
        super().__init__()
        self.index, self.suffix, self.seen = index, suffix, []

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.seen.append(self.index.match(self.suffix))


def test_history_index_links_before_it_publishes_a_head():
    # a long answer is indexed in bulk; a peer's match() between publishing a head and
    # linking its chain once indexed prev[] past its end: IndexError, a 500 for that request
    idx = SuffixIndex()
    doc = list(range(10, 10 + 3 * BULK))
    for n in KEY_SIZES:
        idx._head[n] = _PeerLooksOnPublish(idx, doc[-KEY_SIZES[-1]:])
    idx.add(doc)
    seen = [m for n in KEY_SIZES for m in idx._head[n].seen]
    assert seen and all(starts == [len(doc)] for starts, _ in seen), seen
