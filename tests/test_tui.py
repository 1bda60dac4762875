"""The chat's live panel, rendered from a recorded sequence of engine events (no models)."""
from __future__ import annotations

import io

import pytest

from rich.console import Console
from tandem.chat.tui import ChatView, LiveState, markdown_tail, render, render_answer, sparkline
from tandem.engine.loop.events import DoneEvent, PrefillEvent, StepEvent, TokenEvent
from tandem.engine.loop.stats import GenStats

# A recorded answer: (time, event). Three verify steps with drafts of 4:
#   step 0: 4 drafted, 4 accepted -> 4 draft tokens + 1 target token
#   step 1: 4 drafted, 2 accepted -> 2 draft tokens + 1 target token
#   step 2: 4 drafted, 0 accepted -> 1 target token
# 9 tokens in all; 6 of 12 drafts accepted (50%); mean accepted length (6 + 3) / 3 = 3.00;
# per position: 1: 2/3, 2: 2/3, 3: 1/3, 4: 1/3.
WORDS = ["# Title", "\n\n", "Some ", "**bold** ", "text ", "and ", "`code`", " done", "\n"]
FROM_DRAFT = [True, True, True, True, False, True, True, False, False]


def recorded_events():
    t = 10.0
    evs = [(t, PrefillEvent(0, 100, 101)), (t + 0.5, PrefillEvent(100, 100, 101))]
    t += 0.5
    tok = 0
    for step, (drafted, accepted) in enumerate([(4, 4), (4, 2), (4, 0)]):
        for _ in range(accepted + 1):
            t += 0.05
            evs.append((t, TokenEvent(100 + tok, WORDS[tok], FROM_DRAFT[tok], step)))
            tok += 1
        evs.append((t, StepEvent(step, drafted, accepted, 4, 0.01, 0.02, 0.001)))
    return evs, t


def feed(state, evs):
    for t, ev in evs:
        state.apply(ev, t)
    return state


def export(renderable, width=100, **kw) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), **kw)
    console.print(renderable)
    return console.export_text()


def test_panel_content_from_recorded_events():
    evs, t_end = recorded_events()
    state = feed(LiveState(strategy="draft", n_max=4, plain_rate=10.0,
                           plain_source="16-token plain probe", plain_at=t_end - 5), evs)
    assert state.n_tokens == 9 and state.drafted == 12 and state.accepted == 6
    state.now = t_end
    text = export(render(state, width=100))
    # the answer so far, rendered as markdown (no literal ** or #)
    assert "Title" in text and "bold" in text and "**" not in text and "# Title" not in text
    # 9 tokens in 0.45 s since the prompt was evaluated: 20 tok/s average; all in the last second
    assert "20.0 avg" in text
    assert "tok/s now" in text
    # speedup against the measured plain rate, clearly labelled as measured
    assert "2.00× vs plain 10.0 tok/s" in text
    assert "measured here: 16-token plain probe, 5 s ago" in text
    assert "accepted 50% (6/12 drafted)" in text
    assert "mean accepted length 3.00" in text
    assert "model draft ≤ 4" in text
    assert "by position " + sparkline([2 / 3, 2 / 3, 1 / 3, 1 / 3]) in text
    assert "1:67% 2:67% 3:33% 4:33%" in text


def test_current_rate_uses_the_last_second():
    state = LiveState(strategy="draft", n_max=4)
    state.apply(PrefillEvent(0, 0, 5), 0.0)
    for i in range(20):  # 10 tok/s for 2 s
        state.apply(TokenEvent(i, "x", False, i), 0.1 * (i + 1))
    state.now = 2.0
    assert abs(state.avg_rate - 10.0) < 1e-9
    for i in range(10):  # then 10 tokens in 0.2 s
        state.apply(TokenEvent(i, "y", False, i), 2.0 + 0.02 * (i + 1))
    state.now = 2.2
    # window (1.2, 2.2]: 8 old tokens (1.3 .. 2.0) + 10 new ones
    assert abs(state.current_rate - 18.0) < 1e-9
    assert state.current_rate > state.avg_rate


