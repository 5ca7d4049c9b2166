"""Memory scaling: measured peak bytes against size (a line, or a quadratic where they curve
up) and the recommendations derived from it. Predicted sizes are estimates, labelled as such;
a recommendation is never above the largest size that ran."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from oomguard.engine.core.search.trial import Trial
from oomguard.engine.util.units import fmt_bytes

# A margin is kept free of what grows with the size: the usable bytes less the fixed part (the
# weights, gradients and optimizer state), docs/measurements.md#margin-on-what-grows.
MEASURED = "measured"  # SearchConfig.margin: derive the margin from the trials' step peaks
# A measured margin: SPREAD_FACTOR times the largest spread (bytes) of one trial's steady step
# peaks (a run sees thousands of steps, a trial a few), within [MIN, MAX] of what grows: the
# floor keeps room for the boundary's noise between fresh processes (measured: 1-2% of the
# size) and some for what no trial shows (fragmentation, an eval step), the cap keeps a noisy
# trial from recommending almost nothing. DEFAULT_MARGIN: where no trial ran two steady steps.
SPREAD_FACTOR = 2.0
MIN_MEASURED_MARGIN = 0.03
MAX_MEASURED_MARGIN = 0.5
DEFAULT_MARGIN = MIN_MEASURED_MARGIN


@dataclass(frozen=True)
class LinearFit:
    """peak_bytes ~= base_bytes + per_item_bytes * size, fitted on ``points`` trials."""

    base_bytes: float
    per_item_bytes: float
    r2: float
    points: int

    def predict(self, size: int) -> float:
        """Estimated peak bytes at ``size``."""
        return self.base_bytes + self.per_item_bytes * size

    def largest_size_within(self, nbytes: float) -> int | None:
        """Largest size whose estimated peak is <= ``nbytes`` (None if no slope)."""
        if self.per_item_bytes <= 0:
            return None
        return int((nbytes - self.base_bytes) // self.per_item_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def fit_line(trials: Sequence[Trial]) -> LinearFit | None:
    """:func:`fit_points` over the successful trials with a measured peak."""
    return fit_points([(t.size, t.peak_bytes) for t in trials
                       if t.ok and t.peak_bytes is not None])


def peak_model(points: Sequence[tuple[int, int]]) -> LinearFit | None:
    """Peak bytes against size from measured ``(size, peak bytes)`` points (an estimate): the
    least-squares line from two distinct sizes or more; from one, a line through the origin and
    its largest peak (overstates larger sizes when part of the peak does not grow); None
    without a point or with a peak of 0."""
    if len({s for s, _ in points}) != 1:
        return fit_points(points)
    size, peak = max(points)
    if peak <= 0:
        return None
    return LinearFit(base_bytes=0.0, per_item_bytes=peak / size, r2=1.0, points=1)


# The line's misfit (largest absolute residual, a fraction of the largest peak) above which
# convex points are fitted with a quadratic. Measured (bench/peers.py): linear workloads stay
# within 1.8%, curves miss a line by 10% or more.
CURVE_MISFIT = 0.05


@dataclass(frozen=True)
class QuadraticFit:
    """peak_bytes ~= base_bytes + per_item_bytes * size + per_item2_bytes * size**2 (an estimate
    from ``points`` measured trials), such as attention scores over the sequence length."""

    base_bytes: float
    per_item_bytes: float
    per_item2_bytes: float
    points: int

    def predict(self, size: int) -> float:
        """Estimated peak bytes at ``size``."""
        return self.base_bytes + size * (self.per_item_bytes + self.per_item2_bytes * size)

    def largest_size_within(self, nbytes: float) -> int | None:
        """Largest size whose estimated peak is <= ``nbytes`` on the rising side of the curve
        (the larger root); None if no size's estimate is that small."""
        a, b, c = self.per_item2_bytes, self.per_item_bytes, self.base_bytes - nbytes
        disc = b * b - 4 * a * c
        if disc < 0:
            return None
        size = int((-b + math.sqrt(disc)) // (2 * a))
        while size > 0 and self.predict(size) > nbytes:  # float rounding at the boundary
            size -= 1
        return size


def curve_model(points: Sequence[tuple[int, int]]) -> LinearFit | QuadraticFit | None:
    """The peak model a guided search predicts with (an estimate): :func:`peak_model`, or from
    three distinct sizes or more, the least-squares quadratic where it curves up and the line
    misses a point by more than :data:`CURVE_MISFIT` of the largest peak."""
    line = peak_model(points)
    if len({s for s, _ in points}) < 3 or line is None:
        return line
    quad = fit_quadratic(points)
    misfit = max(abs(p - line.predict(s)) for s, p in points)
    if quad is None or quad.per_item2_bytes <= 0 or misfit <= CURVE_MISFIT * max(p for _, p in points):
        return line
    return quad


def fit_quadratic(pts: Sequence[tuple[int, int]]) -> QuadraticFit | None:
    """The least-squares quadratic through ``(size, peak bytes)`` points; None with fewer than
    three distinct sizes. Sizes are centred and scaled before solving the normal equations."""
    if len({s for s, _ in pts}) < 3:
        return None
    mean = statistics.fmean(s for s, _ in pts)
    scale = max(abs(s - mean) for s, _ in pts)
    xs, ys = [(s - mean) / scale for s, _ in pts], [float(p) for _, p in pts]
    m = [[sum(x ** (i + j) for x in xs) for j in range(3)] for i in range(3)]
    v = [sum(y * x ** i for x, y in zip(xs, ys, strict=True)) for i in range(3)]
    c0, c1, c2 = _solve3(m, v)
    # back to sizes: y = c0 + c1 (s - mean)/scale + c2 ((s - mean)/scale)**2
    a2 = c2 / scale**2
    a1 = c1 / scale - 2 * c2 * mean / scale**2
    a0 = c0 - c1 * mean / scale + c2 * mean**2 / scale**2
    return QuadraticFit(base_bytes=a0, per_item_bytes=a1, per_item2_bytes=a2, points=len(pts))


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    """Cramer's rule for a 3 x 3 system (non-singular: three distinct, scaled sizes)."""
    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))
    d = det(m)
    cols = [[[v[r] if c == k else m[r][c] for c in range(3)] for r in range(3)] for k in range(3)]
    x0, x1, x2 = (det(col) / d for col in cols)
    return x0, x1, x2


