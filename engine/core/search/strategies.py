"""Search strategies: small objects that propose the next size to try (``strategy=``).

Given the trials so far, a strategy returns the next size, or ``None`` when done. Each bisects
the bracket between the largest fit and the smallest larger OOM until closed, so all answer
alike on a monotone workload, at different speeds. The built-in ones are frozen: their fields,
positive integers, are what runs and what ``result.config`` records.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from oomguard.engine.core.search.fit import (
    CURVE_MISFIT,
    LinearFit,
    QuadraticFit,
    curve_model,
    fit_line,
)
from oomguard.engine.core.search.trial import Trial
from oomguard.engine.errors import UsageError, check_positive_int
from oomguard.engine.util.units import fmt_bytes

# Bytes by which a fitted size's peak may exceed the headroom read before it (measured up to
# 0.4 MB, docs/measurements.md#cpu-limit-units); a predicted maximum is tried up to REACH_SIZES
# sizes higher where their estimated peaks are within it.
UNITS_SLACK_BYTES = 400_000
REACH_SIZES = 2


class Strategy(Protocol):
    """Proposes sizes; ``next`` returns None to stop. An optional ``why(trials, size)`` says
    in one phrase why it proposed a size (recorded on the trial, narrated by the report)."""

    name: str

    def describe(self) -> str: ...

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None: ...


def why_chosen(strategy: Any, trials: Sequence[Trial], size: int) -> str:
    """Why ``strategy`` proposed ``size``: its ``why``, or its name where it has none."""
    why = getattr(strategy, "why", None)
    return str(why(trials, size)) if callable(why) else f"proposed by {strategy.name}"


def _bracket_why(trials: Sequence[Trial], size: int, grown: str = "") -> str:
    """The end game every strategy shares, in words: halving while nothing fits, bisecting;
    ``grown`` (``+8``, ``x2``) names the growth of a strategy that grows the largest fit."""
    lo, hi = bracket(trials)
    if not trials:
        return "the start"
    if lo is None:
        return f"half of {hi}, which ran out of memory: nothing has fitted yet"
    if hi is not None:
        return f"bisecting between {lo} (fits) and {hi} (out of memory)"
    return f"{grown} from {lo}, which fitted" if grown else (
        f"growing from {lo}, the largest size that fitted")


def strategy_params(strategy: Any) -> dict[str, Any]:
    """The parameters a strategy runs with: its dataclass fields (empty for other objects)."""
    if dataclasses.is_dataclass(strategy) and not isinstance(strategy, type):
        return {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)}
    return {}


def bracket(trials: Sequence[Trial]) -> tuple[int | None, int | None]:
    """(largest size that fitted, smallest larger size that ran out of memory)."""
    lo = max((t.size for t in trials if t.ok), default=None)
    return lo, min((t.size for t in trials if not t.ok and (lo is None or t.size > lo)),
                   default=None)


def _refine(lo: int | None, hi: int | None) -> int | None:
    """The shared end game: halve the smallest failure while nothing fits, then bisect."""
    if lo is None:
        return hi // 2 or None  # type: ignore[operator]
    return (lo + hi) // 2 if hi is not None and hi - lo > 1 else None


class _PositiveFields:
    """Checks that every field of the built-in strategy (not a subclass's) is a positive int."""

    def __post_init__(self) -> None:
        builtin = next(c for c in type(self).__mro__ if c.__module__ == __name__)
        for f in dataclasses.fields(builtin):  # type: ignore[arg-type]
            check_positive_int(f.name, getattr(self, f.name))


def _grow_then_refine(trials: Sequence[Trial], max_size: int, start: int,
                      grow: Callable[[int], int]) -> int | None:
    """``start``, ``grow`` the largest fit while nothing failed above, :func:`_refine`."""
    if not trials:
        return min(start, max_size)
    lo, hi = bracket(trials)
    if lo is not None and hi is None:
        return None if lo >= max_size else min(grow(lo), max_size)
    return _refine(lo, hi)


@dataclass(frozen=True)
class ExpandBisect(_PositiveFields):
    """Expand by ``step`` while it fits, then bisect (:meth:`describe`): the E10 Maximum Batch
    Size Report's routine, the reference every faster strategy must agree with."""

    start: int = 32
    step: int = 8
    name: ClassVar[str] = "expand-bisect"

    def describe(self) -> str:
        return (f"Start at {self.start}; expand in +{self.step} increments while "
                "successful; on the first OOM, bisect between the last success and the first "
                "OOM until they are adjacent (halve first if the start does not fit).")

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        return _grow_then_refine(trials, max_size, self.start, lambda n: n + self.step)

    def why(self, trials: Sequence[Trial], size: int) -> str:
        return _bracket_why(trials, size, f"+{self.step}")


@dataclass(frozen=True)
class E10(ExpandBisect):
    """Deprecated name of :class:`ExpandBisect`, kept for one release."""

    def __post_init__(self) -> None:
        warnings.warn("E10 is deprecated: use ExpandBisect (the same routine, named for what "
                      "it does)", FutureWarning, stacklevel=3)
        super().__post_init__()


@dataclass(frozen=True)
class Doubling(_PositiveFields):
    """Lightning's 'power' then 'binsearch' without their off-by-one (:meth:`describe`):
    fewer trials than ExpandBisect when the maximum is far from the start, same answer."""

    start: int = 32
    factor: int = 2
    name: ClassVar[str] = "doubling"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.factor < 2:
            raise UsageError(f"factor must be at least 2, got {self.factor}; give 2 or more")

    def describe(self) -> str:
        return (f"Start at {self.start}; multiply by {self.factor} while successful; then bisect "
                "between the last success and the first OOM until they are adjacent.")

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        return _grow_then_refine(trials, max_size, self.start, lambda n: n * self.factor)

    def why(self, trials: Sequence[Trial], size: int) -> str:
        return _bracket_why(trials, size, f"x{self.factor}")


@dataclass(frozen=True)
class LinearJump(_PositiveFields):
    """Fit a line of peak bytes against size, jump to its maximum under ``capacity_bytes``,
    verify, then bisect (:meth:`describe`); doubles while no usable fit exists."""

    capacity_bytes: int
    start: int = 8
    name: ClassVar[str] = "linear-jump"

    def describe(self) -> str:
        return (f"Measure peaks at {self.start} and {2 * self.start}, fit a line, jump to the size "
                "the line predicts fits the capacity, then bisect the bracket it leaves.")

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        if not trials:
            return min(self.start, max_size)
        lo, hi = bracket(trials)
        if lo is None or hi is not None:
            if lo is not None and hi is not None and hi - lo > 1:
                guess = self._predict(trials)  # probed first when inside the bracket
                if guess is not None and lo < guess < hi and not _tried(trials, guess):
                    return guess
            return _refine(lo, hi)
        if lo >= max_size:
            return None
        guess = self._predict(trials)
        if guess is None or guess < lo:  # no line yet, or it underestimates: double
            return min(2 * lo, max_size)
        if guess == lo:  # the predicted maximum fitted: verify the size above it
            return min(lo + 1, max_size)
        return min(guess, max_size)

    def _predict(self, trials: Sequence[Trial]) -> int | None:
        fit = fit_line(trials)
        return fit.largest_size_within(self.capacity_bytes) if fit is not None else None

    def why(self, trials: Sequence[Trial], size: int) -> str:
        if trials and size == self._predict(trials):
            return f"the largest size the fitted line predicts within {fmt_bytes(self.capacity_bytes)}"
        return _bracket_why(trials, size)


def _tried(trials: Sequence[Trial], size: int) -> bool:
    return any(t.size == size for t in trials)


@dataclass(frozen=True)
class Guided(_PositiveFields):
    """The default: predict the maximum from measured peaks, run it, then bracket it.

    :func:`predict_max` fits peaks in the limit's units; after the predicted ``m`` runs, ``m + 1``
    closes the bracket. After an unexpected OOM, :func:`_square_step` (a point near the maximum
    for the quadratic), then bisection. After ``misses`` wrong predictions (:func:`_missed`), or
    without a known limit, it doubles and bisects: it never walks down one size at a time.
    """

    start: int = 32
    misses: int = 2
    name: ClassVar[str] = "guided"

    def describe(self) -> str:
        return (f"Start at {self.start}; predict the largest size that fits from the peaks measured "
                "in the limit's units (proportional from one trial, a least-squares line from "
                "two, a quadratic from three where they curve up), run it, then try the size "
                "above it; after an OOM the prediction did not expect, run the size that fits if "
                "memory grows as the square of the size, else bisect; after "
                f"{self.misses} wrong predictions, double and bisect.")

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        if not trials:
            return min(self.start, max_size)
        lo, hi = bracket(trials)
        if lo is None or (hi is not None and hi - lo <= 1) or (hi is None and lo >= max_size):
            return _refine(lo, hi)
        guess = predict_max(trials)
        if guess is None or _missed(trials) >= self.misses:
            return min(2 * lo, max_size) if hi is None else _refine(lo, hi)
        curved = any(_refuted(trials, i) for i in range(1, len(trials)))
        if hi is not None and (guess >= hi or _refuted(trials, len(trials) - 1)):
            # An OOM at or below the prediction refutes it and measures no peak: re-proposing near
            # it would walk down one size at a time; the square step gives a point near the maximum.
            step = _square_step(trials, lo) if curved else None
            inside = step is not None and lo < step < hi and not _tried(trials, step)
            return step if inside else _refine(lo, hi)
        if curved and _bends_up(trials):
            # A prediction ran out before and the line's base is below zero: memory grows faster
            # than the line, which would overshoot again; the square step cannot.
            guess = min(guess, _square_step(trials, lo) or guess)
        elif guess > lo:
            guess = _reach(trials, guess, hi)
        size = min(lo + 1 if guess <= lo else guess, max_size)  # m ran: bracket with m + 1
        return _refine(lo, hi) if _tried(trials, size) else size

    def why(self, trials: Sequence[Trial], size: int) -> str:
        lo, hi = bracket(trials)
        if trials and size == predict_max(trials):
            headroom = next((t.headroom_bytes for t in reversed(trials)
                             if t.headroom_bytes is not None), None)
            return (f"the largest size predicted to fit {fmt_bytes(headroom)} of headroom from "
                    "the peaks measured so far")
        if lo is not None and size == lo + 1:
            return f"the size above {lo}, which fitted: closes the bracket if it runs out"
        if lo is not None and size == _square_step(trials, lo):
            return f"the size that fits if memory grows as the square of the size from {lo}"
        if lo is not None and hi is None and size == 2 * lo:
            return f"twice {lo}, which fitted (no prediction to trust yet)"
        return _bracket_why(trials, size)


@dataclass(frozen=True)
class Confirm(_PositiveFields):
    """Close the bracket around a confirmed search's in-process answer in fresh trials: ``start``,
    then as :class:`Guided` when it fits, or down by 1, 2, 4, ... until a size fits, then bisect."""

    start: int
    name: ClassVar[str] = "confirm"

    def describe(self) -> str:
        return (f"Run {self.start}; if it fits, go on as guided from it; if not, step down by "
                "1, 2, 4, ... until a size fits, then bisect.")

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        lo, hi = bracket(trials)
        if trials and lo is None:
            assert hi is not None
            return max(hi - 2 ** (len(trials) - 1), 1) if hi > 1 else None
        return Guided(start=self.start).next(trials, max_size)

    def why(self, trials: Sequence[Trial], size: int) -> str:
        if not trials:
            return f"the in-process answer {self.start}, re-run in a fresh process"
        lo, hi = bracket(trials)
        if lo is None:
            return f"{hi} ran out of memory in a fresh process: stepping down"
        return Guided(start=self.start).why(trials, size)


def predict_max(trials: Sequence[Trial], proven_bytes: int = 0) -> int | None:
    """The largest size predicted to fit (an estimate) from the peaks measured in the limit's units
    (:func:`~oomguard.engine.core.search.fit.curve_model`); None without a headroom or a peak.

    The capacity is the latest headroom, or the largest peak that fitted (or ``proven_bytes``,
    one outside ``trials``) if more: on a CPU a peak can exceed the headroom read before it
    (docs/measurements.md#cpu-limit-units)."""
    model = _model(trials, proven_bytes)
    return model[0].largest_size_within(model[1]) if model is not None else None


def _points(trials: Sequence[Trial]) -> list[tuple[int, int]]:
    """(size, peak bytes in the limit's units) of every trial that fitted with a measured peak."""
    points = [(t.size, t.limit_peak_bytes if t.limit_peak_bytes is not None else t.peak_bytes)
              for t in trials if t.ok]
    return [(s, p) for s, p in points if p is not None]


def _model(trials: Sequence[Trial], proven_bytes: int = 0
           ) -> tuple[LinearFit | QuadraticFit, int] | None:
    """(the peak model, the capacity in bytes) :func:`predict_max` predicts with, or None."""
    headroom = next((t.headroom_bytes for t in reversed(trials)
                     if t.headroom_bytes is not None), None)
    points = _points(trials)
    fit = curve_model(points)
    if headroom is None or fit is None:
        return None
    return fit, max(headroom, proven_bytes, *(p for _, p in points))


def _reach(trials: Sequence[Trial], guess: int, hi: int | None) -> int:
    """``guess`` moved up by at most :data:`REACH_SIZES` sizes whose estimated peaks are within
    :data:`UNITS_SLACK_BYTES` over the capacity, where the model rests on three sizes or more."""
    model = _model(trials)
    if model is None or len({s for s, _ in _points(trials)}) < 3:
        return guess
    fit, capacity = model
    up = guess
    while (up < guess + REACH_SIZES and (hi is None or up + 1 < hi)
           and fit.predict(up + 1) <= capacity + UNITS_SLACK_BYTES):
        up += 1
    return up


def _square_step(trials: Sequence[Trial], lo: int) -> int | None:
    """``lo * sqrt(capacity / peak at lo)`` (an estimate): the largest size that fits if the peak
    grows as the square of the size from ``lo``, the largest fit. Where memory is
    ``a + b * size + c * size**2`` with a, b, c >= 0 this cannot overshoot."""
    model = _model(trials)
    peak = max((p for s, p in _points(trials) if s == lo), default=0)
    if model is None or peak <= 0:
        return None
    return int(lo * math.sqrt(model[1] / peak))


def _bends_up(trials: Sequence[Trial]) -> bool:
    """Whether the model is a line through two sizes whose base is below zero by more than
    :data:`~oomguard.engine.core.search.fit.CURVE_MISFIT` of the smaller peak (memory curves)."""
    model, points = _model(trials), _points(trials)
    if model is None or not isinstance(model[0], LinearFit) or len({s for s, _ in points}) != 2:
        return False
    return model[0].base_bytes < -CURVE_MISFIT * max(p for s, p in points if s == min(points)[0])


def _refuted(trials: Sequence[Trial], i: int) -> bool:
    """Whether trial ``i`` (not a guarded refusal) ran out at a size predicted to fit before it."""
    t = trials[i]
    if t.ok or t.guarded:
        return False
    guess = predict_max(trials[:i])
    return guess is not None and t.size <= guess


def _missed(trials: Sequence[Trial]) -> int:
    """How many trials contradicted the prediction from the trials before them: an OOM at a size
    predicted to fit, or a fit over one size and 1% (the fit's noise) above the prediction made
    with its own peak as capacity."""
    missed = 0
    for i, t in enumerate(trials[1:], start=1):
        peak = t.limit_peak_bytes if t.limit_peak_bytes is not None else t.peak_bytes
        guess = predict_max(trials[:i], (peak or 0) if t.ok else 0)
        missed += guess is not None and (
            (t.ok and t.size > guess + 1 + guess // 100) or _refuted(trials, i))
    return missed
