"""llama.cpp's spellings on tandem's command line (issue 51): models named as llama.cpp's -hf
names them (and as run's first word), offload set by -ngl as TANDEM_GPU_LAYERS sets it, and
every llama.cpp option tandem lacks refused in an error that names it, never read as another
option (`-ngl 99` was once `-n gl`). In process, each command stopped right after its flags
resolved (nothing loads); a subprocess where a model must answer. Hub references are served
by the local fake hub (tests/fake_hub.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fake_hub import FakeHubServer, use_fake_hub
from inprocess import run_main
from tandem.errors import EXIT_DOWNLOAD, EXIT_MODEL, EXIT_OK, EXIT_USAGE, TandemError

REPO = "org/tiny-GGUF"
STOPPED = 99


class _Stopped(TandemError):
    exit_code = STOPPED


@pytest.fixture
def hub(monkeypatch, tmp_path, tiny_models):
    """The fake hub with the tiny target as REPO's Q4_K_M and target.gguf, the tiny draft as
    its Q8_0; TANDEM_HOME and HF_HOME under tmp_path."""
    with FakeHubServer() as h:
        use_fake_hub(monkeypatch, tmp_path, h.url)
        h.add(REPO, "Tiny-Q4_K_M.gguf", tiny_models["target"].read_bytes())
        h.add(REPO, "target.gguf", tiny_models["target"].read_bytes())
        h.add(REPO, "Tiny-Q8_0.gguf", tiny_models["draft"].read_bytes())
        yield h


@pytest.fixture
def prepared(monkeypatch):
    """The Prepared each command's flags resolve to (settings, options, files), kept; the
    command then stops with exit STOPPED before any model loads."""
    from tandem.commands import options, run, serve

    kept = []
    real = options.prepare_pair

    def stop(*args, **kwargs):
        kept.append(real(*args, **kwargs))
        raise _Stopped("stopped before loading")

    for module in (options, run, serve):  # run and serve import the name itself
        monkeypatch.setattr(module, "prepare_pair", stop)
    return kept


def tandem(args, tmp_path, **kw):
    """`tandem ARGS` in process, with the home use_fake_hub (or the test) set."""
    return run_main([str(a) for a in args], home=tmp_path / "home", **kw)


def err(res) -> str:
    return res.stderr.decode()


def tiny(tiny_models) -> list[str]:
    return ["-m", tiny_models["target"], "-md", tiny_models["draft"], "-t", "1"]


# ------------------------------------------------- llama-server's common options, one by one


def _settings(key, value):
    return lambda p: p.settings.sources[key].value == value and p.settings.source(key) == "cli"


# (the option's words, what it does to the Prepared: None where the command must refuse it
# by name); the commands they are tried on: serve (llama-server's own) and run
LLAMA_SERVER = [
    (["-ngl", "99"], {"serve": _settings("target_gpu_layers", 99),
                      "run": _settings("target_gpu_layers", 99)}),
    (["-fa"], {"serve": lambda p: p.options.target_ctx.flash_attn == "on",  # alone: on
               "run": lambda p: p.options.target_ctx.flash_attn == "on"}),  # "hi": the prompt
    (["-fa", "off"], {"serve": lambda p: p.options.target_ctx.flash_attn == "off",
                      "run": lambda p: p.options.target_ctx.flash_attn == "off"}),
    (["-b", "64"], {"serve": lambda p: p.options.target_ctx.n_batch == 64,
                    "run": lambda p: p.options.target_ctx.n_batch == 64}),
    (["-ub", "32"], {"serve": lambda p: p.options.target_ctx.n_ubatch == 32}),
    (["-ctk", "q8_0"], {"serve": lambda p: p.options.target_ctx.type_k == "q8_0"}),
    (["-ctv", "q8_0"], {"serve": lambda p: p.options.target_ctx.type_v == "q8_0",
                        "run": lambda p: p.options.target_ctx.type_v == "q8_0"}),
    (["-np", "2"], {"serve": _settings("parallel", 2), "run": None}),
    (["-cb"], {"serve": lambda p: True, "run": None}),  # serve batches continuously anyway
    (["--mlock"], {"serve": _settings("mlock", "on"),
                   "run": lambda p: (p.options.mlock, p.options.mmap) == (True, True)}),
    (["--no-mmap"], {"serve": lambda p: (p.options.mmap, p.options.mlock) == (False, False),
                     "run": _settings("mmap", "off")}),
    (["-dev", "CUDA0"], {"serve": None, "run": None}),
    (["-hf", f"{REPO}:Q4_K_M"], {"serve": lambda p: p.target.name == "Tiny-Q4_K_M.gguf",
                                 "run": lambda p: p.target.name == "Tiny-Q4_K_M.gguf"}),
    (["-hf", REPO, "-hff", "target.gguf"], {"serve": lambda p: p.target.name == "target.gguf"}),
    (["-a", "my-model"], {"serve": lambda p: True, "run": None}),  # the name: test_serve_alias
    (["--jinja"], {"serve": lambda p: True, "run": lambda p: True}),  # Jinja templates always
]
CASES = [(cmd, words, check) for words, by_cmd in LLAMA_SERVER
         for cmd, check in by_cmd.items()]


@pytest.mark.parametrize("cmd,words,check", CASES,
                         ids=[f"{c}{' '.join(w)}" for c, w, _ in CASES])
def test_llama_server_options_do_what_they_say_or_are_named(cmd, words, check, hub, prepared,
                                                            tiny_models, tmp_path):
    models = [] if "-hf" in words else tiny(tiny_models)
    tail = ["--port", "0"] if cmd == "serve" else ["hi"]
    res = tandem([cmd, *models, *words, *tail], tmp_path)
    if check is None:
        assert res.returncode == EXIT_USAGE, err(res)
        first = err(res).splitlines()[0]
        assert first.startswith("Error: ") and words[0] in first, err(res)
        assert "Invalid value" not in err(res) and "No such option" not in err(res)
        assert prepared == []
    else:
        assert res.returncode == STOPPED, err(res)
        assert check(prepared[0]), prepared[0]


@pytest.mark.parametrize("words,name", [
    (["pull", "-ngl", "99"], "-ngl"),  # pull has no -n, but click read it as -n gl elsewhere
    (["pairs", "-hf", REPO], "-hf"),  # once -h -f: the help, exit 0
    (["run", "-nkvo", "hi"], "-nkvo"),
    (["run", "-ngld", "0", "-np", "2", "hi"], "-np"),
    (["run", "-dev", "none", "hi"], "-dev"),
    (["run", "-r", "STOP", "hi"], "-r"),
    (["run", "-xyz", "hi"], "-xyz"),  # in no table: still not `-x yz`
    (["hw", "costs", "-ngl", "3"], "-ngl"),
    (["pull", "--no-mmap"], "--no-mmap"),  # the commands that load a model have it
    (["chat", "--device", "CUDA0"], "--device"),
])
def test_an_option_tandem_lacks_is_named_in_its_own_error(words, name, tmp_path):
    res = tandem(words, tmp_path)
    assert res.returncode == EXIT_USAGE, err(res)
    assert err(res).startswith("Error: ") and name in err(res).splitlines()[0], err(res)
    assert "Hint: " in err(res) and res.stdout == b""


# ---------------------------------------------------------------------------- offload


@pytest.mark.parametrize("flags,env", [
    (["-ngl", "99"], {"TANDEM_GPU_LAYERS": "99"}),
    (["--gpu-layers", "all"], {"TANDEM_GPU_LAYERS": "all"}),
    (["-ngl", "auto", "-ngld", "0"], {"TANDEM_GPU_LAYERS": "auto", "TANDEM_GPU_LAYERS_DRAFT": "0"}),
    (["--n-gpu-layers-draft", "7"], {"TANDEM_GPU_LAYERS_DRAFT": "7"}),
])
def test_gpu_layer_flags_set_offload_as_the_variables_do(flags, env, tiny_models, tmp_path,
                                                         prepared):
    """`tandem hw --json` shows the flag's value where the variable's was (the source says
    which), and run's options (the n_gpu_layers loaded) are the same either way."""
    def hw(args, environ):
        res = tandem(["hw", "-m", tiny_models["target"], "-md", tiny_models["draft"], "--json",
                      *args], tmp_path, env=environ)
        assert res.returncode == EXIT_OK, err(res)
        return json.loads(res.stdout)["settings"]

    by_flag, by_env = hw(flags, {}), hw([], env)
    for key, var in (("target_gpu_layers", "TANDEM_GPU_LAYERS"),
                     ("draft_gpu_layers", "TANDEM_GPU_LAYERS_DRAFT")):
        if var in env:
            want = int(env[var]) if env[var].isdigit() else env[var]
            assert by_flag[key]["value"] == by_env[key]["value"] == want
            assert (by_flag[key]["source"], by_env[key]["source"]) == ("cli", "env")
        else:
            assert by_flag[key] == by_env[key]
    for args, environ in ((flags, {}), ([], env)):
        res = tandem(["run", *tiny(tiny_models), *args, "hi"], tmp_path, env=environ)
        assert res.returncode == STOPPED, err(res)
    a, b = (p.options for p in prepared)
    assert (a.target_gpu_layers, a.draft_gpu_layers) == (b.target_gpu_layers, b.draft_gpu_layers)


