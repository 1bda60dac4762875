"""Profiles: the built-in ones load and match the recorded machines; bad YAML names file, line
and key; user profiles add or override."""
from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from hw_fixtures import machine
from tandem.machine.hardware import from_probe
from tandem.config.files import SettingsFileError
from tandem.machine.profiles import (
    ProfileError,
    ProfileMismatchError,
    get_profile,
    load_profiles,
    profiles_dir,
    select_profile,
)

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ("rtx-4090", "rtx-4080", "rtx-3090", "nvidia-generic", "mac-studio", "apple-silicon",
           "cpu")


@pytest.fixture(scope="module")
def builtin():
    return load_profiles(include_user=False)


def test_builtin_profiles_load_from_the_checkout(builtin):
    assert profiles_dir() == ROOT / "profiles"
    assert set(BUILTIN) <= set(builtin)
    for p in builtin.values():
        assert p.backend in ("cuda", "metal", "cpu") and p.description
        v = {k: loc.value for k, loc in p.values.items()}
        # every profile states the full set of run settings, so nothing falls to defaults
        for key in ("strategy", "n_max", "n_min", "p_min", "n_ctx", "n_batch", "n_ubatch",
                    "n_threads", "flash_attn", "type_k", "type_v", "target_gpu_layers",
                    "draft_gpu_layers"):
            assert key in v, (p.name, key)
        assert p.recommended_pairs and p.cost.get("source")


def test_profiles_dir_env_override(tmp_path, monkeypatch):
    shutil.copy(ROOT / "profiles" / "cpu.yaml", tmp_path / "cpu.yaml")
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    assert profiles_dir() == tmp_path
    assert list(load_profiles(include_user=False)) == ["cpu"]
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path / "missing"))
    with pytest.raises(SettingsFileError, match="no built-in profiles found"):
        load_profiles(include_user=False)


@pytest.mark.parametrize("kind,expected", [
    ("rtx4090", "rtx-4090"), ("rtx4080", "rtx-4080"), ("m2-ultra", "mac-studio"),
    ("cpu-box", "cpu"),
])
def test_recorded_machines_pick_their_profile(builtin, kind, expected):
    profile, reason = select_profile(machine(kind), builtin)
    assert profile.name == expected
    assert reason.startswith("matches")


def test_other_machines_fall_to_the_generic_profiles(builtin):
    a6000 = from_probe(machine_raw("rtx4090", nvidia_smi="NVIDIA RTX A6000, 49140, 48500\n"))
    p, _ = select_profile(a6000, builtin)
    assert p.name == "nvidia-generic"
    assert p.tier_for(a6000.accelerator_memory).min_memory_gib == 40
    assert p.values_for(a6000)["n_ctx"].value == 16384
    assert "llama3.3-70b" not in p.pairs_for(a6000)
    r3090 = from_probe(machine_raw("rtx4090", nvidia_smi="NVIDIA GeForce RTX 3090, 24576, 23000\n"))
    assert select_profile(r3090, builtin)[0].name == "rtx-3090"
    small = from_probe(machine_raw("rtx4090", nvidia_smi="NVIDIA GeForce RTX 4060, 8188, 7900\n"))
    p, _ = select_profile(small, builtin)
    assert p.name == "nvidia-generic" and p.values_for(small)["type_k"].value == "q8_0"
    m1 = from_probe(machine_raw("m2-ultra", sysctl=_sysctl("Apple M1 Pro", 16)))
    p, _ = select_profile(m1, builtin)
    assert p.name == "apple-silicon" and "qwen2.5-coder-7b" in p.pairs_for(m1)


def machine_raw(kind, **over):
    from hw_fixtures import raw

    return raw(kind, **over)


def _sysctl(chip: str, gib: int) -> str:
    from hw_fixtures import text

    return (text("sysctl-m2-ultra.txt").replace("Apple M2 Ultra", chip)
            .replace("206158430208", str(gib << 30)))


def test_mac_studio_tiers_and_cost_variant(builtin):
    hw = machine("m2-ultra")
    p = builtin["mac-studio"]
    assert p.values_for(hw)["n_ctx"].value == 32768  # 192 GB tier
    assert p.pairs_for(hw)[0] == "llama3.3-70b"
    cost = p.cost_for(hw)
    assert cost["variant"] == "M2 Ultra"
    assert cost["bw_eff_gbps"] == 560 and cost["t0_ms"] == 4.5
    assert cost["verify_ratio"] == {2: 1.48, 4: 2.42, 8: 3.6, 16: 4.5}
    m4 = from_probe(machine_raw("m2-ultra", sysctl=_sysctl("Apple M4 Max", 64)))
    assert p.matches(m4) and p.cost_for(m4)["bw_eff_gbps"] == 355


