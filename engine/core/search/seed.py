"""An estimate as a search's first prediction: :class:`Seeded` and :func:`plan_seed`.

:func:`~oomguard.engine.core.estimate.estimate.estimate` predicts a workload's peak at a size
without running it (fake tensors: no data, no memory). Before the first trial a search estimates
the peaks at two sizes (a third where the line through them is extrapolated far), fits the line
(:func:`~oomguard.engine.core.search.fit.peak_model`) and takes the largest size whose estimated
peak fits the headroom the trials will have, less :data:`SEED_MARGIN`, as its first trial
(:class:`Seeded`); from its measured peak the estimated slope gives the maximum ``m``, and
``m + 1`` closes the bracket: three trials where the estimate is exact, two where the seed is
the maximum or one above it; the strategy it wraps (Guided) then goes on from there. The sizes run are still the only answer: an estimate chooses a size, never
the result.

An estimate that is wrong costs little: too low, the seeded trial fits and Guided's line from its
measured peak goes up; one size too high, the trial below it closes the bracket; far too high,
the search falls back to the wrapped strategy's own first size, knowing the OOM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard.engine.core.search.fit import peak_model
from oomguard.engine.core.search.strategies import Guided, Strategy, bracket
from oomguard.engine.core.search.trial import Trial
from oomguard.engine.core.workload import name_of, own_estimate

log = logging.getLogger("oomguard.search")

ESTIMATE = "estimate"  # Trial.chosen_by of the size the estimate predicted
BELOW_ESTIMATE = "below the estimate"  # first - 1, first - 3: the estimate ran out of memory
FITS_ALL = "estimated: fits all samples"  # a job's size with no search (jobs/sizing.py)
SLOPE = "estimate slope"  # after a fit: its measured peak plus the estimate's bytes per item
# A third size is estimated where the predicted maximum lies this many times past the larger
# of the two sizes estimated: a curve that is not a line (attention over the sequence) bends
# away from a line extrapolated that far, and the line through the estimate there is closer.
EXTRAPOLATED = 2.0
# The seed is predicted for this fraction less than the headroom. The estimate counts storage
# bytes, the limit VmData in a process whose free heap varies; on the GPT-2 step the largest
# size that ran in a fresh process was 72 where the estimate predicted 75 (4% of the budget).
# A seed that fits is worth more than one that does not: its measured peak and the estimate's
# slope give the maximum next (3 trials where the estimate is exact), where an OOM measures
# nothing (docs/measurements.md#estimate-error).
SEED_MARGIN = 0.03


@dataclass(frozen=True)
class Seeded:
    """Run ``first`` (the size an estimate predicts is the largest that fits), then ``then``.

    Where ``first`` fits, the size its measured peak plus ``per_item_bytes`` (the estimated
    line's slope, bytes per item) predicts fits the headroom, where that is above it (an
    estimate low by a constant: a proportional guess from one peak would undershoot); where
    ``first`` runs out of memory, ``first - 1`` next and ``first - 3`` after it (an estimate one to
    three sizes high closes the bracket there); where those run out too, ``then``'s own first size
    (below the OOMs). Then ``then`` on every trial so far: an estimate far too high costs three
    trials, and the strategy goes on knowing an OOM above. ``name`` is ``then``'s: the search is ``then``'s, seeded."""

    first: int
    then: Strategy = field(default_factory=Guided)
    per_item_bytes: float | None = None

    @property
    def name(self) -> str:
        return self.then.name

    def describe(self) -> str:
        return (f"Run {self.first}, the largest size the estimate (fake tensors, not a "
                f"measurement) predicts fits the headroom; if it runs out of memory, run "
                f"{self.first - 1}; then as {self.then.name}: {self.then.describe()}")

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        if not trials:
            return min(self.first, max_size)
        lo, hi = bracket(trials)
        below = self._below(trials)
        if below is not None:
            return below
        up = self._up(trials, max_size)
        if up is not None:
            return up
        own = self.then.next([], max_size)  # then's sequence, from its own start
        if lo is None and own is not None and hi is not None and own < hi and \
                not any(t.size == own for t in trials):
            return own
        return self.then.next(trials, max_size)

    def chosen_by(self, trials: Sequence[Trial]) -> str:
        """Who chooses the size :meth:`next` proposes after ``trials``: the estimate, the size
        below it, or the wrapped strategy (its name)."""
        if not trials:
            return ESTIMATE
        if self._below(trials) is not None:
            return BELOW_ESTIMATE
        return SLOPE if self._up(trials, 1 << 62) is not None else self.then.name

    def _below(self, trials: Sequence[Trial]) -> int | None:
        """While every trial ran out of memory: ``first - 1``, then ``first - 3`` (an estimate
        is close, docs/measurements.md#estimate-error: one or three sizes high closes the
        bracket there); None after that, or where ``first - 3`` is more than 5% below it."""
        if any(t.ok for t in trials) or len(trials) > 2:
            return None
        first = trials[0].size  # the estimate's size, or max_size below it
        size = first - (1 if len(trials) == 1 else 3)
        return size if size >= 1 and size >= 0.95 * first else None

    def _up(self, trials: Sequence[Trial], max_size: int) -> int | None:
        """While the latest trial is the largest fit and nothing above it ran out of memory (or
        it is the only fit): the size its measured peak plus the estimated slope predicts fits
        the headroom, at least the size above it, below any OOM; else None (``then`` goes on).
        Two fits a size apart measure the same bytes within the sampling noise (on the GPT-2
        step the larger read 3 MB less): a line through them would say nothing."""
        lo, hi = bracket(trials)
        t = trials[-1]
        fits = sum(x.ok for x in trials)
        if not t.ok or t.size != lo or (hi is not None and fits > 1) or \
                not self.per_item_bytes or self.per_item_bytes <= 0 or lo >= max_size:
            return None
        peak = t.limit_peak_bytes if t.limit_peak_bytes is not None else t.peak_bytes
        if peak is None or t.headroom_bytes is None:
            return None
        room = max(t.headroom_bytes, peak) - peak
        size = min(lo + max(1, int(room // self.per_item_bytes)), max_size,
                   hi - 1 if hi is not None else max_size)
        return size if size > lo and not any(x.size == size for x in trials) else None


@dataclass
class SeedPlan:
    """The estimated peaks (bytes above the warmed-up state, estimates, not measurements) at
    ``sizes``, the line through them, and the seconds the estimates took."""

    points: list[tuple[int, int]]
    seconds: float
    more: Callable[[int], int] | None = None  # estimate one more size (None: no more)
    first: int | None = None
    capacity_bytes: int | None = None
    per_item_bytes: float | None = None  # the slope of the line that predicted ``first``
    notes: list[str] = field(default_factory=list)

    def predict(self, capacity_bytes: int, max_size: int) -> int | None:
        """The largest size whose estimated peak is within ``capacity_bytes`` less
        :data:`SEED_MARGIN` (at most ``max_size``), refined by one more estimate near it where the line was extrapolated
        far; None where the line has no slope or no size fits."""
        target = capacity_bytes * (1 - SEED_MARGIN)
        fit = peak_model(self.points)
        m = fit.largest_size_within(target) if fit is not None else None
        largest = max(s for s, _ in self.points)
        if m is not None and self.more is not None and m > EXTRAPOLATED * largest and \
                min(m, max_size) not in {s for s, _ in self.points}:
            size = min(m, max_size)
            t0 = time.perf_counter()
            try:
                self.points = sorted([*self.points, (size, self.more(size))])
            except _NoMore:
                pass  # predicted from the two sizes estimated
            else:
                near = sorted(self.points, key=lambda p: abs(p[0] - size))[:2]
                fit = peak_model(sorted(near))
                m = fit.largest_size_within(target) if fit is not None else None
            self.seconds += time.perf_counter() - t0
        if m is None or m < 1:
            return None
        self.first, self.capacity_bytes = min(m, max_size), capacity_bytes
        self.per_item_bytes = fit.per_item_bytes if fit is not None else None
        return self.first

    def to_dict(self) -> dict[str, Any]:
        """For the search's record: what was estimated and what it chose."""
        return {"estimated_peaks": [{"size": s, "peak_bytes": p} for s, p in self.points],
                "first": self.first, "capacity_bytes": self.capacity_bytes,
                "seconds": self.seconds, "kind": "estimate, not measured", "notes": self.notes}


