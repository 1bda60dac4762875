"""The chat core on tiny models: history, KV reuse across turns, dropping old turns, /save,
slash commands."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")

from tandem.engine.backend import template as chat_template  # noqa: E402
from tandem.chat.conversation import (  # noqa: E402
    COMMANDS,
    ChatSession,
    Notice,
    message_text,
    parse_command,
)
from tandem.engine.loop.events import DoneEvent, PrefillEvent, TokenEvent  # noqa: E402
from tandem.engine.backend.llama import ContextParams, common_prefix  # noqa: E402
from tandem.engine.pair import PairSession, SessionOptions  # noqa: E402
from tandem.engine.loop.speculative import GenParams  # noqa: E402
from tandem.errors import ContextOverflowError, TandemError, UsageError  # noqa: E402


def make_pair(tiny_models, n_ctx=2048, draft=True, n_batch=512):
    opts = SessionOptions(strategy="draft" if draft else "none",
                          target_ctx=ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_threads=1))
    return PairSession(tiny_models["target"], tiny_models["draft"] if draft else None, opts)


@pytest.fixture()
def pair(tiny_models):
    with make_pair(tiny_models) as p:
        yield p


def answer(chat, text):
    """Run a turn; returns (DoneEvent or None, [Notice])."""
    done, notices = None, []
    for ev in chat.send(text):
        if isinstance(ev, DoneEvent):
            done = ev
        elif isinstance(ev, Notice):
            notices.append(ev)
    return done, notices


def test_history_and_template(pair):
    chat = ChatSession(pair, system="You are terse.", gen=GenParams(max_tokens=12))
    d1, _ = answer(chat, "hello there")
    d2, _ = answer(chat, "and now?")
    assert [t.user for t in chat.turns] == ["hello there", "and now?"]
    assert chat.turns[0].assistant == d1.text and chat.turns[1].assistant == d2.text
    assert d1.stats.n_generated == 12 and chat.turns[0].reason == "length"
    msgs = chat.messages("third")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    # the GGUF template (sandboxed Jinja) renders the whole conversation
    text = chat_template.render(pair.target, msgs)
    assert text.startswith("<|system|>\nYou are terse.\n<|user|>\nhello there\n<|assistant|>\n")
    assert text.endswith("<|user|>\nthird\n<|assistant|>\n")
    assert len(pair.prompt_tokens(msgs)) > d2.stats.n_prompt


def test_second_turn_reuses_the_kv_caches(pair):
    chat = ChatSession(pair, system="Be brief.", gen=GenParams(max_tokens=24))
    long_question = "Explain the following code in detail: " + "def f(x): return x * 2; " * 20
    d1, _ = answer(chat, long_question)
    assert d1.stats.n_prompt_eval == d1.stats.n_prompt  # nothing cached yet
    cached_before = list(pair.target_ctx.tokens)
    draft_decoded = pair.draft_ctx.n_decoded
    prompt2 = pair.prompt_tokens(chat.messages("Thanks. Shorter?"))
    new = len(prompt2) - common_prefix(cached_before, prompt2)
    d2, _ = answer(chat, "Thanks. Shorter?")
    assert d2.stats.n_prompt == len(prompt2)
    # only what the first turn's cache lacked is evaluated, not the whole conversation
    assert d2.stats.n_prompt_eval <= new + 1
    assert d2.stats.n_prompt_eval < d2.stats.n_prompt / 5
    # the draft model reused its cache too: it evaluated the new prompt tokens and its drafts,
    # far fewer than the conversation's length
    assert pair.draft_ctx.n_decoded - draft_decoded < len(prompt2) / 2


def test_prefill_reports_progress_in_chunks(tiny_models):
    with make_pair(tiny_models, n_batch=64) as p:
        chat = ChatSession(p, gen=GenParams(max_tokens=4))
        events = [ev for ev in chat.send("word " * 150) if isinstance(ev, PrefillEvent)]
        totals = {ev.total for ev in events}
        assert len(totals) == 1 and totals.pop() > 150
        dones = [ev.done for ev in events]
        assert dones == sorted(dones) and dones[0] == 0 and dones[-1] == events[-1].total
        assert len(dones) >= 4  # several chunks of 64


def test_context_fill_drops_the_oldest_turns(tiny_models):
    with make_pair(tiny_models, n_ctx=512) as p:
        chat = ChatSession(p, gen=GenParams(max_tokens=40), reserve=64)
        dropped_at = None
        for i in range(12):
            done, notices = answer(chat, f"message number {i}: " + "tell me more " * 4)
            assert done is not None and done.stats.n_prompt + 64 <= chat.n_ctx
            if notices:
                assert notices[0].kind == "dropped" and notices[0].dropped_turns >= 1
                assert "dropped the" in notices[0].message and "oldest turn" in notices[0].message
                dropped_at = i
                break
        assert dropped_at is not None, "the context never filled"
        assert chat.context_start >= 1 and chat.dropped_turns == chat.context_start
        # the transcript keeps everything; the prompt has only the kept turns
        assert len(chat.turns) == dropped_at + 1
        users = [m["content"] for m in chat.messages() if m["role"] == "user"]
        assert users[0].startswith(f"message number {chat.context_start}:")
        assert chat.to_dict()["messages"][0]["content"].startswith("message number 0:")


def test_answer_cut_by_the_context_is_reported(tiny_models):
    with make_pair(tiny_models, n_ctx=256) as p:
        chat = ChatSession(p, gen=GenParams(max_tokens=10_000), reserve=8)
        done, notices = answer(chat, "go on forever")
        assert done.reason == "context"
        assert [n.kind for n in notices] == ["context-full"]
        # the next message drops the full turn and still gets an answer
        done2, notices2 = answer(chat, "next")
        assert notices2 and notices2[0].kind == "dropped" and done2 is not None


def test_prompt_longer_than_the_context_is_an_error_and_the_chat_goes_on(tiny_models):
    with make_pair(tiny_models, n_ctx=256) as p:
        chat = ChatSession(p, gen=GenParams(max_tokens=8))
        answer(chat, "hi")
        with pytest.raises(ContextOverflowError) as exc:
            answer(chat, "x " * 400)
        assert "context holds 256" in exc.value.message
        assert len(chat.turns) == 1  # the failed message is not in the conversation
        done, _ = answer(chat, "still there?")
        assert done is not None and len(chat.turns) == 2


def test_empty_message_is_refused(pair):
    chat = ChatSession(pair)
    with pytest.raises(UsageError):
        answer(chat, "   ")
    assert chat.turns == []


def test_interrupted_answer_keeps_the_partial_text_and_the_cache(pair):
    chat = ChatSession(pair, gen=GenParams(max_tokens=500))
    stream = chat.send("tell me a long story")
    got = []
    for ev in stream:
        if isinstance(ev, TokenEvent):
            got.append(ev.text)
            if len(got) == 7:
                break
    stream.close()  # what Ctrl-C does
    turn = chat.turns[-1]
    assert turn.reason == "interrupted" and turn.assistant == "".join(got)
    assert turn.stats.n_generated == 7
    d2, _ = answer(chat, "go on")
    assert d2.stats.n_prompt_eval < d2.stats.n_prompt / 2  # the partial answer was cached


def test_save_markdown_and_json(pair, tmp_path):
    chat = ChatSession(pair, system="sys prompt", gen=GenParams(max_tokens=8))
    answer(chat, "first question")
    answer(chat, "second question")
    res = chat.command(f"/save {tmp_path / 'chat.md'}")
    assert res.action == "saved" and "2 turns" in res.message
    md = (tmp_path / "chat.md").read_text()
    assert md.startswith("# Chat with target.gguf + draft.gguf")
    assert "## System\n\nsys prompt" in md
    assert md.count("## User") == 2 and md.count("## Assistant") == 2
    assert "first question" in md and chat.turns[1].assistant in md
    assert "tok/s" in md and "accepted" in md
    chat.command(f"/save {tmp_path / 'chat.json'}")
    doc = json.loads((tmp_path / "chat.json").read_text())
    roles = [m["role"] for m in doc["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert doc["messages"][2]["content"] == chat.turns[0].assistant
    assert doc["messages"][2]["stats"]["n_generated"] == 8
    assert doc["target"] == "target.gguf" and doc["draft"] == "draft.gguf"
    with pytest.raises(TandemError, match="cannot write"):
        chat.command(f"/save {tmp_path / 'missing-dir' / 'x.md'}")
    with pytest.raises(UsageError, match="needs a file name"):
        chat.command("/save")


def test_save_closes_the_code_fence_of_an_answer_cut_at_the_token_limit(pair, tmp_path):
    """An answer stopped by --max-tokens inside a code block left its fence open, and the
    rest of the saved file rendered as code: /save closes it (markdown only; the JSON keeps
    the answer as generated)."""
    from tandem.chat.transcript import Turn, open_fence
    from tandem.engine.loop.stats import GenStats

    chat = ChatSession(pair, gen=GenParams(max_tokens=8))
    cut = "Here it is:\n\n```python\ndef add(a, b):\n    return a +"
    chat.turns += [Turn("write add()", cut, "length", "draft", GenStats(n_generated=8)),
                   Turn("and a tilde one", "~~~~\ncode\n~~~\nstill code", "length", "draft"),
                   Turn("thanks", "You're welcome.", "eos", "draft")]
    chat.command(f"/save {tmp_path / 'chat.md'}")
    md = (tmp_path / "chat.md").read_text()
    assert open_fence(md) is None
    assert "    return a +\n```\n\n_8 tokens" in md  # closed before the turn's summary
    assert "still code\n~~~~\n" in md  # closed with its own marker, as long as it opened
    # the headings after the cut answers are outside any code block
    before_thanks = md[:md.index("## User\n\nthanks")]
    assert open_fence(before_thanks) is None
    chat.command(f"/save {tmp_path / 'chat.json'}")
    doc = json.loads((tmp_path / "chat.json").read_text())
    assert doc["messages"][1]["content"] == cut


def test_open_fence_follows_commonmark():
    from tandem.chat.transcript import closed_fences, open_fence

    assert open_fence("no code") is None
    assert open_fence("```\nx\n```") is None
    assert open_fence("```js\nx") == "```"
    assert open_fence("````\n```\nstill inside") == "````"  # a shorter fence does not close
    assert open_fence("```\nx\n``` not a close") == "```"  # a closing fence has no text
    assert open_fence("~~~\n```\n") == "~~~"  # nor the other character
    assert open_fence("``` inline ` code") is None  # a backtick after ``` is not a fence
    assert closed_fences("```\nx\n") == "```\nx\n```"
    assert closed_fences("plain") == "plain"


def test_slash_command_parsing():
    assert parse_command("hello") is None
    assert parse_command("//etc/passwd is a file") is None
    assert message_text("//etc/passwd") == "/etc/passwd"
    assert parse_command("/draft 8").arg == "8"
    assert parse_command("  /QUIT ").name == "exit"
    assert parse_command("/max-tokens 5").name == "max-tokens"
    for bad in ("/nope", "/", "/drafts 3"):
        with pytest.raises(UsageError, match="unknown command"):
            parse_command(bad)
    assert {c[0] for c in COMMANDS} >= {"help", "stats", "strategy", "draft", "temp", "system",
                                        "reset", "save", "exit"}


def test_slash_commands_change_the_session(pair):
    chat = ChatSession(pair, gen=GenParams(max_tokens=6))
    assert chat.command("/help").data["commands"] == COMMANDS
    assert chat.command("/draft 8").data == {"draft": 8} and chat.draft.n_max == 8
    for bad, match in [("/draft -1", "0..64"), ("/draft 65", "0..64"), ("/draft x", "whole number"),
                       ("/temp x", "needs a number"), ("/temp -1", ">= 0"), ("/temp nan", "finite"),
                       ("/strategy warp", "unknown strategy"), ("/max-tokens 0", "1..")]:
        with pytest.raises(UsageError, match=match):
            chat.command(bad)
    assert chat.draft.n_max == 8  # unchanged by the bad values
    assert chat.command("/draft 0").data == {"draft": 0}  # as --draft-max 0: nothing drafted
    chat.command("/draft 8")
    chat.command("/temp 0.7")
    assert chat.gen.sampling.temperature == 0.7
    chat.command("/temp 0")
    chat.command("/strategy none")
    done, _ = answer(chat, "plain please")
    assert done.stats.strategy == "none" and done.stats.drafted == 0
    chat.command("/strategy draft")
    chat.command("/system Answer in French.")
    assert chat.messages()[0] == {"role": "system", "content": "Answer in French."}
    done, _ = answer(chat, "bonjour")
    assert done.stats.drafted > 0
    stats = chat.command("/stats").data
    assert stats["turns"] == 2 and stats["drafted"] == done.stats.drafted
    assert stats["last_prompt_tokens"] == done.stats.n_prompt
    res = chat.command("/reset")
    assert res.action == "reset" and chat.turns == [] and chat.system == "Answer in French."
    chat.command("/system")
    assert chat.system is None
    assert chat.command("/exit").action == "exit"


def test_strategy_draft_needs_a_draft_model(tiny_models):
    with make_pair(tiny_models, draft=False) as p:
        chat = ChatSession(p, gen=GenParams(max_tokens=4))
        with pytest.raises(UsageError, match="needs a draft model"):
            chat.command("/strategy draft")
        assert chat.strategy == "none"


def test_plain_rate_is_measured_here(pair):
    chat = ChatSession(pair, gen=GenParams(max_tokens=16))
    assert chat.plain_rate is None
    import time

    t0 = time.perf_counter()
    rate = chat.measure_plain(12)
    assert rate and rate > 0 and "12-token plain probe" in chat.plain_source
    # the latest measurement alone, with when it was taken: the live view compares with it
    # only while it is recent
    latest, source, when = chat.latest_plain.rate, chat.latest_plain.source, chat.latest_plain.when
    assert latest == pytest.approx(rate) and source == "12-token plain probe"
    assert t0 <= when <= time.perf_counter()
    assert chat.turns == []  # the probe is not part of the conversation
    chat.command("/strategy none")
    answer(chat, "count")
    assert "plain turns of this chat" in chat.plain_source
    assert chat.latest_plain.source == "plain turns of this chat" and chat.latest_plain.when >= when


def test_stats_compare_turns_only_with_plain_measured_at_the_same_load(pair):
    """/stats' speculative ratio counts only the turns that had a plain measurement under
    30 s old taken at the same load; a busy turn is never set against a quiet probe (which
    once gave "speculative 0.12x")."""
    import io

    from rich.console import Console
    from tandem.chat.speed import PlainMeasure, plain_for
    from tandem.chat.transcript import Turn
    from tandem.chat.tui import ChatView
    from tandem.engine.loop.stats import GenStats

    chat = ChatSession(pair, gen=GenParams(max_tokens=16))
    chat.plain_log.append(PlainMeasure(10.0, "16-token plain probe", 100.0, 0.02))

    def turn(started, busy):  # 20 tokens in 1 s: 2x the probe's 10 tok/s
        return Turn("q", "a", "eos", "draft", GenStats(n_generated=20, t_total=1.0),
                    started=started, busy=busy)

    chat.turns += [turn(110.0, 0.01), turn(112.0, 0.70), turn(200.0, 0.0)]
    assert plain_for(chat.plain_log, chat.turns[0]) is chat.plain_log[0]
    assert plain_for(chat.plain_log, chat.turns[1]) is None  # busy against a quiet probe
    assert plain_for(chat.plain_log, chat.turns[2]) is None  # 100 s after the probe
    vs = chat.vs_plain()
    assert vs == {"ratio": pytest.approx(2.0), "compared": 1, "speculative": 3, "busy": 1}
    out = io.StringIO()
    ChatView(Console(file=out, width=200)).show_stats(chat.session_stats())
    text = out.getvalue()
    assert "2.00× vs plain over 1 of 3 turns" in text and "1 of them ran while the machine " \
        "was busy" in text
    chat.turns[0].busy = 0.9  # now no turn compares: no ratio at all
    out = io.StringIO()
    ChatView(Console(file=out, width=200)).show_stats(chat.session_stats())
    assert "×" not in out.getvalue() and "not compared: none of 3 turns" in out.getvalue()


@pytest.mark.slow
def test_real_pair_second_turn_does_not_reevaluate_the_first(real_pair):
    paths = real_pair  # conftest fetches the default pair once
    opts = SessionOptions(strategy="draft", target_ctx=ContextParams(n_ctx=2048))
    with PairSession(paths[0], paths[1], opts) as p:
        chat = ChatSession(p, gen=GenParams(max_tokens=16))
        q1 = "Write a Python function that reverses a string."
        prompt1 = p.prompt_tokens(chat.messages(q1))
        d1, _ = answer(chat, q1)
        assert d1.stats.n_prompt_eval == len(prompt1)
        draft_decoded = p.draft_ctx.n_decoded
        q2 = "Now add type hints and a docstring."
        prompt2 = p.prompt_tokens(chat.messages(q2))
        # what turn 2 adds after turn 1's prompt and answer: end of turn, the new user message
        new = len(prompt2) - len(prompt1) - len(d1.tokens)
        d2, _ = answer(chat, q2)
        assert d2.stats.n_prompt == len(prompt2) > len(prompt1)
        assert d2.stats.n_prompt_eval <= new + 4, (d2.stats.n_prompt_eval, new)
        assert d2.stats.n_prompt_eval < len(prompt2) / 2
        # the draft model too: its evaluations in turn 2 are the new tokens plus its drafts
        assert p.draft_ctx.n_decoded - draft_decoded <= new + 4 + d2.stats.drafted + d2.stats.n_steps
        print(f"turn 2: prompt {d2.stats.n_prompt} tokens, evaluated {d2.stats.n_prompt_eval}, new {new}")
        assert d2.stats.n_generated == 16 and d2.text


def test_add_indexes_a_file_for_drafting_and_refuses_bad_ones(pair, tmp_path):
    chat = ChatSession(pair, gen=GenParams(max_tokens=8), strategy="auto")
    (tmp_path / "app.py").write_text("def load(path):\n    return open(path).read()\n")
    res = chat.command(f"/add {tmp_path / 'app.py'}")
    assert res.action == "set" and "added app.py" in res.message and res.data["tokens"] > 5
    assert chat.session_stats()["context_files"] == ["app.py"]
    with pytest.raises(UsageError, match="not found"):
        chat.command(f"/add {tmp_path / 'missing.py'}")
    (tmp_path / "blob").write_bytes(b"\x00\x01\x02")
    with pytest.raises(UsageError, match="binary"):
        chat.command(f"/add {tmp_path / 'blob'}")
    with pytest.raises(UsageError, match="needs a file"):
        chat.command("/add")
    answer(chat, "show me load")
    assert "by_source" in chat.session_stats()


@pytest.mark.parametrize("before", ["draft", "none"])
@pytest.mark.parametrize("cached_costs", [False, True], ids=["calibrating", "cached-costs"])
def test_switching_to_auto_keeps_the_kv_prefix(before, cached_costs, tiny_models, monkeypatch,
                                               tmp_path):
    """The first `auto` turn checks (or measures) the costs; that measurement once prefilled
    its own probe into the target's cache, so the turn re-evaluated the whole conversation
    (3,500 tokens, 40 s on the real pair). It measures after what the cache holds instead."""
    from tandem.engine.tuning import costs as costs_mod

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.0)  # quiet machine
    if cached_costs:  # a calibration on disk from an earlier session: the check path
        with make_pair(tiny_models) as p:
            p.costs()
    with make_pair(tiny_models) as p:
        chat = ChatSession(p, system="Be brief.", gen=GenParams(max_tokens=16))
        chat.command(f"/strategy {before}")
        question = "Explain the following code in detail: " + "def f(x): return x * 2; " * 20
        d1, _ = answer(chat, question)
        assert d1.stats.n_prompt_eval == d1.stats.n_prompt
        cached_before = list(p.target_ctx.tokens)
        chat.command("/strategy auto")  # checks (or measures) the costs now
        assert p.target_ctx.tokens == cached_before
        prompt2 = p.prompt_tokens(chat.messages("Thanks. Shorter?"))
        new = len(prompt2) - common_prefix(cached_before, prompt2)
        d2, _ = answer(chat, "Thanks. Shorter?")
        assert d2.stats.strategy == "auto"
        assert d2.stats.n_prompt == len(prompt2)
        assert d2.stats.n_prompt_eval <= new + 1, (d2.stats.n_prompt_eval, new)
        assert d2.stats.n_prompt_eval < d2.stats.n_prompt / 5


def test_a_hybrid_models_second_turn_evaluates_only_what_is_new(tiny_models):
    """Issue 40: on a hybrid target (recurrent layers beside attention) the second turn starts
    from the copy of the state kept at the first turn's end, not from the whole conversation,
    and answers as a fresh session given the same conversation does (greedy)."""
    def hybrid_pair():
        opts = SessionOptions(strategy="draft",
                              target_ctx=ContextParams(n_ctx=2048, n_threads=1))
        return PairSession(tiny_models["hybrid"], tiny_models["hybrid_draft"], opts)

    question = "Explain the following code in detail: " + "def f(x): return x * 2; " * 10
    with hybrid_pair() as p:
        chat = ChatSession(p, system="Be brief.", gen=GenParams(max_tokens=16))
        answer(chat, question)
        d2, _ = answer(chat, "Thanks. Shorter?")
        assert d2.stats.n_prompt_eval < d2.stats.n_prompt / 2
        turns = [(t.user, t.assistant) for t in chat.turns]
    with hybrid_pair() as p:
        fresh = ChatSession(p, system="Be brief.", gen=GenParams(max_tokens=16))
        fresh.turns = chat.turns[:1]
        again, _ = answer(fresh, "Thanks. Shorter?")
        assert again.stats.n_prompt_eval == again.stats.n_prompt  # nothing cached
    assert again.text == turns[1][1]
