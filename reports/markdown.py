"""Markdown report of a size search (a batch size or a metric's knob), in the shape of the
E10 report.

``render_markdown(result, context)`` turns a :class:`oomguard.engine.core.search.search.SearchResult`
into the sections of the E10 Maximum Batch Size Report: Configuration, Data,
Search Strategy, Results (performance metrics and the trial table), Memory
Scaling Analysis, Recommendations, Key Observations and a Conclusion. Every
number comes from the result; the prose around it is generated from the trial
sequence, never hard-coded. Byte counts are printed in binary units (KiB, MiB,
GiB) with :func:`oomguard.engine.util.units.fmt_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.util.units import fmt_bytes
from oomguard.reports.json_report import (
    PEAK_MEANING,
    cap_advice,
    capacity_label,
    capped_by,
    device_type,
    non_monotonic,
    peak_at_max,
    scaling_verdict,
    size_heading,
    size_label,
    status_text,
    strategy_steps,
    utilisation,
)
from oomguard.reports.throughput import speed_and_verification

_KNOWN_CONTEXT = {"model", "parameters", "architecture", "device_name", "dtype", "data", "title",
                  "workload_spec"}  # the last is for `oomguard verify`, not for readers


def fmt_value(value: Any) -> str:
    """A workload's return value for a table cell: floats to 4 decimals, None to ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        inner = ", ".join(fmt_value(v) for v in value[:4])
        return f"[{inner}{', ...' if len(value) > 4 else ''}]"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 40 else text[:37] + "..."


def _pct(frac: float | None) -> str:
    return "-" if frac is None else f"{frac * 100:.1f}%"


def _params(n: Any) -> str:
    if isinstance(n, int) and not isinstance(n, bool):
        for div, suf in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
            if n >= div:
                return f"{n:,} (~{n / div:.3g}{suf})"
        return f"{n:,}"
    return str(n)


def _label(key: str) -> str:
    return key.replace("_", " ").strip().capitalize()


def _nested(value: Any, indent: str = "  ") -> list[str]:
    if isinstance(value, Mapping):
        return [f"{indent}- {_label(str(k))}: {v}" for k, v in value.items()]
    return []