def test_cost_figures_are_hardware_md_values(builtin):
    c = builtin["rtx-4090"].cost_for(machine("rtx4090"))
    assert (c["bw_eff_gbps"], c["t0_ms"], c["eta"]) == (700, 1.0, 0.72)
    assert c["verify_ratio"] == {2: 1.12, 4: 1.27, 8: 1.45, 16: 1.35}
    assert c["decode_ms"]["32b"] == 28.7
    c = builtin["rtx-3090"].cost
    assert c["verify_ratio"][8] == 2.17 and c["bw_eff_gbps"] == 600
    assert builtin["rtx-4080"].cost["bw_eff_gbps"] == 510
    assert builtin["cpu"].cost["decode_ms"] == {"0.5b": 35, "1.5b": 84}


def test_speculative_defaults_follow_the_hardware(builtin):
    n_max = {n: builtin[n].values["n_max"].value for n in BUILTIN}
    assert n_max["rtx-4090"] >= 8 and n_max["rtx-4080"] >= 8  # Ada verifies 16 cheaply
    assert 4 <= n_max["rtx-3090"] <= 6  # Ampere: r(8) = 2.2
    assert n_max["mac-studio"] <= 3 and builtin["mac-studio"].values["p_min"].value >= 0.8
    assert builtin["rtx-4090"].values["draft_gpu_layers"].value == "all"
    assert builtin["cpu"].values["target_gpu_layers"].value == 0


def test_named_profile_that_does_not_match_is_refused_with_the_reason(builtin):
    cpu_box = machine("cpu-box")
    with pytest.raises(ProfileMismatchError) as e:
        get_profile("rtx-4090", cpu_box, builtin)
    assert "needs an NVIDIA GPU" in e.value.message and "--force-profile" in e.value.hint
    with pytest.raises(ProfileMismatchError, match="GPU named like 'RTX 4080'"):
        get_profile("rtx-4080", machine("rtx4090"), builtin)
    with pytest.raises(ProfileMismatchError, match="Apple chip like"):
        get_profile("mac-studio", from_probe(machine_raw("m2-ultra",
                                                         sysctl=_sysctl("Apple M1", 16))),
                    builtin)
    p, warnings = get_profile("rtx-4090", cpu_box, builtin, force=True)
    assert p.name == "rtx-4090" and "forced" in warnings[0]
    with pytest.raises(Exception, match="unknown profile 'nope'"):
        get_profile("nope", cpu_box, builtin)


# ------------------------------------------------------------------------ bad YAML


def _write(directory: Path, name: str, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(body).lstrip(), encoding="utf-8")
    return path


GOOD = """
    description: test
    match: {vendor: any}
    backend: cpu
    context: 4096
    speculative: {strategy: draft, n_max: 4, n_min: 0, p_min: 0.5}
"""


def _load_one(tmp_path, body, name="bad.yaml"):
    d = tmp_path / "p"
    _write(d, name, body)
    return load_profiles(builtin_dir=d, include_user=False)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, """
            description: test
            match: {vendor: any}
            backend: cpu
            speculative:
              n_max: 4
             n_min: [1, 2
            """)
    err = e.value
    assert err.path.endswith("bad.yaml") and err.line in (5, 6)
    assert "YAML syntax error" in err.message and f"line {err.line}" in err.message


def test_unknown_key_names_line_and_key(tmp_path):
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, GOOD + "    kv_cache: {type_k: f16, typ_v: f16}\n")
    assert (e.value.line, e.value.key) == (6, "kv_cache.typ_v")
    assert "unknown key" in e.value.message and "type_v" in e.value.message
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, GOOD + "    contxt: 8192\n")
    assert (e.value.line, e.value.key) == (6, "contxt") and "did you mean 'context'" in \
        e.value.message
    with pytest.raises(SettingsFileError, match="key 'match.gpu': unknown key"):
        _load_one(tmp_path, GOOD.replace("match: {vendor: any}", "match: {gpu: x}"))


@pytest.mark.parametrize("line,key,problem", [
    ("    context: lots\n", "context", "must be a whole number, got str 'lots'"),
    ("    batch: 512\n", "batch", "must be a mapping"),
    ("    offload: {target: many}\n", "offload.target", "must be auto, all or a layer count"),
    ("    flash_attn: maybe\n", "flash_attn", "must be one of auto, on, off"),
    ("    recommended_pairs: 3\n", "recommended_pairs", "must be a list of names"),
    ("    priority: high\n", "priority", "must be a whole number"),
])
def test_wrong_type_names_line_and_key(tmp_path, line, key, problem):
    body = GOOD.replace("    context: 4096\n", "") + line
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, body)
    assert e.value.key == key and problem in e.value.problem
    assert e.value.line == 5 and "bad.yaml, line 5" in e.value.message


