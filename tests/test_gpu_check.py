"""scripts/gpu_check.py's measuring part on the tiny models with the CPU backend: the JSON
that spec-bench --predict-costs and the GPU run's readers rely on (no building, no natives)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.bench.predict import gpu_check_costs

KS = list(range(1, 18))


@pytest.fixture(scope="module")
def result(tiny_models, tmp_path_factory):
    import gpu_check

    out = tmp_path_factory.mktemp("gpu-check") / "gc.json"
    rc = gpu_check.main(["--model", f"draft={tiny_models['draft']}",
                         "--model", f"target={tiny_models['target']}", "--pair", "target,draft",
                         "--backend", "cpu", "--threads", "1", "--contexts", "24,40",
                         "--reps", "1", "--n-decode", "8", "--n-gen", "16", "--pair-reps", "1",
                         "--out", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def result_file(result, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-check-file") / "gc.json"
    path.write_text(json.dumps(result))
    return path


def test_top_level_keys_and_environment(result):
    assert result["schema"] == 1 and result["backend"] == "cpu"
    assert {"environment", "settings", "models", "shapes", "offload", "pair"} <= set(result)
    env = result["environment"]
    assert env["gpu_offload"] in (True, False) and isinstance(env["system_info"], str)
    assert result["settings"]["ks"] == KS


@pytest.mark.parametrize("shape", ["target", "draft"])
def test_each_shape_has_its_costs_and_an_exactness_verdict_per_k(result, shape):
    s = result["shapes"][shape]
    assert "error" not in s, s.get("error")
    assert isinstance(s["decode_ms"], float) and s["decode_ms"] > 0
    assert isinstance(s["host_argmax_us"], float) and isinstance(s["host_draft_top_us"], float)
    curve = s["verify"]
    assert list(curve["ms"]) == [str(k) for k in KS] == list(curve["ratio"])
    assert all(isinstance(v, float) and v > 0 for v in curve["ms"].values())
    assert curve["ratio"]["1"] == 1.0
    for mode in ("exact", "fast"):
        ex = s["exactness"][mode]
        assert list(ex["identical"]) == [str(k) for k in KS]
        assert all(isinstance(v, bool) for v in ex["identical"].values())
        assert ex["identical"]["1"] is True  # a batch of one is single-token decoding
        up_to = ex["exact_up_to"]
        assert isinstance(up_to, int) and 1 <= up_to <= 17
        assert all(ex["identical"][str(k)] for k in range(1, up_to + 1))
        assert up_to == 17 or not ex["identical"][str(up_to + 1)]
        assert all(isinstance(v, float) for v in ex["max_abs_diff"].values())


def test_offload_and_the_pair_loop(result):
    off = result["offload"]
    assert "error" not in off, off.get("error")
    assert off["as_planned"] is True  # a CPU machine: every layer stays on the CPU
    for role in ("target", "draft"):
        m = off["models"][role]
        assert m["layers_on_gpu"] == 0 and m["placement"]["layers_by_device"] == {"CPU": m["layers"]}
    pair = result["pair"]
    assert "error" not in pair, pair.get("error")
    assert (pair["target_shape"], pair["draft_shape"]) == ("target", "draft")
    for name in ("none", "draft"):
        p = pair[name]
        assert p["tandem_tok_s"] > 0 and p["host_us_per_token"] is not None
        assert p["native_tok_s"] is None and p["ratio"] is None  # no --bin-dir: no natives


def test_spec_bench_prices_with_the_measured_curve(result):
    costs = gpu_check_costs(result, "target.gguf", "draft.gguf")
    assert set(costs["verify_ratio"]) == set(range(2, 18))
    target = result["shapes"]["target"]
    assert costs["verify_ratio"][4] == target["verify"]["ratio"]["4"]
    assert costs["draft_ratio"] > 0


def _spec_bench(tiny_models, tmp_path, *args):
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "tandem", "spec-bench", "-m", str(tiny_models["target"]),
           "-md", str(tiny_models["draft"]), "-t", "1", "--prompts", "-", "--strategies",
           "draft", "-n", "8", "--no-cost-curve", "--json", *args]
    return subprocess.run(cmd, input=b"a prompt\n", capture_output=True, env=env, timeout=120)


def test_spec_bench_predict_costs_reads_the_file(tiny_models, result_file, tmp_path):
    res = _spec_bench(tiny_models, tmp_path, "--predict-costs", str(result_file))
    assert res.returncode == 0, res.stderr.decode()
    preds = json.loads(res.stdout)["meta"]["predictions"]
    (key, pred), = preds.items()
    assert key.startswith("gc.json: gpu_check on") and pred["speedup"]["draft"] > 0


def test_spec_bench_refuses_a_bad_costs_file_before_benchmarking(tiny_models, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 1, "shapes": {}}')
    res = _spec_bench(tiny_models, tmp_path, "--predict-costs", str(bad))
    err = res.stderr.decode()
    assert res.returncode != 0 and err.startswith("Error: the costs file has no measured shape")
    assert "[1/" not in err  # refused before the first run
