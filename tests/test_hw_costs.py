"""`tandem hw costs` on the tiny pair: the costs file a wheel user makes (tandem.bench.hw_costs),
which `tandem spec-bench --predict-costs` reads and prices; what it refuses. Structure and
arithmetic only, never a speed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.bench.hw_costs import SEQS
from tandem.bench.predict import costs_from_file

KS = [str(k) for k in range(1, 18)]


def _tandem(tmp_path, *args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "tandem", *args], input=stdin,
                          capture_output=True, env=env, timeout=300)


def _pair(tiny_models) -> list[str]:
    return ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t", "1"]


@pytest.fixture(scope="module")
def measured(tiny_models, tmp_path_factory):
    """(the file, its JSON, the command's stdout and stderr)."""
    tmp = tmp_path_factory.mktemp("hw-costs")
    out = tmp / "costs.json"
    res = _tandem(tmp, "hw", "costs", *_pair(tiny_models), "--reps", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr.decode()
    return out, json.loads(out.read_text()), res.stdout.decode(), res.stderr.decode()


def test_the_file_holds_both_models_costs_keyed_by_file_name(measured):
    _, doc, stdout, stderr = measured
    assert doc["schema"] == 1 and doc["source"] == "tandem hw costs"
    assert doc["pair"] == {"target_shape": "target.gguf", "draft_shape": "draft.gguf"}
    assert set(doc["shapes"]) == set(doc["seq_batch"]) == {"target.gguf", "draft.gguf"}
    for key, s in doc["shapes"].items():
        assert s["decode_ms"] > 0 and s["host_draft_top_us"] >= 0 and s["host_argmax_us"] >= 0
        curve = s["verify"]
        assert list(curve["ms"]) == list(curve["ratio"]) == KS
        assert curve["ratio"]["1"] == 1.0
        assert all(curve["ratio"][k] == round(curve["ms"][k] / curve["ms"]["1"], 4) for k in KS)
        seq = doc["seq_batch"][key]
        assert seq["seqs"] == list(SEQS) and seq["rows_per_seq"] == [1, 5]
        assert seq["ratio"]["1"]["1"] == 1.0
        assert all(seq["ratio"][w][n] == round(seq["ms"][w][n] / seq["ms"]["1"]["1"], 4)
                   for w in ("1", "5") for n in seq["ms"][w])
        assert doc["models"][key]["placement"]["layers_by_device"]  # llama.cpp's load log
    assert doc["settings"]["target"]["threads"] == 1 and doc["settings"]["draft"]["reps"] == 1
    assert stdout.count("target.gguf:") == 2 and "verify/plain k=2:" in stdout
    assert "wrote" in stderr and "--predict-costs" in stderr


def test_the_file_prices_as_spec_bench_reads_it(measured):
    _, doc, _, _ = measured
    costs = costs_from_file(doc, "target.gguf", "draft.gguf")
    t, d = doc["shapes"]["target.gguf"], doc["shapes"]["draft.gguf"]
    assert costs["verify_ratio"] == {int(k): t["verify"]["ratio"][k] for k in KS[1:]}
    assert costs["draft_ratio"] == pytest.approx(
        (d["decode_ms"] + d["host_draft_top_us"] / 1000) / t["decode_ms"])
    plain = doc["seq_batch"]["target.gguf"]["ratio"]["1"]
    assert costs["seq_plain_ratio"] == {int(n): r for n, r in plain.items()}
    assert costs["source"].startswith("tandem hw costs on cpu: target.gguf target")
    # files named otherwise: the pair the file names
    assert costs_from_file(doc, "mine.gguf", "small.gguf")["draft_ratio"] == costs["draft_ratio"]


def test_spec_bench_predicts_with_the_file(measured, tiny_models, tmp_path):
    path, doc, _, _ = measured
    res = _tandem(tmp_path, "spec-bench", *_pair(tiny_models), "--prompts", "-",
                  "--strategies", "draft", "-n", "8", "--no-cost-curve", "--json",
                  "--predict-costs", str(path), stdin=b"a prompt\n")
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    (key, pred), = out["meta"]["predictions"].items()
    assert key.startswith("costs.json: tandem hw costs on")
    # the draft configuration's measured steps, each priced at its own length
    costs = costs_from_file(doc, "target.gguf", "draft.gguf")
    ratio = {1: 1.0, **costs["verify_ratio"]}
    cell = next(c for c in out["cells"] if c["config"] == "draft" and c["category"] == "overall")
    hist = cell["steps_by_drafted"]
    step = sum(n * (k * costs["draft_ratio"] + ratio[k + 1])
               for k, n in enumerate(hist)) / sum(hist)
    assert pred["speedup"]["draft"] == pytest.approx(cell["tokens_per_step"] / step, abs=1e-3)
    plain = doc["seq_batch"]["target.gguf"]["ratio"]["1"]
    assert pred["concurrency"] == {n: round(int(n) / r, 3) for n, r in plain.items()}


@pytest.mark.parametrize("args, code, message", [
    (["-m", "{W}/missing.gguf", "-md", "{D}"], 3, "target model file not found"),
    (["-m", "{T}", "-md", "{W}/not-a-model.gguf"], 3, "not a GGUF file"),
    (["-m", "{T}"], 2, "costs are measured for a target and its draft"),
    (["-m", "{T}", "-md", "{D}", "--out", "{W}"], 2, "cannot be written as a file"),
    (["-m", "{T}", "-md", "{D}", "--reps", "0"], 2, "--reps"),
])
def test_what_it_refuses(tiny_models, tmp_path, args, code, message):
    """Each an Error: with a Hint: (a usage error 2, a model file 3 as for every command),
    before anything is measured or written."""
    (tmp_path / "not-a-model.gguf").write_text("just text\n")
    argv = [a.replace("{T}", str(tiny_models["target"])).replace(
        "{D}", str(tiny_models["draft"])).replace("{W}", str(tmp_path)) for a in args]
    res = _tandem(tmp_path, "hw", "costs", *argv)
    err = res.stderr.decode()
    assert res.returncode == code, err
    assert message in err and "Traceback" not in err and "costs:" not in err
    assert err.startswith("Error: ") and "\nHint: " in err