@pytest.mark.parametrize("extra,key,problem", [
    ("    context: 0\n", "context", "must be in 256..1048576, got 0"),
    ("    threads: {n_threads: -2}\n", "threads.n_threads", "must be in 0..1024"),
    ("    kv_cache: {type_k: q3_k}\n", "kv_cache.type_k", "must be one of f16, f32"),
    ("    offload: {draft: -1}\n", "offload.draft", "layer count >= 0"),
    ("    batch: {n_batch: 256, n_ubatch: 512}\n", "batch.n_ubatch", "must not exceed"),
    ("    flash_attn: off\n    kv_cache: {type_v: q8_0}\n", "kv_cache.type_v",
     "needs flash attention"),
    ("    cost: {verify_ratio: {4: 0.5}}\n", "cost.verify_ratio.4", "cannot cost less"),
    ("    cost: {t0_ms: -1}\n", "cost.t0_ms", "must be > 0"),
    ("    tiers: [{context: 8192}]\n", "tiers[0].min_memory_gib", "is required"),
])
def test_impossible_values(tmp_path, extra, key, problem):
    body = GOOD.replace("    context: 4096\n", "") + extra
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, body)
    assert e.value.key == key and problem in e.value.problem


def test_impossible_speculative_and_match(tmp_path):
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, GOOD.replace("n_min: 0", "n_min: 6"))
    assert e.value.key == "speculative.n_min" and e.value.line == 5
    with pytest.raises(SettingsFileError, match="p_min': must be in 0..1, got 1.5"):
        _load_one(tmp_path, GOOD.replace("p_min: 0.5", "p_min: 1.5"))
    with pytest.raises(SettingsFileError, match="no machine can match"):
        _load_one(tmp_path, GOOD.replace("match: {vendor: any}",
                                         "match: {min_memory_gib: 32, max_memory_gib: 16}"))
    with pytest.raises(ProfileError, match="must match the file name"):  # a settings file error
        _load_one(tmp_path, GOOD + "    name: other\n")
    with pytest.raises(SettingsFileError, match="key 'backend': is required"):
        _load_one(tmp_path, GOOD.replace("    backend: cpu\n", ""))


