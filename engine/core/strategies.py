"""Search strategies: small objects that propose the next size to try.

A strategy sees the trials so far and returns the next size, or ``None`` when
it is done. It never decides the answer: the search returns the largest size
that actually ran. Composable like tenacity's stop/wait objects: pass one to
:func:`oomguard.engine.core.search.search` as ``strategy=``.

Every strategy brackets the maximum between the largest size that fitted and
the smallest larger size that ran out of memory, and bisects that bracket
until the two are adjacent, so all of them return the same answer on a
monotone workload; they differ in how fast they find the bracket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from oomguard.engine.core.trial import Trial


class Strategy(Protocol):
    """Proposes sizes. ``next`` returns None to stop."""

    name: str

    def describe(self) -> str: ...

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None: ...


def bracket(trials: Sequence[Trial]) -> tuple[int | None, int | None]:
    """(largest size that fitted, smallest larger size that ran out of memory)."""
    oks = [t.size for t in trials if t.ok]
    lo = max(oks) if oks else None
    ooms = [t.size for t in trials if not t.ok and (lo is None or t.size > lo)]
    return lo, (min(ooms) if ooms else None)


def _refine(trials: Sequence[Trial], lo: int | None, hi: int | None) -> int | None:
    """The shared end game: halve down while nothing fits, bisect a bracket."""
    if lo is None:  # nothing fitted yet: halve below the smallest failure
        assert hi is not None
        return hi // 2 if hi // 2 >= 1 else None
    if hi is None:
        return None
    if hi - lo <= 1:
        return None
    return (lo + hi) // 2


@dataclass
class E10:
    """The E10 report's routine: start at ``start``, add ``step`` while it fits,
    then bisect between the last fit and the first OOM until they are adjacent.

    If ``start`` does not fit, halve until something does, then go on.
    """

    start: int = 32
    step: int = 8
    name: str = "e10"

    def describe(self) -> str:
        return (
            f"Start at batch size {self.start}; expand in +{self.step} increments while "
            "successful; on the first OOM, bisect between the last success and the first "
            "OOM until they are adjacent (halve first if the start does not fit)."
        )

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        if not trials:
            return min(self.start, max_size)
        lo, hi = bracket(trials)
        if lo is not None and hi is None:
            return None if lo >= max_size else min(lo + self.step, max_size)
        return _refine(trials, lo, hi)


@dataclass
class Doubling:
    """Double from ``start`` while it fits, then bisect (Lightning's 'power' then
    'binsearch', without their off-by-one): fewer trials when the maximum is far
    from the start, same answer."""

    start: int = 32
    factor: int = 2
    name: str = "doubling"

    def describe(self) -> str:
        return (
            f"Start at {self.start}; multiply by {self.factor} while successful; then bisect "
            "between the last success and the first OOM until they are adjacent."
        )

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        if not trials:
            return min(self.start, max_size)
        lo, hi = bracket(trials)
        if lo is not None and hi is None:
            return None if lo >= max_size else min(lo * self.factor, max_size)
        return _refine(trials, lo, hi)


@dataclass
class LinearJump:
    """Measure two sizes, fit peak bytes = base + per_item * size, jump to the
    predicted maximum under ``capacity_bytes``, verify, then bisect.

    Falls back to E10-style expansion while no usable fit exists. After a
    failed jump it bisects between the last fit and the failure; it never walks
    down one size at a time (CPU-OOM-FACTS.md).
    """

    capacity_bytes: int
    start: int = 8
    step: int = 8
    name: str = "linear-jump"

    def describe(self) -> str:
        return (
            f"Measure peaks at {self.start} and {2 * self.start}, fit a line, jump to the size "
            "the line predicts fits the capacity, then bisect the bracket it leaves."
        )

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        if not trials:
            return min(self.start, max_size)
        lo, hi = bracket(trials)
        if lo is None or hi is not None:
            if lo is not None and hi is not None and hi - lo > 1:
                guess = self._predict(trials)
                # Probe just above the prediction first when it lies inside the bracket.
                if guess is not None and lo < guess < hi and not _tried(trials, guess):
                    return guess
            return _refine(trials, lo, hi)
        if lo >= max_size:
            return None
        guess = self._predict(trials)
        if guess is None or guess <= lo:
            return min(2 * lo, max_size)
        if _tried(trials, guess):
            return min(guess + 1, max_size)
        return min(guess, max_size)

    def _predict(self, trials: Sequence[Trial]) -> int | None:
        from oomguard.engine.core.fit import fit_line

        fit = fit_line(trials)
        if fit is None or fit.per_item_bytes <= 0:
            return None
        return int((self.capacity_bytes - fit.base_bytes) // fit.per_item_bytes)


def _tried(trials: Sequence[Trial], size: int) -> bool:
    return any(t.size == size for t in trials)
