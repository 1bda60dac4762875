"""`tandem run` as scripts use it, through a subprocess with the tiny models: stdout carries
only the text, stderr the rest; --json; exit codes; llama.cpp's flag spellings."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp")

from tandem.errors import EXIT_CONTEXT, EXIT_MODEL, EXIT_OK, EXIT_USAGE  # noqa: E402


@pytest.fixture(scope="module")
def cli(tiny_models, tmp_path_factory):
    home = tmp_path_factory.mktemp("tandem-home")
    base = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t", "1"]

    def run(*args, stdin: bytes | str | None = None, models: bool = True, env: dict | None = None,
            timeout: float = 60):
        # the strategy is pinned: the hardware profile's default (auto) may decode plainly
        full_env = {**os.environ, "TANDEM_HOME": str(home), "NO_COLOR": "1", "COLUMNS": "100",
                    "TANDEM_STRATEGY": "draft"}
        full_env.pop("FORCE_COLOR", None)
        full_env.update(env or {})
        data = stdin.encode() if isinstance(stdin, str) else stdin
        cmd = [sys.executable, "-m", "tandem", "run", *(base if models else []), *args]
        return subprocess.run(cmd, input=data if data is not None else b"", capture_output=True,
                              env=full_env, timeout=timeout)

    return run


def text(res) -> str:
    return res.stdout.decode()


def err(res) -> str:
    return res.stderr.decode()


def test_stdout_has_only_the_text_and_stderr_the_stats(cli):
    res = cli("--raw", "-n", "16", "--stats", "hello there")
    assert res.returncode == EXIT_OK, err(res)
    out = text(res)
    assert out.endswith("\n") and out.count("\n") >= 1
    assert "tok/s" not in out and "accepted" not in out
    assert "16 tokens" in err(res) and "tok/s" in err(res) and "accepted" in err(res)
    quiet = cli("--raw", "-n", "16", "--no-stats", "hello there")
    assert text(quiet) == out and err(quiet) == ""
    # stats default to off when stderr is not a terminal
    assert err(cli("--raw", "-n", "16", "hello there")) == ""


def test_json_output(cli, tiny_models):
    res = cli("--raw", "-n", "12", "--json", "--stats", "hello there")
    assert res.returncode == EXIT_OK, err(res)
    doc = json.loads(text(res))  # stdout is exactly one JSON object
    assert set(doc) >= {"text", "finish_reason", "stats"}
    assert doc["finish_reason"] == "length"
    st = doc["stats"]
    assert st["n_generated"] == 12 and st["strategy"] == "draft"
    assert {"acceptance_rate", "mean_accepted_length", "acceptance_by_position",
            "tokens_per_second", "n_prompt", "n_prompt_eval", "drafted", "accepted"} <= set(st)
    plain = cli("--raw", "-n", "12", "hello there")
    assert text(plain).rstrip("\n") == doc["text"]  # greedy: same text as the streamed run
    assert "tok/s" in err(res)
    # the thread count the answer ended with, in the stats and on the stats line (-t 1 here;
    # unset, the engine's choice among this machine's cores)
    assert st["n_threads"] == 1 and ", 1 thread)" in err(res)
    chosen = cli("-m", str(tiny_models["target"]), "--raw", "-n", "4", "--json", "hi",
                 models=False)
    assert 1 <= json.loads(text(chosen))["stats"]["n_threads"] <= (os.cpu_count() or 1)


def test_no_stream_prints_the_same_text(cli):
    a = cli("--raw", "-n", "20", "abc")
    b = cli("--raw", "-n", "20", "--no-stream", "abc")
    assert b.returncode == EXIT_OK and text(a) == text(b)


def test_stdin_is_joined_before_the_argument(cli):
    both = cli("--raw", "-n", "12", "--json", "second part", stdin="first part")
    inline = cli("--raw", "-n", "12", "--json", "first part\n\nsecond part")
    reverse = cli("--raw", "-n", "12", "--json", "second part\n\nfirst part")
    assert both.returncode == EXIT_OK, err(both)
    b, i, r = (json.loads(text(x)) for x in (both, inline, reverse))
    assert b["stats"]["n_prompt"] == i["stats"]["n_prompt"] and b["text"] == i["text"]
    assert b["text"] != r["text"] or b["stats"]["n_prompt"] != r["stats"]["n_prompt"]


@pytest.mark.parametrize("spelling", [
    ["--draft-max", "2"], ["--spec-draft-n-max", "2"],
])
def test_draft_length_spellings(cli, spelling):
    res = cli("--raw", "-n", "30", "--json", *spelling, "hello there")
    assert res.returncode == EXIT_OK, err(res)
    st = json.loads(text(res))["stats"]
    assert st["drafted"] > 0 and len(st["drafted_at"]) <= 2


def test_model_and_length_spellings(cli, tiny_models):
    t, d = str(tiny_models["target"]), str(tiny_models["draft"])
    for flags, n_flag in ((["--model", t, "--model-draft", d], "--max-tokens"),
                          (["-m", t, "--spec-draft-model", d], "--n-predict"),
                          (["-m", t, "-md", d], "-n")):
        res = cli(*flags, "-t", "1", "--raw", "--json", n_flag, "5", "hi", models=False)
        assert res.returncode == EXIT_OK, err(res)
        st = json.loads(text(res))["stats"]
        assert st["n_generated"] == 5 and st["strategy"] == "draft"
    # -m alone: plain decoding
    res = cli("-m", t, "-t", "1", "--raw", "--json", "-n", "5", "hi", models=False)
    assert json.loads(text(res))["stats"]["strategy"] == "none"


def test_context_size_spellings(cli):
    long_prompt = "word " * 300
    small = cli("--raw", "-c", "256", "-n", "4", long_prompt)
    assert small.returncode == EXIT_CONTEXT, err(small)
    assert "context holds 256" in err(small) and text(small) == ""
    big = cli("--raw", "--ctx-size", "2048", "-n", "4", long_prompt)
    assert big.returncode == EXIT_OK, err(big)


@pytest.mark.parametrize("args,stdin,code,message", [
    (["--raw", ""], None, EXIT_USAGE, "the prompt is empty"),
    (["--raw", "   "], "  \n ", EXIT_USAGE, "the prompt is empty"),
    (["--raw", "--temp", "-1", "hi"], None, EXIT_USAGE, "temperature must be >= 0"),
    (["--raw", "--top-p", "0", "hi"], None, EXIT_USAGE, "top-p"),
    (["--raw", "--draft-max", "100", "hi"], None, EXIT_USAGE, "draft max must be in 0..64"),
    (["--raw", "--strategy", "warp", "hi"], None, EXIT_USAGE, "unknown strategy"),
    (["--raw", "-n", "0", "hi"], None, EXIT_USAGE, "max tokens must be >= 1"),
    (["--raw", "hi"], b"\xff\xfe caf\xe9", EXIT_USAGE, "stdin is not UTF-8"),
    (["--raw", "hi"], b"ELF\x00\x01\x02", EXIT_USAGE, "stdin looks binary"),
])
def test_exit_codes(cli, args, stdin, code, message):
    res = cli(*args, stdin=stdin)
    assert res.returncode == code, err(res)
    assert text(res) == ""  # nothing on stdout when it fails
    e = err(res)
    assert e.startswith("Error: ") and message in e
    assert "Traceback" not in e


def test_missing_model_file(cli, tmp_path, tiny_models):
    for flags in (["-m", str(tmp_path / "nope.gguf")],
                  ["-m", str(tmp_path / "nope.gguf"), "-md", str(tiny_models["draft"])],
                  ["-m", str(tiny_models["target"]), "-md", str(tmp_path / "nope.gguf")]):
        res = cli(*flags, "--raw", "hi", models=False)
        assert res.returncode == EXIT_MODEL, err(res)
        assert "nope.gguf" in err(res) and "Hint:" in err(res)


def test_incompatible_draft_is_a_model_error(cli, tiny_models):
    res = cli("-m", str(tiny_models["target"]), "-md", str(tiny_models["mismatch"]), "--raw", "hi",
              models=False)
    assert res.returncode == EXIT_MODEL, err(res)


def test_unparsable_option_value_is_a_usage_error(cli):
    res = cli("--raw", "--temp", "warm", "hi")
    assert res.returncode == EXIT_USAGE and "unexpected" not in err(res)
    res = cli("--raw", "--no-such-flag", "hi")
    assert res.returncode == EXIT_USAGE and "No such option" in err(res)


_SGR = re.compile(r"\x1b\[([0-9;]*)m")


def _colour_codes(data: str) -> list[int]:
    codes = []
    for params in _SGR.findall(data):
        for p in params.split(";"):
            if p.isdigit() and (30 <= int(p) <= 49 or 90 <= int(p) <= 107):
                codes.append(int(p))
    return codes


def test_no_color_is_respected(cli):
    forced = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"}
    coloured = cli("--help", env={**forced, "NO_COLOR": ""}, models=False)
    plain = cli("--help", env={**forced, "NO_COLOR": "1"}, models=False)
    assert plain.returncode == EXIT_OK
    assert "--draft-max" in _SGR.sub("", text(plain))
    assert not _colour_codes(text(plain))
    if not _colour_codes(text(coloured)):
        pytest.skip("help output has no colour here even when forced")
    res = cli("--raw", "-n", "8", "--stats", "hi", env={**forced, "NO_COLOR": "1"})
    assert res.returncode == EXIT_OK and not _colour_codes(text(res) + err(res))


def test_a_first_word_that_looks_like_a_pair_is_named_before_generating(cli):
    """`tandem run nosuchpair hello` once answered "nosuchpair hello" without a word: a first
    word that reads as a pair name but is none is said on stderr (with the close catalog
    names) before the answer, which still comes; a quoted prompt is never taken for a pair."""
    res = cli("--raw", "-n", "4", "nosuchpair", "hello")
    assert res.returncode == EXIT_OK, err(res)
    assert err(res).startswith("Warning: 'nosuchpair' is not a pair name: the prompt is "
                               "'nosuchpair hello'. `tandem pairs` lists the pairs")
    assert text(res)  # the answer came
    close = cli("--raw", "-n", "4", "qwen7b", "hello")
    assert close.returncode == EXIT_OK
    assert "'qwen7b' is not a pair name (close pairs: qwen2.5-7b" in err(close)
    for prompt in (["nosuchpair hello"], ["repair", "this"], ["explain", "hash", "maps"]):
        quiet = cli("--raw", "-n", "4", *prompt)
        assert quiet.returncode == EXIT_OK and "pair name" not in err(quiet), prompt


def test_the_first_kept_answer_says_where_and_how_to_turn_it_off(cli, tmp_path):
    """Answers are kept for drafting by default: the first run that keeps one says so once
    on stderr (a marker file in TANDEM_HOME), with the way out; later runs say nothing."""
    home = tmp_path / "home"
    env = {"TANDEM_HOME": str(home)}
    off = cli("--raw", "-n", "16", "--no-history", "hello there", env=env)
    assert off.returncode == EXIT_OK and "keeps its answers" not in err(off)
    first = cli("--raw", "-n", "16", "hello there", env=env)
    assert first.returncode == EXIT_OK, err(first)
    note = [line for line in err(first).splitlines() if "keeps its answers" in line]
    assert note == [f"Note: tandem keeps its answers in {home / 'history'} so that `auto` can "
                    "draft from text repeated later (said once). --no-history (or `history: "
                    "off` in config.yaml, TANDEM_HISTORY=off) turns it off; `tandem history "
                    "clear` deletes them."]
    assert text(first) and "keeps its answers" not in text(first)  # stdout: the answer only
    assert (home / "history" / ".noted").is_file()
    again = cli("--raw", "-n", "16", "hello there", env=env)
    assert again.returncode == EXIT_OK and "keeps its answers" not in err(again)
    # clearing the answers keeps the marker: the note is not repeated
    cleared = subprocess.run([sys.executable, "-m", "tandem", "history", "clear"],
                             capture_output=True, env={**os.environ, "TANDEM_HOME": str(home)})
    assert cleared.returncode == EXIT_OK and b"cleared 1 history" in cleared.stdout
    assert "keeps its answers" not in err(cli("--raw", "-n", "16", "hello there", env=env))


def test_prediction_file_keeps_the_answer_and_counts_what_it_used(cli, tmp_path):
    """--prediction FILE: the expected answer, a draft source of auto; greedy output is the
    same with it, and --json says how much of it the answer used."""
    args = ["--raw", "--exact", "--strategy", "auto", "-n", "16", "--json", "hello there"]
    alone = json.loads(text(cli(*args)))
    expected = tmp_path / "expected.txt"
    expected.write_text(alone["text"])
    res = cli("--prediction", str(expected), *args)
    assert res.returncode == EXIT_OK, err(res)
    got = json.loads(text(res))
    assert got["text"] == alone["text"]
    used, unused = got["stats"]["prediction"]
    assert used == got["stats"]["n_generated"] and unused == 0
    assert alone["stats"]["prediction"] is None
    missing = cli("--prediction", str(tmp_path / "nope.txt"), *args)
    assert missing.returncode == EXIT_USAGE and "nope.txt" in err(missing)


def test_auto_says_the_cost_calibration_it_waits_for_once(cli, tmp_path):
    """A machine with no saved costs: auto calibrates before the first answer and says so on
    stderr, with what it took (a user once waited seconds for it, unannounced); the next run
    finds the costs on disk and says nothing of them."""
    env = {"TANDEM_HOME": str(tmp_path / "home"), "TANDEM_STRATEGY": "auto"}
    first = cli("--raw", "-n", "4", "hello there", env=env)
    assert first.returncode == EXIT_OK, err(first)
    lines = err(first).splitlines()
    said = [i for i, line in enumerate(lines) if "drafting costs" in line]
    assert len(said) == 2 and "measuring" in lines[said[0]], lines
    assert lines[said[1]].startswith("tandem: drafting costs in ") and " s: calibrated now" \
        in lines[said[1]], lines
    assert [p for p in (tmp_path / "home").rglob("costs/*.json")
            if not p.name.endswith(".knowledge.json")]  # the costs (or a busy start's, apart)
    again = cli("--raw", "-n", "4", "hello there", env=env)
    assert again.returncode == EXIT_OK and "measuring" not in err(again), err(again)
    assert text(again) == text(first)
