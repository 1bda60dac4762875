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
    fixed = bc.FIXED.format(n=2)
    rows = [_row("a", bc.DEFAULTS, 16.0, "loops", ["threads: 1 of 2 (2 were 1.7x slower: x)"]),
            _row("a", fixed, 8.0, "loops"), _row("a", bc.SERVER, 10.0, "loops"),
            _row("b", bc.DEFAULTS, 12.0, "loops", ["threads: 1 of 2, kept from an earlier "
                                                   "request (y)", "threads: 1 -> 2 at step 9"]),
            _row("b", fixed, 10.0, "loops"), _row("b", bc.SERVER, 12.0, "loops")]
    assert bc.ratio_median(rows, bc.DEFAULTS, fixed) == (1.6, 2)
    assert bc.threads_chosen(rows) == "1 (1), 2 (1)"
    table = bc.render(rows, ["quiet", "loops"], fixed)
    assert "| loops | 2 | 14.0 | 9.0 | 11.0 | 1.60 | 1.30 |" in table
    assert "-t >= 1.5x: met; server >= 1x: met" in table
    assert "| quiet |" not in table  # nothing measured there


def test_failed_rows_are_left_out():
    fixed = bc.FIXED.format(n=2)
    bad = _row("a", fixed, 0.0, "llama")
    bad.error = "tandem exited with code 1"
    rows = [_row("a", bc.DEFAULTS, 15.0, "llama"), bad]
    ratio, n = bc.ratio_median(rows, bc.DEFAULTS, fixed)
    assert n == 0 and ratio != ratio
    assert "not met" in bc.render(rows, ["llama"], fixed)


def test_tandem_defaults_run_without_a_thread_count():
    p = Prompt("x", "code", "hello")
    assert "-t" not in peer_runs.tandem_command(["tandem"], p, 16, None, 4096, 42, [], [], "pair")
    fixed = peer_runs.tandem_command(["tandem"], p, 16, 2, 4096, 42, [], [], "pair")
    assert fixed[fixed.index("-t") + 1] == "2"