# ---------------------------------------------------------------- sections
def _configuration(result: SearchResult, ctx: Mapping[str, Any]) -> list[str]:
    out = ["## Configuration", f"- **Workload**: {result.workload}"]
    if "model" in ctx:
        out.append(f"- **Model**: {ctx['model']}")
    if "parameters" in ctx:
        out.append(f"- **Parameters**: {_params(ctx['parameters'])}")
    if isinstance(ctx.get("architecture"), Mapping):
        out.append("- **Architecture**:")
        out.extend(_nested(ctx["architecture"]))
    if "dtype" in ctx:
        out.append(f"- **Dtype**: {ctx['dtype']}")
    for key, value in ctx.items():
        if key in _KNOWN_CONTEXT:
            continue
        if isinstance(value, Mapping):
            out.append(f"- **{_label(key)}**:")
            out.extend(_nested(value))
        else:
            out.append(f"- **{_label(key)}**: {value}")
    dev = result.device
    if ctx.get("device_name"):
        dev = f"{ctx['device_name']} ({result.device})"
    out.append(f"- **Device**: {dev}")
    if result.budget_bytes is not None:
        how = {"cpu": "RLIMIT_DATA above the process's data size at the start",
               "cuda": "torch.cuda.set_per_process_memory_fraction"}.get(device_type(result), "")
        out.append(f"- **Memory budget**: {fmt_bytes(result.budget_bytes)}"
                   + (f" (enforced with {how}; OOMs are real allocator errors)" if how else ""))
    elif result.limit:
        out.append(f"- **Memory budget**: none; trials ran under a {result.limit['description']}: "
                   "a watchdog stopped a trial past it, and sizes predicted past it did not run. "
                   "The limit is estimated from the RAM available, not enforced by the OS")
    else:
        out.append("- **Memory budget**: none (the device's own limit)")
    label = capacity_label(result)
    if result.capacity_bytes is None:
        out.append("- **Capacity**: unknown (no budget and free memory could not be probed; "
                   "utilisation figures are omitted)")
    elif label == "budget":
        out.append(f"- **Capacity**: {fmt_bytes(result.capacity_bytes)} (the budget)")
    else:
        out.append(f"- **Capacity**: {fmt_bytes(result.capacity_bytes)} (free memory probed "
                   "before the search: an estimate of headroom, not a limit)")
    if result.mode == "isolated":
        mode = ("isolated: each trial ran in a fresh child process, so no trial inherits another's "
                "caches or heap fragments; this is the faithful maximum")
    elif result.mode == "confirmed":
        mode = ("confirmed: the search ran in-process, then the answer and the size above it "
                "ran again in fresh child processes, and the search went on there where they "
                "disagreed; the answer is the faithful maximum")
    else:
        mode = ("in-process: all trials ran in one process one after another; later trials "
                "inherit caches and heap fragments, so the result is history-dependent: lower "
                "than a fresh process's maximum when leftovers take room, higher under a CPU "
                "budget when free heap chunks are reused without counting (rerun isolated for "
                "the faithful figure)")
    out.append(f"- **Mode**: {mode}")
    cfg = result.config
    if cfg:
        out.append("- **Search settings**: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    return out


def _data(ctx: Mapping[str, Any]) -> list[str]:
    data = ctx.get("data")
    if not isinstance(data, Mapping) or not data:
        return []
    return ["## Data Configuration", *(f"- **{_label(str(k))}**: {v}" for k, v in data.items())]


def _results(result: SearchResult, ctx: Mapping[str, Any]) -> list[str]:
    best = peak_at_max(result)
    cap = result.capacity_bytes
    peak = best.peak_bytes if best else None
    util = utilisation(peak, cap)
    margin_left = cap - peak if cap is not None and peak is not None else None
    shown = "-" if result.max_ok is None else str(result.max_ok)
    suffix = ("" if result.first_oom is not None or result.max_ok is None
              else " (no OOM seen: the largest useful size, every sample at once)"
              if capped_by(result, ctx) == "samples" else " (no OOM seen: a lower bound)")
    of_cap = f" (of {fmt_bytes(cap)} {capacity_label(result)})" if cap else " (capacity unknown)"
    out = [
        "## Results", "", f"### Maximum {size_heading(result)}: **{shown}**{suffix}", "",
        "### Performance Metrics", "| Metric | Value |", "|--------|-------|",
        f"| Peak Memory at maximum | {fmt_bytes(peak)} |",
        f"| Memory Utilization | {_pct(util)}{of_cap if util is not None else ''} |",
        f"| Margin left | {fmt_bytes(margin_left)}"
        + (f" ({margin_left:,} bytes)" if margin_left is not None else "") + " |",
        f"| Seconds (trial at maximum) | {best.seconds:.3f} |" if best else "| Seconds (trial at maximum) | - |",
        f"| Value returned at maximum | {fmt_value(best.value) if best else '-'} |",
        f"| Search wall time | {result.seconds:.2f} s |",
        "", "### Search Details",
        f"| {size_heading(result)} | Status | Peak Memory | Seconds | Value |",
        "|-----------|--------|-------------|---------|-------|",
    ]
    for t in result.trials:
        out.append(f"| {t.size} | {status_text(t)} | {fmt_bytes(t.peak_bytes)} | "
                   f"{t.seconds:.3f} | {fmt_value(t.value)} |")
    if any(not t.ok and not t.guarded for t in result.trials):
        out.append("")
        out.append("An OOM trial's peak is unknown (the allocation that failed never happened); "
                   "its row shows `-`.")
    if any(t.guarded for t in result.trials):
        out.append("")
        out.append("A RAM guard row is the guard's verdict against its estimated limit, not an "
                   "allocation that failed: its peak is what was measured until the trial was "
                   "stopped, or `-` for a size that did not run because its predicted peak was "
                   "over the limit.")
    return out


def _no_growth(result: SearchResult) -> str:
    """The honest sentence for a fit that does not rise: memory is not what ``size`` costs."""
    fit = result.fit
    assert fit is not None
    label = size_label(result)
    sizes = sorted({t.size for t in result.trials if t.ok and t.peak_bytes is not None})
    how = ("" if fit.per_item_bytes <= 0 else ": no more than the scatter of the measurements")
    if result.first_oom is not None:
        why = (f"yet {label} {result.first_oom} ran out of memory, so the limit is elsewhere "
               "(memory the peak does not count, or a cost that jumps rather than grows): "
               "trust the sizes that ran, not the line")
    else:
        why = (f"the limit is elsewhere and every size tried fits, so choose {label} for speed, "
               "not memory")
    return (f"- **No memory growth**: peak memory did not grow with {label} over the sizes "
            f"tried ({sizes[0]} to {sizes[-1]}; fitted slope {fit.per_item_bytes:,.0f} bytes "
            f"per +1 of {label}{how}); {why}.")


def _scaling(result: SearchResult) -> list[str]:
    out = ["## Memory Scaling Analysis"]
    meaning = PEAK_MEANING.get(device_type(result), "the device's peak bytes over the trial")
    fit = result.fit
    label = size_label(result)
    verdict = scaling_verdict(result)
    if fit is None:
        out.append("- **No fit**: fewer than two distinct sizes ran with a measured peak, so no "
                   "scaling line could be fitted.")
    elif verdict == "flat":
        out += [_no_growth(result),
                f"- **Fit**: peak ≈ {fmt_bytes(fit.base_bytes)} + {fit.per_item_bytes:,.0f} "
                f"bytes × {result.size_name}, a least-squares line over the {fit.points} "
                "measured peaks of successful trials; it does not rise, so it says nothing "
                "about sizes beyond those tried."]
    else:
        step = result.config.get("step")
        lin = ("untested (only two points; R² is 1 by construction)" if verdict == "untested"
               else verdict)
        if isinstance(step, int) and step > 0:
            out.append(f"- **Linear scaling {lin}** (R² = {fit.r2:.4f}): each +{step} {label} "
                       f"increment adds ~{fmt_bytes(fit.per_item_bytes * step)} peak memory")
        else:
            out.append(f"- **Linear scaling {lin}** (R² = {fit.r2:.4f})")
        out += [
            f"- **Starting overhead** (intercept at size 0): ~{fmt_bytes(fit.base_bytes)}",
            f"- **Per-item cost**: ~{fmt_bytes(fit.per_item_bytes)} per +1 of {label} "
            f"({fit.per_item_bytes:,.0f} bytes)",
            f"- **Fit**: peak ≈ {fmt_bytes(fit.base_bytes)} + {fmt_bytes(fit.per_item_bytes)} × "
            f"{result.size_name}, a least-squares line over the {fit.points} measured peaks of successful "
            "trials; sizes and peaks it predicts are estimates, not measurements.",
        ]
        if result.capacity_bytes:
            pred = fit.largest_size_within(result.capacity_bytes)
            out.append(f"- **Fitted size at capacity** (estimate): {pred} "
                       f"(measured maximum: {result.max_ok})")
            # Only an OOM shows that the line over-predicts; without one the search was capped.
            if pred is not None and result.first_oom is not None and pred >= result.first_oom:
                out.append("  - The line predicts more than ran: memory the peak does not count "
                           "(allocator rounding and fragmentation, thread stacks, caches) uses "
                           "the difference. Trust the measured maximum.")
    out.append(f"- **What the peak measures**: {meaning}. It counts bytes above the state at the "
               "start of each trial, not the model and data loaded before it.")
    return out


def _recommendations(result: SearchResult) -> list[str]:
    rec = result.recommendation
    if rec is None:
        return ["## Recommendations", "- No recommendation: no size fitted."]
    cap, fit = result.capacity_bytes, result.fit
    by_size = {t.size: t.peak_bytes for t in result.trials if t.ok and t.peak_bytes is not None}

    def est(size: int) -> str:
        measured = by_size.get(size)
        peak = measured if measured is not None else fit.predict(size) if fit else None
        if peak is None:
            return "peak unknown"
        kind = "measured" if measured is not None else "estimated"
        util = utilisation(peak, cap)
        return f"{kind} {fmt_bytes(peak)}" + (f", {_pct(util)} utilization" if util is not None else "")

    best = by_size.get(rec.maximum)
    left = cap - best if cap is not None and best is not None else None
    util = utilisation(best, cap)
    if util is None:
        risk = "Margin unknown (no capacity or no measured peak)"
    elif util >= 0.9:
        risk = f"Very tight memory margin ({fmt_bytes(left)} buffer)"
    elif util >= 0.8:
        risk = f"Tight memory margin ({fmt_bytes(left)} buffer)"
    else:
        risk = f"Moderate memory margin ({fmt_bytes(left)} buffer)"
    if result.mode == "in-process":
        risk += "; found in-process, so a fresh process may fit more, a fragmented one less"
    lo_hi = (f"{rec.conservative}-{rec.safe}" if rec.conservative != rec.safe else str(rec.safe))
    return [
        "## Recommendations", "", "### Safe Production Settings",
        f"For production with a {rec.margin:.0%} safety margin of capacity "
        f"({rec.margin_source or 'fixed'}):",
        f"- **Recommended {size_label(result)}**: {rec.safe} ({est(rec.safe)}); basis: {rec.basis}",
        f"- **Recommended range**: {lo_hi}",
        f"- **Conservative {size_label(result)}**: {rec.conservative} ({est(rec.conservative)}; "
        + ("the largest size that ran whose measured peak is within the margin)" if cap
           else "the largest size that ran at or below the recommended size)"),
        "", "### Maximum Throughput Setting",
        f"- **Absolute maximum**: {rec.maximum} ({est(rec.maximum)})",
        f"- **Risk**: {risk}",
        f"- **Margin left at maximum**: {fmt_bytes(left)}"
        + (f" ({left:,} bytes)" if left is not None else ""),
        "- **Suitable for**: benchmarking, time-limited runs",
    ] + speed_and_verification(result)


def _scaling_observation(result: SearchResult) -> str:
    fit, verdict = result.fit, scaling_verdict(result)
    if fit is None:
        return "**Scaling unknown**: too few measured sizes for a fit."
    if verdict == "flat":
        return (f"**No memory growth with {size_label(result)}**: the measured peaks do not "
                "rise with the size, so the fitted line predicts nothing beyond the sizes tried.")
    if verdict == "untested":
        return ("**Scaling barely measured**: the line goes through two points, so its R² "
                "says nothing; treat fitted estimates as rough.")
    if verdict == "confirmed":
        return (f"**Linear memory scaling**: R² = {fit.r2:.4f} over {fit.points} points; "
                f"memory grows predictably with {size_label(result)}.")
    if verdict == "approximate":
        return f"**Roughly linear scaling**: R² = {fit.r2:.4f}; fitted estimates are rough."
    return (f"**Non-linear or noisy scaling**: R² = {fit.r2:.4f}; do not trust the fitted "
            "estimates, rely on measured sizes only.")


def _observations(result: SearchResult, ctx: Mapping[str, Any]) -> list[str]:
    obs: list[str] = [_scaling_observation(result)]
    fit = result.fit
    n_ok = sum(t.ok for t in result.trials)
    n = len(result.trials)
    trial_s = sum(t.seconds for t in result.trials)
    obs.append(f"**Search cost**: {n} trials ({n_ok} fitted, {n - n_ok} ran out of memory), "
               f"{trial_s:.2f} s in trials, {result.seconds:.2f} s of search wall time.")
    obs.append(f"**Stopped because**: {result.stopped_because}.")
    advice = cap_advice(result, ctx)
    if advice:
        obs.append(advice)
    bad = non_monotonic(result)
    if bad:
        sizes = ", ".join(str(t.size) for t in bad)
        obs.append(f"**Non-monotonic outcomes**: size(s) {sizes} ran out of memory although "
                   f"{result.max_ok} fitted; memory use depends on history or is noisy here, "
                   "so keep a wider margin.")
    if result.mode == "in-process":
        obs.append("**Mode caveat**: trials ran in-process; the maximum can differ from a fresh "
                   "process's (lower: caches, heap fragments; higher under a CPU budget: reused "
                   "free heap). Rerun with isolation for the faithful figure.")
    elif result.mode == "confirmed":
        obs.append("**Mode**: the answer was confirmed in fresh processes (it fits there and the "
                   "size above it does not), so it does not depend on the order of the trials.")
    else:
        obs.append("**Mode**: each trial ran in a fresh process; the maximum does not depend on "
                   "the order of the trials.")
    if fit is not None and fit.base_bytes < 0:
        obs.append("**Negative intercept**: the fitted overhead is below zero, so the line is "
                   "only meaningful within the measured range.")
    return [f"{i}. {o}" for i, o in enumerate(obs, 1)]


def _conclusion(result: SearchResult, ctx: Mapping[str, Any]) -> list[str]:
    if result.max_ok is None:
        return ["## Conclusion", f"**{result.workload}: no {size_label(result)} fitted.**"]
    best = peak_at_max(result)
    util = utilisation(best.peak_bytes if best else None, result.capacity_bytes)
    where = ctx.get("device_name") or result.device
    tail = f", utilizing {_pct(util)} of {capacity_label(result)}" if util is not None else ""
    bound = "at least " if result.first_oom is None else ""
    return ["## Conclusion",
            f"**{result.workload} runs on {where} at {size_label(result)} {bound}{result.max_ok} "
            f"({result.mode}){tail}.**"]


def render_markdown(result: SearchResult, context: dict | None = None) -> str:
    """Render ``result`` as a Markdown report in the E10 report's shape.

    ``context`` describes what was measured: ``model`` (str), ``parameters``
    (int), ``architecture`` (dict), ``device_name``, ``dtype``, ``data``
    (dict), ``title``; any other key is listed under Configuration. Byte
    figures are shown in KiB/MiB/GiB; seconds are wall-clock seconds.
    """
    ctx: Mapping[str, Any] = context or {}
    title = ctx.get("title") or f"{result.workload} Maximum {size_heading(result)} Report"
    parts: list[list[str]] = [
        [f"# {title}"],
        _configuration(result, ctx),
        _data(ctx),
        ["## Search Strategy", f"Strategy `{result.strategy}`: {result.strategy_description}", "",
         *(f"{i}. {s}" for i, s in enumerate(strategy_steps(result), 1))],
        _results(result, ctx),
        _scaling(result),
        _recommendations(result),
        ["## Key Observations", "", *_observations(result, ctx)],
        _conclusion(result, ctx),
    ]
    return "\n\n".join("\n".join(p) for p in parts if p) + "\n"
