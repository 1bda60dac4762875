"""`tandem hw` on recorded machines (detection replaced by fixtures) and on this one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hw_fixtures import machine
from tandem.commands.app import app
from tandem.machine import hardware
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    for var in [v for v in os.environ if v.startswith("TANDEM_") and v != "TANDEM_HOME"]:
        monkeypatch.delenv(var)
    return tmp_path / "home"


def run_hw(monkeypatch, kind: str, *args: str):
    monkeypatch.setattr(hardware, "detect", lambda with_backend=True: machine(kind))
    monkeypatch.setenv("COLUMNS", "120")
    return CliRunner().invoke(app, ["hw", *args])


def test_hw_json_on_a_recorded_rtx4090(home, monkeypatch):
    res = run_hw(monkeypatch, "rtx4090", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["hardware"]["vendor"] == "nvidia"
    assert out["profile"]["name"] == "rtx-4090" and out["profile"]["cost"]["bw_eff_gbps"] == 700
    assert out["backend"] == "cuda"
    assert out["settings"]["n_ctx"] == {"value": 8192, "source": "profile", "origin": "rtx-4090"}
    assert out["pair"] == "qwen2.5-coder-1.5b"
    plan = out["plan"]
    assert plan["status"] == "fits"
    assert plan["target"]["gpu_layers"] == plan["target"]["max_layers"] == 29
    assert plan["draft"]["gpu_layers"] == 25
    assert plan["gpu_left"] > 0 and plan["target"]["kv_cpu"] == 0
    assert out["recommended_pairs"]


def test_hw_tables_on_a_recorded_rtx4080(home, monkeypatch):
    res = run_hw(monkeypatch, "rtx4080", "--pair", "qwen2.5-coder-3b")
    assert res.exit_code == 0, res.output
    text = res.stdout
    for needle in ("NVIDIA GeForce RTX 4080", "Profile", "rtx-4080", "Settings",
                   "Plan for qwen2.5-coder-3b", "Layers on GPU", "37/37", "25/25",
                   "Free memory left: GPU", "Status: fits", "Recommended pairs"):
        assert needle in text, needle


def test_hw_on_the_m2_ultra_and_a_big_context(home, monkeypatch):
    res = run_hw(monkeypatch, "m2-ultra", "--json", "--ctx-size", "65536")
    out = json.loads(res.stdout)
    assert out["profile"]["name"] == "mac-studio" and out["backend"] == "metal"
    assert out["settings"]["n_ctx"]["source"] == "cli"
    assert out["plan"]["unified_memory"] and out["plan"]["context"]["n_ctx"] == 65536


def test_hw_with_gguf_files_is_exact(home, monkeypatch, tiny_models):
    res = run_hw(monkeypatch, "cpu-box", "--json", "-m", str(tiny_models["target"]),
                 "-md", str(tiny_models["draft"]))
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    assert plan["target"]["exact"] and plan["backend"] == "cpu"
    assert plan["target"]["buffers"]["CPU_Mapped"] == tiny_models["target"].stat().st_size - \
        _data_offset(tiny_models["target"])


def test_hw_names_each_models_memory_type(home, monkeypatch, tiny_models):
    res = run_hw(monkeypatch, "cpu-box", "--json", "-m", str(tiny_models["hybrid"]),
                 "-md", str(tiny_models["target"]))
    assert res.exit_code == 0, res.output
    memory = json.loads(res.stdout)["memory"]
    assert memory["target"]["type"] == "hybrid" and "snapshots" in memory["target"]["rollback"]
    assert memory["draft"] == {"type": "attention",
                               "rollback": "drafts rolled back by truncating the KV cache",
                               "mtp_heads": 0}
    res = run_hw(monkeypatch, "cpu-box", "-m", str(tiny_models["recurrent"]))
    assert "Memory of the target: recurrent" in res.stdout


def _data_offset(path):
    from tandem.models.gguf_meta import read_gguf_header

    return read_gguf_header(path).data_offset


def test_hw_refuses_a_profile_for_other_hardware(home, monkeypatch):
    res = run_hw(monkeypatch, "cpu-box", "--profile", "rtx-4090")
    assert res.exit_code != 0
    assert "does not match this machine" in res.exception.message
    res = run_hw(monkeypatch, "cpu-box", "--profile", "rtx-4090", "--force-profile", "--json")
    assert res.exit_code == 0
    out = json.loads(res.stdout)
    assert out["profile"]["name"] == "rtx-4090" and out["backend"] == "cpu"
    assert any("forced" in w for w in out["warnings"])


def test_hw_subprocess_error_and_output_streams(home):
    """The real entry point: results on stdout, Error/Hint on stderr with exit code 2."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "cli"), COLUMNS="100")
    cmd = [sys.executable, "-m", "tandem", "hw"]
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "Hardware" in ok.stdout and "Status:" in ok.stdout and ok.stderr == ""
    bad = subprocess.run(cmd + ["--profile", "mac-studio"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("Error: profile 'mac-studio' does not match this machine")
    assert "Hint:" in bad.stderr
    bad = subprocess.run(cmd + ["--pair", "no-such-pair"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown pair 'no-such-pair'" in bad.stderr


def test_hw_shows_spec_bench_tuned_settings_for_files_on_disk(home, monkeypatch, tiny_models):
    # what spec-bench --tune writes for these files on this machine (any thread count = all)
    from tandem.config import tuned as tune

    target, draft = tiny_models["target"], tiny_models["draft"]
    tune.save(tune.tuned_path(home, target, draft),
              {"overall": {"config": "ngram", "strategy": "ngram", "n_max": 5, "n_min": 0,
                           "p_min": 0.5, "speedup": 1.2}, "by_category": {}, "partial": False},
              {})
    res = run_hw(monkeypatch, "cpu-box", "--json", "-m", str(target), "-md", str(draft))
    assert res.exit_code == 0, res.output
    settings = json.loads(res.stdout)["settings"]
    assert settings["strategy"]["value"] == "ngram" and settings["strategy"]["source"] == "tuned"
    assert settings["n_max"]["value"] == 5
