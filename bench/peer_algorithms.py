"""Batch-size finders of other libraries, rewritten from their documented behaviour.

Each peer is a generator: it yields the next size to run, is sent the
:class:`~oomguard.engine.core.search.trial.Trial` that size gave, and returns its answer as an
:class:`Outcome`. :class:`PeerStrategy` turns one into a search strategy, so a peer's
trials run through :func:`oomguard.search` exactly as oomguard's own strategies' do (the
warm-up, then the CPU budget, real allocation failures, the same trial runner); only the
answer differs: a peer's is its own return value, not the largest size that ran. None of
these libraries is installed; each function follows the library's documentation and the
behaviour of its source at the version named, written anew:

- accelerate ``find_executable_batch_size(starting_batch_size=128)``: run at the start;
  on OOM multiply by 0.9 (since accelerate 1.9) or halve (before 1.9), rounding down;
  the first size that runs is the answer; it raises when the size reaches 0.
- Lightning ``BatchSizeFinder`` (2.6): ``init_val=2``, ``max_trials=25``,
  ``steps_per_trial=3`` (a trial is three steps at one size), ``max_val=8192``, and the
  dataset's length caps growth (here the workload's ``max_size``). ``power`` doubles until an OOM and halves the failed
  size; ``binsearch`` doubles, then bisects with ``low`` starting at 1, and returns
  ``int(size * (1 - margin))`` (``margin=0.05`` since 2.6, none before). Known quirks kept
  as they are: a first size that OOMs in binsearch returns 1 without running it; a
  failure at a size >= the dataset length is not halved (``_adjust_batch_size`` leaves
  such a size unchanged): power returns that size, binsearch runs it again forever (the
  search stops at the repeat). Before 2.6, reaching ``max_trials`` returned a doubled size
  that never ran; 25 doublings from 2 are not reached here.
- toma ``toma.simple.batch(func, initial_batchsize)``: halve (``//= 2``) on OOM until a
  size runs; an OOM at size 1 is raised.
- ultralytics ``autobatch`` (linear fit; 8.3.51 fitted in log space, reverted in April
  2025): profile sizes 1, 2, 4, 8, 16 (devices under 16 GiB), fit memory = a + b * size by
  least squares through the points that ran and grew, and take
  ``int((free * 0.60 - a) / b)``; if a profiled size failed and the answer is not below
  it, the size before it; outside [1, 1024], the default 16. Here ``free`` is the budget
  and memory a trial's measured peak in the budget's units (``Trial.limit_peak_bytes``:
  bytes of ``VmData`` above the trial's start, what ``RLIMIT_DATA`` counts); it does not
  run its answer.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from oomguard.engine.core.search.fit import fit_points
from oomguard.engine.core.search.trial import Trial

# A peer proposes sizes (yields), is sent each size's Trial, and returns its answer.
Proposals = Generator[int, Trial, "Outcome"]


@dataclass
class Outcome:
    """What a peer returned: ``size`` (None: it gave up), and a note on how it ended."""

    size: int | None
    note: str = ""
    extra: dict[str, int | None] = field(default_factory=dict)


class PeerStrategy:
    """A peer's generator as a search strategy (``next(trials, max_size)``).

    ``outcome`` is the peer's answer once it has returned; it stays None if the search
    stopped it first (a repeated size, ``max_trials``), and the search's
    ``stopped_because`` says why. A peer is searched without the workload's ``max_size``
    (it has none of its own): a size above it runs as the workload makes it run (a
    micro-batch larger than the data is all of the data).
    """

    def __init__(self, name: str, proposals: Proposals) -> None:
        self.name = name
        self._proposals = proposals
        self.outcome: Outcome | None = None

    def describe(self) -> str:
        return f"{self.name}, rewritten from its documented behaviour (bench/peer_algorithms.py)"

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        if self.outcome is not None:
            return None
        try:
            size = self._proposals.send(trials[-1] if trials else None)  # type: ignore[arg-type]
        except StopIteration as done:
            self.outcome = done.value
            return None
        return size


def accelerate(start: int = 128, factor: float = 0.9) -> Proposals:
    """accelerate's find_executable_batch_size; ``factor=0.5`` is the pre-1.9 halving."""
    size = start
    while size > 0:
        if (yield size).ok:
            return Outcome(size)
        size = int(size * factor)
    return Outcome(None, "no executable batch size found, reached zero")


def toma(start: int = 128) -> Proposals:
    """toma.simple.batch: halve on OOM until a size runs."""
    size = start
    while not (yield size).ok:
        if size <= 1:
            return Outcome(None, "OOM at batch size 1 (raised)")
        size //= 2
    return Outcome(size)


def _lightning_adjust(size: int, dataset_len: int, max_val: int, factor: float = 1.0,
                      value: int | None = None) -> tuple[int, bool]:
    """Lightning's ``_adjust_batch_size``: the next size and whether it changed; a size
    already >= the dataset's length stays as it is."""
    if size >= dataset_len:  # "greater or equal than the length of your dataset"
        return size, False
    new = min(value if value is not None else int(size * factor), max_val)
    return new, new != size