def fit_points(pts: Sequence[tuple[int, int]]) -> LinearFit | None:
    """The least-squares line through ``(size, peak bytes)`` points; None with fewer than
    two distinct sizes."""
    sizes, peaks = [s for s, _ in pts], [p for _, p in pts]
    if len(set(sizes)) < 2:
        return None
    slope, base = statistics.linear_regression(sizes, peaks)
    # r2 of a least-squares line is the squared correlation; 1.0 when every peak is the same
    r2 = statistics.correlation(sizes, peaks) ** 2 if len(set(peaks)) > 1 else 1.0
    return LinearFit(base_bytes=base, per_item_bytes=slope, r2=r2, points=len(pts))


def peaks_spread(peaks: Sequence[int]) -> float | None:
    """``(max - min) / max`` of per-step peaks (a fraction); None for < 2 steps or no peak."""
    if len(peaks) < 2 or max(peaks) <= 0:
        return None
    return (max(peaks) - min(peaks)) / max(peaks)


def steady_spread(trial: Trial) -> int | None:
    """``max - min`` (bytes) of a fitting trial's steady step peaks, the steps after the first
    (the first allocates what a run allocates once: an optimizer's state, lazily built
    caches); None for a trial that did not fit or ran fewer than three steps."""
    steady = trial.step_peaks[1:]
    return max(steady) - min(steady) if trial.ok and len(steady) >= 2 else None


@dataclass(frozen=True)
class Margin:
    """What a recommendation keeps free: ``fraction`` of what grows with the size, and in
    words, with bytes, where it came from (``source``)."""

    fraction: float
    source: str


