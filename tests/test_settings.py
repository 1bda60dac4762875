"""Settings precedence: cli > env > config > tuned > profile > default, each value with its
source; the profile choice; tuned settings files; building the engine's SessionOptions."""
from __future__ import annotations

import json
import textwrap

import pytest
from hw_fixtures import machine
from tandem.commands.compose import resolve, session_options
from tandem.config import tuned as tuned_file
from tandem.config.files import SettingsFileError
from tandem.config.settings import SOURCES
from tandem.engine.pair import SessionOptions
from tandem.errors import UsageError
from tandem.machine.fit import plan_for_settings
from tandem.machine.placement import ContextSpec
from tandem.machine.planner import MemoryBudget, plan
from tandem.machine.profiles import ProfileError, ProfileMismatchError, load_profiles

TEST_PROFILE = """
description: test profile
match: {vendor: any}
backend: cpu
context: 4000
speculative: {n_max: 5}
"""
CPU_BOX = machine("cpu-box")


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    return h


@pytest.fixture
def profiles(tmp_path):
    d = tmp_path / "profiles"
    d.mkdir()
    (d / "test.yaml").write_text(TEST_PROFILE)
    return load_profiles(builtin_dir=d, include_user=False)


def write_config(home, body: str):
    (home / "config.yaml").write_text(textwrap.dedent(body).lstrip())


def model_files(tmp_path, draft="draft.gguf"):
    """Two files standing for a pair: tuned results are keyed by the files (names, sizes)."""
    (tmp_path / "target.gguf").write_bytes(b"t" * 10)
    (tmp_path / draft).write_bytes(b"d" * 10)
    return tmp_path / "target.gguf", tmp_path / draft


def write_tuned(home, models, spec=None, **ctx):
    """spec-bench --tune's file for `models`: `spec` strategy/n_max..., `ctx` context fields."""
    overall = {"config": "x", "strategy": "draft", "speedup": 1.2, **(spec or {}),
               "target_ctx": ctx or None}
    path = tuned_file.tuned_path(home, *models)
    tuned_file.save(path, {"overall": overall, "by_category": {}, "partial": False}, {})
    return path


def settings_of(cli, models=None, **kw):
    """The Settings that commands/compose.py's resolve() merges for `cli` (and `models`' files)."""
    return resolve(cli, models, **kw).settings


VALUES = {"cli": 1800, "env": 1700, "config": 1600, "tuned": 1500, "profile": 1400,
          "default": 512}


@pytest.mark.parametrize("top", SOURCES)
def test_each_source_wins_over_the_next(top, home, tmp_path):
    """Set n_batch in `top` and every weaker source: `top` wins and is reported as the source.
    (n_batch, not the context size: spec-bench's tuned results never set the context.)"""
    weaker = SOURCES[SOURCES.index(top):]
    cli = {"n_batch": VALUES["cli"]} if "cli" in weaker else {}
    env = {"TANDEM_BATCH_SIZE": str(VALUES["env"])} if "env" in weaker else {}
    if "config" in weaker:
        write_config(home, f"""
            # my settings
            batch: {{n_batch: {VALUES['config']}}}
            """)
    models = model_files(tmp_path)
    tuned = write_tuned(home, models, n_batch=VALUES["tuned"]) if "tuned" in weaker else None
    d = tmp_path / "p"
    d.mkdir()
    body = TEST_PROFILE + (f"batch: {{n_batch: {VALUES['profile']}}}\n"
                           if "profile" in weaker else "")
    (d / "test.yaml").write_text(body)
    profiles = load_profiles(builtin_dir=d, include_user=False)
    s = settings_of(cli, env=env, home=home, hardware=CPU_BOX, profiles=profiles,
                    models=models)
    assert s.n_batch == VALUES[top]
    assert s.source("n_batch") == top
    origin = {"cli": "--batch-size", "env": "TANDEM_BATCH_SIZE",
              "config": f"{home / 'config.yaml'}:2", "tuned": str(tuned),
              "profile": "test", "default": ""}[top]
    assert s.origin("n_batch") == origin
    assert s.sources["n_batch"].describe().startswith(top)