def test_final_stats_replace_live_estimates():
    evs, t_end = recorded_events()
    state = feed(LiveState(strategy="draft", n_max=4, plain_rate=None), evs)
    stats = GenStats(strategy="draft", n_generated=9, t_total=1.5, t_prefill=0.5)
    state.apply(DoneEvent(stats, "eos", "".join(WORDS), tuple(range(9))), t_end + 5)
    text = export(render(state, width=100))
    assert "9.0 tok/s" in text and "9 tokens" in text  # 9 tokens / 1.0 s of decoding
    assert "no plain rate measured yet" in text


def test_drafter_notes_shown_once_the_answer_is_done():
    evs, t_end = recorded_events()
    state = feed(LiveState(strategy="auto", n_max=4, plain_rate=10.0), evs)
    note = "draft model off: this machine's costs predict 1.05x at 90% acceptance (needs 1.15x)"
    assert "draft model off" not in export(render(state, width=120))
    stats = GenStats(strategy="auto", n_generated=9, t_total=1.5, t_prefill=0.5, notes=[note])
    state.apply(DoneEvent(stats, "eos", "".join(WORDS), tuple(range(9))), t_end + 5)
    assert note in export(render(state, width=120)).replace("\n", " ")


def test_plain_strategy_panel():
    state = LiveState(strategy="none", n_max=0, plain_rate=10.0)
    state.apply(PrefillEvent(0, 0, 3), 0.0)
    state.apply(TokenEvent(1, "hi", False, 0), 0.1)
    state.apply(StepEvent(0, 0, 0, 0, 0.0, 0.1, 0.0), 0.1)
    state.now = 0.1
    text = export(render(state, width=100))
    assert "plain decoding" in text and "accepted" not in text


def test_prefill_progress_shown_before_the_first_token():
    state = LiveState(strategy="draft", n_max=4)
    state.apply(PrefillEvent(0, 2048, 2049), 0.0)
    state.apply(PrefillEvent(512, 2048, 2049), 0.2)
    text = export(render(state, width=100))
    assert "evaluating prompt 512/2048 tokens" in text


def test_narrow_terminal_gets_a_compact_panel():
    evs, t_end = recorded_events()
    state = feed(LiveState(strategy="draft", n_max=4, plain_rate=10.0, plain_source="probe",
                           plain_at=t_end), evs)
    state.now = t_end
    text = export(render(state, width=40), width=40)
    lines = text.splitlines()
    assert all(len(line) <= 40 for line in lines)
    assert "2.00× vs plain 10.0 (measured)" in text
    assert "acc 50% · len 3.00 · model draft ≤ 4" in text
    assert "╭" not in text  # no box on narrow terminals


def test_height_limit_shows_the_end_of_a_long_answer():
    state = LiveState(strategy="draft", n_max=4)
    state.apply(PrefillEvent(0, 0, 3), 0.0)
    for i in range(200):
        state.apply(TokenEvent(i, f"line {i}\n\n", False, i), 0.01 * i)
    state.now = 2.0
    text = export(render(state, width=80, height=20), width=80)
    assert len(text.splitlines()) <= 20
    assert "line 199" in text and "line 0\n" not in text


def test_markdown_tail_reopens_a_cut_code_fence():
    text = "intro\n```python\n" + "x = 1\n" * 500 + "```\n"
    tail = markdown_tail(text[:-4], 100)
    assert tail.startswith("```\n") and len(tail) <= 110
    assert markdown_tail("short", 100) == "short"


