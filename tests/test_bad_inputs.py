"""Bad inputs through the real CLI (tiny models; the app's main() in this process for refusals
that come before any model loads, a subprocess for the rest and a few smoke tests of the real
entry point): each gives exactly one
`Error:` line followed by a `Hint:`, the documented exit code, no traceback, nothing on stdout,
and leaves the store (TANDEM_HOME) and the working directory as they were, without `*.tmp` or
`*.partial` files. Faults a test machine cannot produce by itself (a read-only or full disk,
an unreadable file as root) are injected by tests/cli_faults.py."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("llama_cpp")

from tandem import errors  # noqa: E402
from tandem.errors import (  # noqa: E402
    EXIT_MODEL,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_STORAGE,
    EXIT_USAGE,
)

ROOT = Path(__file__).resolve().parents[1]
FAULTS = Path(__file__).with_name("cli_faults.py")
KEEP = "models/org/keep-GGUF/keep.gguf"  # a registered model every store starts with


# ----------------------------------------------------------------------------- harness


@dataclass
class Case:
    id: str
    args: list
    code: int
    message: str  # must appear in the Error: line
    setup: Callable | None = None  # (home, work, models) -> extra env or None
    stdin: bytes = b""
    faults: dict = field(default_factory=dict)  # TANDEM_TEST_* -> value (placeholders ok)
    stdout: bool = False  # the command prints results before it fails (pairs check)


def _store(home: Path, models: dict) -> None:
    """A store with one registered model, as a user's would have."""
    path = home / KEEP
    path.parent.mkdir(parents=True)
    data = models["draft"].read_bytes()
    path.write_bytes(data)
    reg = {"version": 1, "models": {"org/keep-GGUF/keep.gguf": {
        "name": "keep", "repo": "org/keep-GGUF", "filename": "keep.gguf", "path": KEEP,
        "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "source": "local",
        "when": "2026-01-01T00:00:00+00:00"}}}
    (home / "registry.json").write_text(json.dumps(reg, indent=2) + "\n")


def snapshot(root: Path) -> dict:
    """Every file under `root` (or `root` itself) with its mode and content hash."""
    if not root.exists() or not root.is_dir():
        return {".": root.read_bytes() if root.is_file() else None}
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, digest)
    return out


def leftovers(root: Path) -> list[str]:
    return [str(p) for pat in ("*.tmp", "*.partial", ".registry.*") for p in root.rglob(pat)]


def _fill(value, ctx: dict):
    if isinstance(value, bytes):
        return value
    return value.format(**ctx)


def run_cli(args, *, home: Path, work: Path, models: dict, stdin: bytes = b"",
            env: dict | None = None, faults: dict | None = None, timeout: float = 120,
            **popen) -> subprocess.CompletedProcess:
    ctx = {"T": models["target"], "D": models["draft"], "M": models["mismatch"], "W": work,
           "H": home}
    full_env = {**os.environ, "TANDEM_HOME": str(home), "NO_COLOR": "1", "COLUMNS": "120"}
    full_env.pop("FORCE_COLOR", None)
    full_env.update(env or {})
    for key, value in (faults or {}).items():
        full_env[key] = _fill(value, ctx)
    entry = [str(FAULTS)] if faults else ["-m", "tandem"]
    cmd = [sys.executable, *entry, *(_fill(a, ctx) for a in args)]
    return subprocess.run(cmd, input=stdin, capture_output="stdout" not in popen, env=full_env,
                          timeout=timeout, cwd=work, **popen)