# ------------------------------------------------------------------ how weights load


@pytest.mark.parametrize("cmd", ["run", "chat", "serve", "spec-bench"])
def test_no_mmap_and_mlock_reach_every_command_s_session(cmd, prepared, tiny_models, tmp_path):
    """llama.cpp's --no-mmap and --mlock set the settings mmap and mlock (source cli) and the
    session's options both models load with; without them: mapped, not locked (defaults)."""
    tail = {"run": ["hi"], "serve": ["--port", "0"], "chat": [], "spec-bench": ["--quick"]}[cmd]
    for words in (["--no-mmap", "--mlock"], []):
        res = tandem([cmd, *tiny(tiny_models), *words, *tail], tmp_path)
        assert res.returncode == STOPPED, err(res)
    given, plain = prepared
    assert (given.options.mmap, given.options.mlock) == (False, True)
    assert [given.settings.sources[k].value for k in ("mmap", "mlock")] == ["off", "on"]
    assert {given.settings.source(k) for k in ("mmap", "mlock")} == {"cli"}
    assert (plain.options.mmap, plain.options.mlock) == (True, False)
    assert {plain.settings.source(k) for k in ("mmap", "mlock")} == {"default"}


def test_hw_shows_mmap_and_mlock_from_the_variables_and_config(tiny_models, tmp_path):
    """`tandem hw` lists both with the other settings, and --json with their sources; the
    variables set run's options as the flags do."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text("mlock: on\n")
    hw = ["hw", "-m", tiny_models["target"], "-md", tiny_models["draft"]]
    res = tandem([*hw, "--json"], tmp_path, env={"TANDEM_MMAP": "off"})
    assert res.returncode == EXIT_OK, err(res)
    shown = json.loads(res.stdout)["settings"]
    assert (shown["mmap"]["value"], shown["mmap"]["source"]) == ("off", "env")
    assert (shown["mlock"]["value"], shown["mlock"]["source"]) == ("on", "config")
    table = tandem(hw, tmp_path).stdout.decode()
    rows = [[cell.strip() for cell in line.split("│")[1:3]] for line in table.splitlines()]
    assert ["mmap", "on"] in rows and ["mlock", "on"] in rows, table
    bad = tandem([*hw, "--json"], tmp_path, env={"TANDEM_MLOCK": "maybe"})
    assert bad.returncode == EXIT_USAGE and "TANDEM_MLOCK" in err(bad)


@pytest.mark.parametrize("mmap,mlock,mode", [(True, False, "LLAMA_LOAD_MODE_MMAP"),
                                             (False, False, "LLAMA_LOAD_MODE_NONE"),
                                             (True, True, "LLAMA_LOAD_MODE_MMAP_MLOCK"),
                                             (False, True, "LLAMA_LOAD_MODE_MLOCK")])
def test_the_session_s_options_are_both_models_load_mode(mmap, mlock, mode, tiny_models,
                                                         monkeypatch):
    """What llama.cpp receives: the load_mode of each llama_model_params the session hands
    to llama_model_load_from_file (the target's and the draft's), as llama-cpp-python's
    Llama(use_mmap=, use_mlock=) would set it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tandem.engine.backend import llama
    from tandem.engine.pair import PairSession, SessionOptions

    seen = []
    real = llama._lc.llama_model_load_from_file

    def spy(path, params):
        seen.append((os.path.basename(path.decode()), params.load_mode))
        return real(path, params)

    monkeypatch.setattr(llama._lc, "llama_model_load_from_file", spy)
    opts = SessionOptions(strategy="draft", mmap=mmap, mlock=mlock)
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as session:
        assert session.draft is not None
    want = getattr(llama_cpp, mode)
    assert seen == [(tiny_models["target"].name, want), (tiny_models["draft"].name, want)]