def lightning_power(dataset_len: int, init_val: int = 2, max_trials: int = 25,
                    max_val: int = 8192) -> Proposals:
    """Lightning BatchSizeFinder(mode="power")."""
    size, any_success = init_val, False
    for i in range(max_trials):
        if size >= max_val:
            return Outcome(size, f"max_val {max_val} reached")
        if size < 1:
            return Outcome(None, "size reached 0")
        if (yield size).ok:
            if i + 1 >= max_trials:
                return Outcome(size, "max_trials reached")
            size, changed = _lightning_adjust(size, dataset_len, max_val, factor=2.0)
            if not changed:
                return Outcome(size, "size did not change")
            any_success = True
        else:
            size, changed = _lightning_adjust(size, dataset_len, max_val, factor=0.5)
            if any_success:
                return Outcome(size, "" if changed else
                               f"OOM at {size} >= dataset length {dataset_len}: kept, not halved")
    return Outcome(size, "max_trials reached")


def lightning_binsearch(dataset_len: int, init_val: int = 2, max_trials: int = 25,
                        max_val: int = 8192, margin: float = 0.05) -> Proposals:
    """Lightning BatchSizeFinder(mode="binsearch"); ``extra["no_margin"]`` is the size
    before the margin (what Lightning before 2.6 returned from the same trials)."""
    size, low, high, count, note = init_val, 1, None, 0, ""
    while True:
        if size >= max_val:
            note = f"max_val {max_val} reached"
            break
        if size < 1:
            return Outcome(None, "size reached 0", {"no_margin": None})
        if (yield size).ok:
            count += 1
            if count >= max_trials:  # Lightning >= 2.6: keep the size that just ran
                note = "max_trials reached"
                break
            low = size
            if high:
                if high - low <= 1:
                    break
                size, changed = _lightning_adjust(size, dataset_len, max_val,
                                                  value=(high + low) // 2)
            else:
                size, changed = _lightning_adjust(size, dataset_len, max_val, factor=2.0)
            if not changed:
                note = "size did not change"
                break
        else:  # an unchanged size is proposed again: the search stops at the repeat
            high = size
            size, _ = _lightning_adjust(size, dataset_len, max_val, value=(high + low) // 2)
            if high - low <= 1:
                break
    found = max(1, int(size * (1 - margin))) if margin > 0 else size
    return Outcome(found, note, {"no_margin": size})


def ultralytics(capacity_bytes: int, fraction: float = 0.60, default: int = 16,
                sizes: tuple[int, ...] = (1, 2, 4, 8, 16)) -> Proposals:
    """ultralytics autobatch, linear fit: a size from a line through small profiled sizes."""
    peaks: list[int | None] = []
    for s in sizes:
        trial = yield s
        peaks.append(trial.limit_peak_bytes if trial.ok else None)
    points = [(s, p) for i, (s, p) in enumerate(zip(sizes, peaks, strict=True))
              if p is not None and 0 < p < capacity_bytes
              and (i == 0 or peaks[i - 1] is None or p > peaks[i - 1])]  # type: ignore[operator]
    fit = fit_points(points)
    if fit is None:  # their polyfit raises; the catch-all returns the default
        return Outcome(default, f"fewer than 2 usable points: default {default}")
    if fit.per_item_bytes <= 0:
        return Outcome(default, f"non-increasing fit: default {default}")
    found = int((capacity_bytes * fraction - fit.base_bytes) / fit.per_item_bytes)
    note = f"fit {fit.per_item_bytes / 2**20:.2f} MiB/item + {fit.base_bytes / 2**20:.1f} MiB"
    if None in peaks:
        first_fail = peaks.index(None)
        if found >= sizes[first_fail]:
            found = sizes[max(first_fail - 1, 0)]
            note += f"; capped below failed size {sizes[first_fail]}"
    if found < 1 or found > 1024:
        note += f"; {found} outside [1, 1024]: default {default}"
        found = default
    return Outcome(found, note)


@dataclass(frozen=True)
class Peer:
    """A peer row: ``name`` in the table; ``proposals(workload)`` starts its generator;
    ``steps`` per trial (Lightning's ``steps_per_trial``; None: the workload's own)."""

    name: str
    proposals: Callable[[Any], Proposals]
    steps: int | None = None

    def strategy(self, workload: Any) -> PeerStrategy:
        """A fresh strategy for one search of ``workload``."""
        return PeerStrategy(self.name, self.proposals(workload))


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("accelerate x0.9 (>=1.9)", lambda w: accelerate(w.peer_start, 0.9)),
    Peer("accelerate /2 (<1.9)", lambda w: accelerate(w.peer_start, 0.5)),
    Peer("lightning power", lambda w: lightning_power(w.max_size), steps=3),
    Peer("lightning binsearch", lambda w: lightning_binsearch(w.max_size), steps=3),
    Peer("toma", lambda w: toma(w.peer_start)),
    Peer("ultralytics autobatch", lambda w: ultralytics(w.budget_bytes)),
)}
# A row derived from another's trials: the same run, its answer before Lightning 2.6's margin.
DERIVED = {"lightning binsearch, no margin (<2.6)": ("lightning binsearch", "no_margin")}