def test_the_validation_is_msgspecs_and_its_paths_map_to_lines(tmp_path):
    """msgspec checks the file against the profile's Struct; its error path
    ($.tiers[1].batch.n_batch) becomes the file's line and the dotted key."""
    import msgspec
    from tandem.config.files import load_yaml, translate
    from tandem.machine import profiles as mod

    body = GOOD + textwrap.indent(textwrap.dedent("""
        tiers:
          - {min_memory_gib: 8}
          - min_memory_gib: 16
            batch:
              n_ubatch: 64
              n_batch: 0
        """), "    ")
    doc = load_yaml(tmp_path / "x.yaml", textwrap.dedent(body).lstrip())
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.tiers\[1\]\.batch\.n_batch`"):
        msgspec.convert(doc, mod._Profile)
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, body)
    assert (e.value.line, e.value.key) == (12, "tiers[1].batch.n_batch")
    assert e.value.problem == "must be in 1..65536, got 0"  # the schema's range, worded
    assert translate("Expected `int` >= 1 - at `$.tiers[1].batch.n_batch`", doc,
                     mod._Profile) == (12, "tiers[1].batch.n_batch", "must be in 1..65536, got 0")
    with pytest.raises(SettingsFileError, match="t0_ms': must be a finite number, got inf"):
        _load_one(tmp_path, GOOD + "    cost: {t0_ms: .inf}\n")  # no bound of msgspec's own


def test_the_translator_finds_entries_msgspec_writes_as_dots(tmp_path):
    """msgspec names a mapping's entry `[...]` (and a key `key` in `$...`): the translator
    finds which one, down to cost.variants.<name>.verify_ratio.<n>."""
    from tandem.config.files import load_yaml, translate
    from tandem.machine import profiles as mod

    body = GOOD + textwrap.indent(textwrap.dedent("""
        cost:
          variants:
            "M1 Max": {verify_ratio: {2: 1.5}}
            "M2 Max":
              eta: 0.6
              verify_ratio: {2: 1.5, 4: 0.5}
        """), "    ")
    doc = load_yaml(tmp_path / "x.yaml", textwrap.dedent(body).lstrip())
    want = (12, "cost.variants.M2 Max.verify_ratio.4",
            "a batch of 4 cannot cost less than one token, got 0.5")
    assert translate("Expected `float` >= 1.0 - at `$.cost.variants[...].verify_ratio[...]`",
                     doc, mod._Profile) == want
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, body)
    assert (e.value.line, e.value.key, e.value.problem) == want
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, body.replace("{2: 1.5, 4: 0.5}", "{0: 2.0}"))
    assert (e.value.line, e.value.key) == (12, "cost.variants.M2 Max.verify_ratio.0")
    assert e.value.problem.startswith("batch size must be a whole number >= 1")
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, body.replace("eta: 0.6", "eta: 2"))
    assert (e.value.line, e.value.key) == (11, "cost.variants.M2 Max.eta")
    assert e.value.problem == "must be a fraction (0..1.5), got 2"
    with pytest.raises(SettingsFileError) as e:
        _load_one(tmp_path, body.replace("eta: 0.6", "etta: 0.6"))
    assert (e.value.line, e.value.key) == (11, "cost.variants.M2 Max.etta")
    assert "unknown key; cost takes: source, bandwidth_gbps" in e.value.problem
    assert "variants" not in e.value.problem  # a variant has none of its own


def test_the_setting_types_come_from_the_schema():
    """One definition per setting: the profile's section Structs carry schema.Field.type."""
    import msgspec
    from tandem.config.schema import SETTING_FIELDS
    from tandem.machine import profiles as mod

    top = {f.name: f.type for f in msgspec.structs.fields(mod._Profile)}
    for field in SETTING_FIELDS:
        if len(field.path) == 1:
            assert top[field.path[0]] == field.type, field.key
        else:
            inner = {f.name: f.type for f in msgspec.structs.fields(top[field.path[0]])}
            assert inner[field.path[1]] == field.type, field.key


def test_bare_on_off_are_read_as_flash_attention_modes(tmp_path):
    p = _load_one(tmp_path, GOOD + "    flash_attn: on\n", "x.yaml")["x"]
    assert p.values["flash_attn"].value == "on"


# ---------------------------------------------------------------------- user profiles


def test_user_profiles_add_override_and_extend(tmp_path):
    user = tmp_path / "user"
    _write(user, "rtx-4090.yaml", """
        context: 16384
        kv_cache: {type_k: q8_0, type_v: q8_0}
        """)
    _write(user, "my-box.yaml", """
        extends: cpu
        description: my box
        speculative: {n_max: 6}
        """)
    profiles = load_profiles(user_dir=user)
    over = profiles["rtx-4090"]
    assert over.origin == "user override"
    assert over.values["n_ctx"].value == 16384 and over.values["type_k"].value == "q8_0"
    assert over.values["n_max"].value == 12  # the rest stays the built-in's
    assert over.match.gpu_name == ("RTX 4090",)
    mine = profiles["my-box"]
    assert mine.origin == "user" and mine.description == "my box"
    assert mine.values["n_max"].value == 6 and mine.values["n_min"].value == 0
    assert mine.backend == "cpu"


def test_user_profile_errors_name_the_user_file(tmp_path):
    user = tmp_path / "user"
    path = _write(user, "rtx-4090.yaml", "context: 16384\nspeculativ: {n_max: 3}\n")
    with pytest.raises(SettingsFileError) as e:
        load_profiles(user_dir=user)
    assert e.value.path == str(path) and e.value.line == 2
    path.write_text("extends: nothing\n")
    with pytest.raises(SettingsFileError, match="unknown profile 'nothing'"):
        load_profiles(user_dir=user)
    path.unlink()
    _write(user, "a.yaml", "extends: b\n")
    _write(user, "b.yaml", "extends: a\n")
    with pytest.raises(SettingsFileError, match="loop"):
        load_profiles(user_dir=user)


def test_user_override_beats_the_builtin_tiers(tmp_path):
    user = tmp_path / "user"
    _write(user, "mac-studio.yaml", "context: 4096\nkv_cache: {type_k: q8_0}\n")
    p = load_profiles(user_dir=user)["mac-studio"]
    hw = machine("m2-ultra")  # 192 GiB: the built-in tier says 32768
    assert p.values_for(hw)["n_ctx"].value == 4096
    assert p.values_for(hw)["type_k"].value == "q8_0"
    assert p.pairs_for(hw)[0] == "llama3.3-70b"  # the tier's other keys still apply


def test_profiles_dir_outside_a_checkout_is_the_wheels_share_dir(tmp_path, monkeypatch):
    import sys

    import tandem.machine.profiles as profiles_module

    monkeypatch.delenv("TANDEM_PROFILES_DIR", raising=False)
    monkeypatch.setattr(profiles_module, "__file__", str(tmp_path / "site" / "tandem" / "machine" / "profiles.py"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    assert profiles_dir() == tmp_path / "venv" / "share" / "tandem" / "profiles"


def test_the_wheel_carries_every_profile(tmp_path):
    pytest.importorskip("setuptools")  # the build backend, used without isolation (offline)
    import subprocess
    import sys
    import zipfile

    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = tmp_path.glob("tandem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).name for n in names if "/data/share/tandem/profiles/" in n}
    assert shipped == {p.name for p in (ROOT / "profiles").glob("*.yaml")}
    assert "tandem/data/catalog.yaml" in names