def _vm_locked(pid: int) -> int:
    """kB of a process's memory locked in RAM (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))


def _may_lock_beyond_the_limit() -> bool:
    """Whether this process (and so its children) has CAP_IPC_LOCK, bit 14 of its effective
    capabilities: then no lock limit applies (Linux)."""
    with open("/proc/self/status") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(caps >> 14 & 1)


def _may_lock_a_megabyte() -> bool:
    """Whether this process's children may lock the tiny models: CAP_IPC_LOCK or a lock
    limit of at least 4 MiB."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return _may_lock_beyond_the_limit() or soft == resource.RLIM_INFINITY or soft >= 4 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_no_mmap_mlock_reads_the_weights_in_and_locks_them(tiny_models, tmp_path):
    """In llama.cpp's own terms: by default the server maps both GGUF files (they are in
    /proc/PID/maps) and locks nothing; with --no-mmap --mlock neither file is mapped and the
    weights are locked (VmLck), where this machine lets a process lock a megabyte."""
    pytest.importorskip("llama_cpp")
    from serve_helpers import Server

    files = [str(tiny_models["target"]), str(tiny_models["draft"])]
    found = {}
    for words in ([], ["--no-mmap", "--mlock"]):
        srv = Server(["-m", files[0], "-md", files[1], "-t", "1", *words], tmp_path / "home")
        try:
            status, answer, _ = srv.raw("POST", "/v1/completions", json.dumps(
                {"prompt": "abc", "max_tokens": 4, "temperature": 0}))
            assert status == 200, answer
            with open(f"/proc/{srv.proc.pid}/maps") as f:
                maps = f.read()
            found[bool(words)] = ([p in maps for p in files], _vm_locked(srv.proc.pid),
                                  answer["choices"][0]["text"])
        finally:
            srv.stop()
        assert "Traceback" not in "".join(srv.log)
    assert found[False][:2] == ([True, True], 0)
    assert found[True][0] == [False, False]
    assert found[True][2] == found[False][2]  # the same weights, read another way
    if _may_lock_a_megabyte():
        assert found[True][1] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_mlock_without_the_privilege_warns_and_answers(tiny_models, tmp_path):
    """A lock limit of 0 (a user without CAP_IPC_LOCK): llama.cpp warns and loads the
    models anyway, so tandem answers as it does without --mlock (the warning shows with -v;
    with CAP_IPC_LOCK the limit does not apply and the lock succeeds)."""
    pytest.importorskip("llama_cpp")
    import resource

    def no_locking():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))

    env = {"TANDEM_HOME": str(tmp_path / "home")}
    common = ["run", *tiny(tiny_models), "--raw", "-n", "6", "--temp", "0", "--json", "-v"]
    plain = _cli([*common, "abc"], env)
    full = {**os.environ, "NO_COLOR": "1", **env}
    locked = subprocess.run([sys.executable, "-m", "tandem", *map(str, common), "--mlock",
                             "abc"], capture_output=True, env=full, timeout=120,
                            preexec_fn=no_locking)
    assert (plain.returncode, locked.returncode) == (EXIT_OK, EXIT_OK), locked.stderr.decode()
    assert json.loads(locked.stdout)["text"] == json.loads(plain.stdout)["text"]
    log = locked.stderr.decode()
    assert "load_mode = mmap+mlock" in log and "Traceback" not in log
    if not _may_lock_beyond_the_limit():
        assert "failed to mlock" in log, log


