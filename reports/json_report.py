"""Machine-readable report of a size search, and the figures every report shares.

``render_json(result, context)`` returns a dict that ``json.dumps`` accepts
without a custom encoder (it has been through the one JSON sanitiser,
:func:`~oomguard.engine.util.jsonable.to_jsonable`): every trial, the fit, the recommendation, the
context the caller gave, derived figures (peak at the maximum, utilisation,
margin left), the oomguard version and a UTC ISO-8601 timestamp. Bytes are
ints of bytes, seconds are floats of wall-clock seconds, fractions are in
[0, 1] (not percent).

The derived figures (peak at the maximum, utilisation, what the capacity is,
the search steps in prose) live here so that the Markdown report and the plot
state the same numbers as the JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.core.search.strategies import bracket, predict_max
from oomguard.engine.core.search.trial import Trial
from oomguard.engine.util.jsonable import to_jsonable
from oomguard.engine.util.units import fmt_bytes
from oomguard.metrics.workload import SAMPLE_KNOBS
from oomguard.reports.throughput import fastest_safe_size

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


# ---------------------------------------------------------------- shared figures
def peak_at_max(result: SearchResult) -> Trial | None:
    """The successful trial at ``max_ok`` with a measured peak (the last one if it ran twice)."""
    hits = [t for t in result.trials if t.ok and t.size == result.max_ok]
    return hits[-1] if hits else None


def utilisation(peak: float | None, capacity: int | None) -> float | None:
    """``peak / capacity`` as a fraction, None if either is unknown."""
    if peak is None or not capacity:
        return None
    return peak / capacity


def device_type(result: SearchResult) -> str:
    """``"cpu"``, ``"cuda"`` or ``"mps"`` from the result's device string."""
    return result.device.split(":", 1)[0]


def capacity_label(result: SearchResult) -> str:
    """What ``capacity_bytes`` stands for: the budget, or the free memory probed."""
    if result.capacity_bytes is None:
        return "unknown"
    if result.budget_bytes is not None and result.capacity_bytes == result.budget_bytes:
        return "budget"
    return "free memory"


def non_monotonic(result: SearchResult) -> list[Trial]:
    """OOM trials at sizes below the largest size that ran."""
    if result.max_ok is None:
        return []
    return [t for t in result.trials if not t.ok and t.size < result.max_ok]


def size_label(result: SearchResult) -> str:
    """The searched size's name for prose: ``batch size`` for a batch, otherwise the
    knob's own name as the user passes it (``chunk_size``, ``internal_batch_size``)."""
    return "batch size" if result.size_name == "batch_size" else result.size_name


def size_heading(result: SearchResult) -> str:
    """:func:`size_label` for titles: ``Batch Size``, or the knob's name unchanged."""
    return "Batch Size" if result.size_name == "batch_size" else result.size_name


def _samples(context: Mapping[str, Any] | None) -> int | None:
    # `oomguard search` passes "samples"; MetricTrial.describe() says "n_samples".
    ctx = context or {}
    n = ctx.get("samples", ctx.get("n_samples"))
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def capped_by(result: SearchResult, context: Mapping[str, Any] | None = None) -> str | None:
    """What ended a search before it closed its bracket, or None if it closed
    (an OOM right above the maximum) or nothing fitted.

    ``"samples"``: it stopped at ``max_size`` equal to the number of samples
    (``context["samples"]`` or ``["n_samples"]``) of a knob that slices the
    samples, where larger sizes mean the same thing. ``"max_size"``,
    ``"max_trials"``, ``"max_seconds"``: the search option of that name.
    ``"strategy"``: the strategy stopped proposing sizes without seeing an OOM.
    """
    if result.max_ok is None:
        return None
    if result.first_oom is not None and result.first_oom - result.max_ok <= 1:
        return None
    stopped = result.stopped_because
    for option in ("max_size", "max_trials", "max_seconds"):
        if stopped.startswith(f"{option} ("):  # the prefix search() writes
            break
    else:
        return "strategy" if result.first_oom is None else None
    if (option == "max_size" and result.size_name in SAMPLE_KNOBS
            and _samples(context) == result.config.get("max_size")):
        return "samples"
    return option