def test_show_draft_colours_accepted_draft_tokens_and_no_color_drops_colour():
    evs, t_end = recorded_events()
    for no_color in (False, True):
        out = io.StringIO()
        console = Console(file=out, width=100, force_terminal=True, no_color=no_color,
                          color_system="standard")
        clock = iter([t for t, _ in evs] + [t_end] * 10)
        view = ChatView(console, show_draft=True, live=False, clock=lambda: next(clock))
        view.start_answer("draft", 4)
        for _, ev in evs:
            view.event(ev)
        view.finish()
        # non-live mode streams the raw text, then the summary line
        assert out.getvalue().startswith("# Title")
        assert "accepted 50%" in out.getvalue()
        # the final rendering with --show-draft styles draft tokens (bold survives NO_COLOR)
        out2 = io.StringIO()
        console2 = Console(file=out2, width=100, force_terminal=True, no_color=no_color,
                           color_system="standard")
        console2.print(render_answer(feed(LiveState(show_draft=True), evs)))
        styled = out2.getvalue()
        if no_color:
            assert "32m" not in styled and "\x1b[1m# Title" in styled  # bold, no colour
        else:
            assert "\x1b[1;32m# Title" in styled  # bold green
        assert "text " in styled and "\x1b[1;32mtext" not in styled  # the target's own token
        assert "**bold**" in styled  # plain text, not rendered as markdown