def test_a_bad_layer_count_names_the_flag(tiny_models, tmp_path):
    res = tandem(["run", *tiny(tiny_models), "-ngl", "lots", "hi"], tmp_path)
    assert res.returncode == EXIT_USAGE
    assert "GPU layers must be auto, all or a layer count, got 'lots'" in err(res)
    assert "--n-gpu-layers" in err(res)


# ---------------------------------------------------------------- models named on the hub


def test_a_hub_reference_as_run_s_first_word_is_the_model(hub, prepared, tiny_models,
                                                           tmp_path):
    """`tandem run user/repo:QUANT "hi"` once answered with the default pair and the
    reference as prompt text: now that file is fetched into the store and is the target;
    without a catalog draft of its family, auto drafts from n-grams, and stderr says so."""
    res = tandem(["run", f"{REPO}:q4_k_m", "hi", "there"], tmp_path)
    assert res.returncode == STOPPED, err(res)
    p = prepared[0]
    assert p.target.name == "Tiny-Q4_K_M.gguf" and p.draft is None
    assert p.target.read_bytes() == tiny_models["target"].read_bytes()
    assert p.settings.strategy == "auto"
    assert "no catalog draft is of org/tiny-GGUF/Tiny-Q4_K_M.gguf's family (tiny)" in err(res)
    assert "drafting from n-grams" in err(res)
    assert [r.path for r in hub.gets("Tiny-Q4_K_M.gguf")]  # fetched from the hub


