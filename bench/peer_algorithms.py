"""Batch-size finders of other libraries, rewritten from their documented behaviour.

Each peer runs its own trials through :class:`Runner`: oomguard's
:func:`~oomguard.engine.core.trial.run_trial` in this process, under a CPU budget
(:func:`~oomguard.engine.core.budget.budget`) entered after the workload's warm-up, so
an out-of-memory error is a real allocation failure, read back as ``Trial.ok == False``.
None of these libraries is installed; each function below follows the library's
documentation and the behaviour of its source at the version named, written anew:

- accelerate ``find_executable_batch_size(starting_batch_size=128)``: run at the start;
  on OOM multiply by 0.9 (since accelerate 1.9) or halve (before 1.9), rounding down;
  the first size that runs is the answer; it raises when the size reaches 0.
- Lightning ``BatchSizeFinder`` (2.6): ``init_val=2``, ``max_trials=25``,
  ``steps_per_trial=3`` (a trial is three steps at one size), ``max_val=8192``, and the
  dataset's length caps growth (here the workload's ``max_size``). ``power`` doubles
  until an OOM and halves the failed size; ``binsearch`` doubles, then bisects with
  ``low`` starting at 1, and returns ``int(size * (1 - margin))`` (``margin=0.05``
  since 2.6, none before). Known quirks kept as they are: a first size that OOMs in
  binsearch returns 1 without running it; a failure at a size >= the dataset length is not
  halved (``_adjust_batch_size`` leaves such a size unchanged): power returns that
  size, binsearch would run it again forever (stopped here at the repeat). Before
  2.6, reaching ``max_trials`` returned a doubled size that never ran; 25 doublings
  from 2 are not reached here.
- toma ``toma.simple.batch(func, initial_batchsize)``: halve (``//= 2``) on OOM until a
  size runs; an OOM at size 1 is raised.
- ultralytics ``autobatch`` (linear fit; 8.3.51 fitted in log space, reverted in
  April 2025): profile sizes 1, 2, 4,
  8, 16 (devices under 16 GiB), fit memory = a + b * size by least squares through the
  points that ran and grew, and take ``int((free * 0.60 - a) / b)``; if a profiled size
  failed and the answer is not below it, the size before it; outside [1, 1024], the
  default 16. Here ``free`` is the budget (bytes) and memory the trial's measured peak
  above the warmed-up process (what the budget counts); it does not run its answer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from oomguard.engine.core.budget import budget
from oomguard.engine.core.trial import Trial, run_trial

# A bound on any peer's trials, so that a loop the original would repeat forever ends.
TRIAL_CAP = 64


@dataclass
class Outcome:
    """What a peer returned: ``size`` (None: it gave up), and a note on how it ended."""

    size: int | None
    note: str = ""
    extra: dict[str, int | None] = field(default_factory=dict)


class Runner:
    """Runs ``fn`` at a size in this process under the active budget; records trials.

    ``steps`` runs the size that many times (Lightning's ``steps_per_trial``): the trial
    fits when every step does, and its seconds are their sum.
    """

    def __init__(self, fn: Callable[[int], Any]) -> None:
        self.fn = fn
        self.trials: list[Trial] = []
        self.calls = 0

    def __call__(self, size: int, steps: int = 1) -> bool:
        if len(self.trials) >= TRIAL_CAP:
            raise TrialCapReached(f"{TRIAL_CAP} trials")
        seconds, last = 0.0, None
        for _ in range(steps):
            last = run_trial(self.fn, size, "cpu")
            self.calls += 1
            seconds += last.seconds
            if not last.ok:
                break
        assert last is not None
        last.seconds = seconds
        self.trials.append(last)
        return last.ok


class TrialCapReached(Exception):
    """A peer ran :data:`TRIAL_CAP` trials without ending."""


def accelerate(run: Runner, start: int = 128, factor: float = 0.9) -> Outcome:
    """accelerate's find_executable_batch_size; ``factor=0.5`` is the pre-1.9 halving."""
    size = start
    while True:
        if size == 0:
            return Outcome(None, "no executable batch size found, reached zero")
        if run(size):
            return Outcome(size)
        size = size // 2 if factor == 0.5 else int(size * factor)


def toma(run: Runner, start: int = 128) -> Outcome:
    """toma.simple.batch: halve on OOM until a size runs."""
    size = start
    while not run(size):
        if size <= 1:
            return Outcome(None, "OOM at batch size 1 (raised)")
        size //= 2
    return Outcome(size)


class _Lightning:
    """The parts of Lightning's tuner the two modes share: the batch-size attribute
    and ``_adjust_batch_size`` (dataset length and ``max_val`` limits)."""

    def __init__(self, dataset_len: int, max_val: int) -> None:
        self.dataset_len, self.max_val = dataset_len, max_val

    def adjust(self, size: int, factor: float = 1.0, value: int | None = None) -> tuple[int, bool]:
        if size >= self.dataset_len:  # "greater or equal than the length of your dataset"
            return size, False
        new = value if value is not None else int(size * factor)
        new = min(new, self.max_val)
        return new, new != size


def lightning_power(run: Runner, max_size: int, init_val: int = 2, max_trials: int = 25,
                    steps: int = 3, max_val: int = 8192) -> Outcome:
    """Lightning BatchSizeFinder(mode="power")."""
    tuner = _Lightning(max_size, max_val)
    size, any_success, last_ok = init_val, False, init_val
    for i in range(max_trials):
        if size >= max_val:
            return Outcome(size, f"max_val {max_val} reached")
        if size < 1:
            return Outcome(None, "size reached 0")
        if run(size, steps):
            last_ok = size
            if i + 1 >= max_trials:
                return Outcome(last_ok, "max_trials reached")
            size, changed = tuner.adjust(size, factor=2.0)
            if not changed:
                return Outcome(size, "size did not change")
            any_success = True
        else:
            size, changed = tuner.adjust(size, factor=0.5)
            if any_success:
                return Outcome(size, "" if changed else
                               f"OOM at {size} >= dataset length {max_size}: kept, not halved")
    return Outcome(size, "max_trials reached")


def lightning_binsearch(run: Runner, max_size: int, init_val: int = 2, max_trials: int = 25,
                        steps: int = 3, max_val: int = 8192, margin: float = 0.05) -> Outcome:
    """Lightning BatchSizeFinder(mode="binsearch"); ``extra["no_margin"]`` is the size
    before the margin (what Lightning before 2.6 returned from the same trials)."""
    tuner = _Lightning(max_size, max_val)
    size, low, high, count, note = init_val, 1, None, 0, ""
    while True:
        if size >= max_val:
            note = f"max_val {max_val} reached"
            break
        if size < 1:
            return Outcome(None, "size reached 0", {"no_margin": None})
        if run(size, steps):
            count += 1
            if count >= max_trials:  # Lightning >= 2.6: keep the size that just ran
                note = "max_trials reached"
                break
            low = size
            if high:
                if high - low <= 1:
                    break
                size, changed = tuner.adjust(size, value=(high + low) // 2)
            else:
                size, changed = tuner.adjust(size, factor=2.0)
            if not changed:
                note = "size did not change"
                break
        else:
            high = size
            size, changed = tuner.adjust(size, value=(high + low) // 2)
            if high - low <= 1:
                break
            if not changed:  # the same size, the same state: Lightning would loop forever
                return Outcome(None, f"OOM at {size} >= dataset length {max_size} is retried "
                               "unchanged forever (stopped here)", {"no_margin": None})
    found = max(1, int(size * (1 - margin))) if margin > 0 else size
    return Outcome(found, note, {"no_margin": size})


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys); needs 2+ distinct xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def ultralytics(run: Runner, capacity_bytes: int, fraction: float = 0.60,
                default: int = 16, sizes: tuple[int, ...] = (1, 2, 4, 8, 16)) -> Outcome:
    """ultralytics autobatch, linear fit: sizes from a line through small profiled sizes."""
    peaks: list[int | None] = []
    for s in sizes:
        peaks.append(run.trials[-1].peak_bytes if run(s) else None)
    points = [(s, p) for i, (s, p) in enumerate(zip(sizes, peaks, strict=True))
              if p is not None and 0 < p < capacity_bytes
              and (i == 0 or peaks[i - 1] is None or p > peaks[i - 1])]  # type: ignore[operator]
    if len(points) < 2:  # their polyfit raises; the catch-all returns the default
        return Outcome(default, f"fewer than 2 usable points: default {default}")
    a, b = _least_squares([float(s) for s, _ in points], [float(p) for _, p in points])
    if b <= 0:
        return Outcome(default, f"non-increasing fit: default {default}")
    found = int((capacity_bytes * fraction - a) / b)
    note = f"fit {b / 2**20:.2f} MiB/item + {a / 2**20:.1f} MiB"
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
    """A peer row: ``name`` in the table, ``go(runner, workload)`` -> :class:`Outcome`."""

    name: str
    go: Callable[[Runner, Any], Outcome]


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("accelerate x0.9 (>=1.9)", lambda r, w: accelerate(r, w.peer_start, 0.9)),
    Peer("accelerate /2 (<1.9)", lambda r, w: accelerate(r, w.peer_start, 0.5)),
    Peer("lightning power", lambda r, w: lightning_power(r, w.max_size)),
    Peer("lightning binsearch", lambda r, w: lightning_binsearch(r, w.max_size)),
    Peer("toma", lambda r, w: toma(r, w.peer_start)),
    Peer("ultralytics autobatch", lambda r, w: ultralytics(r, w.budget_bytes)),
)}
# A row derived from another's trials: the same run, its answer before Lightning 2.6's margin.
DERIVED = {"lightning binsearch, no margin (<2.6)": ("lightning binsearch", "no_margin")}


def run_peer(name: str, fn: Callable[[int], Any], workload: Any) -> tuple[Outcome, Runner]:
    """Run peer ``name`` on the warmed-up ``fn`` under ``workload.budget_bytes`` (CPU)."""
    runner = Runner(fn)
    with ExitStack() as stack:
        stack.enter_context(budget(workload.budget_bytes, "cpu"))
        try:
            outcome = PEERS[name].go(runner, workload)
        except TrialCapReached as exc:
            outcome = Outcome(None, f"stopped after {exc}")
    return outcome, runner