def cap_advice(result: SearchResult, ctx: Mapping[str, Any]) -> str | None:
    """What capped a search that did not close its bracket, and which option to change
    (a Markdown sentence; None if nothing did)."""
    cause = capped_by(result, ctx)
    label, cfg, top = size_label(result), result.config, result.max_ok
    lower = "so the reported maximum is a lower bound"
    not_max_size = f"max_size ({cfg.get('max_size')}) was not reached"
    if cause is None:
        return None
    if cause == "samples":
        return (f"**Every useful {label} fits**: the search stopped at {label} {top}, the number "
                f"of samples (--samples {cfg.get('max_size')}); {label} slices the samples, so a "
                f"larger value runs them all at once just the same. No OOM was seen, so {top} is "
                f"the largest useful {label} for this data and raising max_size changes nothing; "
                "with more samples (--samples) it can go higher.")
    if cause == "max_size":
        return (f"**No OOM seen**: the search stopped at max_size ({cfg.get('max_size')}), "
                f"{lower}; raise max_size (--max-size) to find the real limit.")
    if cause in ("max_trials", "max_seconds"):
        spent = (f"all {cfg.get('max_trials')} trials (max_trials)" if cause == "max_trials"
                 else f"its time (max_seconds = {cfg.get('max_seconds')})")
        option = ("raise max_trials (--max-trials)" if cause == "max_trials"
                  else "raise max_seconds")
        if result.first_oom is not None:
            return (f"**Bracket left open**: the search used {spent} before closing in; the "
                    f"limit lies between {top} (fits) and {result.first_oom} (OOM); {option} "
                    "to narrow it.")
        return (f"**No OOM seen**: the search used {spent} before any size ran out of memory, "
                f"{lower}; {option}, start larger (--start) or grow faster (--strategy "
                f"doubling); {not_max_size}.")
    return (f"**No OOM seen**: the strategy stopped proposing sizes ({result.stopped_because}) "
            f"before any size ran out of memory, {lower}; {not_max_size}.")


def scaling_verdict(result: SearchResult) -> str | None:
    """How measured peak memory scaled with the size, judged from the fit.

    None: no fit. ``"flat"``: it did not grow (a zero or negative slope, or a
    positive one no larger than the scatter of the points: t-statistic of the
    slope below 2). ``"untested"``: a rising line through two points (R² is 1 by
    construction). Otherwise by R²: ``"confirmed"`` (>= 0.99), ``"approximate"``
    (>= 0.9), ``"not supported"``.
    """
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


def status_text(t: Trial) -> str:
    return "✓ SUCCESS" if t.ok else "✗ RAM guard (estimated limit)" if t.guarded else "✗ OOM"


def _mark(t: Trial) -> str:
    return f"{t.size} {'✓' if t.ok else '✗ RAM guard' if t.guarded else '✗ OOM'}"


# ---------------------------------------------------------------- search strategy
def _kind(move_lo: int | None, move_hi: int | None) -> str:
    if move_lo is None:
        return "halve"
    if move_hi is None:
        return "expand"
    return "refine"