def run_in_process(args, *, home: Path, work: Path, models: dict, stdin: bytes = b"",
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """What run_cli returns, through main() in this process (tests/inprocess.py): for
    refusals that come before any model loads."""
    from inprocess import run_main

    ctx = {"T": models["target"], "D": models["draft"], "M": models["mismatch"], "W": work,
           "H": home}
    return run_main([_fill(a, ctx) for a in args], home=home, cwd=work, stdin=stdin, env=env)


def check_error(res, code: int, message: str) -> None:
    err = res.stderr.decode(errors="replace")
    assert res.returncode == code, err
    assert "Traceback" not in err and "Usage:" not in err, err
    assert "\x1b[" not in err, err  # NO_COLOR (and no terminal): plain text
    lines = err.splitlines()
    errs = [i for i, line in enumerate(lines) if line.startswith("Error: ")]
    assert len(errs) == 1, err
    assert message in lines[errs[0]], err
    assert errs[0] + 1 < len(lines) and lines[errs[0] + 1].startswith("Hint: "), err
    assert "unexpected" not in lines[errs[0]], err


# ------------------------------------------------------------------------------ setups


def _write(rel: str, text: str | bytes):
    def setup(home, work, models):
        path = (work if not rel.startswith("~/") else home) / rel.removeprefix("~/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
    return setup


def _fifo(home, work, models):
    os.mkfifo(work / "fifo.gguf")


def _fifo_txt(home, work, models):
    os.mkfifo(work / "fifo.txt")


def _big_text(home, work, models):
    (work / "big.txt").write_bytes(b"word " * ((4 << 20) // 5 + 10))


def _truncated(home, work, models):
    data = models["target"].read_bytes()
    (work / "cut.gguf").write_bytes(data[: len(data) // 3])


def _home_is_a_file(home, work, models):
    import shutil

    shutil.rmtree(home)
    home.write_text("not a directory\n")


def _in_home_a_file(name: str):
    def setup(home, work, models):
        import shutil

        if (home / name).is_dir():
            shutil.rmtree(home / name)
        (home / name).write_text("in the way\n")
    return setup


def _registry_is_a_dir(home, work, models):
    (home / "registry.json").unlink()
    (home / "registry.json").mkdir()


def _prompts_and_home_a_file(home, work, models):
    PROMPT_FILE(home, work, models)
    _home_is_a_file(home, work, models)


def _fake_hub_env(hub_url: str, hf_home: Path) -> dict:
    return {"HF_ENDPOINT": hub_url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(hf_home),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def _gpu_check_json(**change) -> str:
    """scripts/gpu_check.sh's result (schema 1) for the tiny pair, with `change` applied."""
    shape = {"decode_ms": 2.0, "host_draft_top_us": 50.0,
             "verify": {"ratio": {"1": 1.0, "2": 1.1, "4": 1.3}}}
    data = {"schema": 1, "backend": "cpu", "pair": {"target_shape": "tiny",
                                                   "draft_shape": "tiny"},
            "shapes": {"tiny": {**shape, **change}}}
    return json.dumps(data)


TINY = ["-m", "{T}", "-md", "{D}", "-t", "1"]
BENCH_BASE = ["spec-bench", *TINY, "-n", "4", "--no-cost-curve", "--no-warmup",
              "--strategies", "draft", "-c", "256"]
BENCH = [*BENCH_BASE, "--prompts", "{W}/p.txt"]
PROMPT_FILE = _write("p.txt", "hello there\n")
PULL_TINY = ["pull", "--no-check", "--target", "org/tiny-GGUF/target.gguf",
             "--draft", "org/tiny-GGUF/draft.gguf"]
DEEP = "[" * 100_000 + "]" * 100_000
# billion laughs: nine levels of ten aliases each, 10^9 "lol"s when expanded
LAUGHS = "a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol,lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 10) + "]\n"
    for i in range(8)) + "pair: *i\n"

CASES = [
    # --- run: option values -----------------------------------------------------------------
    Case("seed-negative", ["run", *TINY, "--seed", "-5", "hi"], EXIT_USAGE, "--seed must be >= -1 (-1: a random seed)"),
    Case("seed-huge", ["run", *TINY, "--seed", str(1 << 70), "hi"], EXIT_USAGE, "--seed"),
    Case("seed-not-int", ["run", *TINY, "--seed", "abc", "hi"], EXIT_USAGE, "'--seed'"),
    Case("ctx-not-int", ["run", *TINY, "-c", "big", "hi"], EXIT_USAGE, "'--ctx-size'"),
    Case("ctx-too-small", ["run", *TINY, "-c", "10", "hi"], EXIT_USAGE, "context size"),
    Case("max-tokens-0", ["run", *TINY, "-n", "0", "hi"], EXIT_USAGE, "max tokens must be >= 1"),
    Case("max-tokens-neg", ["run", *TINY, "-n", "-3", "hi"], EXIT_USAGE, "max tokens"),
    Case("temp-nan", ["run", *TINY, "--temp", "nan", "hi"], EXIT_USAGE, "--temp must be a finite"),
    Case("temp-inf", ["run", *TINY, "--temp", "inf", "hi"], EXIT_USAGE, "--temp must be a finite"),
    Case("temp-negative", ["run", *TINY, "--temp", "-1", "hi"], EXIT_USAGE, "temperature"),
    Case("top-p-nan", ["run", *TINY, "--top-p", "nan", "hi"], EXIT_USAGE, "--top-p"),
    Case("top-p-zero", ["run", *TINY, "--top-p", "0", "hi"], EXIT_USAGE, "top-p"),
    Case("min-p-nan", ["run", *TINY, "--min-p", "nan", "hi"], EXIT_USAGE, "--min-p"),
    Case("repeat-penalty-nan", ["run", *TINY, "--repeat-penalty", "nan", "hi"], EXIT_USAGE,
         "--repeat-penalty"),
    Case("draft-p-min-nan", ["run", *TINY, "--draft-p-min", "nan", "hi"], EXIT_USAGE,
         "--draft-p-min"),
    Case("draft-max-100", ["run", *TINY, "--draft-max", "100", "hi"], EXIT_USAGE, "draft max"),
    Case("draft-min-over-max", ["run", *TINY, "--draft-min", "5", "--draft-max", "2", "hi"],
         EXIT_USAGE, "draft min 5 exceeds draft max 2"),
    Case("strategy-unknown", ["run", *TINY, "--strategy", "warp", "hi"], EXIT_USAGE,
         "unknown strategy"),
    Case("threads-negative", ["run", *TINY, "-t", "-1", "hi"], EXIT_USAGE, "threads"),
    Case("threads-1000", ["run", *TINY[:4], "-t", "1000", "hi"], EXIT_USAGE,
         "threads 1000 (cli: --threads) is far above this machine's"),
    Case("env-threads-1000", ["run", *TINY[:4], "hi"], EXIT_USAGE, "TANDEM_THREADS",
         setup=lambda h, w, m: {"TANDEM_THREADS": "1000"}),
    Case("config-threads-1000", ["run", *TINY[:4], "hi"], EXIT_USAGE, "config.yaml",
         setup=_write("~/config.yaml", "threads:\n  n_threads: 1000\n")),
    Case("no-such-flag", ["run", *TINY, "--no-such-flag", "hi"], EXIT_USAGE, "No such option"),
    # --- run: text ----------------------------------------------------------------------------
    Case("prompt-surrogates", ["run", *TINY, b"abc\xff"], EXIT_USAGE,
         "the prompt is not valid UTF-8"),
    Case("system-surrogates", ["run", *TINY, "-s", b"\xfesys", "hi"], EXIT_USAGE,
         "the system prompt (-s) is not valid UTF-8"),
    Case("stop-surrogates", ["run", *TINY, "--stop", b"\xfe", "hi"], EXIT_USAGE,
         "--stop string is not valid UTF-8"),
    Case("prompt-empty", ["run", *TINY, ""], EXIT_USAGE, "the prompt is empty"),
    Case("stdin-binary", ["run", *TINY, "hi"], EXIT_USAGE, "stdin looks binary",
         stdin=b"ELF\x00\x01"),
    Case("stdin-not-utf8", ["run", *TINY, "hi"], EXIT_USAGE, "stdin is not UTF-8",
         stdin=b"caf\xe9"),
    # --- text inputs: kind and size checked before a byte is read --------------------------
    Case("context-file-fifo", ["run", *TINY, "--context-file", "{W}/fifo.txt", "hi"],
         EXIT_USAGE, "is a named pipe (FIFO)", setup=_fifo_txt),
    Case("context-file-dev-zero", ["run", *TINY, "--context-file", "/dev/zero", "hi"],
         EXIT_USAGE, "/dev/zero is a device"),
    Case("context-file-over-4mib", ["run", *TINY, "--context-file", "{W}/big.txt", "hi"],
         EXIT_USAGE, "the limit is 4 MiB", setup=_big_text),
    Case("chat-context-file-fifo", ["chat", *TINY, "--context-file", "{W}/fifo.txt"],
         EXIT_USAGE, "is a named pipe", setup=_fifo_txt),
    Case("stdin-50mb", ["run", *TINY, "hi"], EXIT_USAGE, "stdin holds over 4 MiB",
         stdin=b"many words " * (50_000_000 // 11)),
    Case("bench-prompts-fifo", [*BENCH_BASE, "--prompts", "{W}/fifo.txt"], EXIT_USAGE,
         "prompts file", setup=_fifo_txt),
    Case("bench-prompts-dev-zero", [*BENCH_BASE, "--prompts", "/dev/zero"], EXIT_USAGE,
         "is a device"),
    # --- run: pairs and model files -----------------------------------------------------------
    Case("pair-unknown-looking", ["run", "no-such-pair-xyz", "hi"], EXIT_USAGE,
         "unknown pair 'no-such-pair-xyz'"),
    Case("pair-typo", ["run", "qwen2.5-coder-1.5bb", "hi"], EXIT_USAGE,
         "unknown pair 'qwen2.5-coder-1.5bb'"),
    Case("pair-and-model", ["run", "qwen2.5-coder-1.5b", *TINY, "hi"], EXIT_USAGE, "not both"),
    Case("target-missing", ["run", "-m", "{W}/nope.gguf", "hi"], EXIT_MODEL,
         "target model file not found"),
    Case("draft-missing", ["run", "-m", "{T}", "-md", "{W}/nope.gguf", "hi"], EXIT_MODEL,
         "draft model file not found"),
    Case("target-directory", ["run", "-m", "{W}", "hi"], EXIT_MODEL, "is a directory"),
    Case("target-fifo", ["run", "-m", "{W}/fifo.gguf", "hi"], EXIT_MODEL, "is a pipe",
         setup=_fifo),
    Case("draft-fifo", ["run", "-m", "{T}", "-md", "{W}/fifo.gguf", "hi"], EXIT_MODEL,
         "the draft model", setup=_fifo),
    Case("target-not-gguf", ["run", "-m", "{W}/x.gguf", "hi"], EXIT_MODEL, "target model:",
         setup=_write("x.gguf", "just some text, not a model\n")),
    Case("target-empty", ["run", "-m", "{W}/x.gguf", "hi"], EXIT_MODEL, "target model:",
         setup=_write("x.gguf", b"")),
    Case("target-truncated", ["run", "-m", "{W}/cut.gguf", "hi"], EXIT_MODEL,
         "target model:", setup=_truncated),
    Case("draft-truncated", ["run", "-m", "{T}", "-md", "{W}/cut.gguf", "hi"], EXIT_MODEL,
         "draft model:", setup=_truncated),
    Case("draft-other-vocab", ["run", "-m", "{T}", "-md", "{M}", "-t", "1", "hi"], EXIT_MODEL,
         "cannot speculate"),
    Case("target-unreadable", ["run", "-m", "{T}", "-t", "1", "hi"], EXIT_MODEL,
         "Permission denied", faults={"TANDEM_TEST_UNREADABLE": "{T}"}),
    # --- settings: environment, config, profiles ------------------------------------------
    Case("env-p-min-nan", ["run", *TINY, "hi"], EXIT_USAGE, "TANDEM_DRAFT_P_MIN",
         setup=lambda h, w, m: {"TANDEM_DRAFT_P_MIN": "nan"}),
    Case("env-ctx-text", ["run", *TINY, "hi"], EXIT_USAGE, "TANDEM_CTX_SIZE",
         setup=lambda h, w, m: {"TANDEM_CTX_SIZE": "big"}),
    Case("config-unknown-key", ["run", *TINY, "hi"], EXIT_USAGE, "known keys:",
         setup=_write("~/config.yaml", "zzz_nope: 1\n")),
    Case("config-nested-deep", ["run", *TINY, "hi"], EXIT_USAGE, "nested too deeply",
         setup=_write("~/config.yaml", DEEP + "\n")),
    Case("config-bad-yaml", ["run", *TINY, "hi"], EXIT_USAGE, "YAML syntax error",
         setup=_write("~/config.yaml", "speculative: [\n")),
    Case("config-alias-bomb", ["run", *TINY, "hi"], EXIT_USAGE,
         "uses more than 16 YAML aliases", setup=_write("~/config.yaml", LAUGHS)),
    Case("config-is-a-directory", ["run", *TINY, "hi"], EXIT_USAGE,
         "is a directory, not a config file", setup=lambda h, w, m: (h / "config.yaml").mkdir()),
    Case("profile-alias-bomb", ["hw", "--profile", "mine", "--force-profile"], EXIT_USAGE,
         "uses more than 16 YAML aliases", setup=_write("~/profiles/mine.yaml",
                                                         "extends: cpu\n" + LAUGHS)),
    Case("config-p-min-nan", ["run", *TINY, "hi"], EXIT_USAGE, "finite",
         setup=_write("~/config.yaml", "speculative:\n  p_min: .nan\n")),
    Case("profile-tier-nan", ["hw", "--profile", "mine", "--force-profile"], EXIT_USAGE,
         "finite", setup=_write("~/profiles/mine.yaml",
                                "extends: cpu\ntiers:\n  - min_memory_gib: .nan\n")),
    Case("profile-name-differs", ["hw", "--profile", "mine", "--force-profile"], EXIT_USAGE,
         "must match the file name", setup=_write("~/profiles/mine.yaml",
                                                  "extends: cpu\nname: other\n")),
    Case("profile-unknown", ["hw", "--profile", "no-such-profile"], EXIT_USAGE,
         "unknown profile"),
    # --- hw -------------------------------------------------------------------------------
    Case("hw-pair-and-model", ["hw", "--pair", "qwen2.5-coder-1.5b", "-m", "{T}"], EXIT_USAGE,
         "not both"),
    Case("hw-draft-alone", ["hw", "-md", "{D}"], EXIT_USAGE, "--model-draft needs --model"),
    Case("hw-target-fifo", ["hw", "-m", "{W}/fifo.gguf"], EXIT_MODEL, "is a pipe",
         setup=_fifo),
    # --- the store ------------------------------------------------------------------------
    Case("home-is-a-file", ["pairs"], EXIT_STORAGE, "is a file, not a directory",
         setup=_home_is_a_file),
    Case("registry-is-a-dir", ["pairs"], EXIT_STORAGE, "is a directory",
         setup=_registry_is_a_dir),
    Case("pull-home-is-a-file", PULL_TINY, EXIT_STORAGE, "is a file, not a directory",
         setup=_home_is_a_file),
    Case("pull-locks-is-a-file", PULL_TINY, EXIT_STORAGE, "locks is a file",
         setup=_in_home_a_file("locks")),
    Case("pull-models-is-a-file", PULL_TINY, EXIT_STORAGE, "models is a file",
         setup=_in_home_a_file("models")),
    Case("pull-tmp-is-a-file", PULL_TINY, EXIT_STORAGE, "tmp is a file",
         setup=_in_home_a_file("tmp")),
    Case("pull-home-read-only", PULL_TINY, EXIT_STORAGE, "read-only file system",
         faults={"TANDEM_TEST_READONLY": "{H}"}),
    Case("history-home-is-a-file", ["history"], EXIT_STORAGE, "is a file, not a directory",
         setup=_home_is_a_file),
    Case("history-json-home-is-a-file", ["history", "show", "--json"], EXIT_STORAGE,
         "is a file, not a directory", setup=_home_is_a_file),
    Case("history-clear-home-is-a-file", ["history", "clear"], EXIT_STORAGE,
         "is a file, not a directory", setup=_home_is_a_file),
    Case("pull-target-alone", ["pull", "--target", "org/tiny-GGUF/target.gguf"], EXIT_USAGE,
         "go together"),
    Case("pull-unknown-pair", ["pull", "no-such-pair"], EXIT_USAGE, "no-such-pair"),
    Case("pull-pair-and-target", ["pull", "qwen2.5-coder-1.5b", "--target", "a/b:Q4_K_M",
                                  "--draft", "a/c:Q4_K_M"], EXIT_USAGE, "not both"),
    Case("pull-escaping-path", ["pull", "--target", "org/repo/../../x.gguf", "--draft",
                                "org/repo/d.gguf"], EXIT_USAGE, "unsafe"),
    Case("pairs-check-other-vocab", ["pairs", "check", "{T}", "{M}"], EXIT_MODEL,
         "cannot speculate", stdout=True),
    Case("pairs-check-fifo", ["pairs", "check", "{W}/fifo.gguf", "{D}"], EXIT_MODEL,
         "not a regular file", setup=_fifo),
    Case("pairs-check-missing", ["pairs", "check", "./nope.gguf", "{D}"], EXIT_MODEL,
         "not found"),
    # --- spec-bench: refused before the benchmark -------------------------------------------
    Case("bench-out-is-a-file", [*BENCH, "--out", "{W}/p.txt"], EXIT_USAGE, "is a file",
         setup=PROMPT_FILE),
    Case("bench-out-under-a-file", [*BENCH, "--out", "{W}/p.txt/out"], EXIT_USAGE,
         "cannot be created", setup=PROMPT_FILE),
    Case("bench-predict-unknown", [*BENCH, "--predict", "no-such-profile"], EXIT_USAGE,
         "unknown profile", setup=PROMPT_FILE),
    Case("bench-reps-0", [*BENCH, "--reps", "0"], EXIT_USAGE, "--reps must be >= 1",
         setup=PROMPT_FILE),
    Case("bench-per-category-0", [*BENCH, "--per-category", "0"], EXIT_USAGE,
         "no prompts selected", setup=PROMPT_FILE),
    Case("bench-tune-home-a-file", [*BENCH, "--tune"], EXIT_STORAGE, "is a file",
         setup=_prompts_and_home_a_file),
    Case("bench-prompts-missing", [*BENCH_BASE, "--prompts", "{W}/none.jsonl"], EXIT_USAGE,
         "cannot read prompts file"),
    Case("bench-jsonl-field", [*BENCH_BASE, "--prompts", "{W}/p.jsonl"], EXIT_USAGE,
         "`category` must be a non-empty string",
         setup=_write("p.jsonl", '{"prompt": "hi", "category": 5}\n')),
    Case("bench-jsonl-deep", [*BENCH_BASE, "--prompts", "{W}/p.jsonl"], EXIT_USAGE,
         "nested too deeply", setup=_write("p.jsonl", DEEP + "\n")),
    Case("bench-predict-costs-list", [*BENCH, "--predict-costs", "{W}/gc.json"], EXIT_USAGE,
         "not a costs file",
         setup=lambda h, w, m: (PROMPT_FILE(h, w, m), _write("gc.json", "[]")(h, w, m))[1]),
    Case("bench-predict-costs-zero", [*BENCH, "--predict-costs", "{W}/gc.json"], EXIT_USAGE,
         "decode_ms of tiny must be a finite number > 0",
         setup=lambda h, w, m: (PROMPT_FILE(h, w, m),
                                _write("gc.json", _gpu_check_json(decode_ms=0))(h, w, m))[1]),
    Case("bench-predict-costs-types", [*BENCH, "--predict-costs", "{W}/gc.json"], EXIT_USAGE,
         "verify ratio for 2 tokens",
         setup=lambda h, w, m: (PROMPT_FILE(h, w, m), _write("gc.json", _gpu_check_json(
             verify={"ratio": {"1": 1.0, "2": "fast"}}))(h, w, m))[1]),
    Case("bench-predict-costs-shape-a-list", [*BENCH, "--predict-costs", "{W}/gc.json"],
         EXIT_USAGE, "no measured shape", setup=lambda h, w, m: (PROMPT_FILE(h, w, m), _write(
             "gc.json", '{"schema": 1, "shapes": {"tiny": [1, 2]}}')(h, w, m))[1]),
    Case("bench-sweep-not-a-number", [*BENCH, "--sweep", "draft-max=1,abc"], EXIT_USAGE,
         "--sweep draft-max: 'abc' is not a valid int", setup=PROMPT_FILE),
    Case("bench-sweep-out-of-range", [*BENCH, "--sweep", "draft-max=1,999"], EXIT_USAGE,
         "out of range", setup=PROMPT_FILE),
    Case("bench-sweep-bad-choice", [*BENCH, "--sweep", "kv-type=q2"], EXIT_USAGE,
         "is not one of", setup=PROMPT_FILE),
    # --- spec-bench: a full disk after the benchmark ----------------------------------------
    Case("bench-report-disk-full", [*BENCH, "--out", "{W}/out"], EXIT_STORAGE,
         "disk full while writing the benchmark report", setup=PROMPT_FILE,
         faults={"TANDEM_TEST_FULL": "report.json.tmp"}),
    # --- chat -----------------------------------------------------------------------------
    Case("chat-plain-probe-negative", ["chat", *TINY, "--plain-probe", "-5"], EXIT_USAGE,
         "--plain-probe must be >= 0"),
    Case("chat-pair-and-model", ["chat", "qwen2.5-coder-1.5b", *TINY], EXIT_USAGE, "not both"),
    Case("chat-temp-nan", ["chat", *TINY, "--temp", "nan"], EXIT_USAGE, "--temp"),
    Case("chat-seed-negative", ["chat", *TINY, "--seed", "-7"], EXIT_USAGE, "--seed"),
    Case("chat-stdin-endless-line", ["chat", *TINY, "-n", "4", "--plain-probe", "0"],
         EXIT_USAGE, "a line on stdin is over 4 MiB", stdin=b"x" * (5 << 20),
         stdout=True),
    Case("chat-system-surrogates", ["chat", *TINY, "-s", b"\xff"], EXIT_USAGE,
         "system prompt"),
]


@pytest.fixture
def sandbox(tmp_path, tiny_models):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    _store(home, tiny_models)
    return home, work


@pytest.fixture(scope="module")
def fake_hub(tiny_models):
    from fake_hub import FakeHubServer

    with FakeHubServer() as hub:
        hub.add("org/tiny-GGUF", "target.gguf", tiny_models["target"].read_bytes())
        hub.add("org/tiny-GGUF", "draft.gguf", tiny_models["draft"].read_bytes())
        yield hub


def test_the_matrix_is_large_enough():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


# Cases that run as a subprocess: the faults cli_faults.py injects into an interpreter of
# their own; those that load the models before they fail; and a few of each kind as smoke
# tests of the real entry point (argv as bytes, stdin, a FIFO, typer's own refusal, the
# store). Every other refusal comes before any model loads, and runs in this process.
SMOKE = {"seed-negative", "prompt-surrogates", "stdin-binary", "target-fifo", "no-such-flag",
         "config-unknown-key", "registry-is-a-dir", "pull-target-alone"}
LOADS_MODELS = {"chat-stdin-endless-line"}  # a chat reads stdin once its models are up


def _in_a_subprocess(case: Case) -> bool:
    return bool(case.faults) or case.id in SMOKE | LOADS_MODELS


def test_most_cases_run_in_process_and_a_few_as_subprocesses():
    separate = [c.id for c in CASES if _in_a_subprocess(c)]
    assert SMOKE | LOADS_MODELS <= {c.id for c in CASES}
    assert len(SMOKE) <= len(separate) <= len(CASES) // 4, separate


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, sandbox, tiny_models, fake_hub, tmp_path):
    home, work = sandbox
    env = {}
    if case.args[:1] == ["pull"]:
        env.update(_fake_hub_env(fake_hub.url, tmp_path / "hf"))
    if case.setup is not None:
        env.update(case.setup(home, work, tiny_models) or {})
    before_home, before_work = snapshot(home), snapshot(work)
    if _in_a_subprocess(case):
        res = run_cli(case.args, home=home, work=work, models=tiny_models, stdin=case.stdin,
                      env=env, faults=case.faults)
    else:
        res = run_in_process(case.args, home=home, work=work, models=tiny_models,
                             stdin=case.stdin, env=env)
    check_error(res, case.code, case.message)
    assert case.stdout or res.stdout == b""
    assert snapshot(home) == before_home
    # files only: a refused spec-bench may leave its --out directory, empty
    assert snapshot(work) == before_work
    assert leftovers(tmp_path) == []


def test_no_download_for_an_unknown_pair_in_an_empty_store(tmp_path, tiny_models):
    """The typo is refused before the default pair (gigabytes) could be fetched."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    res = run_in_process(["run", "no-such-pair-xyz", "hi"], home=home, work=work,
                         models=tiny_models)
    check_error(res, EXIT_USAGE, "unknown pair")
    assert not home.exists()


def test_a_pair_like_word_can_still_be_a_prompt(tmp_path, tiny_models):
    """Quoted as one argument, or a single word with no close pair, it is prompt text."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    for args in (["well-known facts"], ["re-write"]):
        res = run_cli(["run", *TINY, "--raw", "-n", "2", *args], home=home, work=work,
                      models=tiny_models)
        assert res.returncode == EXIT_OK, res.stderr.decode()


# ------------------------------------------------------------------- streams and signals


def test_stdout_closed(sandbox, tiny_models):
    home, work = sandbox
    res = run_cli(["run", *TINY, "hi"], home=home, work=work, models=tiny_models,
                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                  preexec_fn=lambda: os.close(1))
    check_error(res, EXIT_USAGE, "stdout is closed")


@pytest.mark.parametrize("args", [["run", *TINY, "--raw", "-n", "8", "hi"],
                                  ["pairs", "--json"], ["hw", "--json"]],
                         ids=["run", "pairs-json", "hw-json"])
def test_stdout_on_a_full_device(args, sandbox, tiny_models):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    home, work = sandbox
    before = snapshot(home)
    with open("/dev/full", "wb") as full:
        res = run_cli(args, home=home, work=work, models=tiny_models, stdout=full,
                      stderr=subprocess.PIPE)
    check_error(res, EXIT_OUTPUT, "stdout's device is full")
    assert snapshot(home) == before or args[0] == "run"  # run may cache its cost figures


def test_stderr_closed_keeps_errors_off_stdout(sandbox, tiny_models):
    home, work = sandbox
    res = run_cli(["run", *TINY, "--temp", "nan", "hi"], home=home, work=work,
                  models=tiny_models, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                  preexec_fn=lambda: os.close(2))
    assert res.returncode == EXIT_USAGE
    assert res.stdout == b""


def test_reader_going_away_is_a_quiet_exit_0(sandbox, tiny_models):
    """`tandem run ... | head -c 1`: EPIPE ends tandem quietly with 0, as other tools."""
    home, work = sandbox
    env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_STRATEGY": "draft"}
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "run", *_args(TINY, tiny_models),
                             "--raw", "-n", "2000", "-c", "4096", "hello"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=work)
    assert proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_OK, err
    assert err == ""


def _signal_mid_answer(sandbox, tiny_models, sig) -> tuple[int, str, str]:
    """`tandem run` on a long answer, `sig` once its first byte is out: (exit code, stdout,
    stderr)."""
    home, work = sandbox
    env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_STRATEGY": "draft"}
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "run", *_args(TINY, tiny_models),
                             "--raw", "-n", "4000", "-c", "4096", "hello"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=work,
                            # a suite started in the background inherits SIGINT ignored, and
                            # Python then never raises KeyboardInterrupt: restore the default
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    first = proc.stdout.read(1)
    assert first, proc.stderr.read().decode()
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=120)
    return proc.returncode, (first + rest).decode(errors="replace"), err.decode()


def test_ctrl_c_prints_interrupted_and_exits_130(sandbox, tiny_models):
    code, out, err = _signal_mid_answer(sandbox, tiny_models, signal.SIGINT)
    assert code == 130, err
    assert err.rstrip("\n").endswith("Interrupted.") and err.endswith("\n"), err
    assert "Traceback" not in err
    assert out.endswith("\n")  # the partial answer's line is ended


def test_sigterm_is_handled_like_ctrl_c_and_exits_143(sandbox, tiny_models):
    """`kill PID` mid-answer: the partial answer's line is ended, `Terminated.` on stderr,
    exit 143 (128 + SIGTERM), no traceback, no stray temporary file."""
    code, out, err = _signal_mid_answer(sandbox, tiny_models, signal.SIGTERM)
    assert code == errors.EXIT_TERMINATED == 143, err
    assert err.rstrip("\n").endswith("Terminated.") and "Traceback" not in err, err
    assert out.endswith("\n")
    assert leftovers(sandbox[0]) == []


def _args(args, models):
    return [a.format(T=models["target"], D=models["draft"]) for a in args]


# ------------------------------------------------------------ surprises, now said or done


def test_config_unknown_key_lists_the_config_keys(tmp_path):
    """Not the profile-only keys (recommended_pairs, tiers...), which a config cannot take."""
    from tandem.config.settings import load_user_config
    from tandem.config.files import SettingsFileError

    path = tmp_path / "config.yaml"
    path.write_text("zzz_nope: 1\n")
    with pytest.raises(SettingsFileError) as exc:
        load_user_config(path)
    assert "force_profile" in exc.value.message and "speculative" in exc.value.message
    assert "recommended_pairs" not in exc.value.message and "tiers" not in exc.value.message


def test_an_alias_bomb_is_refused_without_expanding_it(sandbox, tiny_models):
    """Refused while composing, so it ends at once (it once took 49 s and 5.5 GB, then a Python
    fatal error) and the message shows no expanded value."""
    home, work = sandbox
    (home / "config.yaml").write_text(LAUGHS)
    res = run_cli(["run", *TINY, "hi"], home=home, work=work, models=tiny_models, timeout=30)
    check_error(res, EXIT_USAGE, "config.yaml, line 3")  # the 17th alias
    assert "lol" not in res.stderr.decode()
    (home / "config.yaml").write_text("a: &x 2\nthreads: *x\n")  # a few aliases are fine
    from tandem.config.files import load_yaml

    assert load_yaml(home / "config.yaml") == {"a": 2, "threads": 2}


def test_seed_minus_one_means_random(sandbox, tiny_models):
    home, work = sandbox
    res = run_cli(["run", *TINY, "--raw", "-n", "4", "--temp", "0.8", "--seed", "-1", "hi"],
                  home=home, work=work, models=tiny_models)
    assert res.returncode == EXIT_OK, res.stderr.decode()


@pytest.mark.parametrize("args,warning", [
    (["-m", "{T}", "-md", "{T}", "-t", "1"], "the draft is the target itself"),
    (["-m", "{T}", "-md", "{D}", "-t", str((os.cpu_count() or 1) + 1)],
     "exceeds this machine's"),
], ids=["target-is-draft", "threads-over-cores"])
def test_warnings(args, warning, sandbox, tiny_models):
    home, work = sandbox
    res = run_cli(["run", *args, "--raw", "-n", "2", "hi"], home=home, work=work,
                  models=tiny_models, env={"TANDEM_STRATEGY": "draft"})
    err = res.stderr.decode()
    assert res.returncode == EXIT_OK, err
    assert any(line.startswith("Warning: ") and warning in line for line in err.splitlines()), err


def test_unknown_tandem_variables_get_one_warning(sandbox, tiny_models):
    home, work = sandbox
    res = run_cli(["run", *TINY, "--raw", "-n", "2", "hi"], home=home, work=work,
                  models=tiny_models, env={"TANDEM_TEMP": "2", "TANDEM_THREAD": "1",
                                           "TANDEM_ZZZ": "x"})
    err = res.stderr.decode()
    assert res.returncode == EXIT_OK, err
    lines = [line for line in err.splitlines() if "unknown environment variable" in line]
    assert len(lines) == 1 and lines[0].startswith("Warning: "), err
    assert "TANDEM_TEMP (no variable sets it: pass --temp)" in lines[0]
    assert "TANDEM_THREAD (did you mean TANDEM_THREADS?)" in lines[0] and "TANDEM_ZZZ" in lines[0]


def test_every_variable_tandem_reads_is_known():
    """No legitimate variable warns: every TANDEM_* name in the code, scripts and docs."""
    from tandem.config.schema import KNOWN_ENV, unknown_env

    names = set()
    for folder in ("cli", "scripts", "tests", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".md") and "build" not in path.parts:
                names |= set(re.findall(r"\bTANDEM_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text(
                    errors="replace")))
    names -= {"TANDEM_TEMP", "TANDEM_THREAD", "TANDEM_ZZZ", "TANDEM_TEST"}  # this file's typos
    assert names - KNOWN_ENV == set()
    assert unknown_env({n: "1" for n in KNOWN_ENV}) is None


def test_an_answer_cut_at_the_context_end_says_so(sandbox, tiny_models):
    home, work = sandbox
    res = run_cli(["run", *TINY, "--raw", "-c", "256", "-n", "400",
                   "hello " * 20], home=home, work=work, models=tiny_models,
                  env={"TANDEM_STRATEGY": "draft"})
    err = res.stderr.decode()
    assert res.returncode == EXIT_OK, err
    lines = [line for line in err.splitlines() if "end of the context" in line]
    assert len(lines) == 1 and lines[0].startswith("Warning: "), err
    assert "(256 tokens)" in lines[0] and "of the 400 tokens asked for" in lines[0]


def test_swapped_pair_warning(tmp_path):
    from tandem.commands.compose import pair_warnings

    small, big = tmp_path / "small.gguf", tmp_path / "big.gguf"
    small.write_bytes(b"x" * 10)
    big.write_bytes(b"x" * 1000)
    assert any("swapped" in w for w in pair_warnings(small, big))
    assert pair_warnings(big, small) == []


def test_nested_tuned_file_is_skipped_with_a_warning(sandbox, tiny_models):
    from tandem.config.tuned import tuned_path

    home, work = sandbox
    path = tuned_path(home, tiny_models["target"], tiny_models["draft"], 1)  # the run's -t 1
    path.parent.mkdir()
    path.write_text(DEEP)
    res = run_cli(["run", *TINY, "--raw", "-n", "2", "hi"], home=home, work=work,
                  models=tiny_models)
    err = res.stderr.decode()
    assert res.returncode == EXIT_OK, err
    assert "Warning: ignored tuned settings" in err and "nested too deeply" in err


@pytest.mark.parametrize("overall,why", [
    ({"strategy": "draft", "n_min": 9, "n_max": 3}, "n_min must not exceed"),
    ({"strategy": "draft", "n_max": -4}, "n_max"),
    ({"strategy": "warp"}, "strategy"),
    ({"strategy": "draft", "p_min": "high"}, "p_min"),
    ({"strategy": "draft", "target_ctx": {"n_batch": 8, "n_ubatch": 64}}, "n_ubatch"),
], ids=["n-min-over-n-max", "n-max-negative", "strategy-unknown", "p-min-text",
        "ubatch-over-batch"])
def test_an_invalid_tuned_file_is_ignored_with_a_warning(overall, why, sandbox, tiny_models):
    """The docs promise that a tuned result never stops `tandem run`."""
    from tandem.config.tuned import tuned_path

    home, work = sandbox
    path = tuned_path(home, tiny_models["target"], tiny_models["draft"], 1)  # the run's -t 1
    path.parent.mkdir()
    path.write_text(json.dumps({"overall": overall}))
    res = run_cli(["run", *TINY, "--raw", "-n", "2", "hi"], home=home, work=work,
                  models=tiny_models)
    err = res.stderr.decode()
    assert res.returncode == EXIT_OK, err
    warned = [line for line in err.splitlines() if line.startswith("Warning: ignored tuned")]
    assert len(warned) == 1 and why in warned[0], err


def test_full_disk_for_the_cost_cache_leaves_no_tmp(sandbox, tiny_models):
    home, work = sandbox
    res = run_cli(["run", *TINY, "--strategy", "auto", "--raw", "-n", "4", "hi"], home=home,
                  work=work, models=tiny_models, faults={"TANDEM_TEST_FULL": "*.tmp"})
    assert res.returncode == EXIT_OK, res.stderr.decode()
    assert leftovers(home) == []


def test_corrupt_registry_is_set_aside_with_a_warning(sandbox, tiny_models):
    home, work = sandbox
    (home / "registry.json").write_text("{not json")
    res = run_cli(["pairs"], home=home, work=work, models=tiny_models)
    err = res.stderr.decode()
    assert res.returncode == EXIT_OK, err
    assert "Warning: ignored the model registry" in err and "registry.json.bad" in err
    assert (home / "registry.json.bad").read_text() == "{not json"


def test_registry_is_as_readable_as_the_models(tmp_path, tiny_models):
    from tandem.models.catalog import ModelSpec
    from tandem.models.store import Store
    from tandem.models.transfer import FetchResult

    store = Store(tmp_path / "home")
    spec = ModelSpec(name="m", repo="org/r", filename="m.gguf")
    store._register(spec, FetchResult(size=1, sha256="0" * 64, source="local"))
    mask = os.umask(0)
    os.umask(mask)
    assert (store.registry_path.stat().st_mode & 0o777) == 0o666 & ~mask


def test_chat_refuses_a_non_utf8_line_and_goes_on(sandbox, tiny_models):
    home, work = sandbox
    res = run_cli(["chat", *TINY, "-n", "4", "--plain-probe", "0"], home=home, work=work,
                  models=tiny_models, stdin=b"caf\xe9\nhello\n/exit\n")
    out, err = res.stdout.decode(errors="replace"), res.stderr.decode()
    assert res.returncode == EXIT_OK, err
    assert "that line is not valid UTF-8" in out
    assert "Loading" not in out and "Finding" not in out  # notes are not chat output
    assert "tok/s" in out  # the next line was answered


def test_chat_refuses_add_of_a_fifo_and_goes_on(sandbox, tiny_models):
    """/add of a named pipe once blocked forever (Ctrl-C then ended the whole chat)."""
    home, work = sandbox
    os.mkfifo(work / "fifo.txt")
    res = run_cli(["chat", *TINY, "-n", "4", "--plain-probe", "0"], home=home, work=work,
                  models=tiny_models, stdin=b"/add fifo.txt\n/add /dev/zero\nhello\n/exit\n",
                  timeout=60)
    out, err = res.stdout.decode(errors="replace"), res.stderr.decode()
    assert res.returncode == EXIT_OK, err
    assert "fifo.txt is a named pipe (FIFO)" in out + err, out + err
    assert "/dev/zero is a device" in out + err, out + err
    assert "Traceback" not in err
    assert "tok/s" in out  # the next line was answered


def test_chat_from_dev_zero_ends_with_an_error(sandbox, tiny_models):
    """`tandem chat < /dev/zero` is one endless line: refused after reading the bound."""
    home, work = sandbox
    env = {**os.environ, "TANDEM_HOME": str(home), "NO_COLOR": "1"}
    with open("/dev/zero", "rb") as zero:
        res = subprocess.run([sys.executable, "-m", "tandem", "chat",
                              *_args(TINY, tiny_models), "-n", "4", "--plain-probe", "0"],
                             stdin=zero, capture_output=True, env=env, cwd=work, timeout=60)
    check_error(res, EXIT_USAGE, "a line on stdin is over 4 MiB")


def test_download_progress_is_shown_when_stderr_is_not_a_terminal():
    import io

    from rich.console import Console
    from tandem.commands.progress import ProgressView
    from tandem.models.transfer import ProgressEvent

    now = [0.0]
    buf = io.StringIO()
    view = ProgressView(Console(file=buf, width=200), bars=False, clock=lambda: now[0])
    total = 1_000_000_000
    view(ProgressEvent("download", "big.gguf", 0, total))
    now[0] = 31.0
    view(ProgressEvent("download", "big.gguf", 10_000_000, total))  # 1%: the timer speaks
    now[0] = 32.0
    view(ProgressEvent("download", "big.gguf", 20_000_000, total))  # 1 s later: silent
    view(ProgressEvent("download", "big.gguf", 260_000_000, total))  # 26%: a quarter
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("Downloading big.gguf (1.0 GB)")
    assert lines[1].strip() == "big.gguf: 10.0 MB of 1.0 GB (1%)"
    assert lines[2].strip() == "big.gguf: 25%"
    assert len(lines) == 3


def test_run_shows_download_progress_and_notes_a_damaged_file(monkeypatch, tmp_path,
                                                               fake_hub, tiny_models):
    """A pair fetched on the way by run/chat/spec-bench reports on stderr, and a store file
    that no longer matches its record is said to be fetched again."""
    import io

    from rich.console import Console
    from tandem.commands import options as app
    from tandem.commands.progress import ProgressView
    from tandem.models import catalog
    from tandem.models.refs import hub_spec

    for key, value in _fake_hub_env(fake_hub.url, tmp_path / "hf").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    target, draft = hub_spec("org/tiny-GGUF", "target.gguf"), hub_spec("org/tiny-GGUF",
                                                                        "draft.gguf")
    pair = catalog.PairSpec(name="tiny", target=target, draft=draft)
    monkeypatch.setattr(catalog, "get_pair", lambda name=None: pair)
    buf = io.StringIO()
    view = ProgressView(Console(file=buf, width=200), bars=False)
    t, d = app.resolve_models("tiny", None, None, view, view.note, yes=True)
    assert t.is_file() and d.is_file()
    assert "Downloading org/tiny-GGUF/target.gguf" in buf.getvalue()
    assert "Note: tiny is not on disk: a download of unknown size (target.gguf, draft.gguf)" \
        in buf.getvalue()
    # damage the draft: same name, other size -> fetched again, and said so
    data = d.read_bytes()
    d.unlink()  # the store file may be a link into the HF cache: replace it, not the blob
    d.write_bytes(data[:100])
    buf.truncate(0)
    buf.seek(0)
    app.resolve_models("tiny", None, None, view, view.note, yes=True)
    assert "Note: draft.gguf in the store does not match its record" in buf.getvalue()
    assert d.read_bytes() == data  # fetched again (here from the HF cache)


def test_a_large_download_needs_a_yes(monkeypatch, tmp_path, fake_hub, capsys):
    """A pair not on disk names its size before downloading; over CONFIRM_DOWNLOAD_BYTES
    (here a catalog size of 3 GB, served by the fake hub as the tiny models) `run` asks at a
    terminal and is refused elsewhere without --yes, and nothing is downloaded; with --yes
    it downloads and answers. Below the limit it downloads with a note."""
    import io
    from dataclasses import replace

    from tandem.commands import options
    from tandem.commands.app import main
    from tandem.models import catalog
    from tandem.models.refs import hub_spec

    for key, value in _fake_hub_env(fake_hub.url, tmp_path / "hf").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TANDEM_STRATEGY", "draft")
    monkeypatch.setenv("TANDEM_THREADS", "1")

    def use_pair(gb: float):
        specs = [replace(hub_spec("org/tiny-GGUF", f), approx_size=int(gb / 2 * 1e9))
                 for f in ("target.gguf", "draft.gguf")]
        pair = catalog.PairSpec(name="tinypair", target=specs[0], draft=specs[1])
        monkeypatch.setattr(catalog, "get_pair", lambda name=None: pair)

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["tandem", "run", "tinypair", "--raw", "-n", "4",
                                          *args, "hi"])
        if not sys.stdin.isatty():  # nothing piped in
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO()))
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        return code, *capsys.readouterr()

    def fetched() -> int:  # GETs of the files so far (the hub serves the whole module)
        return len(fake_hub.gets("target.gguf")) + len(fake_hub.gets("draft.gguf"))

    served = fetched()
    use_pair(3.0)
    code, out, err = run()
    assert code == EXIT_USAGE and out == "", err
    assert ("Error: tinypair is not on disk and needs a ~3.0 GB download (target.gguf, "
            "draft.gguf); a download over 2.0 GB or of unknown size needs a yes") in err
    assert "Hint: pass --yes to download it, or run `tandem pull tinypair` first" in err
    assert fetched() == served
    # at a terminal it asks; "no" downloads nothing
    asked = []
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(options.typer, "confirm", lambda text, **kw: asked.append(text) or False)
    code, out, err = run()
    assert code == EXIT_USAGE and "not downloading tinypair" in err
    assert asked and asked[0].startswith("tinypair is not on disk and needs a ~3.0 GB download")
    assert asked[0].endswith("Download it now?") and fetched() == served
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    code, out, err = run("--yes")
    assert code == EXIT_OK, err
    assert "Note: tinypair is not on disk: a ~3.0 GB download (target.gguf, draft.gguf)" in err
    assert out.strip() and fetched() > served
    # on disk now: not a word about downloads
    code, out, err = run()
    assert code == EXIT_OK and "not on disk" not in err
    # a small pair downloads with a note, no question
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home2"))
    use_pair(1.6)
    code, out, err = run()
    assert code == EXIT_OK, err
    assert "Note: tinypair is not on disk: a ~1.6 GB download (target.gguf, draft.gguf) into " \
        f"{tmp_path / 'home2'}" in err


# ---------------------------------------------------------------------- the exit code table


def _doc_table() -> dict[str, int]:
    text = (ROOT / "docs" / "errors.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(EXIT_\w+)` \|", text, re.M)
    return {name: int(code) for code, name in rows}


def test_docs_list_every_exit_code():
    documented = _doc_table()
    defined = {n: v for n, v in vars(errors).items() if n.startswith("EXIT_")}
    assert documented == defined
    # one meaning per code: a script can tell a failed download (4) from tandem's own files
    # (7) and from stdout (8)
    assert len(set(defined.values())) == len(defined), defined
    # and every TandemError's exit code is one of them
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.TandemError)]
    assert {c.exit_code for c in classes} <= set(defined.values())
