"""Open the pair a command generates with: in this process, or, when the target is on RPC
servers, in a supervised worker process (llama.cpp aborts the process that holds a broken
RPC connection; engine/remote/worker.py says why). run, chat and serve all open it here."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.pair import Pair, SessionOptions


def open_pair(target_path: Path, draft_path: Path | None, opts: SessionOptions) -> Pair:
    """A PairSession, or a RemotePair (the same Pair) when `opts.rpc` is set."""
    if opts.rpc:
        from tandem.engine.remote.worker import RemotePair

        return RemotePair(target_path, draft_path, opts)
    from tandem.engine.pair import PairSession

    return PairSession(target_path, draft_path, opts)
