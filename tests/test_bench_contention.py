"""scripts/bench_contention.py's report arithmetic on made-up rows (no figure of a run)."""
from __future__ import annotations

import bench_contention as bc
from tandem.bench import peer_runs
from tandem.bench.peer_report import Row
from tandem.bench.workloads import Prompt


def _row(prompt: str, config: str, tok_s: float, cond: str, notes=()) -> Row:
    r = Row(prompt, "code", config, "tandem", tok_s=tok_s)
    r.extra = {"condition": cond, "notes": list(notes)}
    return r


def test_ratios_are_per_prompt_medians_and_bars_are_checked():
    one, two = bc.FIXED.format(n=1), bc.FIXED.format(n=2)
    rows = [_row("a", bc.DEFAULTS, 16.0, "loops", ["threads: 1 of 2 (2 were 1.7x slower: x)"]),
            _row("a", two, 8.0, "loops"), _row("a", one, 15.0, "loops"),
            _row("a", bc.SERVER, 10.0, "loops"),
            _row("b", bc.DEFAULTS, 12.0, "loops", ["threads: 1 of 2, kept from an earlier "
                                                   "request (y)", "threads: 1 -> 2 at step 9"]),
            _row("b", two, 10.0, "loops"), _row("b", one, 15.0, "loops"),
            _row("b", bc.SERVER, 12.0, "loops")]
    assert bc.ratio_median(rows, bc.DEFAULTS, two) == (1.6, 2)
    assert bc.threads_chosen(rows) == "1 (1), 2 (1)"
    assert bc.best_fixed(rows, [one, two]) == one
    table = bc.render(rows, ["quiet", "loops"], [one, two], cores=2)
    # medians 14, 15, 9, 11; per-prompt ratios against -t 1: 16/15, 12/15 -> median 0.93
    assert "| loops | 2 | 14.0 | 15.0 | 9.0 | 11.0 | 0.93 | 1.60 | 1.30 | 0.93 (tandem -t 1) |" \
        in table
    assert "-t 2 >= 1.5x: met; server >= 1x: met; best -t >= 0.9x: met" in table
    assert "| quiet |" not in table  # nothing measured there
    # without llama-server: its column and bar are left out, the rest stands
    alone = bc.render([r for r in rows if r.config != bc.SERVER], ["loops"], [one, two],
                      server=False, cores=2)
    assert "llama-server" not in alone and "server >=" not in alone
    assert "best -t >= 0.9x: met" in alone


def test_the_best_fixed_bar_fails_below_nine_tenths():
    one, two = bc.FIXED.format(n=1), bc.FIXED.format(n=2)
    rows = [_row(p, c, v, "loops") for p in "abcd"
            for c, v in ((bc.DEFAULTS, 7.0), (one, 14.0), (two, 7.5))]
    table = bc.render(rows, ["loops"], [one, two], server=False, cores=2)
    assert "0.50 (tandem -t 1)" in table and "best -t >= 0.9x: not met" in table


def test_failed_rows_are_left_out():
    fixed = bc.FIXED.format(n=2)
    bad = _row("a", fixed, 0.0, "llama")
    bad.error = "tandem exited with code 1"
    rows = [_row("a", bc.DEFAULTS, 15.0, "llama"), bad]
    ratio, n = bc.ratio_median(rows, bc.DEFAULTS, fixed)
    assert n == 0 and ratio != ratio
    assert "not met" in bc.render(rows, ["llama"], [fixed], cores=2)


def test_tandem_defaults_run_without_a_thread_count():
    p = Prompt("x", "code", "hello")
    assert "-t" not in peer_runs.tandem_command(["tandem"], p, 16, None, 4096, 42, [], [], "pair")
    fixed = peer_runs.tandem_command(["tandem"], p, 16, 2, 4096, 42, [], [], "pair")
    assert fixed[fixed.index("-t") + 1] == "2"
