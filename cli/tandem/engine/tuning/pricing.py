"""What drafting costs and what paid, per configuration of one pair on this machine.

`Pricing` holds the cost model of each configuration (engine/tuning/costs.py: cached on disk,
else calibrated once) with the policy that keeps a busy machine from poisoning it, and the
knowledge kept beside it (engine/tuning/knowledge.py). PairSession asks it for the active
configuration's figures; the key that names the files is `cost_key` (fsutil.machine_key of
everything the figures depend on).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from tandem.engine.tuning.costs import (BUSY_SHARE, DISAGREE, MAX_BATCH, CostModel, calibrate,
                                         disagreement, load_while)
from tandem.engine.tuning.knowledge import Knowledge
from tandem.fsutil import machine_key

if TYPE_CHECKING:
    from tandem.engine.backend.llama import Context

# a calibration measured on a busy machine (other processes above costs.BUSY_SHARE of the
# CPU) never replaces a quiet one's figures: where there are none it is kept apart
# (busy_path), for later starts that find the machine busy too, until a quiet one measures
# what the calibration decodes: short, and the same on every machine
PROBE_TEXT = "def main():\n    print('calibrating')\n"


class _AfterCache:
    """A context as the cost measurements see it: `prefill(probe)` keeps what the cache holds
    when it holds something (the timings then run after it, and each measurement truncates
    back to it), so a measurement never evicts a conversation. Everything else is the
    context's own."""

    def __init__(self, ctx: Context):
        self._ctx = ctx

    def prefill(self, tokens: Sequence[int], progress=None) -> int:
        return 0 if self._ctx.tokens else self._ctx.prefill(tokens, progress)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def _after_cache(ctx: Context | None) -> Context | _AfterCache | None:
    """`ctx` wrapped in _AfterCache when its cache leaves room for the largest measured batch
    (else the probe replaces the cache, as a measurement at the context end must)."""
    if ctx is None or not ctx.tokens or len(ctx.tokens) + MAX_BATCH + 1 > ctx.n_ctx:
        return ctx
    return _AfterCache(ctx)


def cost_key(target_ctx: Context, draft_ctx: Context | None, target_path: Path,
             draft_path: Path | None, gpu_layers: tuple[int, int],
             rpc: Sequence[str] = ()) -> str:
    """The name of a configuration's cost and knowledge files: this machine, both contexts'
    settings, the layers offloaded, the RPC servers (a remote target's costs are the link's)
    and the models (name and size)."""
    parts: list[object] = [repr(target_ctx.params), *gpu_layers]
    if rpc:
        parts.append("rpc=" + ",".join(rpc))
    if draft_ctx is not None:
        parts.append(repr(draft_ctx.params))
    for p in (target_path, draft_path):
        if p is not None:
            parts += [p.name, p.stat().st_size]
    return machine_key(*parts)


