"""`tandem pull` and `tandem pairs` end to end: through tandem.commands.app.main (exit codes,
`Error:`/`Hint:` lines, stdout/stderr kept apart), against a fake hub on 127.0.0.1."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
from fake_hub import FakeHubServer, closed_port_url, use_fake_hub
from rich.console import Console
from tandem.commands.progress import ProgressView, bars_wanted
from tandem.models import catalog
from tandem.models.gguf_meta import read_gguf_header
from tandem.models.pairing import catalog_drafts
from tandem.models.transfer import ProgressEvent

REPO = "org/tiny-GGUF"
OTHER = "org/other-GGUF"
T, D, M = f"{REPO}/target.gguf", f"{REPO}/draft.gguf", f"{OTHER}/mismatch.gguf"


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run `tandem ARGS...` in-process through main(); returns (exit code, stdout, stderr)."""
    from tandem.commands.app import main

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["tandem", *args])
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def hub(monkeypatch, tmp_path, tiny_models):
    with FakeHubServer() as h:
        use_fake_hub(monkeypatch, tmp_path, h.url)
        h.add(REPO, "target.gguf", tiny_models["target"].read_bytes())
        h.add(REPO, "draft.gguf", tiny_models["draft"].read_bytes())
        h.add(OTHER, "mismatch.gguf", tiny_models["mismatch"].read_bytes())
        yield h


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def assert_error(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert lines[-2].startswith("Error: ") and lines[-1].startswith("Hint: "), err
    for w in words:
        assert w in err, err


# --------------------------------------------------------------------- catalog


def test_pairs_lists_the_catalog(cli, home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = cli("pairs")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["PAIR", "SIZE", "MEMORY", "ON", "DISK", "TYPE", "·", "DRAFT", "·",
                                "GOOD", "FOR"]
    for name in catalog.pair_names():
        assert any(line.startswith(name) for line in lines), name
    assert "qwen2.5-coder-1.5b* " in out and "*: the default pair" in err
    assert "~20.4 GB" in out and re.search(r"~\d+(\.\d)? GiB", out)  # approximate, and marked so
    assert "Error" not in err and "approximate" in err
    assert cli("pairs", "list")[1] == out


@pytest.mark.parametrize("columns", [80, 100])
def test_pairs_fits_the_terminal_and_wide_has_every_column(cli, home, monkeypatch, columns):
    """The default table wraps GOOD FOR to $COLUMNS (80 in a pipe), stderr's legend too;
    --wide prints every column, one line a pair, with the full hub references."""
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = cli("pairs")
    assert code == 0
    for text in (out, err):
        assert max(len(line) for line in text.splitlines()) <= columns, text
    pairs = catalog.load_catalog()
    # every word of every pair's GOOD FOR is there, in order, across its wrapped lines
    assert " ".join(out.split()).count(" ".join(pairs["qwen2.5-coder-32b"].good_for.split())) == 1

    code, wide, _ = cli("pairs", "--wide")
    assert code == 0
    lines = wide.splitlines()
    assert lines[0].split()[:4] == ["PAIR", "TARGET", "DRAFT", "SIZE"]
    assert len(lines) == 1 + len(pairs)  # nothing wraps
    assert "qwen2.5-coder-1.5b (default)" in wide
    for p in pairs.values():
        row = next(line for line in lines if line.startswith(p.name + " "))
        assert p.target.key in row and row.rstrip().endswith(p.good_for), p.name
    assert max(len(line) for line in lines) > 200  # what the default table keeps narrow
    assert cli("pairs", "list", "-w")[1] == wide


def test_pairs_json_catalog_shape(cli, home):
    code, out, _ = cli("pairs", "--json")
    assert code == 0
    doc = json.loads(out)
    pairs = doc["pairs"]
    assert len(pairs) >= 10
    assert [p["name"] for p in pairs if p["default"]] == ["qwen2.5-coder-1.5b"]
    families = {p["target"]["repo"].split("/")[1].split("-")[0].lower() for p in pairs}
    assert {"qwen2.5", "qwen3", "meta", "llama", "gemma", "deepseek"} <= families
    for p in pairs:
        assert p["good_for"] and p["memory"], p["name"]
        assert p["drafted_by"] and p["target"]["memory_type"], p["name"]
        models = [p["target"], p["draft"]] if p["draft"] else [p["target"]]
        sizes = [m["size"] or m["approx_size"] for m in models]
        # a file no source gave a size for has none (SIZE "?"), and so has its pair
        assert p["approx_size"] == (None if None in sizes else sum(sizes)), p["name"]
        if p["draft"] is None:  # no small sibling: n-grams and copies, or its own MTP heads
            assert p["drafted_by"] == (catalog.MTP_HEADS if p["mtp"] else catalog.NO_DRAFT_MODEL)
        for m in (p["target"], p["draft"]) if p["draft"] else (p["target"],):
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", m["repo"])
            assert m["file"].lower().endswith("q4_k_m.gguf"), m
            assert "-of-" not in m["file"]  # never a split file
            assert m["sha256"] is None or re.fullmatch(r"[0-9a-f]{64}", m["sha256"])
            assert m["arch"] and m["memory_type"] in ("attention", "sliding window", "hybrid",
                                                      "recurrent"), m
    default = next(p for p in pairs if p["default"])
    assert default["target"]["mirrors"] == ["pypi"] and default["draft"]["mirrors"] == ["pypi"]
    assert doc["other_models"] == []


def test_docs_list_every_catalog_pair():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "pairs.md").read_text()
    for p in catalog.load_catalog().values():
        assert f"| `{p.name}`" in doc, p.name
        assert p.target.filename in doc and (p.draft is None or p.draft.filename in doc), p.name


def test_pairs_help_lists_subcommands(cli):
    code, out, _ = cli("pairs", "--help")
    assert code == 0 and "check" in out and "suggest" in out and "list" in out


# ------------------------------------------------------------------------ pull


def test_pull_any_pair_then_again_instantly(cli, hub, tmp_path):
    code, out, err = cli("pull", "--target", T, "--draft", D)
    assert code == 0, err
    models = tmp_path / "home" / "models" / "org" / "tiny-GGUF"
    assert out == f"target\t{models / 'target.gguf'}\ndraft\t{models / 'draft.gguf'}\n"
    # not a terminal: plain progress lines on stderr, no bars or escape codes
    assert f"Downloading {T}" in err and f"{T}: 100%" in err and f"Verifying {D}" in err
    assert "\x1b" not in err and "\r" not in err
    assert "is ready" in err

    n = len(hub.requests)
    code, out2, err2 = cli("pull", "--target", T, "--draft", D)
    assert code == 0 and out2 == out
    assert len(hub.requests) == n  # no network at all the second time
    assert "already on disk" in err2 and "Downloading" not in err2

    code, out, _ = cli("pairs")
    assert "Other models on disk:" in out and T in out
    doc = json.loads(cli("pairs", "--json")[1])
    assert {o["ref"] for o in doc["other_models"]} == {T, D}

    code, out, _ = cli("pull", "--target", T, "--draft", D, "--json")
    doc = json.loads(out)
    assert doc["downloaded"] == [] and doc["target"]["ref"] == T
    assert doc["target"]["source"].startswith("hub:") and len(doc["draft"]["sha256"]) == 64


def test_pull_incompatible_pair_downloads_nothing(cli, hub, tmp_path, tiny_models):
    code, out, err = cli("pull", "--target", T, "--draft", M)
    assert code == 3 and out == ""
    assert_error(err, f"draft {M} cannot speculate for target {T}",
                 "vocabulary sizes differ", "pairs suggest")
    assert hub.served[M] < read_gguf_header(tiny_models["mismatch"]).data_offset
    assert hub.served[T] < read_gguf_header(tiny_models["target"]).data_offset
    assert not (tmp_path / "home" / "models").exists()
    assert not list((tmp_path / "hf").rglob("blobs"))


@pytest.mark.parametrize("args, code, words", [
    (["pull", "nope-7b"], 2, ["unknown pair 'nope-7b'", "known pairs:"]),
    (["pull", "--target", T], 2, ["--target and --draft go together"]),
    (["pull", "qwen2.5-coder-7b", "--target", T, "--draft", D], 2, ["not both"]),
    (["pull", "--target", f"{REPO}/missing.gguf", "--draft", D], 4, ["file not found"]),
    (["pull", "--target", "org/absent-GGUF:Q4_K_M", "--draft", D], 4, ["repository not found"]),
    (["pull", "--target", f"{REPO}/../../x.gguf", "--draft", D], 2, ["unsafe file name"]),
    (["pairs", "check", "no-such-model", D], 2, ["unknown model or pair"]),
])
def test_pull_errors(cli, hub, args, code, words):
    got, out, err = cli(*args)
    assert got == code and out == ""
    assert_error(err, *words)


def test_pull_without_network(cli, monkeypatch, tmp_path):
    use_fake_hub(monkeypatch, tmp_path, closed_port_url())
    code, out, err = cli("pull", "--target", T, "--draft", D)
    assert code == 4 and out == ""
    assert_error(err, "cannot reach the Hugging Face hub", "HF_HUB_OFFLINE")


# ----------------------------------------------------------------------- check


def test_pairs_check(cli, hub):
    code, out, err = cli("pairs", "check", T, D)
    assert code == 0 and err == ""
    assert out.splitlines()[0].startswith(f"target  {T}")
    assert "hub: " in out and "requests" in out
    assert out.splitlines()[-1] == f"compatible: {D} can draft for {T}"

    code, out, err = cli("pairs", "check", T, M)
    assert code == 3 and "compatible:" not in out
    assert_error(err, "cannot speculate", "token 5 differs")

    code, out, err = cli("pairs", "check", T, M, "--json")
    doc = json.loads(out)
    assert code == 3 and doc["compatible"] is False and doc["problems"]
    assert doc["draft"]["n_tokens"] == 500 and doc["draft"]["where"] == "hub"


def test_pairs_check_local_files_needs_no_network(cli, home, tiny_models):
    code, out, _ = cli("pairs", "check", str(tiny_models["target"]), str(tiny_models["draft"]))
    assert code == 0 and "on disk" in out and out.rstrip().endswith("can draft for target.gguf")


def test_pairs_check_names_each_models_memory_type(cli, home, tiny_models):
    code, out, _ = cli("pairs", "check", str(tiny_models["hybrid"]),
                       str(tiny_models["recurrent"]))
    lines = out.splitlines()
    assert code == 0 and lines[1].split(":")[0].strip() == "hybrid memory"
    assert "snapshots of the last batch" in lines[1]
    # the memory the state takes at the defaults: a copy, 16 snapshots, 8 checkpoints
    assert lines[2].strip() == ("recurrent state: 1 KiB a copy; llama.cpp's snapshots 16 KiB "
                                "(n_rs_seq 16), context checkpoints up to 8 KiB in RAM (8 "
                                "copies, --ctx-checkpoints); at the defaults, `tandem hw` "
                                "plans yours")
    assert lines[4].strip().startswith("recurrent memory: its steps undone from a saved copy")
    assert "no snapshots" in lines[5]  # Mamba: llama.cpp keeps none
    code, out, _ = cli("pairs", "check", str(tiny_models["recurrent"]),
                       str(tiny_models["target"]), "--json")
    doc = json.loads(out)
    assert doc["target"]["memory"]["type"] == "recurrent"
    assert doc["target"]["memory"]["n_rs_seq"] == doc["target"]["memory"]["snapshots"] == 0
    assert doc["target"]["memory"]["checkpoints"] == 8 * doc["target"]["memory"]["state_bytes"]
    assert doc["draft"]["memory"]["state_bytes"] == 0  # attention: nothing beside the KV
    assert "decodes plain" in doc["target"]["memory"]["rollback"]
    assert doc["draft"]["memory"]["type"] == "attention"


def test_pairs_check_hostile_header(cli, home, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") * 2)
    code, out, err = cli("pairs", "check", str(bad), str(bad))
    assert code == 3
    assert_error(err, "exceeds the limit")


# --------------------------------------------------------------------- suggest


def test_pairs_suggest(cli, hub, tiny_models):
    drafts = {spec.name: spec for spec, _ in catalog_drafts()}
    good = ["qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen3-0.6b-q4_k_m"]
    bad = ["llama-3.2-1b-instruct-q4_k_m"]
    for name in good:
        hub.add(drafts[name].repo, drafts[name].hub_path, tiny_models["draft"].read_bytes())
    for name in bad:
        hub.add(drafts[name].repo, drafts[name].hub_path, tiny_models["mismatch"].read_bytes())

    code, out, err = cli("pairs", "suggest", T, "--all")
    assert code == 0
    lines = out.splitlines()
    assert sorted(line.split()[0] for line in lines if not line.startswith("incompatible")) == good
    assert "qwen2.5-coder-32b" in out  # the pairs that use each draft
    assert any(line.startswith(f"incompatible: {bad[0]}") for line in lines)
    assert err.count("Note: could not check") == len(drafts) - len(good) - len(bad)

    doc = json.loads(cli("pairs", "suggest", T, "--json")[1])
    assert {d["name"] for d in doc["drafts"] if d["compatible"]} == set(good)

    hub.repos[drafts[bad[0]].repo].clear()  # now nothing fits the mismatch vocabulary
    code, out, err = cli("pairs", "suggest", M)
    assert code == 3 and out == ""
    assert_error(err, "no catalog draft is compatible")


# -------------------------------------------------------------------- progress


def _events(model: str, total: int) -> list[ProgressEvent]:
    steps = [0, total // 3, 2 * total // 3, total]
    return ([ProgressEvent("download", model, d, total) for d in steps]
            + [ProgressEvent("verify", model, total, total)])


def test_progress_plain_lines():
    buf = io.StringIO()
    view = ProgressView(Console(file=buf, force_terminal=False), bars=False)
    for ev in _events("m", 4_000_000):
        view(ev)
    view.close()
    assert buf.getvalue().splitlines() == [
        "Downloading m (4.0 MB)...", "  m: 25%", "  m: 50%", "  m: 100%",
        "Verifying m (4.0 MB)...", "  m: 100%",
    ]


def test_progress_bars_on_a_terminal():
    buf = io.StringIO()
    view = ProgressView(Console(file=buf, force_terminal=True, width=100), bars=True)
    for ev in _events("model-x", 4_000_000):
        view(ev)
    view.close()
    text = buf.getvalue()
    assert "Downloading model-x" in text and "4.0/4.0 MB" in text and "━" in text


def test_bars_only_on_a_terminal_without_no_color(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert bars_wanted()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not bars_wanted()
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not bars_wanted()


# ------------------------------------------------------------------ subprocess


def test_real_process_keeps_stdout_and_stderr_apart(tmp_path, tiny_models):
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "tandem", "pairs", "check",
           str(tiny_models["target"]), str(tiny_models["mismatch"])]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 3
    assert [line.split()[0] for line in p.stdout.splitlines()] == ["target", "draft"]
    assert p.stderr.startswith("Error: draft mismatch.gguf cannot speculate for target")
    assert "\nHint: " in p.stderr

    p = subprocess.run([sys.executable, "-m", "tandem", "pairs", "--json"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and len(json.loads(p.stdout)["pairs"]) >= 10


def test_pairs_and_hw_show_one_memory_figure(cli, home):
    """`pairs` once said ~2.2 GB for the default pair (a catalog guess) where `hw` planned
    1.8 GiB: both show the planner's figure now, for every pair, table and JSON alike."""
    code, out, _ = cli("pairs", "--json")
    assert code == 0
    pairs = {p["name"]: p for p in json.loads(out)["pairs"]}
    for name in ("qwen2.5-coder-1.5b", "qwen3-8b", "llama3.3-70b"):
        code, hw_out, err = cli("hw", "--pair", name, "--json")
        assert code == 0, err
        plan = json.loads(hw_out)["plan"]
        planned = plan["target"]["total"] + plan["draft"]["total"]
        assert pairs[name]["memory"] == planned, name
        assert pairs[name]["memory_estimated"] is True  # nothing on disk in this home
    code, table, notes = cli("pairs")
    from tandem.fsutil import fmt_bytes

    row = next(line for line in table.splitlines() if line.startswith("qwen2.5-coder-1.5b"))
    assert f"~{fmt_bytes(pairs['qwen2.5-coder-1.5b']['memory'])}" in row
    assert "as `tandem hw --pair PAIR` plans them" in notes


def test_a_pair_without_a_draft_model_pulls_its_target_only(cli, hub, monkeypatch):
    """A model with no small sibling (`draft: null` in the catalog): `tandem pull` fetches the
    target alone and says what drafts for it; the pair is no draft reference."""
    from tandem.errors import UsageError
    from tandem.models.refs import parse_ref

    solo = catalog.PairSpec("solo", catalog.ModelSpec("solo-target", REPO, "target.gguf"), None)
    monkeypatch.setattr(catalog, "get_pair", lambda name=None, path=None: solo)
    code, out, err = cli("pull", "solo")
    assert code == 0, err
    assert out.splitlines()[0].startswith("target\t") and len(out.splitlines()) == 1
    assert "no draft model: it drafts from n-gram, history and prompt copies" in err
    assert solo.models == (solo.target,) and solo.drafted_by == catalog.NO_DRAFT_MODEL
    with pytest.raises(UsageError, match="has no draft model"):
        parse_ref("gemma3-270m", "draft")


def _run_only(monkeypatch, pair) -> None:
    """`tandem run` finds `pair` whatever it is asked for, with nothing piped in."""
    monkeypatch.setattr(catalog, "get_pair", lambda name=None, path=None: pair)
    monkeypatch.setattr(catalog, "find_pair", lambda name, path=None: pair)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))


def test_a_pair_without_a_draft_model_runs_auto_on_its_target(cli, hub, monkeypatch):
    """`tandem run PAIR` for a model with no small sibling: the target alone, drafted by
    `auto`'s n-grams and copies unless a strategy is given (a profile's `draft` would refuse)."""
    pytest.importorskip("llama_cpp")
    solo = catalog.PairSpec("solo", catalog.ModelSpec("solo-target", REPO, "target.gguf"), None)
    _run_only(monkeypatch, solo)
    code, out, err = cli("run", "solo", "--yes", "--json", "-n", "4", "--no-history", "hello")
    assert code == 0, err
    assert json.loads(out)["stats"]["strategy"] == "auto"
    code, out, err = cli("run", "solo", "--json", "-n", "4", "--strategy", "ngram", "hello")
    assert code == 0 and json.loads(out)["stats"]["strategy"] == "ngram", err
    # a GPU profile's `draft` (no draft model here): auto; a strategy set by the user is kept
    monkeypatch.setenv("TANDEM_PROFILE", "rtx-4090")
    monkeypatch.setenv("TANDEM_FORCE_PROFILE", "1")
    code, out, err = cli("run", "solo", "--json", "-n", "4", "hello")
    assert code == 0 and json.loads(out)["stats"]["strategy"] == "auto", err
    monkeypatch.setenv("TANDEM_STRATEGY", "draft")
    code, out, err = cli("run", "solo", "-n", "4", "hello")
    assert code == 2 and "strategy 'draft' needs a draft model" in err


def test_a_model_with_mtp_heads_is_listed_and_runs_them(cli, hub, monkeypatch, tiny_models):
    """At least one MTP family in the catalog, shown as drafted by its built-in MTP; `tandem
    run PAIR` for such a pair drafts with the target's heads unless a strategy is given."""
    pytest.importorskip("llama_cpp")
    mtp_pairs = [p for p in catalog.load_catalog().values() if p.mtp]
    assert mtp_pairs and all(p.draft is None and p.drafted_by == catalog.MTP_HEADS
                             for p in mtp_pairs)
    code, out, _ = cli("pairs", "--wide")  # the DRAFT column
    assert code == 0 and catalog.MTP_HEADS in out
    hub.add(REPO, "mtp.gguf", tiny_models["mtp"].read_bytes())
    solo = catalog.PairSpec("heads", catalog.ModelSpec("heads-target", REPO, "mtp.gguf"), None,
                            mtp=True)
    _run_only(monkeypatch, solo)
    code, out, err = cli("run", "heads", "--yes", "--json", "-n", "8", "--no-history", "hello")
    assert code == 0, err
    assert json.loads(out)["stats"]["strategy"] == "mtp"
    code, out, err = cli("run", "heads", "--json", "-n", "4", "--strategy", "ngram", "hello")
    assert code == 0 and json.loads(out)["stats"]["strategy"] == "ngram", err


def test_the_catalog_refuses_mtp_beside_a_draft_model(tmp_path):
    doc = {"default": "p", "models": {"t": {"repo": "a/b", "filename": "t.gguf"},
                                      "d": {"repo": "a/b", "filename": "d.gguf"}},
           "pairs": {"p": {"target": "t", "draft": "d", "mtp": True}}}
    path = tmp_path / "catalog.yaml"
    path.write_text(json.dumps(doc))
    with pytest.raises(catalog.CatalogError, match="'mtp' must be true or false"):
        catalog.load_catalog(path)


# ------------------------------------------------------------- late-2026 families

# Their files as public sources name them (cli/tandem/data/catalog.yaml and docs/models.md
# cite each): target, draft (None: n-grams and copies), the target's memory type.
LATE_2026 = {
    "qwen3.8-27b": ("ggml-org/Qwen3.8-27B-GGUF/Qwen3.8-27B-Q4_K_M.gguf",
                    "lmstudio-community/Qwen3.5-0.8B-GGUF/Qwen3.5-0.8B-Q4_K_M.gguf", "hybrid"),
    "gemma4-31b": ("unsloth/gemma-4-31B-it-GGUF/gemma-4-31B-it-Q4_K_M.gguf",
                   "ggml-org/gemma-4-E4B-it-GGUF/gemma-4-E4B-it-Q4_K_M.gguf", "sliding window"),
    "gemma4-26b-a4b": ("ggml-org/gemma-4-26B-A4B-it-GGUF/gemma-4-26B-A4B-it-Q4_K_M.gguf", None,
                       "sliding window"),
}


def test_the_late_2026_families_are_listed_with_memory_type_and_drafter(cli, home, monkeypatch):
    """`tandem pairs` shows each target's memory type and what drafts for it (TYPE · DRAFT ·
    GOOD FOR); no size was confirmed for these files: SIZE "?", never a made-up figure."""
    monkeypatch.setenv("COLUMNS", "400")  # one line a pair
    code, out, err = cli("pairs")
    legend = " ".join(err.split())
    assert code == 0 and "no exact size, ? where it has none" in legend
    rows = {line.split()[0].rstrip("*"): line for line in out.splitlines()[1:]}
    doc = {p["name"]: p for p in json.loads(cli("pairs", "--json")[1])["pairs"]}
    code, wide, _ = cli("pairs", "--wide")
    wide_rows = {line.split()[0]: line for line in wide.splitlines()[1:]}
    for name, (target, draft, kind) in LATE_2026.items():
        pair = catalog.get_pair(name)
        assert pair.target.key == target and (pair.draft.key if pair.draft else None) == draft
        assert pair.target.sha256 is None and pair.target.size is None  # left to the hub
        drafter = pair.draft.name if pair.draft else "n-gram"
        assert f" {kind} · {drafter} · {pair.good_for}" in rows[name], rows[name]
        assert rows[name].split()[1] == "?"  # SIZE: none confirmed
        assert doc[name]["target"]["memory_type"] == kind and doc[name]["approx_size"] is None
        assert doc[name]["drafted_by"] == (drafter if draft else catalog.NO_DRAFT_MODEL)
        assert doc[name]["memory"] and doc[name]["memory_estimated"] is True  # from the label
        assert target in wide_rows[name] and f" {kind} " in wide_rows[name]
        assert (draft or "none (n-gram") in wide_rows[name]
    # Gemma 4's drafter is its own family's: Gemma 3's vocabulary is another tokenizer's
    assert catalog.get_pair("gemma4-31b").draft.arch == "gemma4"
    # with no size, the plan estimates from the name: 26B-A4B is 26B of weights (4B active)
    from tandem.machine.shapes import ModelShape

    moe, small = (ModelShape.estimate(n, None) for n in ("gemma-4-26b-a4b-it-q4_k_m",
                                                         "gemma-4-e4b-it-q4_k_m"))
    assert moe.weights_bytes > 5 * small.weights_bytes
    assert doc["gemma4-26b-a4b"]["memory"] > 5 * small.weights_bytes


@pytest.mark.parametrize("name", sorted(LATE_2026))
def test_a_late_2026_pair_pulls_checked_against_the_hub(cli, hub, tiny_models, name):
    """No hash is pinned for these files: `tandem pull` checks each against the sha256 the hub
    publishes (its LFS ETag) and records it, after the headers' vocabulary check."""
    import hashlib

    pair = catalog.get_pair(name)
    served = {pair.target: tiny_models["target"].read_bytes()}
    if pair.draft is not None:
        served[pair.draft] = tiny_models["draft"].read_bytes()
    for spec, data in served.items():
        hub.add(spec.repo, spec.hub_path, data)
    code, out, err = cli("pull", name, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["pair"] == name and len(doc["downloaded"]) == len(served)
    for role, spec in (("target", pair.target), ("draft", pair.draft)):
        if spec is None:
            assert doc[role] is None and "no draft model" in err
            continue
        assert doc[role]["sha256"] == hashlib.sha256(served[spec]).hexdigest()
        assert doc[role]["source"].startswith("hub:") and doc[role]["ref"] == spec.key


def test_the_catalog_refuses_a_name_given_twice(tmp_path):
    """YAML keeps the last of two equal keys: a model or pair added under a name already taken
    would silently replace the first. The catalog refuses it instead."""
    model = "{repo: a/b, filename: %s.gguf}"
    for models, pairs in (([("t", "t"), ("t", "u")], [("p", "t")]),
                          ([("t", "t")], [("p", "t"), ("p", "t")])):
        text = "default: p\nmodels:\n" + "".join(f"  {n}: {model % f}\n" for n, f in models)
        text += "pairs:\n" + "".join(f"  {n}: {{target: {t}}}\n" for n, t in pairs)
        path = tmp_path / "catalog.yaml"
        path.write_text(text)
        with pytest.raises(catalog.CatalogError, match="duplicate key"):
            catalog.load_catalog(path)
    # the bundled catalog has none, and every name (pair, alias, model) reads back
    pairs = catalog.load_catalog()
    names = [n.lower() for p in pairs.values() for n in (p.name, *p.aliases)]
    assert len(names) == len(set(names))
    for p in pairs.values():
        for m in p.models:
            assert catalog.get_model(m.name) == m
