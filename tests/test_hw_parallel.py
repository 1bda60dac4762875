"""`tandem hw --parallel N` (issue 53): each slot's KV cache, recurrent state (1 + n_rs_seq
copies), checkpoints and MTP context KV, the whole shared context's plan, and a refusal when
the slots do not fit; `tandem pairs` names each target's memory type and what drafts it."""
from __future__ import annotations

import json
import os
import sys

import pytest
from hw_fixtures import machine
from tandem.commands.app import app
from tandem.machine import hardware
from tandem.machine.fit import model_shape
from tandem.machine.placement import ContextSpec, place
from tandem.machine.planner import GiB, MemoryBudget, plan
from tandem.machine.shapes import row_bytes
from tandem.machine.slots import plan_slots, shared_spec
from tandem.models import catalog
from typer.testing import CliRunner

# Qwen3.6-27B's published config: 48 Gated DeltaNet layers (conv kernel 4, 16 key heads
# and 48 value heads of 128) and 16 attention layers (4 KV heads of 256), one MTP layer
CONV, STATE = 3 * (48 * 128 + 2 * 16 * 128), 128 * 48 * 128
ONE_STATE = 48 * 4 * (CONV + STATE)
KV_ROW = 2 * 4 * 256 * 2  # K and V of one attention layer, f16, per cell


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    for var in [v for v in os.environ if v.startswith("TANDEM_") and v != "TANDEM_HOME"]:
        monkeypatch.delenv(var)
    return tmp_path / "home"


def run(monkeypatch, kind: str, *args: str):
    monkeypatch.setattr(hardware, "detect", lambda with_backend=True: machine(kind))
    monkeypatch.setenv("COLUMNS", "160")
    return CliRunner().invoke(app, list(args))


def main(monkeypatch, capsys, kind: str, *args: str) -> tuple[int, str, str]:
    """`tandem ARGS` through main(), its one error mapping: (exit code, stdout, stderr)."""
    from tandem.commands.app import main as tandem_main

    monkeypatch.setattr(hardware, "detect", lambda with_backend=True: machine(kind))
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setattr(sys, "argv", ["tandem", *args])
    try:
        tandem_main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def slots_of(shape, n: int, ctx: ContextSpec, ram: int = 512 * GiB):
    budget = MemoryBudget(ram=ram)
    base = plan(shape, None, budget, ctx)
    return base, plan_slots(base, shape, None, budget, ctx, ctx, n)


def test_the_estimate_of_a_qwen35_target_has_its_recurrent_state():
    spec = catalog.get_pair("qwen3.6-27b").target
    shape = model_shape(spec)
    assert not shape.exact and shape.arch == "qwen35" and shape.snapshots
    assert sum(shape.recurrent) == 48 and shape.state_bytes == ONE_STATE
    assert sum(1 for h in shape.n_head_kv if h) == 16 and shape.nextn == 0
    heads = model_shape(catalog.get_pair("qwen3.6-27b-mtp").target, mtp=True)
    assert heads.nextn == 1 and heads.n_layer == 65 and heads.trunk == 64
    assert heads.weights_bytes == pytest.approx(shape.weights_bytes, rel=1e-6)
    assert not heads.recurrent[64] and sum(heads.recurrent) == 48