class Pricing:
    """The cost models and kept knowledge of a session's configurations, by cost_key.

    `directory`: where the files live (`$TANDEM_HOME/costs`, passed in by the caller); None:
    nothing is read or written, each session calibrates for itself. `rpc`: the servers a
    calibration was measured over (said in its source)."""

    def __init__(self, directory: Path | None, rpc: Sequence[str] = ()):
        self.directory = directory
        self.rpc = tuple(rpc)
        # what paid is kept for the session's next request and, with keep_knowledge, beside
        # the cost cache for the next process (engine/tuning/knowledge.py)
        self.keep_knowledge = True
        self.notes: list[str] = []  # what became of cached costs (for the run's notes)
        # what the latest costs measured are based on, in a sentence (serve's start-up line)
        self.basis = ""
        self._costs: dict[str, CostModel] = {}
        self._calibrated: dict[str, CostModel] = {}
        self._knowledge: dict[str, Knowledge] = {}

    def costs_path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}.json"

    def knowledge_path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}.knowledge.json"

    def take_notes(self) -> list[str]:
        """The notes so far, once: said on the request that found them."""
        notes, self.notes = self.notes, []
        return notes

    def costs(self, key: str, target: Context, draft: Context | None,
              probe: Callable[[], Sequence[int]], calibrated: bool = False,
              save: bool = True) -> CostModel:
        """The configuration's cost model on this machine: cached, else calibrated once (a
        few seconds). A cached model is used only if it is recent and agrees with a quick
        measurement taken now (a busy machine once poisoned every later run); a new
        calibration is saved only if the machine was quiet while it ran. Steps refine it
        during the session (never saved: a refined curve mixes contexts of every length);
        `calibrated=True` gives the calibration itself, whose figures were all measured under
        the same conditions. `probe()`: the tokens the measurements decode; `save=False`: a
        new calibration serves the session only (taken with fewer threads than the key's,
        engine/tuning/threads.py)."""
        if key not in self._costs:
            model = self._measure(self.costs_path(key), target, draft, probe(), save)
            self._calibrated[key] = model
            self._costs[key] = model.copy()
        return (self._calibrated if calibrated else self._costs)[key]

    def _measure(self, path: Path | None, target: Context, draft: Context | None,
                 probe: Sequence[int], save: bool = True) -> CostModel:
        cached = _usable(path)
        # a busy start's figures are kept apart whatever its thread count (a busy machine's
        # next start likely takes the same): otherwise every busy `tandem run` calibrated again
        apart = busy_path(path) if path is not None else None
        busy_kept = False
        if cached is None and apart is not None and apart.exists():
            cached = _usable(apart)  # a busy start's figures
            busy_kept = cached is not None
        # measured after what the caches hold: prefilling the probe replaced a chat's
        # conversation, whose next turn then evaluated it all again (40 s on 3,500 tokens)
        target, draft = _after_cache(target), _after_cache(draft)
        if cached is not None:
            off, now = load_while(lambda: disagreement(target, cached, probe))
            saved = cached.describe().removeprefix("costs: ")
            if 1 / DISAGREE <= off <= DISAGREE and not (busy_kept and _quiet(now)):
                self.basis = (f"the costs a busy start measured ({saved}), checked now "
                              f"({off:.2f}x); a quiet start measures them again"
                              if busy_kept else f"the saved costs ({saved}), checked now "
                              f"({off:.2f}x)")
                return cached
            if not busy_kept and now is not None and now > BUSY_SHARE:
                # a calibration now would be busy and not kept: the quiet curve's shape at
                # today's timings, instead of measuring at every busy start
                scaled = cached.copy()
                scaled.scale(off)
                self.basis = (f"the saved costs ({saved}) scaled by {off:.2f}x to this "
                              f"machine's timings now: other processes use {now:.0%} of the "
                              "CPU, so a calibration would not be kept")
                self.notes.append(f"machine busy (other processes used {now:.0%} of the "
                                  f"CPU): the saved costs scaled by {off:.2f}x, not measured "
                                  "again")
                return scaled
            self.notes.append(f"cached costs were {off:.2f}x this machine's timings now: "
                              "measured again")
        fresh = calibrate(target, draft, probe)
        if self.rpc:  # the link's round trips are in every figure
            fresh.source = f"measured over RPC {','.join(self.rpc)}"
        if fresh.busy is not None and fresh.busy > BUSY_SHARE:
            # kept apart, where no quiet figures are: the next busy start does not measure
            keep = apart is not None and (cached is None or busy_kept) and _saved(fresh, apart)
            self.basis = (f"calibrated now on a busy machine (other processes used "
                          f"{fresh.busy:.0%} of the CPU): "
                          + ("kept apart for later busy starts; a quiet start measures again"
                             if keep else "for this session only, not saved"))
            self.notes.append(f"machine busy while calibrating (other processes used "
                              f"{fresh.busy:.0%} of the CPU): costs used for this session "
                              + ("and kept apart for later busy starts, until a quiet one"
                                 if keep else "only, not saved"))
        elif path is not None and save and _saved(fresh, path):
            self.basis = "calibrated now, saved for later starts"
            with contextlib.suppress(OSError):
                busy_path(path).unlink(missing_ok=True)  # the quiet figures replace them
        else:
            self.basis = "calibrated now, for this session only" + (
                "" if save else " (with fewer threads than this machine's)")
        return fresh

    def knowledge(self, key: str, sources: Sequence[str], buckets: Sequence[int]) -> Knowledge:
        """What earlier requests of the configuration learnt: this session's, else the file
        beside the cost cache (ignored when stale, of another version or invalid)."""
        if key not in self._knowledge:
            path = self.knowledge_path(key)
            kept = (Knowledge.load(path, sources, buckets)
                    if self.keep_knowledge and path is not None else None)
            self._knowledge[key] = kept if kept is not None else Knowledge()
        return self._knowledge[key]

    def keep(self, key: str, knowledge: Knowledge) -> None:
        """Write the configuration's knowledge beside its cost cache (when kept on disk)."""
        path = self.knowledge_path(key)
        if not self.keep_knowledge or path is None:
            return
        try:
            knowledge.save(path)
        except OSError:
            pass  # a read-only home: the next process starts from the priors again


def busy_path(path: Path) -> Path:
    """Where a busy machine's calibration is kept apart from the costs file `path`."""
    return path.with_name(path.stem + ".busy.json")


def _usable(path: Path | None) -> CostModel | None:
    """The cost file's model where it is recent and plausible, else None."""
    cached = CostModel.load(path) if path is not None else None
    return cached if cached is not None and cached.plausible() and not cached.expired() \
        else None


def _quiet(share: float | None) -> bool:
    return share is not None and share <= BUSY_SHARE


def _saved(model: CostModel, path: Path) -> bool:
    try:
        model.save(path)
    except OSError:
        return False  # a read-only home only costs a recalibration next time
    return True