@pytest.mark.parametrize("cmd", ["run", "chat", "serve", "spec-bench"])
def test_hf_is_taken_by_every_command_that_loads_a_model(cmd, hub, prepared, tiny_models,
                                                          tmp_path):
    tail = {"run": ["hi"], "serve": ["--port", "0"], "chat": [], "spec-bench": ["--quick"]}[cmd]
    res = tandem([cmd, "-hf", REPO, "-hfd", f"{REPO}:Q8_0", "-t", "1", *tail], tmp_path)
    assert res.returncode == STOPPED, err(res)
    p = prepared[0]
    assert (p.target.name, p.draft.name) == ("Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf")
    assert p.draft.read_bytes() == tiny_models["draft"].read_bytes()


def test_pull_takes_hf(hub, tmp_path):
    res = tandem(["pull", "-hf", f"{REPO}:Q4_K_M", "-hfd", f"{REPO}:Q8_0"], tmp_path)
    assert res.returncode == EXIT_OK, err(res)
    lines = res.stdout.decode().splitlines()
    assert lines[0].startswith("target\t") and lines[0].endswith("Tiny-Q4_K_M.gguf")
    assert lines[1].startswith("draft\t") and lines[1].endswith("Tiny-Q8_0.gguf")
    alone = tandem(["pull", "-hf", REPO, "-hff", "target.gguf"], tmp_path)
    assert alone.returncode == EXIT_OK, err(alone)
    assert alone.stdout.decode().startswith("target\t") and "no draft model" in err(alone)