def choose_margin(margin: float | str, trials: Sequence[Trial], grows: float | None,
                  fixed: float = 0.0) -> Margin:
    """The fraction of ``grows`` (the usable bytes less the ``fixed`` bytes that do not grow
    with the size; None: unknown) to keep free: a number as given; ``"measured"``:
    :data:`SPREAD_FACTOR` x the largest :func:`steady_spread` in bytes, within the MIN/MAX
    measured margins of ``grows`` (without ``grows``: of the trial's own peak), else (no
    trial of three steps or more) :data:`DEFAULT_MARGIN`, saying so."""
    of = ("of the size (no capacity known to measure bytes against)" if grows is None
          else f"of the {fmt_bytes(grows)} that grows above the fixed {fmt_bytes(fixed)}"
          if fixed > 0 else f"of the {fmt_bytes(grows)} that grows with the size (no fixed "
                            "part: the fitted peak at size 0 is not above 0)")
    if margin != MEASURED:
        return Margin(float(margin), f"{float(margin):.0%} {of} (as configured)")
    spreads = [(s, t.size, t.peak_bytes or 0) for t in trials if (s := steady_spread(t)) is not None]
    if not spreads:
        return Margin(DEFAULT_MARGIN, (
            f"{DEFAULT_MARGIN:.0%} {of}: the measured margin's floor, as no trial ran three "
            "steps or more (no spread of steady steps to measure)"))
    spread, size, peak = max(spreads)
    whole = grows if grows is not None else peak
    wanted = SPREAD_FACTOR * spread / whole if whole > 0 else MAX_MEASURED_MARGIN
    chosen = min(MAX_MEASURED_MARGIN, max(MIN_MEASURED_MARGIN, wanted))
    bound = ("" if chosen == wanted else f", raised to the {MIN_MEASURED_MARGIN:.0%} floor"
             if chosen > wanted else f", capped at {MAX_MEASURED_MARGIN:.0%}")
    return Margin(chosen, (
        f"{chosen:.1%} {of}: measured, {SPREAD_FACTOR:g} x the largest spread of a trial's "
        f"steady step peaks ({fmt_bytes(spread)} at size {size}, of {len(spreads)} trial(s) of "
        f"three steps or more){bound}"))


@dataclass(frozen=True)
class Recommendation:
    """Sizes to use, at most the measured maximum: ``safe``, the largest whose estimated peak keeps
    ``margin_bytes`` free below ``limit_against``; ``conservative``, the largest up to ``safe``
    that ran with a measured peak within that limit (``conservative_ran`` False: none did, it
    equals ``safe``); ``maximum``, the largest that ran. ``basis``: how ``safe`` was obtained.

    The margin is kept of what grows with the size: ``fixed_bytes`` is the fitted peak at size 0
    (the weights, gradients, optimizer state: an estimate), ``margin`` the fraction of the usable
    bytes above it kept free (``margin_bytes``), ``margin_source`` which rule chose it, in
    words (:func:`choose_margin`). ``limit_bytes``: the peak ``safe`` stays under (peak-meter
    bytes), ``limit_against`` the usable bytes (the capacity, or the fitted peak at the first
    OOM where lower) less the margin; ``safe_line_bytes``: the capacity (or the usable bytes,
    where the meter read more than the capacity) less the same margin.
    ``checked_peak_bytes``: the measured peak at ``safe``."""

    safe: int
    conservative: int
    maximum: int
    margin: float
    capacity_bytes: int | None
    basis: str
    conservative_ran: bool = True
    margin_source: str = ""
    limit_bytes: int | None = None
    limit_against: str | None = None
    checked_peak_bytes: int | None = None
    fixed_bytes: int | None = None
    margin_bytes: int | None = None
    safe_line_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def usable_bytes(trials: Sequence[Trial], capacity_bytes: int | None, fit: LinearFit | None,
                 first_oom: int | None) -> tuple[int | None, str]:
    """The bytes a size's peak may reach, in the peak meter's units, and what they are, in
    words: the capacity, or where memory ran out (the fitted peak at ``first_oom``, never
    below the peak measured at the largest size that fitted: it ran) where that is lower, or
    where a measured peak exceeded the capacity. The meter and the limit need not count the
    same bytes: on CPU resident against virtual, and a child's resident pages copied from its
    parent count, not charged to its budget."""
    fitted = [t for t in trials if t.ok and t.peak_bytes is not None]
    top = max((t.size for t in fitted), default=None)
    ran = max((t.peak_bytes for t in fitted if t.size == top), default=0)
    over = capacity_bytes is not None and any(t.peak_bytes > capacity_bytes for t in fitted)
    if fit is not None and first_oom is not None and fit.per_item_bytes > 0:
        at_oom = max(fit.predict(first_oom), ran)
        if capacity_bytes is None or at_oom < capacity_bytes or over:
            return int(at_oom), f"the fitted peak at the first OOM ({first_oom})"
    elif over:
        return ran, f"the peak measured at {top}, the largest size that ran"
    return capacity_bytes, "capacity"