def plan_seed(fn: Any, device: torch.device, start: int, max_size: int,
              capacity_bytes: int | None) -> SeedPlan | None:
    """Estimate ``fn``'s peaks at ``start`` and twice it (at most ``max_size``) on ``device`` and,
    with ``capacity_bytes``, predict the first size (:meth:`SeedPlan.predict`); None where the
    workload cannot be estimated (logged at debug: the search runs unseeded).

    In a fresh child process (the project's one launcher,
    :mod:`~oomguard.engine.core.child`): an estimate of a workload without ``for_estimate`` runs
    its ``warmup()`` under fake tensors, which would leave fake modules in this process's copy,
    and operations with small outputs run for real (the estimate's ``REAL_LIMIT``): their freed
    heap, here, would be reused by the trials and hidden from the budget. ``fn`` must then be
    picklable, as for ``isolate=True``."""
    hi = min(2 * start, max_size)
    sizes = sorted({max(1, min(start, hi // 2)), hi})
    if len(sizes) < 2:
        return None
    t0 = time.perf_counter()
    plan = _in_child(fn, _estimated, fn, str(device), sizes, capacity_bytes, max_size)
    if plan is not None:
        plan.seconds = time.perf_counter() - t0  # the child's start and the estimates
    return plan


def estimate_in_child(fn: Any, device: str | torch.device, size: int) -> int | None:
    """``fn``'s estimated peak at ``size`` on ``device`` (bytes above its warmed-up state: an
    estimate, not a measurement), made in a fresh child as :func:`plan_seed` makes its; None
    where it cannot be estimated (logged at debug)."""
    plan = _in_child(fn, _estimated, fn, str(device), [size], None, size)
    return plan.points[0][1] if plan is not None else None


def _in_child(fn: Any, target: Callable[..., SeedPlan], *args: Any) -> SeedPlan | None:
    """``target(*args)`` in a fresh child (the project's one launcher), None where it fails."""
    from oomguard.engine.core import child as launcher
    from oomguard.engine.core.workload import workload_preload

    try:
        ctx = launcher.context(launcher.server_method(), workload_preload(fn))
        with launcher.Child(ctx, target, *args, name="oomguard-estimate") as child:
            return child.wait().result()
    except Exception as exc:  # noqa: BLE001 - an estimate is optional: the work goes on without
        log.debug("%s: no estimate (%s: %s)", name_of(fn), type(exc).__name__, exc)
        return None


def _estimated(fn: Any, device: str, sizes: list[int], capacity_bytes: int | None,
               max_size: int) -> SeedPlan:
    """In the estimate's child: the peaks at ``sizes``, and the first size where the
    capacity is known (the third estimate, if any, made here too)."""
    from oomguard.engine.core.estimate.estimate import EstimateSession, estimate

    t0 = time.perf_counter()
    if own_estimate(fn) is not None:
        def more(size: int) -> int:
            return estimate(fn, [size], device)[0].peak_bytes
        got = estimate(fn, sizes, device)
    else:
        session = EstimateSession(fn, device)

        def more(size: int) -> int:
            return session.at([size])[0].peak_bytes
        got = session.at(sizes)
    plan = SeedPlan([(e.size, e.peak_bytes) for e in got], time.perf_counter() - t0,
                    _logged(fn, more), notes=sorted({n for e in got for n in e.notes}))
    if capacity_bytes is not None:
        plan.predict(capacity_bytes, max_size)
    plan.more = None  # not picklable, and no estimate after this one
    return plan


def _logged(fn: Any, more: Callable[[int], int]) -> Callable[[int], int]:
    """``more``, its failure raised as :class:`_NoMore` (the plan then keeps its two sizes)."""
    def wrapped(size: int) -> int:
        try:
            return more(size)
        except Exception as exc:  # noqa: BLE001 - as in plan_seed
            log.debug("%s: no estimate at %d (%s)", name_of(fn), size, exc)
            raise _NoMore from exc
    return wrapped


class _NoMore(Exception):
    """The third estimate failed: the seed is predicted from the first two."""