def _growth(sizes: Sequence[int]) -> str:
    diffs = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
    if diffs and len(set(diffs)) == 1:
        return f"+{diffs[0]} increments"
    if diffs and all(a > 0 and b % a == 0 for a, b in zip(sizes, sizes[1:], strict=False)):
        ratios = {b // a for a, b in zip(sizes, sizes[1:], strict=False)}
        if len(ratios) == 1:
            return f"x{ratios.pop()} steps"
    return "jumps (" + " → ".join(str(s) for s in sizes) + ")"


def _guided_steps(result: SearchResult) -> list[str]:
    """Why the guided strategy tried each size: the prediction it had, in the limit's units."""
    name, steps = result.size_name, []
    for i, t in enumerate(result.trials):
        if i == 0:
            steps.append(f"Started with {name}={t.size} ({status_text(t)})")
            continue
        seen = result.trials[:i]
        lo, hi = bracket(seen)
        guess = predict_max(seen)
        if guess is not None and t.size == guess:
            why = (f"the largest size predicted to fit {fmt_bytes(t.headroom_bytes)} of "
                   f"headroom (peaks measured as {t.limit_units or 'the trial peak'})")
        elif lo is not None and t.size == lo + 1:
            why = f"the size above {lo}, which ran: closes the bracket if it runs out"
        elif hi is not None and t.size == hi - 1:
            why = f"the size below {hi}, which was predicted to fit and did not"
        else:
            why = "doubling or bisection (the predictions were not reliable)"
        steps.append(f"Tried {name}={t.size}, {why} ({status_text(t)})")
    return steps


def strategy_steps(result: SearchResult) -> list[str]:
    """Numbered-list items describing the search as it actually ran, from the trials."""
    trials = result.trials
    if not trials:
        return [f"No trial ran ({result.stopped_because})."]
    first = trials[0]
    name = result.size_name
    if result.strategy == "guided":
        return _guided_steps(result) + _ending(result)
    steps = [f"Started with {name}={first.size} ({status_text(first)})"]
    groups: list[tuple[str, int | None, int | None, list[Trial]]] = []
    seen: list[Trial] = [first]
    for t in trials[1:]:
        lo, hi = bracket(seen)
        kind = _kind(lo, hi)
        if groups and groups[-1][0] == kind:
            groups[-1][3].append(t)
        else:
            groups.append((kind, lo, hi, [t]))
        seen.append(t)
    for kind, lo, hi, group in groups:
        if kind == "expand":
            oks = [t.size for t in group if t.ok]
            base = lo if lo is not None else first.size
            if oks:
                steps.append(f"Expanded in {_growth([base, *oks])} while successful "
                             f"({base} → {oks[-1]}, {len(oks)} more successful trials)")
            failed = [t for t in group if not t.ok]
            if failed:
                steps.append(f"When OOM encountered at {name}={failed[0].size}, switched to "
                             "binary search refinement")
        elif kind == "halve":
            steps.append(f"{name}={hi} ran out of memory; halved: "
                         + ", ".join(_mark(t) for t in group))
        else:
            steps.append(f"Bisected between {lo} (fits) and {hi} (OOM): "
                         + ", ".join(_mark(t) for t in group))
    return steps + _ending(result)


def _ending(result: SearchResult) -> list[str]:
    name, steps = result.size_name, []
    if result.max_ok is None:
        steps.append("No size fitted")
    elif result.first_oom is not None and result.first_oom - result.max_ok <= 1:
        steps.append(f"Final refinement found maximum at {name}={result.max_ok} "
                     f"({name}={result.first_oom} ran out of memory)")
    elif result.first_oom is not None:
        steps.append(f"Stopped ({result.stopped_because}) with the maximum between "
                     f"{result.max_ok} (fits) and {result.first_oom} (OOM); largest size that "
                     f"ran: {name}={result.max_ok}")
    else:
        steps.append(f"No OOM seen; stopped because {result.stopped_because}: the maximum is at "
                     f"least {name}={result.max_ok}")
    return steps


def oomguard_version() -> str:
    """The installed oomguard version, or ``"unknown"``."""
    try:
        return version("oomguard")
    except PackageNotFoundError:
        return "unknown"


def render_json(result: SearchResult, context: dict | None = None) -> dict[str, Any]:
    """Every figure of ``result`` (and ``context``) as a JSON-serialisable dict.

    Keys: ``schema``, ``oomguard_version``, ``generated_at`` (UTC ISO 8601),
    ``context``, ``result`` (:meth:`SearchResult.to_dict`: all trials, fit,
    recommendation, capacity, budget, config) and ``summary`` (derived:
    ``peak_bytes_at_max``, ``utilisation`` as a fraction, ``margin_left_bytes``,
    counts, ``capped_by`` (:func:`capped_by`), ``memory_scaling``
    (:func:`scaling_verdict`), the search steps as prose).
    """
    best = peak_at_max(result)
    peak = best.peak_bytes if best else None
    cap = result.capacity_bytes
    n_ok = sum(t.ok for t in result.trials)
    fit = result.fit
    summary: dict[str, Any] = {
        "max_ok": result.max_ok,
        "first_oom": result.first_oom,
        "max_is_lower_bound": result.first_oom is None,
        "peak_bytes_at_max": peak,
        "seconds_at_max": best.seconds if best else None,
        "value_at_max": best.value if best else None,
        "capacity_kind": capacity_label(result),
        "utilisation": utilisation(peak, cap),
        "margin_left_bytes": cap - peak if cap is not None and peak is not None else None,
        "trials": len(result.trials),
        "trials_ok": n_ok,
        "trials_oom": len(result.trials) - n_ok,
        "trial_seconds": sum(t.seconds for t in result.trials),
        "non_monotonic_oom_sizes": [t.size for t in non_monotonic(result)],
        "size_label": size_label(result),
        "capped_by": capped_by(result, context),
        "memory_scaling": scaling_verdict(result),
        "fitted_size_at_capacity": (fit.largest_size_within(cap)
                                    if fit is not None and cap else None),
        "peak_measures": PEAK_MEANING.get(device_type(result), "unknown"),
        "fit_is_estimate": True,
        "fastest_safe_size": fastest_safe_size(result),
        "mode_note": {
            "in-process": "in-process: history-dependent, can differ from a fresh process's maximum",
            "confirmed": ("confirmed: searched in-process, the answer and the size above it re-run "
                          "in fresh processes; the faithful maximum"),
        }.get(result.mode, "isolated: each trial in a fresh process, the faithful maximum"),
        "search_steps": strategy_steps(result),
    }
    doc = {
        "schema": SCHEMA,
        "oomguard_version": oomguard_version(),
        # timezone.utc, not datetime.UTC: setup.cfg still admits Python 3.10.
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "context": context or {},
        "result": result.to_dict(),
        "summary": summary,
    }
    return to_jsonable(doc)
