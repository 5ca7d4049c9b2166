"""A memory model over batch and length, from real searches: :func:`search_shapes`.

Text has long-tailed lengths: sizing the batch at the longest length is safe, but most batches
then use a fraction of the memory. ``search_shapes(step, lengths)`` runs the batch-size
:func:`~oomguard.engine.core.search.search.search` of ``step`` at two lengths (the longest
and a short one, the 10th percentile) and fits, from their measured peaks (estimates)::

    peak(batch, length) ~= fixed + batch * (a * length + b * length**2)

The :class:`ShapePlan` it returns gives the largest safe batch at any length
(:meth:`ShapePlan.max_batch`), and batches planned from the data's lengths
(:meth:`ShapePlan.batches`, :meth:`ShapePlan.batch_sampler` for a ``DataLoader``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy

from oomguard.engine.core.length_batches import (
    LengthBatchSampler,
    check_lengths,
    plan_batches,
)
from oomguard.engine.core.search.search import SearchResult, search
from oomguard.engine.core.workload import name_of
from oomguard.engine.errors import check_positive_int

log = logging.getLogger("oomguard.search")

SHORT_QUANTILE = 0.10  # the short length searched: this quantile of the dataset's lengths
SHORT_TRIALS = 3  # trials of the short length's search, at most (then its recommendation)
# A second length closer than this fraction of the longest to it adds little to the fit.
MIN_LENGTH_RATIO = 0.9


@dataclass(frozen=True)
class ShapePoint:
    """One searched length (measured): ``seq_len``; ``safe``, the search's recommended batch
    (its margin kept); ``max_ok``/``first_oom`` the bracket; ``per_row_bytes`` and
    ``fixed_bytes``, its fitted line's slope and peak at batch 0 (estimates from measured
    peaks); ``limit_bytes``, the peak its ``safe`` batch stays under; ``trials``: how many ran."""

    seq_len: int
    safe: int
    max_ok: int
    first_oom: int | None
    per_row_bytes: float
    fixed_bytes: float
    limit_bytes: int | None
    trials: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ShapePlan:
    """The largest safe batch at each length, from searches at a few lengths.

    Measured: ``points`` (:class:`ShapePoint`, one per searched length, and ``results``, the
    searches themselves). Estimates (fitted on the measured peaks, bytes):
    ``fixed_bytes`` (what no batch adds: weights, gradients, optimizer state),
    ``per_token_bytes`` (a) and ``per_token2_bytes`` (b) of the per-row cost
    ``a * length + b * length**2``, and ``room_bytes``, the peak bytes above ``fixed_bytes``
    a batch may use (the searches' safe line, their margin kept).
    """

    workload: str
    device: str
    budget_bytes: int | None
    points: list[ShapePoint]
    fixed_bytes: float
    per_token_bytes: float
    per_token2_bytes: float
    room_bytes: float
    max_size: int
    seconds: float
    results: list[SearchResult] = field(default_factory=list, repr=False)

    def per_row_bytes(self, seq_len: int) -> float:
        """The estimated peak bytes one row of ``seq_len`` adds. Below the shortest searched
        length, never less than the estimate there scaled in proportion to the length (the
        model is not trusted where nothing ran)."""
        def fitted(n: int) -> float:
            return n * (self.per_token_bytes + self.per_token2_bytes * n)

        short = self.points[0].seq_len
        if seq_len < short:  # a falling per-token cost below it is not measured: none
            return max(fitted(seq_len), fitted(short) * seq_len / short)
        return fitted(seq_len)

    def max_batch(self, seq_len: int) -> int:
        """The largest safe batch (rows) at ``seq_len``: the fitted surface's, bounded by what
        the searches measured. Memory grows with the length, so the batch safe at a searched
        length is a ceiling for longer lengths and a floor for shorter ones; at a searched
        length it is that search's recommendation. 0 where no row is predicted to fit."""
        check_positive_int("seq_len", seq_len)
        per_row = self.per_row_bytes(seq_len)
        fitted = (self.max_size if per_row <= 0
                  else min(self.max_size, max(0, math.floor(self.room_bytes / per_row))))
        ceiling = [p.safe for p in self.points if p.seq_len <= seq_len]
        floor = [p.safe for p in self.points if p.seq_len >= seq_len]
        if ceiling:
            fitted = min(fitted, ceiling[-1])  # points run from the shortest
        if floor:
            fitted = max(fitted, floor[0])
        return fitted

    def batches(self, lengths: Sequence[int], *, shuffle: bool = False,
                seed: int | None = None) -> list[list[int]]:
        """``lengths``' indices in batches, every index once, each batch (padded to its longest
        sample) at most :meth:`max_batch` of that length: :func:`plan_batches`."""
        return plan_batches(lengths, self.max_batch, shuffle=shuffle, seed=seed)

    def batch_sampler(self, lengths: Sequence[int], *, shuffle: bool = False, seed: int = 0,
                      rank: int = 0, world_size: int = 1) -> LengthBatchSampler:
        """A ``DataLoader(dataset, batch_sampler=...)`` sampler of :meth:`batches`: resumable
        (``state_dict``), split across ranks, deterministic for a seed
        (:class:`LengthBatchSampler`)."""
        return LengthBatchSampler(lengths, self.max_batch, shuffle=shuffle, seed=seed,
                                  rank=rank, world_size=world_size)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: the measured points, the fitted coefficients and the searches."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("points", "results")}
        return out | {"points": [p.to_dict() for p in self.points],
                      "results": [r.to_dict() for r in self.results]}


class _AtLength:
    """``step(size, seq_len)`` at one length: the workload one search runs."""

    def __init__(self, step: Callable[[int, int], Any], seq_len: int) -> None:
        self.step, self.seq_len = step, seq_len
        self.name = f"{name_of(step)} at length {seq_len}"
        self.steps_per_trial = getattr(step, "steps_per_trial", 1)

    def __call__(self, size: int) -> Any:
        return self.step(size, self.seq_len)


def search_shapes(step: Callable[[int, int], Any], lengths: Sequence[int], *,
                  budget: int | None = None, restore: Sequence[Any] | None = None,
                  device: Any = None, **search_options: Any) -> ShapePlan:
    """Plan batch sizes over sequence lengths from real trials: a :class:`ShapePlan`.

    ``step(batch_size, seq_len)`` runs the real step (a training step with its optimizer,
    given as ``restore=(model, optimizer)`` as to :func:`search`, or a metric); ``lengths``
    are the dataset's sample lengths. A :func:`search` runs at the longest length, then one at
    the 10th percentile, started where the first predicts (per-row bytes in proportion to the
    length: at or below the maximum where memory grows with the length at least that fast).
    ``budget`` (bytes), ``device`` and ``search_options`` (:class:`SearchConfig` fields,
    ``start``) are the searches'. Raises what :func:`search` raises; :class:`UsageError` for
    bad ``lengths``, before any trial.
    """
    lengths = check_lengths(lengths)
    t0 = time.perf_counter()
    options = dict(search_options)
    if budget is not None:
        options["budget"] = budget
    if restore is not None:
        options["restore"] = tuple(restore)
    if device is not None:
        options["device"] = device
    ordered = sorted(lengths)
    longest = ordered[-1]
    short = ordered[int(SHORT_QUANTILE * (len(ordered) - 1))]
    first = search(_AtLength(step, longest), **options)
    results = [first]
    if short < MIN_LENGTH_RATIO * longest:
        results.insert(0, search(_AtLength(step, short), **_second(options, first, short,
                                                                    longest)))
    points = [_point(r, n) for r, n in zip(results, (short, longest)[-len(results):],
                                           strict=True)]
    fixed, a, b = _surface(results, points)
    # The bytes a batch may add above the fixed part: the least of the searched lengths' safe
    # batches' (their margins kept), so that the surface gives each its own safe batch or less.
    room = min(p.safe * p.seq_len * (a + b * p.seq_len) for p in points)
    plan = ShapePlan(workload=name_of(step), device=first.device, budget_bytes=first.budget_bytes,
                     points=points, fixed_bytes=fixed, per_token_bytes=a, per_token2_bytes=b,
                     room_bytes=room, max_size=int(first.config.get("max_size", 65536)),
                     seconds=time.perf_counter() - t0, results=results)
    log.info("shapes: %s", ", ".join(f"{p.safe} rows at length {p.seq_len}" for p in points))
    return plan


def _second(options: dict[str, Any], first: SearchResult, short: int, longest: int
            ) -> dict[str, Any]:
    """The short length's search options: started at the batch the first search predicts
    there (per-row bytes in proportion to the length), unless the caller chose a strategy."""
    if "strategy" in options or "size_step" in options or first.fit is None:
        return options
    point = _point(first, longest)
    per_row = point.per_row_bytes * short / longest
    if per_row <= 0:
        return options
    max_size = options.get("max_size", 65536)
    start = max(1, min(max_size, int(point.safe * point.per_row_bytes // per_row)))
    # The start and the sizes the guided strategy predicts from it: the short length's
    # points for the fit, and its bound; closing its bracket row by row (hundreds of rows)
    # would add trials and nothing the plan uses.
    trials = min(SHORT_TRIALS, options.get("max_trials", SHORT_TRIALS))
    return options | {"start": start, "max_trials": trials}


def _point(result: SearchResult, seq_len: int) -> ShapePoint:
    """What a search at ``seq_len`` measured: its safe batch and its fitted line (bytes)."""
    rec, fit = result.recommendation, result.fit
    # The recommendation, its margin kept, also where the search stopped before an OOM
    # (SHORT_TRIALS): its size was measured under the limit (SearchResult.checks).
    safe = rec.safe if rec is not None else result.size_to_use
    assert safe is not None and result.max_ok is not None  # a search without an answer raised
    if fit is not None and fit.per_item_bytes > 0:
        per_row, fixed = fit.per_item_bytes, max(0.0, fit.base_bytes)
    else:  # one size ran: its peak, all of it per row (overstates the per-row bytes)
        peak = max((t.peak_bytes or 0) for t in result.trials if t.ok and t.size == result.max_ok)
        per_row, fixed = peak / result.max_ok, 0.0
    return ShapePoint(seq_len=seq_len, safe=safe, max_ok=result.max_ok,
                      first_oom=result.first_oom, per_row_bytes=per_row, fixed_bytes=fixed,
                      limit_bytes=rec.limit_bytes if rec else None,
                      trials=len(result.trials) + len(result.checks))


def _surface(results: list[SearchResult], points: list[ShapePoint]
             ) -> tuple[float, float, float]:
    """(fixed, a, b) of ``peak ~= fixed + batch * (a * length + b * length**2)`` (bytes, an
    estimate): least squares over every trial that fitted with a measured peak, at every
    searched length; a and b never below 0 (memory does not shrink as a length grows), the
    other refitted alone where one would be. From one length: in proportion to it."""
    rows = [(t.size, p.seq_len, float(t.peak_bytes)) for r, p in zip(results, points, strict=True)
            for t in [*r.trials, *r.checks] if t.ok and t.peak_bytes is not None]
    if len(points) == 1:
        p = points[0]
        return p.fixed_bytes, p.per_row_bytes / p.seq_len, 0.0
    for terms in ((1, 2), (1,), (2,)):  # the powers of the length in the per-row bytes
        x = numpy.array([[1.0, *(n * length**k for k in terms)] for n, length, _ in rows])
        y = numpy.array([peak for *_, peak in rows])
        coef = numpy.linalg.lstsq(x, y, rcond=None)[0]
        if all(c >= 0 for c in coef[1:]):
            per = dict(zip(terms, coef[1:], strict=True))
            return max(0.0, float(coef[0])), float(per.get(1, 0.0)), float(per.get(2, 0.0))
    # No non-negative fit (noise at one size each): in proportion to the longest's own line.
    p = points[-1]
    return p.fixed_bytes, p.per_row_bytes / p.seq_len, 0.0
