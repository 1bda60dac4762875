"""scripts/gpu_check.py's measuring part on the tiny models with the CPU backend: the JSON
that spec-bench --predict-costs and the GPU run's readers rely on (no building, no natives);
its exit status when a section errs; and scripts/runtime_deps.py, the one list of packages
that gpu_check.sh installs and trim_sdist.sh bundles, against pyproject.toml."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tandem.bench.predict import costs_from_file

KS = list(range(1, 18))
ROOT = Path(__file__).resolve().parents[1]


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
    assert {"environment", "settings", "models", "shapes", "seq_batch", "offload",
            "pair"} <= set(result)
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


@pytest.mark.parametrize("shape", ["target", "draft"])
def test_each_shape_has_its_several_sequence_step_costs(result, shape):
    s = result["seq_batch"][shape]
    assert "error" not in s, s.get("error")
    assert s["seqs"] == [1, 2, 4, 8] and s["rows_per_seq"] == [1, 5]  # n_max 4: 1 + 4 rows
    for width in ("1", "5"):
        assert list(s["ms"][width]) == list(s["ratio"][width]) == ["1", "2", "4", "8"]
        assert all(isinstance(v, float) and v > 0 for v in s["ms"][width].values())
    assert s["ratio"]["1"]["1"] == 1.0 and s["one_seq_context_ms"] > 0
    assert s["context"]["n_seq_max"] == 8 and s["context"]["n_ctx_seq"] >= 128 + 5


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
    costs = costs_from_file(result, "target.gguf", "draft.gguf")
    assert set(costs["verify_ratio"]) == set(range(2, 18))
    target = result["shapes"]["target"]
    assert costs["verify_ratio"][4] == target["verify"]["ratio"]["4"]
    assert costs["draft_ratio"] > 0
    plain = result["seq_batch"]["target"]["ratio"]["1"]
    assert costs["seq_plain_ratio"] == {int(n): r for n, r in plain.items()}
    from tandem.bench.predict import predict
    from tandem.bench.report import Report

    pred = predict(Report(configs=[], cells=[], categories=[]), costs)
    assert pred["concurrency"] == {int(n): round(int(n) / r, 3) for n, r in plain.items()}
    assert "N=8" in pred["basis"]


def test_a_bad_seq_batch_curve_is_refused_and_a_missing_one_is_none(result):
    from tandem.errors import UsageError

    older = {k: v for k, v in result.items() if k != "seq_batch"}  # a file from before it
    assert costs_from_file(older, "target.gguf", "draft.gguf")["seq_plain_ratio"] == {}
    for bad, message in (({"1": {"two": 1.0}}, "not a count of sequences"),
                         ({"1": {"2": 0}}, "seq_batch ratio for 2 sequences must be"),
                         ({"5": {"2": 1.0}}, "no plain-step curve")):
        data = {**result, "seq_batch": {"target": {"ratio": bad}}}
        with pytest.raises(UsageError, match=message):
            costs_from_file(data, "target.gguf", "draft.gguf")


def test_a_section_that_errs_fails_the_run_and_is_named(tmp_path, capsys):
    import gpu_check

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a model")
    rc = gpu_check.main(["--model", f"x={bad}", "--backend", "cpu", "--threads", "1",
                         "--out", str(tmp_path / "gc.json")])
    err = capsys.readouterr().err
    assert rc == 1
    data = json.loads((tmp_path / "gc.json").read_text())
    for section in ("shapes", "seq_batch"):
        assert "error" in data[section]["x"]
        assert re.search(rf"^gpu_check: FAILED {section} \(x\): \w+", err, re.M), err


def test_a_native_tool_failure_counts_as_the_pair_sections_error():
    import gpu_check

    result = {"pair": {"none": {}, "native_errors": ["completion: llama-completion failed\nlog"]},
              "offload": {"skipped": "deadline"}, "shapes": {"t": {"decode_ms": 1.0}}}
    assert gpu_check.failures(result) == ["pair: completion: llama-completion failed"]


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


# ---- the packages: one list, read from pyproject.toml

def _pyproject_deps() -> list[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_the_list_is_pyprojects_dependencies():
    from runtime_deps import dist_name, requirements

    assert requirements(ROOT / "pyproject.toml") == _pyproject_deps()
    build = requirements(ROOT / "pyproject.toml", build=True)
    assert {dist_name(r) for r in build} >= {dist_name(r) for r in _pyproject_deps()} | {
        "setuptools"}


def test_a_new_dependency_is_listed_and_checked(tmp_path):
    """pyproject.toml gains a dependency: the list (what the check installs and the bundle
    fetches) holds it, and the check of an environment without it fails naming it."""
    from runtime_deps import requirements

    text = (ROOT / "pyproject.toml").read_text()
    grown = tmp_path / "pyproject.toml"
    grown.write_text(text.replace('dependencies = [\n', 'dependencies = [\n    "tandem-absent-dep==1.0",\n', 1))
    assert "tandem-absent-dep==1.0" in requirements(grown)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "runtime_deps.py"), "--check",
                          "--pyproject", str(grown)], capture_output=True, text=True)
    assert res.returncode == 1
    assert "tandem-absent-dep: not installed (tandem-absent-dep==1.0 needed)" in res.stderr


def test_the_sdists_own_dependencies_and_build_requirements_replace_it(tmp_path):
    from runtime_deps import dist_name, requirements

    tree = tmp_path / "llama_cpp_python-0.3.36"
    tree.mkdir()
    (tree / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["scikit-build-core[pyproject]>=0.9.2"]\n'
        '[project]\nname = "llama_cpp_python"\n'
        'dependencies = ["numpy>=1.20.0", "diskcache>=5.6.1"]\n')
    sdist = tmp_path / "llama.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    reqs = requirements(ROOT / "pyproject.toml", sdist, build=True)
    names = [dist_name(r) for r in reqs]
    assert "llama-cpp-python" not in names and "diskcache" in names
    assert "scikit-build-core[pyproject]>=0.9.2" in reqs
    # both numpy specifiers stay: pip installs what satisfies the two
    assert "numpy>=1.26" in reqs and "numpy>=1.20.0" in reqs


@pytest.mark.parametrize("script", ["gpu_check.sh", "trim_sdist.sh"])
def test_the_scripts_install_and_fetch_only_the_list(script):
    """No second, hand-written list: each pip call names the list, the sdist or the repo."""
    from runtime_deps import dist_name, requirements

    text = (ROOT / "scripts" / script).read_text()
    assert "runtime_deps.py" in text
    joined = re.sub(r"\\\n\s*", " ", text)
    calls = [line for line in joined.splitlines()
             if re.search(r"pip (install|download)", line) and not line.lstrip().startswith("#")]
    assert calls
    # llama-cpp-python comes as the sdist (trim_sdist.sh downloads it by name)
    names = {dist_name(r) for r in requirements(ROOT / "pyproject.toml", build=True)} - {
        "llama-cpp-python"}
    for call in calls:
        words = {dist_name(w) for w in re.findall(r"[\"' ]([A-Za-z][\w.-]*)[=<>\"' ]", call + " ")}
        assert not words & names, f"{script} names packages itself: {call.strip()}"


def test_the_bundle_carries_the_list():
    """Where scripts/trim_sdist.sh made a bundle here: every requirement installs from it
    alone for the device's Python (a new dependency makes trim_sdist.sh fetch again)."""
    from runtime_deps import requirements

    bundle = ROOT / ".gpu-bundle"
    sdists = sorted(bundle.glob("llama_cpp_python-*-trimmed.tar.gz"))
    if not (bundle / "wheels" / ".complete").exists() or not sdists:
        pytest.skip("no .gpu-bundle here (scripts/trim_sdist.sh makes one)")
    reqs = requirements(ROOT / "pyproject.toml", sdists[-1], build=True)
    tags = ["--python-version", "3.12", "--implementation", "cp",
            *[a for n in range(17, 36) for a in ("--platform", f"manylinux_2_{n}_x86_64")]]
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
                          "--ignore-installed", "--no-index", "--find-links",
                          str(bundle / "wheels"), "--only-binary", ":all:",
                          "--ignore-requires-python", "--target", "/nonexistent", *tags, *reqs],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_mtp_section_measures_the_synthetic_head(result):
    """The synthetic MTP model's head against its body, and greedy mtp output equal to plain
    (issue 42): what a lent GPU reports next to the shapes."""
    m = result["mtp"]
    assert "error" not in m, m.get("error")
    assert m["greedy_equal"] is True
    assert m["predicted"]["head_over_t1"] > 0 and len(m["predicted"]["accepted_through"]) == 4
    assert set(map(str, m["predicted"]["by_k"])) == {"1", "2", "3", "4"}
