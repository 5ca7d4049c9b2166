"""A memory model over batch and length, from an estimate and a few real trials:
:func:`search_shapes`.

Text has long-tailed lengths: sizing the batch at the longest length is safe, but most
batches then use a fraction of the memory. ``search_shapes(step, lengths)`` estimates the
step's per-row bytes at up to three lengths (the longest, a short one, the 10th percentile,
and their geometric mean) on fake tensors, runs the batch-size
:func:`~oomguard.engine.core.search.search.search` of ``step`` at the longest length from
the estimate's start, then one real trial at each other length, at the batch the estimate
and the measured peaks predict: at most :data:`MAX_TRIALS` real runs of the step. The
:class:`ShapePlan` it returns gives the largest safe batch at any length
(:meth:`ShapePlan.max_batch`: the lengths' safe batches, interpolated), batches planned from
the data's lengths (:meth:`ShapePlan.batches`, :meth:`ShapePlan.batch_sampler` for a
``DataLoader``), and the memory model fitted on the measured peaks (estimates)::

    peak(batch, length) ~= fixed + batch * (c + a * length + b * length**2)

It lives beside the search, not in it: the search knows nothing of the estimator.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy

from oomguard.engine.core.length_batches import (
    LengthBatchSampler,
    check_lengths,
    plan_batches,
    plan_steps,
)
from oomguard.engine.core.search.config import SearchConfig
from oomguard.engine.core.search.search import SearchResult, search, verify
from oomguard.engine.core.workload import name_of
from oomguard.engine.errors import NoSizeFits, check_positive_int

log = logging.getLogger("oomguard.search")

SHORT_QUANTILE = 0.10  # the short length searched: this quantile of the dataset's lengths
# The share of the bend three searched lengths show that max_batch adds to the straight line
# between two of them (log-log axes): ShapePlan.max_batch.
BEND_SHARE = 0.5
# Real runs of the step per plan, at most (issue 39): the longest length's search takes
# LONGEST_TRIALS trials at most, and its recommendation's check where one is needed; each
# further length one trial, where the budget leaves one (see search_shapes).
MAX_TRIALS = 6
LONGEST_TRIALS = 3
# The longest length's search starts at this share of the batch the estimate predicts fits:
# the estimate leaves out the allocator's rounding and the fixed part it cannot see, and a
# start that fits measures a peak the search predicts the rest from.
START_SHARE = 0.8
ESTIMATE_BATCHES = (8, 64)  # the batches an estimate's per-row bytes come from
# A further length's one trial aims this share of what grows under the safe line: a
# prediction 3% over still fits under it (measured: the estimate's per-row bytes were 1.5%
# to 6% over the fitted ones at lengths 12 and 39, docs/guides/shapes.md#how-it-measures).
SLACK = 0.03
# From a one-trial length's measured peak, its safe batch reaches up along the line through
# the longest length's fixed part, at most this share above the size that ran (the margin
# covers the line's error that far: a fixed part off by F bytes moves the peak by REACH * F).
REACH = 0.10
# A length between the short and the longest one is searched too where the short one is
# shorter than this fraction of the longest.
MID_LENGTH_RATIO = 0.5
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

    Measured: ``points`` (:class:`ShapePoint`, one per searched length, from the shortest;
    ``results``, the searches themselves). :meth:`max_batch` interpolates the points' safe
    batches. Estimates (bytes, fitted on the measured peaks, for reading, not for sizing):
    ``fixed_bytes`` (what no batch adds: weights, gradients, optimizer state, the longest
    length's fitted line at batch 0), and the per-row bytes ``c + a * length + b * length**2``
    (``per_row_const_bytes``, ``per_token_bytes``, ``per_token2_bytes``: :meth:`per_row_bytes`).
    ``max_size``: the searches' largest size. ``estimated_row_bytes``: the per-row bytes
    the fake-tensor estimate gave at each searched length (estimates; empty: none ran).
    :attr:`trials`: the real runs of the step making this plan took (0 for a plan read back
    with :meth:`from_dict`: ``results`` are not kept there).
    """

    workload: str
    device: str
    budget_bytes: int | None
    points: list[ShapePoint]
    fixed_bytes: float
    per_row_const_bytes: float
    per_token_bytes: float
    per_token2_bytes: float
    max_size: int
    seconds: float
    results: list[SearchResult] = field(default_factory=list, repr=False)
    estimated_row_bytes: dict[int, float] = field(default_factory=dict)
    failed_trials: int = 0

    @property
    def trials(self) -> int:
        """Real runs of the step this plan made: every search's trials and checks, and those
        of a length where no batch fitted (``failed_trials``, left out of the plan)."""
        return sum(_runs(r) for r in self.results) + self.failed_trials

    def per_row_bytes(self, seq_len: int) -> float:
        """The estimated peak bytes one row of ``seq_len`` adds (fitted, an estimate)."""
        return (self.per_row_const_bytes
                + seq_len * (self.per_token_bytes + self.per_token2_bytes * seq_len))

    def max_batch(self, seq_len: int) -> int:
        """The largest safe batch (rows) at ``seq_len``; 0 where no row is predicted to fit.

        At a searched length, that search's recommendation (its margin kept). Between two,
        their safe batches interpolated on log-log axes: a batch ``~ room / per-row bytes``,
        whose per-row bytes (a polynomial in the length with no negative term) grow ever
        faster on those axes, so the straight line there is below the truth; half the bend
        three searched lengths show is added back (measured: the straight line alone was 12%
        below a fresh process's maximum between lengths 39 and 128 of an attention model, the
        whole bend 1% above it between 12 and 39). Below the shortest: in proportion to the
        length, or less where the points fall slower. Above the longest: as the length
        squared. Never above the batch safe at a shorter searched length (memory grows with
        the length), never below one safe at a longer one.
        """
        check_positive_int("seq_len", seq_len)
        xs = [math.log(p.seq_len) for p in self.points]
        ys = [math.log(p.safe) for p in self.points]
        x = math.log(seq_len)
        slopes = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
        if x <= xs[0]:
            y = ys[0] - min(1.0, -slopes[0] if slopes else 1.0) * (x - xs[0])
        elif x >= xs[-1]:
            y = ys[-1] - max(2.0, -slopes[-1] if slopes else 2.0) * (x - xs[-1])
        else:
            i = max(k for k in range(len(xs) - 1) if xs[k] <= x)
            # The bend: the second divided difference of the points around the segment (the
            # smaller where two triples hold it), never one that would lower the line.
            bends = [-(slopes[k + 1] - slopes[k]) / (xs[k + 2] - xs[k])
                     for k in (i - 1, i) if 0 <= k < len(slopes) - 1]
            bend = max(0.0, min(bends, default=0.0))
            y = ys[i] + slopes[i] * (x - xs[i]) + BEND_SHARE * bend * (x - xs[i]) * (xs[i + 1] - x)
        size = min(self.max_size, max(0, math.floor(math.exp(y) + 1e-9)))
        ceiling = [p.safe for p in self.points if p.seq_len <= seq_len]
        floor = [p.safe for p in self.points if p.seq_len >= seq_len]
        if ceiling:
            size = min(size, ceiling[-1])  # points run from the shortest
        if floor:
            size = max(size, floor[0])
        return size

    def batches(self, lengths: Sequence[int], *, shuffle: bool = False,
                seed: int | None = None) -> list[list[int]]:
        """``lengths``' indices in batches, every index once, each batch (padded to its longest
        sample) at most :meth:`max_batch` of that length: :func:`plan_batches`."""
        return plan_batches(lengths, self.max_batch, shuffle=shuffle, seed=seed)

    def batch_sampler(self, lengths: Sequence[int], *, shuffle: bool = False, seed: int = 0,
                      rank: int = 0, world_size: int = 1, rows_per_step: int | None = None,
                      tokens_per_step: int | None = None) -> LengthBatchSampler:
        """A ``DataLoader(dataset, batch_sampler=...)`` sampler of :meth:`batches` (with
        ``rows_per_step`` or ``tokens_per_step``: of :meth:`steps`, a step at a time):
        resumable (``state_dict``), split across ranks, deterministic for a seed
        (:class:`LengthBatchSampler`)."""
        return LengthBatchSampler(lengths, self.max_batch, shuffle=shuffle, seed=seed,
                                  rank=rank, world_size=world_size, rows_per_step=rows_per_step,
                                  tokens_per_step=tokens_per_step)

    def steps(self, lengths: Sequence[int], *, rows: int | None = None,
              tokens: int | None = None, shuffle: bool = False,
              seed: int | None = None) -> list[list[list[int]]]:
        """Optimizer steps of ``rows`` samples or at most ``tokens`` tokens each, cut into
        batches :meth:`max_batch` allows: :func:`plan_steps` (each batch's share of its step's
        loss: :func:`~oomguard.engine.core.length_batches.step_shares`)."""
        return plan_steps(lengths, self.max_batch, rows=rows, tokens=tokens, shuffle=shuffle,
                          seed=seed)

    def check(self, step: Callable[[int, int], Any], lengths: Sequence[int], *,
              restore: Sequence[Any] | None = None, steps: int = 2,
              **search_options: Any) -> dict[str, Any]:
        """Run the epoch's worst predicted batch once for real, before the run: the batch of
        :meth:`batches` (unshuffled; shuffling changes no batch's shape) whose fitted peak is
        the largest, ``steps`` steps of ``step`` at its shape, as a search's trial runs them
        (:func:`verify`, under the plan's budget and on its device unless ``search_options``
        say otherwise; ``restore`` as for :func:`search_shapes`). Returns which batch it was
        (``batch``: its index; ``size``, ``seq_len``, ``predicted_peak_bytes``, an estimate)
        and what happened (``ok``, ``peak_bytes``, an OOM's ``error``: reported, not raised).
        """
        lengths = check_lengths(lengths)
        batches = self.batches(lengths)
        shapes = [(len(b), max(lengths[i] for i in b)) for b in batches]

        def predicted(shape: tuple[int, int]) -> float:
            return self.fixed_bytes + shape[0] * self.per_row_bytes(shape[1])
        worst = max(range(len(shapes)), key=lambda k: predicted(shapes[k]))
        size, seq_len = shapes[worst]
        options: dict[str, Any] = {"budget": self.budget_bytes, "device": self.device}
        if restore is not None:
            options["restore"] = tuple(restore)
        got = verify(_AtLength(step, seq_len), size, steps, **(options | search_options))
        log.info("shapes: the worst predicted batch, %d rows of length %d (batch %d), %s",
                 size, seq_len, worst, "ran" if got["ok"] else "ran out of memory")
        return {"batch": worst, "seq_len": seq_len,
                "predicted_peak_bytes": int(predicted(shapes[worst]))} | got

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: the measured points, the fitted coefficients, ``trials`` and the
        searches."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("points", "results")}
        return out | {"trials": self.trials, "points": [p.to_dict() for p in self.points],
                      "results": [r.to_dict() for r in self.results]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ShapePlan:
        """The plan :meth:`to_dict` wrote (read back from JSON: the size cache), without its
        searches (``results`` empty, so :attr:`trials` is 0: none ran for it); KeyError or
        TypeError where ``doc`` is not such a plan."""
        names = {f.name for f in dataclasses.fields(cls)} - {"points", "results",
                                                             "failed_trials"}
        fields = {k: doc[k] for k in names if k in doc}
        fields["estimated_row_bytes"] = {int(n): float(v) for n, v in
                                         (doc.get("estimated_row_bytes") or {}).items()}
        points = [ShapePoint(**p) for p in doc["points"]]
        if not points:
            raise KeyError("points")
        return cls(**fields, points=points)


class _AtLength:
    """``step(size, seq_len)`` at one length: the workload one search runs."""

    def __init__(self, step: Callable[[int, int], Any], seq_len: int) -> None:
        self.step, self.seq_len = step, seq_len
        self.name = f"{name_of(step)} at length {seq_len}"
        self.steps_per_trial = getattr(step, "steps_per_trial", 1)

    def __call__(self, size: int) -> Any:
        return self.step(size, self.seq_len)

    def __getattr__(self, name: str) -> Any:
        # The step's own warm-up and estimate copy, where it has them (a workload's hooks,
        # engine/core/workload.py): an estimate runs the copy, warmed up outside its count.
        if name not in ("warmup", "for_estimate") or "step" not in self.__dict__:
            raise AttributeError(name)
        hook = getattr(self.step, name)
        if name == "warmup":
            return hook
        return lambda device: _AtLength(hook(device), self.seq_len)


def search_shapes(step: Callable[[int, int], Any], lengths: Sequence[int], *,
                  budget: int | None = None, restore: Sequence[Any] | None = None,
                  device: Any = None, estimate: bool = True,
                  **search_options: Any) -> ShapePlan:
    """Plan batch sizes over sequence lengths from real trials: a :class:`ShapePlan`.

    ``step(batch_size, seq_len)`` runs the real step (a training step with its optimizer,
    given as ``restore=(model, optimizer)`` as to :func:`search`, or a metric); ``lengths``
    are the dataset's sample lengths. At most :data:`MAX_TRIALS` real runs of ``step`` in all
    (:attr:`ShapePlan.trials`; a further length is tried only while one is left, and its
    search keeps no margin of its own, so runs no check: :func:`_under_line`; a
    ``verify_steps`` verification of the longest length's answer is one more). With
    ``estimate``, the step's per-row bytes at each length
    searched are first estimated on fake tensors (:func:`_estimated_rows`: no memory, no real
    trial; with ``restore`` its objects are put back after). A :func:`search` runs at the
    longest length, started at the batch the estimate predicts, :data:`LONGEST_TRIALS` trials
    at most (then its recommendation is measured, as every search's); then, where the 10th
    percentile is shorter than 0.9 of it, one trial there, and where it is shorter than half
    of it, one at their geometric mean, each at the batch the measured peaks and the estimate
    predict keeps under the longest length's safe line (:func:`_one_trial`). ``budget`` (bytes),
    ``device`` and ``search_options`` (:class:`SearchConfig` fields, ``start``) are the
    searches'. Raises what :func:`search` raises; :class:`UsageError` for bad ``lengths``,
    before any trial.
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
    wanted = searched_lengths(lengths)
    longest = wanted[-1]
    rows = _estimated_rows(step, wanted, options) if estimate else None
    searched = [(longest, search(_AtLength(step, longest), **_first(options, rows, longest)))]
    # The short length first: the one between is then predicted from both sides.
    used = _runs(searched[0][1])
    for k, seq_len in enumerate(wanted[:-1]):
        # One trial kept for each length after this one.
        left = MAX_TRIALS - used - (len(wanted) - 2 - k)
        if left < 1:
            log.info("shapes: %d trials ran; length %d not searched", used, seq_len)
            continue
        result, runs = _one_trial(step, seq_len, options, _plan(step, searched, t0, rows),
                                  rows, left)
        used += runs
        if result is not None:
            searched.append((seq_len, result))
            searched.sort(key=lambda s: s[0])
    plan = _plan(step, searched, t0, rows)
    plan.failed_trials = used - plan.trials  # of lengths where nothing fitted
    log.info("shapes: %s (%d trials)", ", ".join(
        f"{p.safe} rows at length {p.seq_len}" for p in plan.points), plan.trials)
    return plan


def searched_lengths(lengths: Sequence[int]) -> list[int]:
    """The lengths a plan of ``lengths`` searches, from the shortest: the longest; the 10th
    percentile where it is shorter than 0.9 of it; their geometric mean where the 10th
    percentile is shorter than half of it. A plan depends on ``lengths`` only through these
    (the size cache's key: ``oomguard bench --lengths``)."""
    ordered = sorted(check_lengths(lengths))
    longest = ordered[-1]
    short = ordered[int(SHORT_QUANTILE * (len(ordered) - 1))]
    wanted = [longest]
    if short < MIN_LENGTH_RATIO * longest:
        wanted.insert(0, short)
        # Between them, where the two lengths' surface is furthest from the truth if the
        # per-row bytes have a part that does not grow with the length, or a bend.
        mid = round(math.sqrt(short * longest))
        if short < mid < longest and short < MID_LENGTH_RATIO * longest:
            wanted.insert(1, mid)
    return wanted


def _runs(result: SearchResult) -> int:
    """The real runs of the step a search made: its trials, its recommendation's checks and
    its verification (``verify_steps``; a trial the RAM guard refused never ran)."""
    return (sum(not t.guarded for t in result.trials) + len(result.checks)
            + (result.verification is not None))


def _estimated_rows(step: Callable[[int, int], Any], lengths: Sequence[int],
                    options: dict[str, Any]) -> dict[int, dict[str, float]] | None:
    """Per length, the estimated per-row bytes of ``step`` (``row``) and its peak at batch 0
    (``fixed``): :func:`~oomguard.engine.core.estimate.estimate.estimate` at two batches, on
    fake tensors (no memory, no real trial, estimates). The step runs on fake tensors, but
    operations on small real inputs run for real: ``restore``'s objects are put back after,
    as after a trial (a step with its own ``for_estimate`` runs on that copy instead). None,
    logged, where the step cannot be estimated (a workload whose memory depends on values, a
    device estimates do not cover): the plan then predicts from the measured peaks alone."""
    from oomguard.engine.core.estimate.estimate import estimate
    from oomguard.engine.core.snapshot import Snapshot

    device = options.get("device", getattr(options.get("config"), "device", "cpu"))
    restore = options.get("restore") or getattr(options.get("config"), "restore", ())
    snapshot = Snapshot.take(restore) if restore else None
    t0 = time.perf_counter()
    try:
        rows = {}
        shapes = _ByShape(step, lengths)
        got = estimate(shapes, [shapes.size(b, i) for i in range(len(lengths))
                                for b in ESTIMATE_BATCHES], device, workspace=False)
        for i, seq_len in enumerate(lengths):
            low, high = got[2 * i: 2 * i + 2]
            row = (high.peak_bytes - low.peak_bytes) / (high.size - low.size)
            if row <= 0:
                return None
            rows[seq_len] = {"row": row, "fixed": low.peak_bytes - (low.size % _SPAN) * row}
    except Exception as exc:  # an estimate only saves trials: the plan goes on without it
        log.info("shapes: no estimate of %s (%s: %s); predicting from the trials alone",
                 name_of(step), type(exc).__name__, str(exc)[:200])
        return None
    finally:
        if snapshot is not None:
            snapshot.restore()
    log.info("shapes: estimated per-row bytes %s (%.1f s)", ", ".join(
        f"{r['row']:,.0f} at length {n}" for n, r in rows.items()), time.perf_counter() - t0)
    return rows


_SPAN = 1 << 20  # sizes of one length in a _ByShape: more than any estimated batch


class _ByShape(_AtLength):
    """``step(batch, length)`` at several lengths as one workload, so one estimate (one
    warm-up) covers them: size ``i * _SPAN + batch`` runs ``batch`` rows of
    ``lengths[i]``."""

    def __init__(self, step: Callable[[int, int], Any], lengths: Sequence[int]) -> None:
        super().__init__(step, max(lengths))
        self.lengths = list(lengths)
        self.name = f"{name_of(step)} at lengths {', '.join(map(str, lengths))}"

    def size(self, batch: int, index: int) -> int:
        return index * _SPAN + batch

    def __call__(self, size: int) -> Any:
        index, batch = divmod(size, _SPAN)
        return self.step(batch, self.lengths[index])

    def __getattr__(self, name: str) -> Any:
        hook = super().__getattr__(name)
        if name == "for_estimate":
            return lambda device: _ByShape(getattr(self.step, name)(device), self.lengths)
        return hook


def _first(options: dict[str, Any], rows: dict[int, dict[str, float]] | None,
           longest: int) -> dict[str, Any]:
    """The longest length's search options: at most :data:`LONGEST_TRIALS` trials, started
    (unless the caller chose a start or a strategy) at :data:`START_SHARE` of the batch the
    estimate predicts fits the budget, else the free memory (an estimate that leaves out the
    allocator's rounding: below it, so the start fits and its peak predicts the rest)."""
    trials = min(LONGEST_TRIALS, options.get("max_trials", LONGEST_TRIALS))
    if rows is None or _chose_strategy(options) or "start" in options:
        return options | {"max_trials": trials}
    config = options.get("config")
    capacity = options.get("capacity_bytes", getattr(config, "capacity_bytes", None)) or \
        options.get("budget", getattr(config, "budget", None))
    if capacity is None:
        from oomguard.probes import probe

        capacity = probe(options.get("device", getattr(config, "device", "cpu"))).free_bytes
    most = options.get("max_size", getattr(config, "max_size", SearchConfig.max_size))
    if not capacity:
        return options | {"max_trials": trials}
    row = rows[longest]
    start = int(START_SHARE * (capacity - max(0.0, row["fixed"])) / row["row"])
    return options | {"start": max(1, min(most, start)), "max_trials": trials}


def _chose_strategy(options: dict[str, Any]) -> bool:
    """Whether the caller chose how a search proposes sizes (a strategy, a size step)."""
    chosen = getattr(options.get("config"), "strategy", None) is not None
    return chosen or "strategy" in options or "size_step" in options


def _predicted_row(plan: ShapePlan, rows: dict[int, dict[str, float]] | None,
                   seq_len: int) -> float | None:
    """The per-row bytes at ``seq_len`` (an estimate) from the measured points' per-row bytes,
    each scaled by the estimate's ratio between the lengths; where two points bracket it,
    their scale factors interpolated on the log of the length. None without an estimate."""
    if rows is None or seq_len not in rows:
        return None
    factors = [(math.log(p.seq_len), p.per_row_bytes / rows[p.seq_len]["row"])
               for p in plan.points if p.seq_len in rows]
    if not factors:
        return None
    x = math.log(seq_len)
    below = [f for f in factors if f[0] <= x]
    above = [f for f in factors if f[0] >= x]
    if below and above and above[0][0] > below[-1][0]:
        (x0, f0), (x1, f1) = below[-1], above[0]
        factor = f0 + (f1 - f0) * (x - x0) / (x1 - x0)
    else:
        factor = (below[-1] if below else above[0])[1]
    return factor * rows[seq_len]["row"]


@dataclass(frozen=True)
class _Planned:
    """A further length's trials: ``start`` (the predicted batch); after it fits with a peak,
    the batch the line through that peak and the longest length's ``fixed_bytes`` puts at
    ``1 - SLACK`` of the room under ``line_bytes``, where that is more than :data:`REACH`
    above it (a prediction that was too low: measured, not reached); after an OOM, three
    quarters of it. Otherwise done. ``max_trials`` bounds it, as every search."""

    start: int
    line_bytes: int
    fixed_bytes: float
    name: ClassVar[str] = "planned"

    def describe(self) -> str:
        return (f"Run {self.start}, the batch predicted under the safe line; then, where its "
                f"peak puts the line's batch more than {REACH:.0%} higher, that batch; after "
                "an OOM, three quarters of it.")

    def next(self, trials: Sequence[Any], max_size: int) -> int | None:
        if not trials:
            return min(self.start, max_size)
        last = trials[-1]
        if not last.ok:
            return last.size * 3 // 4 or None
        if len(trials) > 1 or last.peak_bytes is None or last.peak_bytes <= self.fixed_bytes:
            return None
        row = (last.peak_bytes - self.fixed_bytes) / last.size
        size = min(max_size, int((1 - SLACK) * (self.line_bytes - self.fixed_bytes) / row))
        return size if size > last.size * (1 + REACH) else None

    def why(self, trials: Sequence[Any], size: int) -> str:
        if not trials:
            return "the batch predicted to keep the peak under the longest length's safe line"
        if not trials[-1].ok:
            return f"three quarters of {trials[-1].size}, which ran out of memory"
        return f"where the peak at {trials[-1].size} puts the safe line's batch"


def _one_trial(step: Callable[[int, int], Any], seq_len: int, options: dict[str, Any],
               plan: ShapePlan, rows: dict[int, dict[str, float]] | None,
               left: int) -> tuple[SearchResult | None, int]:
    """A further length's search and its real runs: one trial (:class:`_Planned`), at the batch
    predicted to keep the peak under the longest length's safe line (its recommendation's
    limit, less :data:`SLACK` of what grows: a prediction's error stays under the line), from
    the per-row bytes :func:`_predicted_row` gives, else (no estimate) where the plan so far
    puts it (:meth:`ShapePlan.max_batch`: the per-row bytes in proportion to the length, at
    or below the maximum where they grow at least that fast). Where ``left`` (trials this
    length may run, at least 1) allows, a second: where the first's peak says the prediction
    was too low, or after an OOM. Its search keeps no margin of its own (the trials are read
    against the longest length's line, :func:`_under_line`), so it runs no check. None where
    nothing fitted: the length is left out of the plan."""
    longest = plan.points[-1]
    line = longest.limit_bytes
    row = _predicted_row(plan, rows, seq_len)
    if row is not None and line is not None:
        size = int((1 - SLACK) * (line - longest.fixed_bytes) / row)
    else:
        size = plan.max_batch(seq_len)
    size = max(1, min(plan.max_size, size))
    config = {k: v for k, v in options.items() if k not in ("start", "size_step", "strategy")}
    if line is not None:
        # Its trials are measured against the longest length's safe line (the plan's one
        # margin, _point), so its own recommendation keeps none: it is a measured size, and
        # no check runs past the plan's trials.
        config |= {"margin": 0.0, "verify_steps": 0}
    planned = _Planned(size, line if line is not None else 0, longest.fixed_bytes)
    try:
        result = search(_AtLength(step, seq_len), **config, strategy=planned,
                        max_trials=max(1, min(2, left)) if line is not None else 1)
    except NoSizeFits as exc:
        log.info("shapes: no batch from %d ran at length %d", size, seq_len)
        return None, _runs(exc.result)
    return result, _runs(result)


def _plan(step: Callable[[int, int], Any], searched: list[tuple[int, SearchResult]],
          t0: float, rows: dict[int, dict[str, float]] | None = None) -> ShapePlan:
    """The plan from searches ``(length, result)`` by length from the shortest; the longest
    length's fitted fixed bytes stand for every length's (an estimate)."""
    longest = _point(searched[-1][1], searched[-1][0])
    points = [_point(r, n, longest) for n, r in searched[:-1]] + [longest]
    results = [r for _, r in searched]
    fixed, c0, a, b = _surface(results, points)
    first = results[-1]
    return ShapePlan(workload=name_of(step), device=first.device, budget_bytes=first.budget_bytes,
                     points=points, fixed_bytes=fixed, per_row_const_bytes=c0, per_token_bytes=a,
                     per_token2_bytes=b,
                     max_size=int(first.config.get("max_size", SearchConfig.max_size)),
                     seconds=time.perf_counter() - t0, results=results,
                     estimated_row_bytes={n: r["row"] for n, r in (rows or {}).items()})


def _point(result: SearchResult, seq_len: int, longest: ShapePoint | None = None) -> ShapePoint:
    """What a search at ``seq_len`` measured: its safe batch and its fitted line (bytes). A
    further length's trials (``longest``: the longest length's point) are read against the
    longest length's safe line (:func:`_under_line`)."""
    rec, fit = result.recommendation, result.fit
    # The recommendation, its margin kept, also where the search stopped before an OOM: its
    # size was measured under the limit (SearchResult.checks).
    safe = rec.safe if rec is not None else result.size_to_use
    assert safe is not None and result.max_ok is not None  # a search without an answer raised
    if fit is not None and fit.per_item_bytes > 0:
        per_row, fixed = fit.per_item_bytes, max(0.0, fit.base_bytes)
    else:  # one size ran: its peak, above the longest length's fixed part where known
        peak = max((t.peak_bytes or 0) for t in [*result.trials, *result.checks]
                   if t.ok and t.size == result.max_ok)
        fixed = longest.fixed_bytes if longest is not None and peak > longest.fixed_bytes else 0.0
        per_row = (peak - fixed) / result.max_ok
    limit = rec.limit_bytes if rec else None
    if longest is not None and longest.limit_bytes is not None:
        safe, limit = _under_line(result, longest), longest.limit_bytes
    return ShapePoint(seq_len=seq_len, safe=safe, max_ok=result.max_ok,
                      first_oom=result.first_oom, per_row_bytes=per_row, fixed_bytes=fixed,
                      limit_bytes=limit, trials=_runs(result))


def _under_line(result: SearchResult, longest: ShapePoint) -> int:
    """A further length's safe batch against the longest length's safe line
    (``longest.limit_bytes``, its margin kept): from the largest trial measured under it, up
    along the line through that peak and the longest length's fixed bytes as far as the line
    allows, :data:`REACH` above that trial at most; where every trial that fitted ran over
    it, down along the line through the smallest one's peak (at least 1). Never past
    ``max_size``."""
    line, fixed = longest.limit_bytes, longest.fixed_bytes
    assert line is not None
    ran = [t for t in [*result.trials, *result.checks] if t.ok and t.peak_bytes is not None]
    if not ran:  # no peak was read: what the search answered
        return max(1, result.size_to_use or 1)
    under = [t for t in ran if t.peak_bytes <= line]
    top = max(under, key=lambda t: t.size) if under else min(ran, key=lambda t: t.size)
    base = fixed if top.peak_bytes > fixed else 0.0
    along = int((line - base) / ((top.peak_bytes - base) / top.size))
    if not under:
        return max(1, min(along, top.size - 1))
    most = int(result.config.get("max_size", SearchConfig.max_size))
    return max(top.size, min(int(top.size * (1 + REACH)), along, most))


def _surface(results: list[SearchResult], points: list[ShapePoint]
             ) -> tuple[float, float, float, float]:
    """(fixed, c, a, b) of ``peak ~= fixed + batch * (c + a * length + b * length**2)`` (bytes,
    an estimate). ``fixed``: the longest length's fitted line at batch 0 (its trials span the
    widest share of their batches); the per-row bytes at each length: its largest fitting
    trial's peak less ``fixed``, per row; c, a, b: least squares through them, c only from
    three lengths, none below 0 (of the fits with no term below 0, the closest)."""
    fixed = points[-1].fixed_bytes
    per_row = []
    for result, point in zip(results, points, strict=True):
        top = max((t for t in [*result.trials, *result.checks]
                   if t.ok and t.peak_bytes is not None), key=lambda t: t.size)
        per_row.append((point.seq_len, (top.peak_bytes - fixed) / top.size))
    candidates = ((0, 1, 2), (1, 2), (0, 2), (0, 1), (1,), (2,)) if len(points) >= 3 else (
        (1, 2), (1,), (2,)) if len(points) == 2 else ((1,),)
    y = numpy.array([bytes_ for _, bytes_ in per_row])
    fits = []
    for terms in candidates:  # the powers of the length in the per-row bytes
        x = numpy.array([[float(length) ** k for k in terms] for length, _ in per_row])
        coef = numpy.linalg.lstsq(x, y, rcond=None)[0]
        if all(c >= 0 for c in coef):
            fits.append((float(numpy.sum((x @ coef - y) ** 2)), terms, coef))
    if fits:
        _, terms, coef = min(fits, key=lambda f: f[0])  # the closest of the non-negative fits
        per = dict(zip(terms, (float(c) for c in coef), strict=True))
        return fixed, per.get(0, 0.0), per.get(1, 0.0), per.get(2, 0.0)
    length, bytes_ = per_row[-1]  # no such fit: in proportion to the longest length
    return fixed, 0.0, max(0.0, bytes_) / length, 0.0