def test_every_key_has_a_value_and_a_source(home, profiles):
    s = settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    assert (s.n_ctx, s.source("n_ctx")) == (4000, "profile")
    assert (s.n_max, s.source("n_max")) == (5, "profile")
    assert (s.n_batch, s.source("n_batch")) == (512, "default")
    assert (s.strategy, s.source("strategy")) == ("draft", "default")
    assert (s.profile, s.source("profile")) == ("test", "detected")
    assert (s.pair, s.source("pair")) == ("qwen2.5-coder-1.5b", "default")
    d = s.to_dict()
    assert d["n_ctx"] == {"value": 4000, "source": "profile", "origin": "test"}
    with pytest.raises(AttributeError):
        s.no_such_setting  # noqa: B018


def test_defaults_match_the_engine_defaults():
    from tandem.config.schema import FIELDS_BY_KEY
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.drafting.drafters import DraftParams
    from tandem.machine.fit import ENGINE_REPACK

    assert ENGINE_REPACK["fast"] == SessionOptions().repack  # what the planner assumes about loading
    c, d = ContextParams(), DraftParams()
    for key, value in (("n_ctx", c.n_ctx), ("n_batch", c.n_batch), ("n_ubatch", c.n_ubatch),
                       ("n_threads", c.n_threads), ("flash_attn", c.flash_attn),
                       ("type_k", c.type_k), ("type_v", c.type_v), ("n_max", d.n_max),
                       ("n_min", d.n_min), ("p_min", d.p_min)):
        assert FIELDS_BY_KEY[key].default == value, key