def test_no_color_environment_is_honoured(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    from tandem.chat.tui import make_console

    console = make_console()
    assert console.no_color


def test_view_verbs_on_a_non_terminal():
    out = io.StringIO()
    console = Console(file=out, width=80)  # not a terminal: no live display, no escapes
    view = ChatView(console)
    assert not view.interactive
    view.notice("dropped the 1 oldest turn")
    view.error("draft must be in 1..64, got 99", "for example: /draft 8")
    view.show_help([("draft", "N", "draft length")])
    text = out.getvalue()
    assert "\x1b[" not in text
    assert "dropped the 1 oldest turn" in text
    assert "✗ draft must be in 1..64, got 99" in text and "for example: /draft 8" in text
    assert "/draft N" in text and "Ctrl-C" in text


def test_summary_line_after_an_answer():
    from tandem.chat.tui import summary_line

    evs, t_end = recorded_events()
    state = feed(LiveState(strategy="draft", n_max=4, plain_rate=10.0, plain_source="probe",
                           plain_at=t_end - 1), evs)
    state.now, state.status = t_end, "interrupted"
    line = summary_line(state, 100)
    assert line.startswith("20.0 tok/s · 9 tokens · 2.00× vs plain 10.0 tok/s "
                           "(measured: probe, 1 s ago)")
    assert "accepted 50% (6/12)" in line and "mean accepted length 3.00" in line
    assert line.endswith("stopped: Ctrl-C")
    assert "\n" in summary_line(state, 40)  # narrow: one item a line


def test_panel_counts_drafts_from_history_apart_from_the_prompt():
    """auto's steps say where their drafts came from; the panel, the summary line and /stats
    show accepted/drafted per source."""
    from tandem.chat.tui import sources_text, summary_line

    state = LiveState(strategy="auto", n_max=4)
    t = 1.0
    state.apply(PrefillEvent(10, 10, 11), t)
    tok = 0
    for step, (drafted, accepted, source) in enumerate([(4, 4, "prompt"), (6, 3, "history"),
                                                        (2, 0, "history")]):
        for i in range(accepted + 1):
            t += 0.05
            state.apply(TokenEvent(tok, "x ", i < accepted, step), t)
            tok += 1
        state.apply(StepEvent(step, drafted, accepted, 8, 0.0, 0.02, 0.0,
                              sources=((source, drafted, accepted),)), t)
    assert state.steps.by_source == {"prompt": [4, 4], "history": [8, 3]}
    text = export(render(state, width=100))
    assert "drafts accepted/drafted from: prompt 4/4 · history 3/8" in text
    assert "from prompt 4/4 · history 3/8" in summary_line(state)
    # a plain draft-model run has nothing to tell apart
    assert sources_text({"model": [5, 3]}) == ""
    total = GenStats()
    total.add(state.steps)
    assert total.by_source == {"prompt": [4, 4], "history": [8, 3]}


def test_no_ratio_against_a_stale_plain_rate():
    """A start-up probe a minute old says nothing about the machine's load now (issue 25:
    2.64x with nothing accepted, 0.45x a minute later): no ratio rather than a wrong one."""
    from tandem.chat.tui import PLAIN_FRESH_S, summary_line

    evs, t_end = recorded_events()
    state = feed(LiveState(strategy="draft", n_max=4, plain_rate=10.0, plain_source="probe",
                           plain_at=t_end - PLAIN_FRESH_S - 1), evs)
    state.now = t_end
    assert state.speedup is None
    text = export(render(state, width=100))
    assert "×" not in text and "no recent measurement" in text
    assert "×" not in summary_line(state, 100)
    # a rate of unknown age is not used either
    state.plain_at = None
    assert state.speedup is None


def _auto_answer(plain_step_s: float, spec_steps, plain_steps: int = 10):
    """auto's answer: `plain_steps` plain steps of plain_step_s, then drafted steps
    (drafted, accepted, seconds)."""
    state = LiveState(strategy="auto", n_max=4, plain_rate=50.0, plain_source="probe",
                      plain_at=0.0)
    t = 0.0
    state.apply(PrefillEvent(5, 5, 6), t)
    step = 0
    for _ in range(plain_steps):
        t += plain_step_s
        state.apply(TokenEvent(step, "x", False, step), t)
        state.apply(StepEvent(step, 0, 0, 16, 0.0001, plain_step_s - 0.0001, 0.0), t)
        step += 1
    for drafted, accepted, seconds in spec_steps:
        t += seconds
        for i in range(accepted + 1):
            state.apply(TokenEvent(step, "y", i < accepted, step), t)
        state.apply(StepEvent(step, drafted, accepted, 16, 0.0, seconds, 0.0), t)
        step += 1
    state.now = t
    return state


def test_vs_plain_uses_this_answers_own_plain_steps():
    """Under load the start-up probe (50 tok/s here) is far off; the answer's own plain
    steps (0.1 s each: 10 tok/s) were measured in the same conditions as its drafts."""
    # 10 plain steps of 0.1 s, then 5 steps of 4 drafts all accepted at 0.2 s each: 35 tokens
    # in 2.0 s of steps = 17.5 tok/s against 10 tok/s plain
    state = _auto_answer(0.1, [(4, 4, 0.2)] * 5)
    speedup, plain, what, busy = state.comparison()
    assert plain == pytest.approx(10.0) and speedup == pytest.approx(1.75) and busy is None
    assert what == "10 plain steps of this answer"
    text = export(render(state, width=120))
    assert "1.75× vs plain 10.0 tok/s (measured here: 10 plain steps of this answer)" in text
    # steps where the draft model ran but proposed nothing are not plain steps
    state.apply(StepEvent(99, 0, 0, 16, 0.3, 0.1, 0.0), state.now)
    assert state.plain_steps == 10
    # too few plain steps of its own: the recent probe, or nothing
    few = _auto_answer(0.1, [(4, 4, 0.2)] * 5, plain_steps=3)
    assert few.comparison()[2].startswith("probe")


def test_the_two_draft_limits_say_which_is_which():
    evs, t_end = recorded_events()
    auto = feed(LiveState(strategy="auto", n_max=4), [(t, ev) for t, ev in evs])
    auto.apply(StepEvent(9, 0, 0, 16, 0.0, 0.02, 0.0), t_end)  # auto's step cap: n-gram's
    text = export(render(auto, width=120))
    assert "tandem · auto · model draft ≤ 4" in text  # the draft model's n_max
    assert "n-gram draft ≤ 16" in text  # the longest n-gram draft a step may carry
    ngram = feed(LiveState(strategy="ngram", n_max=6), evs)
    assert "n-gram draft ≤ 6" in export(render(ngram, width=120))


# ----- a ratio measured on a busy machine (issue 32) -----
# "x vs plain" is a speed against plain decoding measured in the same conditions; a busy
# machine's ratio is marked busy ("busy: 1.75× ...") or not shown, never a plain "× vs plain".
VS_PLAIN = "× vs plain"


def _all_text(state) -> str:
    return export(render(state, width=120)) + summary_text(state)


def summary_text(state) -> str:
    from tandem.chat.tui import summary_line

    return summary_line(state, 120) + "\n" + summary_line(state, 40)


def test_a_busy_answer_is_not_compared_with_a_quiet_probe():
    """The probe ran on a quiet machine; another program then took 60% of the CPU during
    the answer: the recent probe is no measure of plain decoding now (chat once said
    "speculative 0.12x")."""
    evs, t_end = recorded_events()
    state = feed(LiveState(strategy="draft", n_max=4, plain_rate=10.0, plain_source="probe",
                           plain_at=t_end - 5, plain_busy=0.02), evs)
    state.now = t_end
    assert state.comparison() is not None  # same load: compared
    assert VS_PLAIN in _all_text(state)
    state.busy = 0.60
    assert state.comparison() is None
    text = _all_text(state)
    assert "×" not in text
    assert "not comparable" in text and "60% of the CPU now, 2% at the plain" in text
    assert "not comparable (busy)" in export(render(state, width=40))
    # the other way round: a probe measured busy says nothing of a quiet answer
    state.busy, state.plain_busy = 0.01, 0.70
    assert state.comparison() is None and "×" not in _all_text(state)


def test_a_busy_ratio_against_its_own_plain_steps_is_marked_busy():
    """The answer's own plain steps ran under the same load as its drafts: the ratio may be
    shown, marked busy, never as a plain "× vs plain"."""
    state = _auto_answer(0.1, [(4, 4, 0.2)] * 5)
    state.busy = 0.55
    cmp = state.comparison()
    assert cmp is not None and cmp.busy == 0.55 and cmp.speedup == pytest.approx(1.75)
    for text in (export(render(state, width=120)), export(render(state, width=40)),
                 summary_text(state)):
        assert VS_PLAIN not in text and "busy: 1.75×" in text
    assert "other processes used 55% of the CPU" in export(render(state, width=120))


def test_the_view_measures_the_load_of_each_answer():
    """ChatView takes each answer's load from its meter and says so in the summary."""

    class Meter:
        def __init__(self, share):
            self.value = share

        def start(self):
            return self

        def share(self):
            return self.value

    evs, t_end = recorded_events()
    for share, expect_ratio in ((0.03, True), (0.8, False)):
        out = io.StringIO()
        clock = iter([evs[0][0]] + [t for t, _ in evs] + [t_end] * 10)
        view = ChatView(Console(file=out, width=120), live=False, clock=lambda: next(clock),
                        load=lambda: Meter(share))
        view.set_plain_rate(10.0, "probe", evs[0][0], 0.02)
        view.start_answer("draft", 4)
        for _, ev in evs:
            view.event(ev)
        view.finish()
        assert (VS_PLAIN in out.getvalue()) is expect_ratio, out.getvalue()
        assert ("×" in out.getvalue()) is expect_ratio


def test_the_header_says_how_the_plain_rate_is_used():
    from tandem.chat.speed import PlainMeasure
    from tandem.chat.tui import plain_banner

    quiet = plain_banner(PlainMeasure(31.2, "16-token plain probe", 0.0, 0.02))
    assert quiet.startswith("plain decoding measured here: 31.2 tok/s (16-token plain probe)")
    assert "for 30 s, at the same load" in quiet
    loaded = plain_banner(PlainMeasure(9.5, "16-token plain probe", 0.0, 0.53))
    assert "while other processes used 53% of the CPU" in loaded


def test_stats_compare_only_turns_measured_like_their_plain_rate():
    from tandem.chat.tui import vs_plain_text

    assert vs_plain_text({"ratio": None, "compared": 0, "speculative": 3, "busy": 2}) == (
        "not compared: none of 3 turns had a plain measurement under 30 s old, taken at the "
        "same load (/strategy none for a plain turn); 2 of them ran while the machine was busy")
    text = vs_plain_text({"ratio": 1.234, "compared": 2, "speculative": 3, "busy": 1})
    assert text.startswith("1.23× vs plain over 2 of 3 turns")