@pytest.mark.parametrize("ref,code,words", [
    ("org/nothing-GGUF:Q4_K_M", EXIT_DOWNLOAD, "repository not found"),
    (f"{REPO}:IQ2_XS", EXIT_DOWNLOAD, "no IQ2_XS GGUF file in org/tiny-GGUF"),
    (f"{REPO}/missing.gguf", EXIT_DOWNLOAD, "missing.gguf"),
    ("./missing.gguf", EXIT_MODEL, "model file not found"),
])
def test_a_model_that_cannot_be_fetched_is_an_error_not_another_model(ref, code, words, hub,
                                                                        prepared, tmp_path):
    res = tandem(["run", ref, "hi"], tmp_path, cwd=tmp_path)
    assert res.returncode == code, err(res)
    assert words in err(res) and res.stdout == b"" and prepared == []
    assert not (tmp_path / "home" / "models" / "Qwen").exists()  # the default pair: untouched


def test_a_catalog_target_named_on_the_hub_is_its_pair(hub, tiny_models, tmp_path):
    """bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M is the catalog pair qwen2.5-7b's target:
    that pair is the one run (here: its 4.7 GB is refused without --yes, nothing fetched)."""
    hub.add("bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf",
            tiny_models["target"].read_bytes())
    res = tandem(["run", "bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M", "hi"], tmp_path)
    assert res.returncode == EXIT_USAGE, err(res)
    assert "target of the catalog pair qwen2.5-7b" in err(res)
    assert "qwen2.5-7b is not on disk" in err(res) and "needs a yes" in err(res)
    assert hub.gets("Qwen2.5-7B-Instruct-Q4_K_M.gguf") == []


@pytest.mark.parametrize("draft_model,chosen", [("draft", True), ("mismatch", False)])
def test_a_hub_target_gets_its_family_s_catalog_draft_if_the_vocabulary_fits(
        draft_model, chosen, hub, prepared, tiny_models, monkeypatch, tmp_path):
    """A target outside the catalog: the draft of a catalog pair of its family (org/Tiny-9B's
    for org/Tiny-3B), after both GGUF headers show the same vocabulary; else none (auto)."""
    from tandem.models import catalog
    from tandem.models.refs import hub_spec

    pair = catalog.PairSpec("tiny-9b", hub_spec("org/Tiny-9B-GGUF", "Tiny-9B-Q4_K_M.gguf"),
                            hub_spec("org/Tiny-0.5B-GGUF", "Tiny-0.5B-Q4_K_M.gguf"))
    monkeypatch.setattr(catalog, "load_catalog", lambda path=None: {pair.name: pair})
    hub.add("org/Tiny-3B-GGUF", "Tiny-3B-Q4_K_M.gguf", tiny_models["target"].read_bytes())
    hub.add("org/Tiny-0.5B-GGUF", "Tiny-0.5B-Q4_K_M.gguf",
            tiny_models[draft_model].read_bytes())
    res = tandem(["run", "org/Tiny-3B-GGUF:Q4_K_M", "hi"], tmp_path)
    assert res.returncode == STOPPED, err(res)
    p = prepared[0]
    assert p.target.name == "Tiny-3B-Q4_K_M.gguf"
    if chosen:
        assert p.draft.name == "Tiny-0.5B-Q4_K_M.gguf"
        assert "with org/Tiny-0.5B-GGUF/Tiny-0.5B-Q4_K_M.gguf, the catalog's draft of its " \
               "family (tiny" in err(res)
    else:
        assert p.draft is None and p.settings.strategy == "auto"
        assert "has its vocabulary" in err(res)
        reads = hub.gets("Tiny-0.5B-Q4_K_M.gguf")  # its header only, never the whole file
        assert reads and all(r.range for r in reads)
        assert not (tmp_path / "home" / "models" / "org" / "Tiny-0.5B-GGUF").exists()


