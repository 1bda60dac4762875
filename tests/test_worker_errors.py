"""Errors cross the RPC worker's process boundary (engine/remote/worker.py) as they were raised: the
same errors.py class, message, hint and exit code on the caller's side, so `tandem serve`
maps them to the HTTP status a local error gets (a ContextOverflowError from the KV cache
inside the worker is a 400, not a 500)."""
from __future__ import annotations

import multiprocessing

import pytest

from tandem import errors
from tandem.config.files import SettingsFileError
from tandem.engine.remote import worker
from tandem.engine.remote.worker import RemotePair

NAMES = sorted(errors.error_classes())
# raised in the worker, and what the caller should get: a subclass defined outside errors.py
# crosses as its nearest errors.py class; anything else is an unexpected TandemError (exit 1)
OTHERS = {"SettingsFileError": ("UsageError", errors.EXIT_USAGE),
          "ValueError": ("TandemError", errors.EXIT_ERROR)}


def _raised(name: str) -> BaseException:
    if name == "SettingsFileError":
        return SettingsFileError("bad.yaml", 3, "temp", "not a number", "fix the file")
    if name == "ValueError":
        return ValueError("a bug")
    return errors.error_classes()[name](f"{name} message", f"{name} hint")


def _worker_side(conn, names) -> None:
    """In a spawned process, as the worker does: each error through worker._error."""
    for name in names:
        conn.send(worker._error(_raised(name)))
    conn.close()


@pytest.fixture(scope="module")
def crossed():
    """Every error sent from another process and received by RemotePair._receive."""
    ctx = multiprocessing.get_context("spawn")  # as RemotePair starts its worker
    conn, child = ctx.Pipe(duplex=True)
    names = NAMES + sorted(OTHERS)
    proc = ctx.Process(target=_worker_side, args=(child, names), daemon=True)
    proc.start()
    child.close()
    pair = RemotePair.__new__(RemotePair)  # only its receiving end: no pair is loaded
    pair._conn, pair._proc, pair._dead, pair.stall = conn, proc, None, 60.0
    got = {}
    for name in names:
        with pytest.raises(errors.TandemError) as caught:
            pair._receive()
        got[name] = caught.value
    proc.join(30)
    conn.close()
    return got


def _status(exc: errors.TandemError) -> tuple:
    from tandem.serve.protocol import ApiError
    from tandem.serve.job_events import Refused
    from tandem.serve.request_flow import raise_failure

    with pytest.raises(ApiError) as api:
        raise_failure(Refused(exc))
    return api.value.status, api.value.code, api.value.type


def test_every_error_class_is_in_the_registry():
    """Each TandemError subclass errors.py defines, at any depth."""
    defined = {n for n, v in vars(errors).items() if isinstance(v, type)
               and issubclass(v, errors.TandemError)}
    assert set(NAMES) == defined
    assert {"ContextOverflowError", "GGUFFormatError", "UnsafePathError"} <= defined


@pytest.mark.parametrize("name", NAMES)
def test_an_error_crosses_the_worker_boundary_as_raised(crossed, name):
    local = _raised(name)
    remote = crossed[name]
    assert type(remote) is type(local)
    assert (remote.message, remote.hint, remote.exit_code) == \
        (local.message, local.hint, local.exit_code)
    assert _status(remote) == _status(local)


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_other_exceptions_cross_as_their_nearest_known_class(crossed, name):
    cls, code = OTHERS[name]
    remote = crossed[name]
    assert type(remote) is errors.error_classes()[cls] and remote.exit_code == code
    if name == "SettingsFileError":  # a 400 through serve, as locally
        assert remote.hint == "fix the file"
        assert _status(remote) == _status(_raised(name))


def test_a_context_overflow_in_the_worker_is_a_400():
    """The case of issue 29: the KV cache full inside the worker (engine/backend/llama.py)."""
    exc = worker._error(errors.ContextOverflowError("no room left in the KV cache",
                                                    "raise --ctx-size or shorten the prompt"))
    rebuilt = errors.rebuild_error(*exc[1])
    assert isinstance(rebuilt, errors.ContextOverflowError)
    assert _status(rebuilt) == (400, "context_length_exceeded", "invalid_request_error")


def test_an_unknown_name_keeps_the_exit_code_it_was_sent_with():
    err = errors.rebuild_error("SomethingNewError", "m", "h", errors.EXIT_REMOTE)
    assert type(err) is errors.TandemError and err.exit_code == errors.EXIT_REMOTE
    assert (err.message, err.hint) == ("m", "h")
