"""`tandem spec-bench` as users run it, through a subprocess with the tiny models: a full quick
run (JSON on stdout, files, tuned settings, greedy outputs equal to plain decoding's), Ctrl-C
keeping partial results, stdin prompts, and bad input with its exit code and message."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import xml.dom.minidom

import pytest

pytest.importorskip("llama_cpp")

from tandem.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE  # noqa: E402

FILES = ["report.json", "report.md", "runs.csv", "speedup.svg"]
PROGRESS = re.compile(r"^\[(\d+)/(\d+)\] ")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tandem-home")


def bench_env(home) -> dict:
    env = {**os.environ, "TANDEM_HOME": str(home), "NO_COLOR": "1", "COLUMNS": "400"}  # no wrapped stderr lines
    env.pop("FORCE_COLOR", None)
    return env


def bench_cmd(tiny_models, *args) -> list[str]:
    # one thread: the test machine's two cores are shared, and spinning llama.cpp threads
    # on a busy machine can be a thousand times slower
    return [sys.executable, "-m", "tandem", "spec-bench", "-m", str(tiny_models["target"]),
            "-md", str(tiny_models["draft"]), "-t", "1", *args]


@pytest.fixture(scope="module")
def cli(tiny_models, home):
    def run(*args, stdin: bytes = b"", timeout: float = 60):
        return subprocess.run(bench_cmd(tiny_models, *args), input=stdin, capture_output=True,
                              env=bench_env(home), timeout=timeout)

    return run


# ------------------------------------------------------------------ a full quick run

@pytest.fixture(scope="module")
def quick(cli, home, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    res = cli("--quick", "--category", "code", "--category", "json", "--out", str(out), "--json", "--tune",
              timeout=120)
    return res, out


def test_quick_run_prints_one_json_object(quick):
    res, _ = quick
    assert res.returncode == EXIT_OK, res.stderr.decode()
    doc = json.loads(res.stdout.decode())  # the whole of stdout: one JSON object, nothing else
    assert doc["partial"] is False
    assert doc["categories"] == ["code", "json"]
    assert [c["name"] for c in doc["configs"]] == ["plain", "draft", "ngram", "hybrid", "auto"]
    assert doc["meta"]["max_tokens"] == 64 and doc["meta"]["prompts"] == 4 and doc["meta"]["reps"] == 1
    # --quick: two prompts per category, every configuration on every prompt
    assert len(doc["runs"]) == 4 * 5
    assert {(r["prompt_id"], r["config"]) for r in doc["runs"]} == {
        (p, c) for p in ("code-1", "code-2", "json-1", "json-2")
        for c in ("plain", "draft", "ngram", "hybrid", "auto")}
    assert all(r["n_generated"] > 0 and r["tokens_per_second"] > 0 for r in doc["runs"])
    plain = next(c for c in doc["cells"] if c["category"] == "overall" and c["config"] == "plain")
    assert plain["speedup"] == 1.0 and plain["runs"] == 4
    cells = {(c["config"], c["category"]) for c in doc["cells"]}
    assert cells == {(n, cat) for n in ("plain", "draft", "ngram", "hybrid", "auto")
                     for cat in ("code", "json", "overall")}
    draft = next(c for c in doc["cells"] if c["category"] == "overall" and c["config"] == "draft")
    assert 0 < draft["acceptance_rate"] <= 1 and draft["mean_accepted_length"] > 1
    assert draft["acceptance_by_position"] and 0 < draft["draft_share"] < 1


def test_quick_run_greedy_outputs_equal_plain(quick):
    res, _ = quick
    doc = json.loads(res.stdout.decode())
    for cell in doc["cells"]:
        if cell["config"] != "plain" and cell["category"] == "overall":
            assert cell["compared"] == 4, cell
            assert cell["identical"] == cell["compared"], (cell["config"], cell["mismatches"])
            assert cell["mismatches"] == []
    runs = doc["runs"]
    for r in runs:
        base = next(p for p in runs if p["config"] == "plain" and p["prompt_id"] == r["prompt_id"])
        assert r["tokens"] == base["tokens"] and r["text"] == base["text"]


def test_quick_run_progress_on_stderr_only(quick):
    res, out = quick
    err = res.stderr.decode()
    lines = [line for line in err.splitlines() if PROGRESS.match(line)]
    assert [PROGRESS.match(line).groups() for line in lines] == [(str(i), "20") for i in range(1, 21)]
    # each line says how long the rest will take (from the mean time of the runs so far)
    assert all(re.search(r" · about \d+(\.\d)? (s|min|h) left$", line) for line in lines[:-1]), lines
    assert lines[-1].endswith(" · done") and "20 runs" in err.splitlines()
    assert "wrote" in err and "tuned:" in err
    assert "not saved" not in err  # --out was given
    assert "tok/s" not in res.stdout.decode() and "[1/20]" not in res.stdout.decode()


def test_quick_run_writes_the_files(quick):
    res, out = quick
    assert sorted(p.name for p in out.iterdir()) == FILES
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is False and len(report["runs"]) == 20
    assert report["verdict"].startswith(("best here: ", "partial: ")), report["verdict"]
    assert report["cells"] == json.loads(res.stdout.decode())["cells"]
    csv_lines = (out / "runs.csv").read_text().splitlines()
    assert csv_lines[0].startswith("config,prompt_id,category,rep,") and len(csv_lines) == 21
    md = (out / "report.md").read_text()
    assert md.startswith("# spec-bench report") and "| **overall** |" in md and "Partial" not in md
    assert "## Verify-batch cost" in md  # the cost curve is measured by default
    svg = xml.dom.minidom.parse(str(out / "speedup.svg"))
    assert svg.documentElement.tagName == "svg"
    assert len(svg.getElementsByTagName("rect")) == 5 * 3 + 5  # bars + legend


def test_quick_run_never_tunes_from_two_prompts_per_category(quick, home):
    """--quick measures 2 prompts per category: too few to replace the profile's choice,
    whatever the medians say; the report and stderr say why."""
    res, out = quick
    assert res.returncode == EXIT_OK
    assert not (home / "tuned").exists() or list((home / "tuned").iterdir()) == []
    err = res.stderr.decode()
    assert "not tuned: no configuration convinced" in err and "at least 3 prompts" in err
    doc = json.loads(res.stdout.decode())
    assert doc["meta"]["tuning"].startswith("profile kept")
    assert "| tuning | profile kept" in (out / "report.md").read_text()


# ------------------------------------------------------------------ Ctrl-C

def test_ctrl_c_keeps_partial_results(tiny_models, home, tmp_path):
    out = tmp_path / "out"
    stdout_path = tmp_path / "stdout.json"
    args = ["--strategies", "draft,ngram", "--reps", "10", "-n", "64", "--no-cost-curve",
            "--out", str(out), "--json"]
    lines: queue.Queue = queue.Queue()
    with open(stdout_path, "wb") as stdout:
        proc = subprocess.Popen(bench_cmd(tiny_models, *args), stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=subprocess.PIPE, env=bench_env(home))
        reader = threading.Thread(target=lambda: [lines.put(b) for b in iter(proc.stderr.readline, b"")],
                                  daemon=True)
        reader.start()
        seen = []
        try:
            deadline = time.monotonic() + 60
            while not any(PROGRESS.match(line) for line in seen):
                remaining = deadline - time.monotonic()
                assert remaining > 0 and proc.poll() is None, f"no progress line: {seen}"
                try:
                    seen.append(lines.get(timeout=min(remaining, 1.0)).decode())
                except queue.Empty:
                    pass
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
    while not lines.empty():
        seen.append(lines.get().decode())
    err = "".join(seen)
    assert rc == EXIT_INTERRUPTED, err
    assert "Interrupted: partial results" in err
    total = int(PROGRESS.match(next(line for line in seen if PROGRESS.match(line))).group(2))
    assert total > 100
    assert sorted(p.name for p in out.iterdir()) == FILES
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True
    assert 1 <= len(report["runs"]) < total  # the run in flight finishes, nothing after it
    done = [int(PROGRESS.match(line).group(1)) for line in seen if PROGRESS.match(line)]
    assert len(report["runs"]) == max(done)
    assert "**Partial results**" in (out / "report.md").read_text()
    xml.dom.minidom.parse(str(out / "speedup.svg"))
    assert len((out / "runs.csv").read_text().splitlines()) == len(report["runs"]) + 1
    printed = json.loads(stdout_path.read_text())  # --json still prints the partial result
    assert printed["partial"] is True and len(printed["runs"]) == len(report["runs"])


# ------------------------------------------------------------------ prompts from stdin

def test_jsonl_prompts_from_stdin_and_markdown_when_piped(cli):
    stdin = b'{"category": "greet", "prompt": "hello"}\n{"category": "sea", "turns": ["a poem", "more"]}\n'
    res = cli("--prompts", "-", "--strategies", "ngram", "-n", "8", "--no-cost-curve", stdin=stdin)
    assert res.returncode == EXIT_OK, res.stderr.decode()
    out = res.stdout.decode()
    # stdout piped without --json: the Markdown report, progress stays on stderr
    assert out.startswith("# spec-bench report") and "| greet |" in out and "| sea |" in out
    assert "[1/4]" not in out and "[1/4]" in res.stderr.decode()
    # the verdict comes first, from this run's figures; nothing was saved, and stderr says so
    assert re.match(r"\*\*best here: (ngram \d+\.\d\dx( busy)? of plain|plain decoding)",
                    out.splitlines()[2]), out.splitlines()[2]
    assert ("Note: the report was not saved (no --out): pass --out DIR to keep report.json, "
            "runs.csv, report.md and speedup.svg.") in res.stderr.decode()


def test_text_prompts_from_stdin(cli):
    res = cli("--prompts", "-", "--strategies", "ngram", "-n", "8", "--no-cost-curve", "--json",
              stdin=b"first prompt\n\nsecond prompt\n")
    assert res.returncode == EXIT_OK, res.stderr.decode()
    doc = json.loads(res.stdout.decode())
    assert doc["categories"] == ["stdin"] and doc["meta"]["prompts"] == 2


# ------------------------------------------------------------------ bad input

def usage_error(res) -> str:
    err = res.stderr.decode()
    assert res.returncode == EXIT_USAGE, err
    assert res.stdout == b""
    assert err.startswith("Error: "), err
    return err


def test_malformed_prompts_file_names_the_line(cli, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"category": "qa", "turns": ["ok"]}\n\n{"category": "qa", "turns": ["no end"\n')
    err = usage_error(cli("--prompts", str(path)))
    assert f"{path}:3: not valid JSON" in err.splitlines()[0]
    assert "Hint: one JSON object per line" in err


def test_unreadable_and_empty_prompts_files(cli, tmp_path):
    err = usage_error(cli("--prompts", str(tmp_path / "missing.jsonl")))
    assert "cannot read prompts file" in err and "missing.jsonl" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "no prompts found" in usage_error(cli("--prompts", str(empty)))
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    assert "is not UTF-8 text (byte 3)" in usage_error(cli("--prompts", str(latin)))
    assert "stdin is not UTF-8" in usage_error(cli("--prompts", "-", stdin=b"caf\xe9\n"))
    assert "no prompts found" in usage_error(cli("--prompts", "-", stdin=b"\n\n"))


def test_unknown_category(cli):
    err = usage_error(cli("--category", "code", "--category", "nope"))
    assert "Error: no prompts in category nope" in err
    assert re.search(r"Hint: categories here: .*code.*json", err)


def test_empty_selection(cli):
    assert "no prompts selected" in usage_error(cli("--per-category", "0"))


@pytest.mark.parametrize("args, message", [
    (["--sweep", "draft-max=100"], "--sweep draft-max: 100 is out of range 0..64"),
    (["--sweep", "p-min=1.5"], "--sweep p-min: 1.5 is out of range"),
    (["--sweep", "draft-max"], "bad --sweep"),
    (["--sweep", "speed=2"], "unknown sweep key 'speed'"),
    (["--strategies", "draft,fast"], "unknown strategy 'fast'"),
    (["--reps", "0"], "--reps must be >= 1"),
])
def test_bad_settings(cli, args, message):
    assert message in usage_error(cli(*args))


def test_help_names_every_sweep_key_of_the_sweep_table(home):
    from tandem.bench.sweep import SWEEP_KEYS

    res = subprocess.run([sys.executable, "-m", "tandem", "spec-bench", "--help"],
                         capture_output=True, env=bench_env(home), timeout=60)
    assert res.returncode == EXIT_OK
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", res.stdout.decode()).split())
    listed = re.search(r"keys: ((?:[a-z-]+ \([^)]*\)(?:, )?)+)", text)
    assert listed, text
    assert re.findall(r"([a-z-]+) \(", listed.group(1)) == list(SWEEP_KEYS)
    for key, (_, _, parse, allowed) in SWEEP_KEYS.items():
        shown = "|".join(allowed) if parse is str else f"{allowed[0]}..{allowed[1]}"
        assert f"{key} ({shown})" in text