def fixed_part(fit: LinearFit | None, usable: int | None) -> int:
    """The bytes that do not grow with the size (an estimate): the fitted line's peak at size
    0, clamped to [0, ``usable``); 0 without a fit, or where the line crosses 0 at or above
    the usable bytes (it says nothing about a fixed part there)."""
    if fit is None or usable is None or not 0 < fit.base_bytes < usable:
        return 0
    return int(fit.base_bytes)


def recommend(trials: Sequence[Trial], max_ok: int, capacity_bytes: int | None,
              fit: LinearFit | None, margin: float | str = MEASURED,
              first_oom: int | None = None) -> Recommendation:
    """Recommend safe, conservative and maximum sizes up to ``max_ok``.

    With a capacity and a fit, ``safe`` is the fitted size whose estimated peak keeps the
    margin (:func:`choose_margin`: a fraction of what grows, the usable bytes
    (:func:`usable_bytes`) less the :func:`fixed_part`) free. Without a fit:
    ``floor(max_ok * (1 - margin))``, assuming memory proportional to size.
    """
    if margin != MEASURED and not 0 <= margin < 1:  # type: ignore[operator]
        raise ValueError(f"margin must be in [0, 1) or {MEASURED!r}, got {margin}")
    usable, against = usable_bytes(trials, capacity_bytes, fit, first_oom)
    fixed = fixed_part(fit, usable)
    chosen = choose_margin(margin, trials, usable - fixed if usable else None, fixed)
    keep = int(chosen.fraction * (usable - fixed)) if usable else None
    limit = usable - keep if usable and keep is not None else None
    safe = fit.largest_size_within(limit) if limit is not None and fit is not None else None
    basis = (f"fitted line: estimated peak <= {fmt_bytes(limit)}, {against} less the margin"
             if safe is not None
             else f"floor(max_ok x {1 - chosen.fraction:.2f}): no capacity or fit to scale against")
    if safe is None and limit is not None:
        at_max = [t.peak_bytes for t in trials if t.ok and t.size == max_ok and t.peak_bytes is not None]
        if at_max and max(at_max) <= limit:
            safe, basis = max_ok, f"measured peak at {max_ok} is within {fmt_bytes(limit)}"
    if safe is None:
        safe = int(max_ok * (1 - chosen.fraction))
    safe = max(1, min(safe, max_ok))
    measured = [t.size for t in trials if t.ok and t.peak_bytes is not None and t.size <= safe
                and (limit is None or t.peak_bytes <= limit)]
    conservative = max(measured, default=None)
    at_safe = [t.peak_bytes for t in trials if t.ok and t.size == safe and t.peak_bytes is not None]
    return Recommendation(safe=safe, conservative=conservative if conservative else safe,
                          maximum=max_ok, margin=chosen.fraction, capacity_bytes=capacity_bytes,
                          basis=basis, conservative_ran=conservative is not None,
                          margin_source=chosen.source,
                          limit_bytes=limit, limit_against=against if limit is not None else None,
                          checked_peak_bytes=max(at_safe) if at_safe else None,
                          fixed_bytes=fixed if usable else None, margin_bytes=keep,
                          safe_line_bytes=(max(capacity_bytes, usable) - keep if capacity_bytes
                                           and usable and keep is not None else None))


def step_down(size: int, peak: int | None, limit: float, fit: LinearFit | None) -> int:
    """The size below ``size`` predicted to keep its peak under ``limit`` (an estimate): down by
    the excess of ``peak`` over it in fitted bytes per item (or ``peak``'s own), at least one;
    a quarter down after an OOM (``peak`` None)."""
    if peak is None:
        return size - max(1, size // 4)
    per_item = fit.per_item_bytes if fit is not None and fit.per_item_bytes > 0 else peak / size
    return size - max(1, math.ceil((peak - limit) / per_item)) if per_item > 0 else size - 1