def test_env_and_cli_values_are_checked(home, profiles):
    with pytest.raises(UsageError, match="TANDEM_CTX_SIZE: must be a whole number, got 'big'"):
        settings_of({}, env={"TANDEM_CTX_SIZE": "big"}, home=home, hardware=CPU_BOX,
                    profiles=profiles)
    with pytest.raises(UsageError, match="TANDEM_DRAFT_P_MIN: must be in 0..1"):
        settings_of({}, env={"TANDEM_DRAFT_P_MIN": "2"}, home=home, hardware=CPU_BOX,
                    profiles=profiles)
    with pytest.raises(UsageError, match="context size must be in 256..1048576, got 10"):
        settings_of({"n_ctx": 10}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    with pytest.raises(UsageError, match="draft max must be in 0..64, got 100"):
        settings_of({"n_max": 100}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    with pytest.raises(UsageError, match=r"unknown strategy 'warp' \(--strategy\)") as e:
        settings_of({"strategy": "warp"}, env={}, home=home, hardware=CPU_BOX,
                    profiles=profiles)
    assert e.value.hint.startswith("choose one of: none, draft")
    s = settings_of({}, env={"TANDEM_GPU_LAYERS": "all", "TANDEM_FLASH_ATTN": "OFF",
                             "TANDEM_CACHE_TYPE_K": "q8_0", "TANDEM_DRAFT_P_MIN": "0.9"},
                    home=home, hardware=CPU_BOX, profiles=profiles)
    assert (s.target_gpu_layers, s.flash_attn, s.type_k, s.p_min) == ("all", "off", "q8_0", 0.9)


def test_text_values_go_through_the_same_types(home, profiles):
    """Flags and variables are converted by msgspec with the files' types (strict=False
    reads "5" as 5); only case and YAML 1.1 booleans are adjusted before."""
    from tandem.config.schema import FIELDS_BY_KEY
    from tandem.config.settings import cli_values, env_values, load_user_config

    got = env_values({"TANDEM_GPU_LAYERS_DRAFT": "5", "TANDEM_THREADS": " 2 ",
                      "TANDEM_HISTORY": "Off", "TANDEM_RPC": "a:1, b:2"})
    assert {k: v.value for k, v in got.items()} == {
        "draft_gpu_layers": 5, "n_threads": 2, "history": "off", "rpc": "a:1,b:2"}
    for env, problem in (({"TANDEM_RPC_TIMEOUT": "nan"}, "must be a finite number, got nan"),
                         ({"TANDEM_GPU_LAYERS": "-1"}, "layer count >= 0, got -1"),
                         ({"TANDEM_THREADS": "2.5"}, "must be a whole number, got '2.5'")):
        with pytest.raises(UsageError, match=problem):
            env_values(env)
    assert cli_values({"p_min": 0.25, "target_gpu_layers": "ALL"})["target_gpu_layers"].value \
        == "all"
    assert FIELDS_BY_KEY["n_ctx"].type.__metadata__[0].ge == 256  # the range msgspec checks
    (home / "config.yaml").write_text("flash_attn: off\nforce_profile: yes\npair: ' x '\n")
    values, extra = load_user_config(home / "config.yaml")
    assert values["flash_attn"].value == "off" and extra["pair"].value == "x"
    assert extra["force_profile"].value is True  # YAML 1.1's yes
    (home / "config.yaml").write_text("flash_attn: off\nforce_profile: 1\n")
    with pytest.raises(SettingsFileError) as e:
        load_user_config(home / "config.yaml")
    assert (e.value.line, e.value.key) == (2, "force_profile")
    assert e.value.problem == "must be true or false, got 1"
    assert not isinstance(e.value, ProfileError)


def test_unset_flags_are_dropped_and_unknown_keys_refused(home, profiles):
    s = settings_of({"n_ctx": None, "n_max": 6, "n_threads": 2, "profile": "test"},
                    env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    assert (s.n_ctx, s.source("n_ctx")) == (4000, "profile")
    assert (s.n_max, s.source("n_max"), s.origin("n_max")) == (6, "cli", "--draft-max")
    with pytest.raises(TypeError):
        settings_of({"nonsense": 1}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)


def test_config_file_errors_name_file_line_and_key(home, profiles):
    write_config(home, """
        context: 8192
        speculative:
          n_max: 4
          pmin: 0.5
        """)
    with pytest.raises(SettingsFileError) as e:
        settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    assert e.value.path == str(home / "config.yaml") and e.value.line == 4
    assert e.value.key == "speculative.pmin"
    assert not isinstance(e.value, ProfileError)  # config.yaml is not a profile
    write_config(home, "context: [8192\n")
    with pytest.raises(SettingsFileError, match="YAML syntax error"):
        settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    write_config(home, "profile: 12\n")
    with pytest.raises(SettingsFileError, match="key 'profile': must be a name"):
        settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    write_config(home, "")  # an empty file is no configuration
    assert settings_of({}, env={}, home=home, hardware=CPU_BOX,
                       profiles=profiles).n_ctx == 4000


def test_profile_choice_precedence_and_refusal(home):
    profiles = load_profiles(include_user=False)
    hw = machine("rtx4090")
    s = settings_of({}, env={}, home=home, hardware=hw, profiles=profiles)
    assert (s.profile, s.source("profile")) == ("rtx-4090", "detected")
    assert s.n_ctx == 8192 and s.source("n_ctx") == "profile"
    write_config(home, "profile: nvidia-generic\n")
    s = settings_of({}, env={}, home=home, hardware=hw, profiles=profiles)
    assert (s.profile, s.source("profile")) == ("nvidia-generic", "config")
    assert s.origin("n_ctx").startswith("nvidia-generic (tier >= 20 GiB)")
    r = resolve({}, env={"TANDEM_PROFILE": "cpu"}, home=home, hardware=hw, profiles=profiles)
    assert (r.settings.profile, r.settings.source("profile")) == ("cpu", "env")
    assert r.backend == "cpu"  # the user asked for the CPU profile on a GPU box
    s = settings_of({"profile": "rtx-4090"}, env={"TANDEM_PROFILE": "cpu"}, home=home,
                    hardware=hw, profiles=profiles)
    assert (s.profile, s.source("profile")) == ("rtx-4090", "cli")
    # a profile for other hardware is refused with the reason, unless forced
    with pytest.raises(ProfileMismatchError, match="GPU named like 'RTX 4080'"):
        settings_of({"profile": "rtx-4080"}, env={}, home=home, hardware=hw,
                    profiles=profiles)
    r = resolve({"profile": "rtx-4080"}, env={"TANDEM_FORCE_PROFILE": "1"}, home=home,
                hardware=hw, profiles=profiles)
    assert r.settings.profile == "rtx-4080" and any("forced" in w for w in r.warnings)
    write_config(home, "profile: rtx-4080\n")
    with pytest.raises(ProfileMismatchError, match=r"profile set by .*config.yaml:1"):
        settings_of({}, env={}, home=home, hardware=hw, profiles=profiles)
    write_config(home, "profile: rtx-4080\nforce_profile: true\n")
    assert settings_of({}, env={}, home=home, hardware=hw, profiles=profiles).profile == \
        "rtx-4080"


def test_user_profiles_come_from_the_home(home):
    (home / "profiles").mkdir()
    (home / "profiles" / "cpu.yaml").write_text("context: 2048\n")
    r = resolve({}, env={}, home=home, hardware=CPU_BOX)
    assert r.settings.profile == "cpu" and r.settings.n_ctx == 2048
    assert r.profile.origin == "user override"


def test_pair_precedence(home, profiles):
    write_config(home, "pair: qwen2.5-coder-3b\n")
    s = settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    assert (s.pair, s.source("pair")) == ("qwen2.5-coder-3b", "config")
    s = settings_of({"pair": "x"}, env={"TANDEM_PAIR": "y"}, home=home, hardware=CPU_BOX,
                    profiles=profiles)
    assert (s.pair, s.source("pair")) == ("x", "cli")


def test_weaker_conflicting_values_yield(home, profiles):
    # the profile sets n_max 5; the user's --draft-min 7 is stronger, so n_max follows it
    r = resolve({"n_min": 7}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    s = r.settings
    assert (s.n_min, s.n_max) == (7, 7) and s.source("n_max") == "cli"
    assert any("draft min 7 exceeds draft max 5" in w for w in r.warnings)
    s = settings_of({"n_max": 1}, env={"TANDEM_DRAFT_MIN": "3"}, home=home,
                    hardware=CPU_BOX, profiles=profiles)
    assert (s.n_min, s.n_max) == (1, 1)
    s = settings_of({"flash_attn": "off"}, env={"TANDEM_CACHE_TYPE_V": "q8_0"}, home=home,
                    hardware=CPU_BOX, profiles=profiles)
    assert (s.flash_attn, s.type_v) == ("off", "f16")
    with pytest.raises(UsageError, match="both from cli"):
        settings_of({"n_min": 4, "n_max": 2}, env={}, home=home, hardware=CPU_BOX,
                    profiles=profiles)


# ---------------------------------------------------------------------------- tuned


def test_tuned_settings_round_trip_and_tolerate_absence(home, profiles, tmp_path):
    models = model_files(tmp_path)
    assert tuned_file.tuned_values(home, models, 0) == ({}, None, [])
    path = write_tuned(home, models, {"n_max": 2}, n_ubatch=256, n_batch=256)
    r = resolve({}, models, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    s = r.settings
    assert (s.n_max, s.source("n_max"), s.origin("n_max")) == (2, "tuned", str(path))
    assert (s.n_ubatch, s.n_batch) == (256, 256) and r.tuned_path == path
    # measured for other files: not applied
    other = settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles,
                        models=model_files(tmp_path, "draft2.gguf"))
    assert other.n_max == 5 and other.source("n_max") == "profile"


def test_broken_tuned_files_are_skipped_with_a_warning(home, profiles, tmp_path):
    models = model_files(tmp_path)
    path = write_tuned(home, models, {"n_max": 3})
    for content in ("{not json", json.dumps({"overall": {"strategy": "draft", "n_max": -1}})):
        path.write_text(content)
        r = resolve({}, models, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
        assert r.settings.n_max == 5 and r.tuned_path is None
        assert sum("ignored tuned settings" in w for w in r.warnings) == 1


# --------------------------------------------------------------------- engine options


def test_session_options_from_settings_and_plan(home, profiles, tiny_models):
    s = settings_of({"n_ctx": 1024, "n_max": 6, "strategy": "draft"},
                    env={"TANDEM_THREADS": "2", "TANDEM_CACHE_TYPE_K": "q8_0"}, home=home,
                    hardware=CPU_BOX, profiles=profiles)
    opts = session_options(s, verbose=True)
    assert opts.strategy == "draft" and opts.verbose
    assert (opts.draft.n_max, opts.draft.n_min, opts.draft.p_min) == (6, 0, 0.5)
    c = opts.target_ctx
    assert (c.n_ctx, c.n_threads, c.type_k, c.type_v, c.flash_attn) == (1024, 2, "q8_0", "f16",
                                                                         "on")
    assert opts.draft_ctx is None  # the draft uses the target's context settings
    assert (opts.target_gpu_layers, opts.draft_gpu_layers) == (0, 0)  # cpu backend, auto
    assert c.checkpoints == 8  # the schema's default
    s = settings_of({"ctx_checkpoints": 3}, env={}, home=home, hardware=CPU_BOX,
                    profiles=profiles)
    assert session_options(s).target_ctx.checkpoints == 3

    p = plan_for_settings(s, tiny_models["target"], tiny_models["draft"], hardware=CPU_BOX,
                          backend="cpu")
    assert p.status == "fits" and p.target.exact
    opts = session_options(s, p)
    assert (opts.target_gpu_layers, opts.draft_gpu_layers) == (0, 0)


def test_session_options_take_gpu_layers_from_the_plan(home):
    r = resolve({}, env={}, home=home, hardware=machine("rtx4090"))
    s = r.settings
    from tandem.machine.shapes import ModelShape

    t = ModelShape.estimate("qwen2.5-coder-7b-instruct-q4_k_m", int(4.68e9))
    d = ModelShape.estimate("qwen2.5-coder-0.5b-instruct-q4_k_m", 491400064)
    p = plan(t, d, MemoryBudget.for_hardware(r.hardware, s.gpu_reserve_mb, r.backend),
             ContextSpec(n_ctx=s.n_ctx))
    opts = session_options(s, p)
    assert (opts.target_gpu_layers, opts.draft_gpu_layers) == (29, 25)  # all, output included
    no_plan = session_options(s, backend=r.backend)
    assert (no_plan.target_gpu_layers, no_plan.draft_gpu_layers) == (-1, -1)  # llama.cpp: all


def test_planned_options_load_and_run_a_session(home, tiny_models):
    """What `tandem run` does once wired: settings -> plan -> SessionOptions -> PairSession."""
    from tandem.commands.compose import prepare_session
    from tandem.engine.loop.events import DoneEvent
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.pair import PairSession

    # one thread: two OpenMP threads spin against whatever else runs on a 2-core machine
    prep = prepare_session({"n_ctx": 512, "strategy": "draft", "n_max": 3, "n_threads": 1},
                           lambda pair: (tiny_models["target"], tiny_models["draft"]),
                           hardware=CPU_BOX, home=home)
    assert prep.plan.status == "fits" and prep.settings.source("n_ctx") == "cli"
    assert prep.options.target_ctx.n_ctx == 512 and prep.options.draft.n_max == 3
    with PairSession(prep.target, prep.draft, prep.options) as session:
        assert session.target_ctx.n_ctx == 512 and session.draft_ctx.n_ctx == 512
        events = list(session.generate(session.prompt_tokens(
            [{"role": "user", "content": "hi"}], raw=True), GenParams(max_tokens=4)))
    assert isinstance(events[-1], DoneEvent) and events[-1].stats.to_dict()


def test_a_pair_that_does_not_fit_is_refused_with_what_to_change(home):
    from tandem.commands.compose import prepare_session
    from tandem.machine.planner import PlanError
    from tandem.models.catalog import ModelSpec

    huge = ModelSpec("llama-3.3-70b-instruct-q4_k_m", "x/y", "huge.gguf", size=int(42.5e9))
    small = ModelSpec("llama-3.2-1b-instruct-q4_k_m", "x/y", "small.gguf", size=int(0.81e9))
    with pytest.raises(PlanError) as e:
        prepare_session({}, lambda pair: (huge, small), hardware=CPU_BOX, home=home)
    assert e.value.exit_code == 3
    assert "does not fit" in e.value.message and "RAM" in e.value.message
    assert "smaller pair" in e.value.hint


def test_spec_bench_tuned_results_apply_to_their_model_files(home, profiles, tiny_models):
    """spec-bench --tune writes its own format, keyed by the model files (tandem.bench.tune)."""
    tune = tuned_file
    target, draft = tiny_models["target"], tiny_models["draft"]
    overall = {"config": "draft-k3", "strategy": "draft", "n_max": 3, "n_min": 1, "p_min": 0.6,
               "speedup": 1.3, "draft_model": "draft",
               "target_ctx": {"n_ctx": 2048, "n_batch": 256, "n_ubatch": 128, "n_threads": 0,
                              "n_threads_batch": 0, "flash_attn": "on", "type_k": "f16",
                              "type_v": "f16"}, "draft_ctx": None}
    path = tune.tuned_path(home, target, draft, 0)
    tune.save(path, {"overall": overall, "by_category": {}, "partial": False}, {"target": "t"})
    r = resolve({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    assert r.settings.n_max == 5 and not r.warnings  # files unknown yet: not applied, no noise
    s = settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles,
                    models=(target, draft))
    assert (s.n_max, s.n_min, s.p_min, s.n_ubatch, s.n_batch) == (3, 1, 0.6, 128, 256)
    assert s.source("n_max") == "tuned" and s.origin("n_max") == str(path)
    assert s.n_ctx == 4000 and s.source("n_ctx") == "profile"  # the context is the user's
    other = settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles,
                        models=(target, tiny_models["draft_weak"]))
    assert other.n_max == 5


def test_history_is_on_by_default_and_each_source_can_turn_it_off(home, profiles):
    s = settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    assert s.history == "on" and session_options(s).history
    s = settings_of({"history": "off"}, env={}, home=home, hardware=CPU_BOX,
                    profiles=profiles)
    assert s.source("history") == "cli" and s.origin("history") == "--no-history"
    assert not session_options(s).history
    s = settings_of({}, env={"TANDEM_HISTORY": "off"}, home=home, hardware=CPU_BOX,
                    profiles=profiles)
    assert s.history == "off" and s.source("history") == "env"
    (home / "config.yaml").write_text("history: off\n")  # YAML reads a bare off as false
    s = settings_of({}, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    assert s.history == "off" and s.source("history") == "config"
    with pytest.raises(UsageError, match="TANDEM_HISTORY"):
        settings_of({}, env={"TANDEM_HISTORY": "maybe"}, home=home, hardware=CPU_BOX,
                    profiles=profiles)


def test_the_merge_takes_plain_data(home):
    """config/settings.py merges what it is given: no hardware, profile object or catalog."""
    from tandem.config.files import Located
    from tandem.config.settings import Setting, read_sources, resolve_settings

    write_config(home, "speculative: {n_max: 4}\n")
    sources = read_sources({"n_threads": 16}, {"TANDEM_PAIR": "mine"}, home / "config.yaml",
                           "the-default")
    assert (sources.pair.value, sources.pair.source) == ("mine", "env")
    assert sources.profile is None and not sources.force_profile and sources.threads == 16
    s, warnings = resolve_settings(
        sources, Setting("profile", "p", "detected", "why"),
        {"n_ctx": Located(3000, "p", 1), "n_max": Located(2, "p", 2)},
        {"n_batch": Located(128, "tuned.json", None)}, cpu_threads=8)
    assert (s.n_ctx, s.source("n_ctx"), s.n_max, s.source("n_max")) == (3000, "profile", 4,
                                                                         "config")
    assert (s.n_batch, s.source("n_batch"), s.profile) == (128, "tuned", "p")
    assert s.n_threads == 8 and any("exceeds this machine's 8 CPU threads" in w
                                    for w in warnings)
    assert read_sources({}, {}, home / "none.yaml", "the-default").pair.source == "default"


def test_a_bad_flag_fails_before_the_files_are_looked_for(home, profiles):
    def files(pair):
        raise AssertionError(f"files of {pair} looked for before the flags were checked")

    with pytest.raises(UsageError, match="draft max must be in 0..64"):
        resolve({"n_max": 100}, files, env={}, home=home, hardware=CPU_BOX, profiles=profiles)
    with pytest.raises(UsageError, match="TANDEM_CTX_SIZE"):
        resolve({}, files, env={"TANDEM_CTX_SIZE": "big"}, home=home, hardware=CPU_BOX,
                profiles=profiles)
    with pytest.raises(ProfileMismatchError):
        resolve({"profile": "rtx-4080"}, files, env={}, home=home, hardware=CPU_BOX,
                profiles=load_profiles(include_user=False))
