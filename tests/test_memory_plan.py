"""The memory a recurrent state takes, planned like the KV cache (issue 40): a hybrid's
llama.cpp buffer with its n_rs_seq snapshots, and the context checkpoints' copies; shown by
`tandem hw`; a target that cannot roll back says so before it loads."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.machine.fit import model_shape
from tandem.machine.placement import ContextSpec, place


@pytest.mark.parametrize("name, snapshots", [("hybrid", True), ("recurrent", False),
                                             ("target", False), ("sliding", False)])
def test_the_state_and_its_copies_are_planned_from_the_header(tiny_models, name, snapshots):
    shape = model_shape(tiny_models[name])
    plan = place(shape, ContextSpec(n_ctx=512, rs_seq=16, checkpoints=8), 0)
    if name in ("target", "sliding"):  # attention only: nothing beside the KV cache
        assert shape.state_bytes == plan.state == plan.copies == 0
        return
    rows = 17 if snapshots else 1  # llama.cpp clamps n_rs_seq to 0 where it keeps none
    assert shape.state_bytes > 0 and plan.state == rows * shape.state_bytes
    assert plan.snapshots == (rows - 1) * shape.state_bytes
    assert plan.copies == 8 * shape.state_bytes
    assert plan.cpu_total >= plan.kv + plan.state + plan.copies


@pytest.mark.parametrize("name", ["hybrid", "recurrent"])
def test_a_planned_copy_is_what_llama_cpp_copies(tiny_models, name):
    """The plan's copy of the state against llama.cpp's own size of it
    (llama_state_seq_get_size_ext, partial: the recurrent part), which adds a short header."""
    pytest.importorskip("llama_cpp")
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.backend.llama import Context, Model

    model = Model(tiny_models[name])
    ctx = Context(model, ContextParams(n_ctx=256, n_threads=1))
    ctx.decode(model.tokenize("hello", add_special=True))
    ctx.checkpoint()
    (copy,) = ctx.copies.by_pos.values()
    planned = model_shape(tiny_models[name]).state_bytes
    assert planned <= len(copy) <= planned + 128, (planned, len(copy))
    ctx.close()
    model.close()


def _tandem(*args: str, home, **env_vars: str) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "TANDEM_HOME": str(home), **env_vars}
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_hw_shows_the_recurrent_state_and_the_checkpoints(tiny_models, tmp_path):
    args = ("hw", "-m", str(tiny_models["hybrid"]), "-md", str(tiny_models["hybrid_draft"]))
    done = _tandem(*args, "--json", home=tmp_path)
    assert done.returncode == 0, done.stderr
    target = json.loads(done.stdout)["plan"]["target"]
    shape = model_shape(tiny_models["hybrid"])
    assert target["state_copies"] == 8 * shape.state_bytes  # --ctx-checkpoints' default
    assert target["state_snapshots"] == 16 * shape.state_bytes  # n_rs_seq: max(16, n_max)
    done = _tandem(*args, home=tmp_path, TANDEM_CTX_CHECKPOINTS="3")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "Recurrent state of the target:" in text and "n_rs_seq" in text
    assert "up to 3 copies of 1 KiB in RAM" in text


def test_a_target_that_cannot_roll_back_says_why_before_it_loads(tiny_models, tmp_path):
    done = _tandem("run", "-m", str(tiny_models["recurrent"]), "-md", str(tiny_models["draft"]),
                   "--strategy", "draft", "-n", "4", "--stats", "hi", home=tmp_path)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines()
            if line.startswith("Warning: recurrent.gguf is a recurrent model (mamba)")]
    assert len(said) == 1 and "decodes plain" in said[0]
    assert done.stderr.index(said[0]) < done.stderr.index("no drafting")  # before it loads
    plain = _tandem("run", "-m", str(tiny_models["recurrent"]), "-n", "4", "hi", home=tmp_path)
    assert "Warning" not in plain.stderr  # a lone -m decodes plain: nothing to say
