"""The record of a size search: every figure a report states, computed once.

:func:`summarise` derives the figures from a :class:`SearchResult`; ``report.json``
(:func:`render_json`), the Markdown report and the plots all render it. Bytes are ints of
bytes, seconds wall-clock seconds, fractions in [0, 1].
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from oomguard.engine.core.search.record import (
    closed,
    record_of,
    sample_cap,
    trial_at_max,
)
from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.core.search.trial import Trial
from oomguard.engine.util.jsonable import to_jsonable

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
    "forked": ("forked: each trial in a fork of the searching process, which keeps nothing "
               "of it; the maximum of that process"),
    "in-process": "in-process: history-dependent, can differ from a fresh process's maximum",
    "confirmed": ("confirmed: searched in-process, the answer and the size above it re-run "
                  "in fresh processes; the faithful maximum"),
}


def scaling_verdict(result: SearchResult) -> str | None:
    """How measured peak memory scaled with the size: None (no fit), ``"flat"`` (slope <= 0,
    or its t-statistic below 2), ``"untested"`` (two points), else by R²: ``"confirmed"``
    (>= 0.99), ``"approximate"`` (>= 0.9), ``"not supported"``."""
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
    """The size at or below the recommended one (else any) whose measured items per second
    beat every other's by more than :func:`rate_spread`; None without a recommendation, two
    candidates or a measured spread, or when the best two are within it (noise)."""
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
    """The peaks (bytes, the peak meter's) the recommendation keeps under, which ``oomguard
    verify`` checks: ``safe_line_bytes``, the capacity less the margin's bytes (None without a
    capacity); ``recommended_limit_bytes`` and, in words, ``recommended_limit_against``."""
    rec = result.recommendation
    return {"safe_line_bytes": rec.safe_line_bytes if rec is not None else None,
            "recommended_limit_bytes": rec.limit_bytes if rec is not None else None,
            "recommended_limit_against": rec.limit_against if rec is not None else None}


def rate_basis(result: SearchResult) -> str:
    """What the rates measure, in words (the first step is left out when there are more)."""
    steps = max((t.steps for t in result.trials), default=1)
    return ("items per second over the steps after the first" if steps > 1
            else "items per second of the trial's one step (first-step costs included)")


def status_text(t: Trial) -> str:
    """A trial's outcome for a table cell."""
    return "✓ SUCCESS" if t.ok else "✗ RAM guard (estimated limit)" if t.guarded else "✗ OOM"


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
    """Numbered-list items describing the search as it ran: each trial with the reason its
    strategy gave for it (``Trial.reason``), then how it ended."""
    if not result.trials:
        return [f"No trial ran ({result.stopped_because})."]
    name, first, *rest = result.size_name, *result.trials
    return [f"Started with {name}={first.size} ({status_text(first)})",
            *(f"Tried {name}={t.size}{f', {t.reason}' if t.reason else ''} ({status_text(t)})"
              for t in rest), _ending(result)]


def oomguard_version() -> str:
    try:
        return version("oomguard")
    except PackageNotFoundError:
        return "unknown"


def summarise(result: SearchResult, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``report.json``'s ``summary``: the search's record
    (:func:`~oomguard.engine.core.search.record.record_of`) and the figures only a report shows;
    ``context`` gives the number of samples (a cap on the search)."""
    cap, fit, size = result.capacity_bytes, result.fit, result.size_name
    # `oomguard search` passes "samples"; MetricTrial.describe() says "n_samples".
    samples = (context or {}).get("samples", (context or {}).get("n_samples"))
    record = record_of(result, cap_reason=sample_cap(size, result.config.get("max_size"), samples))
    best = trial_at_max(result)
    n_ok = sum(t.ok for t in result.trials)
    return {
        **{k: v for k, v in record.to_dict().items() if k not in ("metric", "others", "source")},
        "max_is_lower_bound": result.first_oom is None,
        "seconds_at_max": best.seconds if best else None,
        "value_at_max": best.value if best else None,
        "margin_left_bytes": (cap - record.peak_at_max_bytes
                              if cap is not None and record.peak_at_max_bytes is not None else None),
        "trials_ok": n_ok,
        "trials_oom": len(result.trials) - n_ok,
        "trial_seconds": sum(t.seconds for t in result.trials),
        "non_monotonic_oom_sizes": [t.size for t in result.trials if not t.ok
                                    and result.max_ok is not None and t.size < result.max_ok],
        "size_label": "batch size" if size == "batch_size" else size,  # as the user says it
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
    ``context``, ``result`` (:meth:`SearchResult.to_dict`) and ``summary`` (:func:`summarise`)."""
    return to_jsonable({
        "schema": SCHEMA, "oomguard_version": oomguard_version(),
        # timezone.utc, not datetime.UTC: setup.cfg still admits Python 3.10.
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "context": context or {}, "result": result.to_dict(),
        "summary": summary if summary is not None else summarise(result, context),
    })