def test_run_s_first_word(hub, prepared, tiny_models, tmp_path):
    """A .gguf path is the target (as -m: plain decoding); a bare user/repo before more words
    reads both ways and is refused with both ways to say it; two targets are refused."""
    res = tandem(["run", tiny_models["target"], "hi"], tmp_path)
    assert res.returncode == STOPPED, err(res)
    assert prepared[0].target == tiny_models["target"] and prepared[0].draft is None
    assert prepared[0].settings.strategy == "none"
    both = tandem(["run", "and/or", "what", "differs"], tmp_path)
    assert both.returncode == EXIT_USAGE and "reads both as a hub repository" in err(both)
    assert "and/or:Q4_K_M" in err(both) and "quote the whole prompt" in err(both)
    quoted = tandem(["run", *tiny(tiny_models), "and/or what differs"], tmp_path)
    assert quoted.returncode == STOPPED, err(quoted)  # one quoted argument: prompt text
    two = tandem(["run", "-hf", REPO, f"{REPO}:Q8_0", "hi"], tmp_path)
    assert two.returncode == EXIT_USAGE and "two targets" in err(two)
    mixed = tandem(["run", "-m", tiny_models["target"], "-hf", REPO, "hi"], tmp_path)
    assert mixed.returncode == EXIT_USAGE and "two models for one role" in err(mixed)
    lone = tandem(["run", "-hff", "x.gguf", "hi"], tmp_path)
    assert lone.returncode == EXIT_USAGE and "-hff" in err(lone)


# ------------------------------------------------------------- real answers, subprocesses


def _cli(args, env, timeout=120):
    full = {**os.environ, "NO_COLOR": "1", **env}
    return subprocess.run([sys.executable, "-m", "tandem", *map(str, args)],
                          capture_output=True, env=full, timeout=timeout)


def test_run_answers_with_the_hub_model(hub, tiny_models, tmp_path):
    """The reference's model answers: the same text as the file itself given with -m."""
    pytest.importorskip("llama_cpp")
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"),
           "TANDEM_HOME": str(tmp_path / "home"), "NO_PROXY": "127.0.0.1"}
    common = ["--raw", "-n", "12", "--temp", "0", "--strategy", "none", "-t", "1", "--json",
              "-ngl", "0"]
    res = _cli(["run", f"{REPO}:Q4_K_M", *common, "hello there"], env)
    assert res.returncode == EXIT_OK, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["gpu_layers"] == {"target": 0, "draft": None}
    direct = _cli(["run", "-m", tiny_models["target"], *common, "hello there"], env)
    assert json.loads(direct.stdout)["text"] == doc["text"] and doc["text"]


def test_serve_takes_a_llama_server_command_line(tiny_models, tmp_path):
    """llama-server's usual flags, verbatim: the alias is the model's name in /v1/models,
    /props and answers; -cb, --jinja and --metrics are what serve does anyway."""
    pytest.importorskip("llama_cpp")
    from serve_helpers import Server

    srv = Server(["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t", "1",
                  "-a", "my-model", "-ngl", "0", "-fa", "on", "-b", "64", "-ub", "64",
                  "-ctk", "f16", "-ctv", "f16", "-np", "1", "-cb", "--jinja", "--metrics"],
                 tmp_path / "home")
    try:
        status, models, _ = srv.raw("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["my-model"]
        status, props, _ = srv.raw("GET", "/props")
        assert status == 200 and props["model_alias"] == "my-model"
        status, answer, _ = srv.raw("POST", "/v1/completions", json.dumps(
            {"prompt": "abc", "max_tokens": 4, "temperature": 0}))
        assert status == 200 and answer["model"] == "my-model"
    finally:
        srv.stop()
    assert "Traceback" not in "".join(srv.log)
