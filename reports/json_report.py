"""The record of a size search: every figure a report states, computed once.

:func:`summarise` derives the figures (peak at the maximum, utilisation, what the capacity is, what
capped the search, how memory scaled, the search steps in prose) from a :class:`SearchResult`;
``report.json`` is that record as JSON (:func:`render_json`), and the Markdown report and the plot
render it, so all three state the same numbers. Bytes are ints of bytes, seconds are floats of
wall-clock seconds, fractions are in [0, 1] (not percent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.core.search.seed import BELOW_ESTIMATE, ESTIMATE
from oomguard.engine.core.search.strategies import bracket, predict_max
from oomguard.engine.core.search.trial import SAMPLE_KNOBS, Trial
from oomguard.engine.util.jsonable import to_jsonable
from oomguard.engine.util.units import fmt_bytes

SCHEMA = "oomguard.search-report/1"

# What a trial's peak counts, per device type (see probes.peak.PeakMeter).
PEAK_MEANING = {
    "cpu": "the process's resident high-water mark (VmHWM after clear_refs) minus the "
           "resident bytes at the start of the trial",
    "cuda": "the CUDA caching allocator's peak reserved bytes (torch.cuda.max_memory_reserved) "
            "minus the reserved bytes at the start of the trial",
    "mps": "the growth of torch.mps.driver_allocated_memory over the trial (a lower bound: "
           "MPS keeps no peak)",
}
_MODE_NOTE = {
    "in-process": "in-process: history-dependent, can differ from a fresh process's maximum",
    "confirmed": ("confirmed: searched in-process, the answer and the size above it re-run "
                  "in fresh processes; the faithful maximum"),
}
_OPTIONS = ("max_size", "max_trials", "max_seconds")


def utilisation(peak: float | None, capacity: int | None) -> float | None:
    """``peak / capacity`` as a fraction, None if either is unknown."""
    return None if peak is None or not capacity else peak / capacity


def closed(result: SearchResult) -> bool:
    """Whether the search closed its bracket: an OOM right above the maximum."""
    return (result.max_ok is not None and result.first_oom is not None
            and result.first_oom - result.max_ok <= 1)


def capped_by(result: SearchResult, context: Mapping[str, Any]) -> str | None:
    """What ended a search before it closed its bracket, or None if it closed (an OOM right above
    the maximum) or nothing fitted. ``"samples"``: it stopped at ``max_size`` equal to the number of
    samples (``context["samples"]`` or ``["n_samples"]``) of a knob that slices the samples, where
    larger sizes mean the same thing. ``"max_size"``, ``"max_trials"``, ``"max_seconds"``: the
    search option of that name. ``"strategy"``: the strategy stopped proposing sizes without seeing
    an OOM."""
    if result.max_ok is None or closed(result):
        return None
    # The prefix search() writes: "max_size (64) reached".
    option = next((o for o in _OPTIONS if result.stopped_because.startswith(f"{o} (")), None)
    if option is None:
        return "strategy" if result.first_oom is None else None
    # `oomguard search` passes "samples"; MetricTrial.describe() says "n_samples".
    samples = context.get("samples", context.get("n_samples"))
    if (option == "max_size" and result.size_name in SAMPLE_KNOBS
            and samples == result.config.get("max_size")):
        return "samples"
    return option


def scaling_verdict(result: SearchResult) -> str | None:
    """How measured peak memory scaled with the size, judged from the fit. None: no fit. ``"flat"``:
    it did not grow (a zero or negative slope, or a positive one no larger than the scatter of the
    points: t-statistic of the slope below 2). ``"untested"``: a rising line through two points (R²
    is 1 by construction). Otherwise by R²: ``"confirmed"`` (>= 0.99), ``"approximate"`` (>= 0.9),
    ``"not supported"``."""
    fit = result.fit
    if fit is None:
        return None
    if fit.per_item_bytes <= 0:
        return "flat"
    if fit.points < 3:
        return "untested"
    # t² of the slope = R² (n - 2) / (1 - R²); below 2², growth is within the noise.
    if fit.r2 < 1 and fit.r2 * (fit.points - 2) < 4 * (1 - fit.r2):
        return "flat"
    return "confirmed" if fit.r2 >= 0.99 else "approximate" if fit.r2 >= 0.9 else "not supported"


def rates(result: SearchResult) -> dict[int, float]:
    """Measured items per second of every size that fitted (sizes without a rate left out)."""
    return {t.size: t.items_per_second for t in result.trials if t.ok and t.items_per_second}


def step_rates(t: Trial) -> list[float]:
    """Items per second of each timed step of ``t`` (the steps after the first, or the only
    one), from ``Trial.step_seconds``; empty where the trial did not record them."""
    seconds = list(getattr(t, "step_seconds", None) or [])
    return [t.size / s for s in (seconds[1:] or seconds) if s > 0]


def rate_spread(result: SearchResult) -> float | None:
    """How much the rate of one size varied from step to step: the largest ``(max - min) /
    max`` of :func:`step_rates` over the trials that fitted and timed two steps or more (a
    fraction, measured); None where none did, so the rates' noise is unknown."""
    spreads = [(max(r) - min(r)) / max(r) for t in result.trials
               if t.ok and len(r := step_rates(t)) >= 2]
    return max(spreads, default=None)