@pytest.mark.parametrize("n", [1, 4])
def test_a_hybrid_slot_holds_its_state_with_n_rs_seq_copies(n):
    shape = model_shape(catalog.get_pair("qwen3.6-27b").target)
    ctx = ContextSpec(n_ctx=4096, rs_seq=16, checkpoints=8)
    base, sp = slots_of(shape, n, ctx)
    slot = sp.per_slot[0]
    assert slot.state_rows == 17 and slot.state == 17 * ONE_STATE
    assert slot.checkpoints == 8 * ONE_STATE and slot.mtp_kv == 0
    assert slot.kv == 16 * 4096 * KV_ROW == base.target.kv
    assert slot.total == slot.kv + slot.state + slot.checkpoints
    t = sp.models[0]
    if n == 1:  # one slot: the context run makes, nothing kept
        assert sp.kept == 0 and sp.slots == 1 and t.total == base.target.total
        return
    # 4 slots and the kept one, and the session's own sequence: 6 states, 5 sets of copies
    assert sp.kept == 1 and sp.slots == 5
    assert t.state == 6 * 17 * ONE_STATE and t.snapshots == 6 * 16 * ONE_STATE
    assert t.copies == 5 * 8 * ONE_STATE
    cells = -(-(4096 * 5 + 512) // 256) * 256
    assert t.kv == 16 * cells * KV_ROW and t.weights == base.target.weights
    assert sp.fits and sp.total == t.total > base.target.total + 4 * slot.total


@pytest.mark.parametrize("n", [1, 4])
def test_an_mtp_target_plans_its_heads_context_per_slot(n):
    shape = model_shape(catalog.get_pair("qwen3.6-27b-mtp").target, mtp=True)
    ctx = ContextSpec(n_ctx=4096, rs_seq=16, checkpoints=8, mtp=True)
    base, sp = slots_of(shape, n, ctx)
    slot = sp.per_slot[0]
    assert slot.mtp_kv == 4096 * KV_ROW == base.target.mtp_kv  # one head layer
    assert slot.kv == 16 * 4096 * KV_ROW  # the head's layer is not in the model's own KV
    assert slot.total == slot.kv + 17 * ONE_STATE + 8 * ONE_STATE + slot.mtp_kv
    t = sp.models[0]
    cells = shared_spec(ctx, sp.slots).cells
    assert t.mtp_kv == cells * KV_ROW and t.kv == 16 * cells * KV_ROW
    without = place(shape, shared_spec(ContextSpec(n_ctx=4096, rs_seq=16, checkpoints=8),
                                       sp.slots), 0)
    assert t.total - without.total == t.mtp_kv


def test_slots_that_do_not_fit_are_refused_with_what_to_change():
    shape = model_shape(catalog.get_pair("qwen3.6-27b").target)
    ctx = ContextSpec(n_ctx=4096, rs_seq=16, checkpoints=8)
    one = slots_of(shape, 1, ctx, ram=24 * GiB)[1]
    assert one.fits
    base, four = slots_of(shape, 4, ctx, ram=24 * GiB)
    assert not four.fits and four.ram_left < 0 and "RAM" in four.problems[0]
    assert any(a.startswith("serve fewer slots: --parallel ") for a in four.advice)
    n = int(next(a for a in four.advice if "--parallel" in a).split()[4])
    assert slots_of(shape, n, ctx, ram=24 * GiB)[1].fits
    assert not slots_of(shape, n + 1, ctx, ram=24 * GiB)[1].fits


def test_hw_parallel_on_a_gguf_hybrid_uses_its_header(home, monkeypatch, tiny_models):
    res = run(monkeypatch, "cpu-box", "hw", "--json", "--parallel", "4",
              "-m", str(tiny_models["hybrid"]), "-md", str(tiny_models["hybrid_draft"]))
    assert res.exit_code == 0, res.output
    slots = json.loads(res.stdout)["slots"]
    shape = model_shape(tiny_models["hybrid"])
    target = slots["per_slot"][0]
    assert slots["slots"] == 5 and slots["fits"] and target["one_state"] == shape.state_bytes
    assert target["state"] == (1 + 16) * shape.state_bytes  # n_rs_seq: max(16, n_max)
    assert target["checkpoints"] == 8 * shape.state_bytes
    assert slots["models"][0]["state_copies"] == 5 * 8 * shape.state_bytes
    res = run(monkeypatch, "cpu-box", "hw", "-m", str(tiny_models["hybrid"]))
    assert res.exit_code == 0 and "Slots:" not in res.stdout  # no --parallel: no slots table


def test_hw_parallel_refuses_what_does_not_fit_and_shows_what_does(home, monkeypatch, capsys):
    code, out, err = main(monkeypatch, capsys, "cpu-box", "hw", "--pair", "qwen3.6-27b-mtp",
                          "--parallel", "4")
    assert code == 3, err
    assert "Slots: 4 and 1 kept for short requests (sizes from the catalog, estimated)" \
        in out and "MTP context KV" in out and "Status: does not fit" in out
    err = " ".join(err.split())
    assert "Error: 4 slots and the 1 kept for short requests of qwen3.6-27b-mtp do not fit" \
        in err and "Hint: serve fewer slots: --parallel" in err
    res = run(monkeypatch, "m2-ultra", "hw", "--pair", "qwen3.6-27b-mtp", "--parallel", "4",
              "--json")
    assert res.exit_code == 0, res.output
    slots = json.loads(res.stdout)["slots"]
    target = slots["per_slot"][0]
    assert slots["fits"] and target["state"] == 17 * ONE_STATE and target["mtp_kv"] > 0
    assert target["total"] == (target["kv"] + target["state"] + target["checkpoints"]
                               + target["mtp_kv"])


def test_pairs_lists_the_late_2026_families_with_memory_type_and_drafter(home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    res = CliRunner().invoke(app, ["pairs"])
    assert res.exit_code == 0, res.output
    rows = {line.split()[0].rstrip("*"): line for line in res.stdout.splitlines()[1:]}
    assert " hybrid · qwen3.5-0.8b-q4_k_m · " in rows["qwen3.8-27b"]
    assert " sliding window · gemma-4-e4b-it-q4_k_m · " in rows["gemma4-31b"]
    assert " sliding window · n-gram · " in rows["gemma4-26b-a4b"]
    assert f" hybrid · {catalog.MTP_HEADS} · " in rows["qwen3.6-27b-mtp"]


def test_pairs_says_unknown_where_the_catalog_does_not_know(home, monkeypatch):
    model = catalog.ModelSpec("mystery-q4_k_m", "some/Mystery-GGUF", "mystery.gguf")
    pair = catalog.PairSpec("mystery", model, None, good_for="a test")
    monkeypatch.setattr(catalog, "load_catalog", lambda path=None: {"mystery": pair})
    monkeypatch.setattr(catalog, "get_pair", lambda name=None, path=None: pair)
    monkeypatch.setenv("COLUMNS", "400")
    res = CliRunner().invoke(app, ["pairs"])
    assert res.exit_code == 0, res.output
    assert "unknown · n-gram · a test" in res.stdout.splitlines()[1]
