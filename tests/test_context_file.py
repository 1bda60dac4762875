"""--context-file puts the file in the prompt: the model reads it, before the request, inside
the user message (issue 51: README's `tandem run --context-file app.py "Add logging to load()
in app.py"` answered with an invented `def load():`, the file having only fed drafting).
--draft-from FILE is the draft-only source it used to be. A file too large for the context
is a usage error that counts its tokens."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tandem.engine.prompt_files import file_block, with_files

APP = "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n"


def test_a_file_is_its_name_and_text_in_a_fence_before_the_request():
    text = with_files("Add logging to load()", [("app.py", APP)])
    assert text == "File app.py:\n```\n" + APP + "```\n\nAdd logging to load()"
    assert with_files("hi", []) == "hi"
    two = with_files("hi", [("a.py", "x = 1"), ("b.md", "y")])
    assert two.index("File a.py:") < two.index("File b.md:") < two.index("\n\nhi")


def test_a_fence_in_the_file_cannot_end_its_block():
    readme = "Run it:\n\n````sh\nmake\n````\n"
    block = file_block("README.md", readme)
    assert block.startswith("File README.md:\n`````\n") and block.endswith("\n`````")
    assert readme.rstrip("\n") in block


# ------------------------------------------------------------------------ tandem run

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama_cpp is not built")


@pytest.fixture(scope="module")
def run_json(tiny_models, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    base = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t", "1"]

    def run(*args: str, ok: bool = True):
        env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_STRATEGY": "draft"}
        res = subprocess.run([sys.executable, "-m", "tandem", "run", *base, "--json", "-n", "4",
                              *args], capture_output=True, text=True, env=env, timeout=120,
                             stdin=subprocess.DEVNULL)
        if ok:
            assert res.returncode == 0, res.stderr
            return json.loads(res.stdout)["stats"]
        return res

    return run


@needs_llama
def test_the_prompt_grows_by_the_file_and_draft_from_leaves_it(run_json, tiny_models, tmp_path):
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions

    app = tmp_path / "app.py"
    app.write_text(APP)
    request = "Add logging to load() in app.py"
    plain = run_json(request)["n_prompt"]
    shown = run_json("--context-file", str(app), request)["n_prompt"]
    drafted = run_json("--draft-from", str(app), request)["n_prompt"]
    opts = SessionOptions(strategy="none", target_ctx=ContextParams(n_ctx=512, n_threads=1))
    with PairSession(tiny_models["target"], None, opts) as pair:
        n_file = len(pair.tokenize(APP))
        block = len(pair.tokenize(with_files(request, [(str(app), APP)]))) - len(
            pair.tokenize(request))
    assert drafted == plain  # drafting sources are not in the prompt
    assert shown - plain >= n_file  # the whole file is in it...
    assert abs((shown - plain) - block) <= 2  # ...as its block (the name, the fences)


def _main(monkeypatch, capsys, *argv: str) -> int:
    from test_structure import _main as main

    return main(monkeypatch, capsys, *argv)


@needs_llama
def test_the_user_message_holds_the_file_then_the_request(monkeypatch, capsys, tiny_models,
                                                          tmp_path):
    """The messages the pair renders, as run sends them (a spy that passes them on)."""
    from tandem.engine.pair import PairSession

    seen: list[list[dict]] = []
    real = PairSession.prompt_tokens

    def spy(self, messages, raw=False, tools=None):
        seen.append([dict(m) for m in messages])
        return real(self, messages, raw, tools)

    monkeypatch.setattr(PairSession, "prompt_tokens", spy)
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "notes.md").write_text("load() reads JSON config files.\n")
    models = ["-m", str(tiny_models["target"]), "-t", "1", "-n", "2", "--strategy", "auto"]
    assert _main(monkeypatch, capsys, "run", *models, "-s", "Be brief.", "--context-file",
                 str(tmp_path / "app.py"), "--context-file", str(tmp_path / "notes.md"),
                 "--draft-from", str(tmp_path / "notes.md"), "Add logging to load()") == 0
    system, user = seen[-1]
    assert system == {"role": "system", "content": "Be brief."}
    assert user["role"] == "user" and user["content"] == with_files(
        "Add logging to load()", [(str(tmp_path / "app.py"), APP),
                                  (str(tmp_path / "notes.md"), "load() reads JSON config files.\n")])
    assert _main(monkeypatch, capsys, "run", *models, "--draft-from", str(tmp_path / "app.py"),
                 "Add logging to load()") == 0
    assert seen[-1] == [{"role": "user", "content": "Add logging to load()"}]


@needs_llama
def test_a_file_too_large_for_the_context_is_a_usage_error(run_json, tmp_path):
    big = tmp_path / "big.py"
    big.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    res = run_json("-c", "256", "--context-file", str(big), "hi", ok=False)
    assert res.returncode == 2, res.stderr
    error, hint = res.stderr.strip().splitlines()[-2:]
    assert error.startswith("Error: the prompt with its context files is ")
    n_prompt = int(error.split(" is ")[1].split()[0])
    n_file = int(error.split(f"{big} ")[1].split()[0])
    assert n_file < n_prompt and n_prompt > 256 and "context holds 256" in error
    assert hint.startswith("Hint: raise --ctx-size (-c ") and "--draft-from" in hint
    need = int(hint.split("(-c ")[1].split()[0])
    assert need > n_prompt and need % 256 == 0
    assert res.stdout == ""
    # the same file only drafted from: the prompt is "hi"
    assert run_json("-c", "256", "--draft-from", str(big), "hi")["n_prompt"] < 64
    assert run_json("-c", str(need), "--context-file", str(big), "hi")["n_prompt"] == n_prompt


# ------------------------------------------------------------------------ chat


@pytest.fixture
def pair(tiny_models):
    pytest.importorskip("llama_cpp")
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions

    opts = SessionOptions(strategy="draft",
                          target_ctx=ContextParams(n_ctx=512, n_batch=512, n_threads=1))
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as p:
        yield p


def _answer(chat, text):
    for _ in chat.send(text):
        pass


def test_chat_files_stay_before_the_first_message_in_the_context(pair):
    from tandem.chat.conversation import ChatSession
    from tandem.engine.loop.speculative import GenParams

    chat = ChatSession(pair, system="S", gen=GenParams(max_tokens=4), files=[("app.py", APP)],
                       reserve=64)
    assert chat.files[0][2] == len(pair.tokenize(APP))
    assert "app.py" in pair.context_files  # and auto drafts from it
    _answer(chat, "first")
    msgs = chat.messages("second")
    assert msgs[1]["content"] == with_files("first", [("app.py", APP)])
    assert [m["content"] for m in msgs[2:]] == [chat.turns[0].assistant, "second"]
    # old turns dropped to fit: the files go with the first message still in the context
    while chat.context_start == 0:
        _answer(chat, "a longer message to fill the context " * 6)
    first = chat.messages()[1]
    assert first["content"].startswith("File app.py:\n```\n" + APP)
    assert chat.session_stats()["files_in_prompt"] == ["app.py"]


def test_chat_add_puts_the_file_in_the_prompt_unless_it_cannot_fit(pair, tmp_path):
    from tandem.chat.conversation import ChatSession
    from tandem.engine.loop.speculative import GenParams
    from tandem.errors import UsageError

    chat = ChatSession(pair, gen=GenParams(max_tokens=4))
    _answer(chat, "hello")
    (tmp_path / "app.py").write_text(APP)
    res = chat.command(f"/add {tmp_path / 'app.py'}")
    assert "the model reads it" in res.message and res.data["tokens"] > 5
    assert chat.messages("next")[0]["content"].startswith(f"File {tmp_path / 'app.py'}:\n")
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * 400)
    with pytest.raises(UsageError, match=r"context files is \d+ tokens .*big\.py \d+ tokens"):
        chat.command(f"/add {big}")
    assert [name for name, _, _ in chat.files] == [str(tmp_path / "app.py")]  # not added
    assert "big.py" not in pair.context_files


# ------------------------------------------------------------------------ the real pair


@pytest.mark.slow
def test_the_real_pair_answers_about_the_file_it_read(real_pair, tmp_path):
    """README's example, greedy: the answer keeps load()'s real signature, `load(path)`."""
    target, draft = real_pair
    (tmp_path / "app.py").write_text(APP)
    res = subprocess.run([sys.executable, "-m", "tandem", "run", "-m", str(target), "-md",
                          str(draft), "--temp", "0", "-n", "200", "--context-file", "app.py",
                          "Add logging to load() in app.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert "def load(path)" in res.stdout, res.stdout


def test_serve_drafts_from_files_and_puts_none_into_its_clients_prompts(tmp_path):
    """A server's clients send their own prompts: serve takes --draft-from, and its
    --context-file is refused with that hint (it had fed drafting only, under run's name)."""
    import typer

    from tandem.commands.app import app
    from tandem.commands.options import llama_args
    from tandem.errors import UsageError

    command = typer.main.get_command(app)
    app_py = tmp_path / "app.py"
    app_py.write_text(APP)
    assert "--draft-from" in llama_args(command, ["serve", "--draft-from", str(app_py)])
    with pytest.raises(UsageError) as err:
        llama_args(command, ["serve", "--context-file", str(app_py)])
    assert "--context-file" in str(err.value) and "--draft-from" in err.value.hint
