"""The one record of a search (:func:`record_of`), whose fields the size cache, jobs, reference
rows and ``report.json`` carry. Sizes in items, bytes, seconds, fractions in [0, 1].
``capped_by`` (:data:`CAPPED_BY`): a search option, the strategy stopping without an OOM, or
what set a knob's ``max_size``, where a search stopped without closing its bracket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oomguard.engine.core.search.trial import SAMPLE_KNOBS
from oomguard.engine.util.record import Record

CAPPED_BY = ("max_size", "max_trials", "max_seconds", "strategy", "samples",
             "largest useful size")
MEASURED, CACHE = "measured", "cache"  # where a record's sizes come from


@dataclass
class SearchRecord(Record):
    """One search, summarised once. ``safe``: the size to use (None: nothing fits, or it failed);
    ``peak_at_safe_bytes``: its peak, measured or fitted (``peak_source``); ``peak_at_max_bytes``:
    measured at ``max_ok``, ``utilisation`` its share of ``capacity_bytes`` (the budget or the
    free memory probed: ``capacity_kind``). ``fixed_bytes``: the part of the peak that does not
    grow with the size (fitted, an estimate); ``margin_bytes``: what ``safe`` keeps free of the
    rest, chosen as ``margin_source`` says. ``limit``: what bounded a search without a budget.
    A knob's search also has its ``metric``, ``unit``, ``cap`` (the largest size it could try),
    the other knobs' sizes (``others``) and ``source`` (measured now, or the size cache)."""

    metric: str
    knob: str
    max_ok: int | None
    first_oom: int | None = None
    safe: int | None = None
    peak_at_safe_bytes: int | None = None
    peak_source: str = ""
    peak_at_max_bytes: int | None = None
    capacity_bytes: int | None = None
    capacity_kind: str = "unknown"
    utilisation: float | None = None
    seconds_per_item: float | None = None
    source: str = MEASURED
    trials: int = 0
    seconds: float = 0.0
    mode: str = ""
    note: str = ""
    strategy: str = ""
    stopped_because: str = ""
    unit: int = 1
    cap: int | None = None
    capped_by: str | None = None
    others: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    limit: str | None = None
    fixed_bytes: int | None = None
    margin_bytes: int | None = None
    margin_source: str = ""


def closed(result: Any) -> bool:
    """Whether the search closed its bracket: an OOM right above the maximum."""
    return (result.max_ok is not None and result.first_oom is not None
            and result.first_oom - result.max_ok <= 1)


def capped_by(result: Any, cap_reason: str | None = None) -> str | None:
    """What ended a search before it closed its bracket (:data:`CAPPED_BY`), or None. ``cap_reason``:
    what set ``max_size``, said instead of ``max_size`` when the search stopped there."""
    if result.max_ok is None or closed(result):
        return None
    option = next((o for o in CAPPED_BY[:3] if result.stopped_because.startswith(f"{o} (")), None)
    if option is None:
        return "strategy" if result.first_oom is None else None
    return cap_reason if option == "max_size" and cap_reason in CAPPED_BY else option


def sample_cap(size_name: str, max_size: int | None, samples: int | None) -> str | None:
    """``samples`` where the knob splits the samples (:data:`SAMPLE_KNOBS`) and ``max_size`` is
    their number."""
    return "samples" if size_name in SAMPLE_KNOBS and samples == max_size else None


def utilisation(peak: float | None, capacity: int | None) -> float | None:
    """``peak / capacity`` as a fraction, None if either is unknown."""
    return None if peak is None or not capacity else peak / capacity


def trial_at_max(result: Any) -> Any:
    """The successful trial at ``max_ok`` (the last one where it ran twice), or None."""
    return next((t for t in reversed(result.trials) if t.ok and t.size == result.max_ok), None)


def record_of(result: Any, *, metric: str = "", unit: int = 1, cap_reason: str | None = None,
              failure: BaseException | None = None) -> SearchRecord:
    """The record of a finished search, one where nothing fits, or one ``failure`` ended."""
    best = trial_at_max(result)
    peak_at_max = best.peak_bytes if best is not None else None
    cap = result.capacity_bytes
    common: dict[str, Any] = {
        "metric": metric, "knob": result.size_name, "max_ok": result.max_ok,
        "first_oom": result.first_oom, "trials": len(result.trials),
        "seconds": round(result.seconds, 3), "mode": result.mode, "strategy": result.strategy,
        "stopped_because": result.stopped_because, "unit": unit,
        "limit": result.limit["description"] if result.limit else None,
        "capacity_bytes": cap, "peak_at_max_bytes": peak_at_max,
        "capacity_kind": ("unknown" if cap is None else "budget" if cap == result.budget_bytes
                          else "free memory"),
        "utilisation": utilisation(peak_at_max, cap),
        "capped_by": capped_by(result, cap_reason)}
    if failure is not None:
        return SearchRecord(**common, note=f"search failed: {str(failure)[:200]}")
    if result.max_ok is None:
        return SearchRecord(**common, note="nothing fits: even the smallest size ran out of memory")
    safe = result.size_to_use
    peak, source = peak_at(result, safe)
    rate = best.items_per_second if best is not None else None
    note = (f"no OOM up to {result.max_ok}, the largest size tried"
            if result.first_oom is None else "")
    rec = result.recommendation
    margin = ({"fixed_bytes": rec.fixed_bytes, "margin_bytes": rec.margin_bytes,
               "margin_source": rec.margin_source} if rec is not None else {})
    return SearchRecord(**common, safe=safe, peak_at_safe_bytes=peak, peak_source=source,
                        seconds_per_item=1.0 / rate if rate else None, note=note, **margin)


def peak_at(result: Any, size: int | None) -> tuple[int | None, str]:
    """The peak at ``size`` and its source: the largest measured (a trial, or the check of the
    recommended size), else the fitted line's estimate. A confirmed search's answer is its
    fresh children's: their peaks first (a fork's or this process's read other bytes)."""
    rec = result.recommendation
    ran = [t for t in result.trials if t.ok and t.size == size and t.peak_bytes is not None]
    checked = ([rec.checked_peak_bytes] if rec is not None and rec.checked_peak_bytes is not None
               and rec.safe == size else [])  # measured as the answer was: fresh, if confirmed
    fresh = ([t.peak_bytes for t in ran if t.mode == "isolated"] + checked
             if result.mode == "confirmed" else [])
    measured = fresh or [t.peak_bytes for t in ran] + checked
    if measured:
        return max(measured), "measured"
    if result.fit is not None and size is not None:
        return int(result.fit.predict(size)), "estimated from the fitted line"
    return None, "not measured"