def fastest_safe_size(result: SearchResult) -> int | None:
    """The size that is fastest beyond the noise, among the sizes at or below the recommended
    size (at or below the maximum when none ran there): its measured items per second beat
    every other candidate's by more than :func:`rate_spread`. None without a recommendation,
    with fewer than two candidates, without a measured spread, or when the best two are
    within it: a rate within the spread of another is not faster, just noisier."""
    measured, rec, spread = rates(result), result.recommendation, rate_spread(result)
    if rec is None or spread is None:
        return None
    safe = {s: r for s, r in measured.items() if s <= rec.safe} or measured
    if len(safe) < 2:
        return None
    best, second = sorted(safe.values(), reverse=True)[:2]
    if (best - second) / best <= spread:
        return None
    return max(safe, key=safe.__getitem__)


def fastest_note(result: SearchResult, fastest: int | None, spread: float | None) -> str:
    """Why a size is or is not named fastest (``fastest`` and ``spread`` as the summary's
    ``fastest_safe_size`` and ``rate_spread``), in words."""
    if fastest is not None:
        return (f"{fastest} is faster than every other size at or below the recommendation by "
                f"more than the step-to-step spread ({spread:.1%})")
    rec, measured = result.recommendation, rates(result)
    safe = sorted(n for n in measured if rec is None or n <= rec.safe) or sorted(measured)
    if len(safe) < 2:
        return (f"only {', '.join(map(str, safe)) or 'no size'} ran at or below the recommended "
                "size: nothing to compare")
    if spread is None:
        return ("the rates' step-to-step spread is unknown (no trial timed two steady steps), "
                "so their differences may be noise")
    return (f"the rates at or below the recommendation differ by no more than the "
            f"step-to-step spread ({spread:.1%}): noise")


def safe_limits(result: SearchResult) -> dict[str, Any]:
    """The peaks the recommendation keeps under, in the peak meter's bytes (None where there
    is no capacity): ``safe_line_bytes``, capacity x (1 - margin), the line memory.png draws;
    ``recommended_limit_bytes``, the peak the recommended size was chosen to stay under: the
    safe line, or the margin taken off the fitted peak at the first OOM where that is lower
    than the capacity (the limit counted bytes the peak does not); ``recommended_limit_against``
    says which, in words. ``oomguard verify`` fails a peak above either. The rule restates
    :func:`~oomguard.engine.core.search.fit.recommend`'s (a Recommendation does not record
    the limit it used)."""
    rec, cap, fit, oom = result.recommendation, result.capacity_bytes, result.fit, result.first_oom
    if rec is None:
        return {"safe_line_bytes": None, "recommended_limit_bytes": None,
                "recommended_limit_against": None}
    line = cap * (1 - rec.margin) if cap else None
    usable, against = cap, "capacity"
    if fit is not None and oom is not None and fit.per_item_bytes > 0:
        at_oom = fit.predict(oom)
        if usable is None or at_oom < usable:
            usable, against = at_oom, f"the fitted peak at the first OOM ({oom})"
    limit = usable * (1 - rec.margin) if usable else None
    return {"safe_line_bytes": line, "recommended_limit_bytes": limit,
            "recommended_limit_against": against if limit is not None else None}


def rate_basis(result: SearchResult) -> str:
    """What the rates measure, in words (the first step is left out when there are more)."""
    steps = max((t.steps for t in result.trials), default=1)
    return ("items per second over the steps after the first" if steps > 1
            else "items per second of the trial's one step (first-step costs included)")


def status_text(t: Trial) -> str:
    """A trial's outcome for a table cell."""
    return "✓ SUCCESS" if t.ok else "✗ RAM guard (estimated limit)" if t.guarded else "✗ OOM"


def _growth(sizes: Sequence[int]) -> str:
    pairs = list(zip(sizes, sizes[1:], strict=False))
    if len({b - a for a, b in pairs}) == 1:
        return f"+{pairs[0][1] - pairs[0][0]} increments"
    ratios = {b // a if a > 0 and b % a == 0 else None for a, b in pairs}
    if len(ratios) == 1 and None not in ratios:
        return f"x{ratios.pop()} steps"
    return "jumps (" + " → ".join(str(s) for s in sizes) + ")"


def _guided_reason(seen: list[Trial], t: Trial) -> str:
    """Why the guided strategy tried ``t`` after ``seen``: the prediction it had."""
    lo, hi = bracket(seen)
    if t.size == predict_max(seen):
        return (f"the largest size predicted to fit {fmt_bytes(t.headroom_bytes)} of "
                f"headroom (peaks measured as {t.limit_units or 'the trial peak'})")
    if lo is not None and t.size == lo + 1:
        return f"the size above {lo}, which ran: closes the bracket if it runs out"
    if hi is not None and t.size == hi - 1:
        return f"the size below {hi}, which was predicted to fit and did not"
    return "doubling or bisection (the predictions were not reliable)"


def _groups(trials: list[Trial]) -> list[tuple[str, int | None, int | None, list[Trial]]]:
    """Runs of trials that expanded, halved or refined the bracket, with the bracket
    ``(lo, hi)`` each run started from."""
    groups: list[tuple[str, int | None, int | None, list[Trial]]] = []
    for i, t in enumerate(trials[1:], 1):
        lo, hi = bracket(trials[:i])
        kind = "halve" if lo is None else "expand" if hi is None else "refine"
        if groups and groups[-1][0] == kind:
            groups[-1][3].append(t)
        else:
            groups.append((kind, lo, hi, [t]))
    return groups


def _expanded(name: str, base: int, group: list[Trial]) -> list[str]:
    oks = [t.size for t in group if t.ok]
    failed = [t for t in group if not t.ok]
    steps = [f"Expanded in {_growth([base, *oks])} while successful "
             f"({base} → {oks[-1]}, {len(oks)} more successful trials)"] if oks else []
    return steps + ([f"When OOM encountered at {name}={failed[0].size}, switched to binary "
                     "search refinement"] if failed else [])


def _stepped(result: SearchResult) -> list[str]:
    """The doubling and increment strategies' steps: runs of expanding, halving, bisecting."""
    name, first, steps = result.size_name, result.trials[0], []
    for kind, lo, hi, group in _groups(result.trials):
        marks = ", ".join(f"{t.size} {'✓' if t.ok else '✗ RAM guard' if t.guarded else '✗ OOM'}"
                          for t in group)
        if kind == "expand":
            steps += _expanded(name, lo if lo is not None else first.size, group)
        elif kind == "halve":
            steps.append(f"{name}={hi} ran out of memory; halved: {marks}")
        else:
            steps.append(f"Bisected between {lo} (fits) and {hi} (OOM): {marks}")
    return steps


def _ending(result: SearchResult) -> str:
    name, top, oom = result.size_name, result.max_ok, result.first_oom
    if top is None:
        return "No size fitted"
    if closed(result):
        return f"Final refinement found maximum at {name}={top} ({name}={oom} ran out of memory)"
    if oom is not None:
        return (f"Stopped ({result.stopped_because}) with the maximum between {top} (fits) "
                f"and {oom} (OOM); largest size that ran: {name}={top}")
    return (f"No OOM seen; stopped because {result.stopped_because}: the maximum is at "
            f"least {name}={top}")


def strategy_steps(result: SearchResult) -> list[str]:
    """Numbered-list items describing the search as it actually ran, from the trials."""
    if not result.trials:
        return [f"No trial ran ({result.stopped_because})."]
    trials, name = result.trials, result.size_name
    middle = ([f"Tried {name}={t.size}, {_reason(trials[:i], t)} ({status_text(t)})"
               for i, t in enumerate(trials) if i] if result.strategy == "guided"
              else _stepped(result))
    return [f"Started with {name}={trials[0].size}{_seeded(result)} ({status_text(trials[0])})",
            *middle, _ending(result)]


def _seeded(result: SearchResult) -> str:
    """How the estimate chose the first trial, in words (empty where it did not)."""
    seed = result.seed
    if not seed or result.trials[0].chosen_by != ESTIMATE:
        return ""
    peaks = ", ".join(f"{fmt_bytes(p['peak_bytes'])} at {p['size']}"
                      for p in seed["estimated_peaks"])
    return (f", chosen by the estimate: the largest size predicted to fit "
            f"{fmt_bytes(seed['capacity_bytes'])} of headroom from peaks estimated with fake "
            f"tensors ({peaks}; estimates, not measurements, {seed['seconds']:.1f} s)")


def _reason(seen: list[Trial], t: Trial) -> str:
    """Why ``t`` ran after ``seen``: below an estimate that ran out, else Guided's reason."""
    if t.chosen_by == BELOW_ESTIMATE:
        return "chosen by the estimate: the size below its prediction, which ran out of memory"
    return _guided_reason(seen, t)


def oomguard_version() -> str:
    try:
        return version("oomguard")
    except PackageNotFoundError:
        return "unknown"


def _at_max(result: SearchResult) -> dict[str, Any]:
    """The successful trial at the maximum (the last one if it ran twice), and how much of
    the capacity (the budget, or the free memory probed) its peak used."""
    best = next((t for t in reversed(result.trials) if t.ok and t.size == result.max_ok), None)
    peak, cap = best.peak_bytes if best else None, result.capacity_bytes
    return {"peak_bytes_at_max": peak, "seconds_at_max": best.seconds if best else None,
            "value_at_max": best.value if best else None,
            "capacity_kind": ("unknown" if cap is None else "budget" if cap == result.budget_bytes
                              else "free memory"),
            "utilisation": utilisation(peak, cap),
            "margin_left_bytes": cap - peak if cap is not None and peak is not None else None}


def summarise(result: SearchResult, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The derived figures of ``result``, ``report.json``'s ``summary`` (module docstring);
    ``context`` says how many samples there were (for :func:`capped_by`)."""
    cap, fit, size = result.capacity_bytes, result.fit, result.size_name
    n_ok = sum(t.ok for t in result.trials)
    return {
        "max_ok": result.max_ok,
        "first_oom": result.first_oom,
        "max_is_lower_bound": result.first_oom is None,
        **_at_max(result),
        "trials": len(result.trials),
        "trials_ok": n_ok,
        "trials_oom": len(result.trials) - n_ok,
        "trial_seconds": sum(t.seconds for t in result.trials),
        "non_monotonic_oom_sizes": [t.size for t in result.trials if not t.ok
                                    and result.max_ok is not None and t.size < result.max_ok],
        "size_label": "batch size" if size == "batch_size" else size,  # as the user says it
        "capped_by": capped_by(result, context or {}),
        "memory_scaling": scaling_verdict(result),
        "fitted_size_at_capacity": fit.largest_size_within(cap) if fit is not None and cap else None,
        "peak_measures": PEAK_MEANING.get(result.device.split(":", 1)[0], "unknown"),
        "fit_is_estimate": True,
        "fastest_safe_size": fastest_safe_size(result),
        "rate_spread": rate_spread(result),
        **safe_limits(result),
        "mode_note": _MODE_NOTE.get(result.mode, "isolated: each trial in a fresh process, the "
                                                 "faithful maximum"),
        "search_steps": strategy_steps(result),
    }


def render_json(result: SearchResult, context: dict | None = None,
                summary: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``report.json``: ``schema``, ``oomguard_version``, ``generated_at`` (UTC ISO 8601),
    ``context``, ``result`` (:meth:`SearchResult.to_dict`: trials, fit, recommendation,
    capacity, budget, config) and ``summary`` (:func:`summarise`, computed unless given)."""
    return to_jsonable({
        "schema": SCHEMA, "oomguard_version": oomguard_version(),
        # timezone.utc, not datetime.UTC: setup.cfg still admits Python 3.10.
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "context": context or {}, "result": result.to_dict(),
        "summary": summary if summary is not None else summarise(result, context),
    })
