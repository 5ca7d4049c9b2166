"""PNG plots of one search: peak memory (GiB or MiB) against the searched size,
``memory.png``, and measured throughput against it, ``throughput.png``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.util.units import GiB, MiB, fmt_bytes
from oomguard.reports import style
from oomguard.reports.json_report import fastest_note, rate_basis, rates, step_rates, summarise

if TYPE_CHECKING:  # for annotations only: matplotlib is imported when a figure is drawn
    from matplotlib.figure import Figure

_METER = {"cpu": "resident, VmHWM", "cuda": "allocator reserved"}  # what a peak counts
_MODE = {"forked": "forked trials (a copy of this process each)",
         "isolated": "isolated trials (fresh process each)",
         "confirmed": "in-process trials, answer confirmed in fresh processes",
         "in-process": "in-process trials (history-dependent)"}


def plot_memory(result: SearchResult, path: str | os.PathLike[str],
                summary: Mapping[str, Any] | None = None) -> Path:
    """Write :func:`memory_figure` of ``result`` as a PNG to ``path`` (atomically); return it."""
    return style.save(memory_figure(result, summary), Path(path))


def _scale(result: SearchResult) -> tuple[float, list[float]]:
    """The x axis's end, and the bytes the y axis must show (peaks, capacity, guard, fit)."""
    cap, fit = result.capacity_bytes, result.fit
    x_max = max([t.size for t in result.trials] or [1]) * 1.08
    values = [float(t.peak_bytes) for t in result.trials if t.ok and t.peak_bytes is not None]
    values += [float(cap)] if cap else []
    values += [float(result.limit["limit_bytes"])] if result.limit and result.limit["limit_bytes"] else []
    return x_max, values + ([fit.predict(x_max)] if fit else [])


def _limits(ax: Any, result: SearchResult, s: Mapping[str, Any], unit: str, div: int) -> None:
    """The capacity line, the safe line below it (the capacity less the margin's bytes), and
    the tighter limit the recommended size was held under where there is one."""
    cap, rec = result.capacity_bytes, result.recommendation
    if cap:
        name = "capacity (budget)" if s["capacity_kind"] == "budget" else "free memory"
        ax.axhline(cap / div, color="black", lw=1.4, label=f"{name}: {fmt_bytes(cap, unit)}")
    line = s.get("safe_line_bytes")
    keep = fmt_bytes(rec.margin_bytes, unit) if rec is not None else "-"
    if line is not None:
        ax.axhline(line / div, color="tab:green", lw=1.1, ls=":",
                   label=f"safe line: capacity less the {keep} margin = {fmt_bytes(line, unit)}")
    limit = s.get("recommended_limit_bytes")
    if limit is not None and (line is None or limit < line):
        ax.axhline(limit / div, color="tab:olive", lw=1.1, ls=(0, (1, 3)),
                   label=f"recommended size held under: {s['recommended_limit_against']} less "
                         f"the {keep} margin = {fmt_bytes(limit, unit)}")


def _fit_and_peaks(ax: Any, result: SearchResult, x_max: float, div: int) -> None:
    """The fitted line (an estimate) and the measured peaks it was fitted on."""
    fit = result.fit
    ok = [t for t in result.trials if t.ok and t.peak_bytes is not None]
    if fit is not None:
        ax.plot([0.0, x_max], [fit.predict(x) / div for x in (0.0, x_max)], ls="--",
                color="tab:blue", lw=1.2,
                label=f"least-squares fit: {fmt_bytes(fit.per_item_bytes)}/item "
                      f"{'+' if fit.base_bytes >= 0 else '−'} {fmt_bytes(abs(fit.base_bytes))}, "
                      f"R² = {fit.r2:.4f} (estimate)")
    if ok:
        ax.plot([t.size for t in ok], [t.peak_bytes / div for t in ok], "o", color="tab:blue",
                ms=5, label=f"measured peak ({len(ok)} successful trials)", zorder=3)


def _ooms(ax: Any, result: SearchResult, div: int) -> None:
    """OOM trials: their peak is unknown, so drawn at capacity (above the highest peak
    without one)."""
    ooms = [t for t in result.trials if not t.ok and not t.guarded]
    if not ooms:
        return
    top = max([t.peak_bytes for t in result.trials if t.ok and t.peak_bytes is not None],
              default=0)
    cap = result.capacity_bytes
    y, where = ((cap / div, "drawn at capacity") if cap else
                (top / div * 1.05 if top else 1.0, "drawn above the highest peak"))
    ax.plot([t.size for t in ooms], [y] * len(ooms), "x", color="red", ms=9, mew=2,
            label=f"OOM (peak unknown; {where}) ({len(ooms)} trials)", zorder=4)


def _guard(ax: Any, result: SearchResult, unit: str, div: int) -> None:
    """The RAM guard's estimated limit, and the trials it stopped or did not run."""
    guard = result.limit["limit_bytes"] if result.limit else None
    guarded = [t for t in result.trials if t.guarded]
    if guard:
        ax.axhline(guard / div, color="tab:orange", lw=1.1, ls="--",
                   label=f"RAM guard limit: {fmt_bytes(guard, unit)} (estimated, not enforced)")
    if guarded:
        ax.plot([t.size for t in guarded],
                [(t.peak_bytes if t.peak_bytes is not None else guard) / div for t in guarded],
                "x", color="tab:orange", ms=9, mew=2, zorder=4,
                label=f"stopped or not run by the RAM guard ({len(guarded)} trials; at the "
                      "peak measured, or on its limit when not run)")


def _maximum(ax: Any, result: SearchResult) -> None:
    if result.max_ok is not None:
        ax.axvline(result.max_ok, color="tab:red", lw=1.0, ls="-.",
                   label=f"measured maximum: {result.max_ok}")


def _safe(ax: Any, result: SearchResult) -> None:
    if result.recommendation is not None:
        ax.axvline(result.recommendation.safe, color="tab:green", lw=1.0, ls="-.",
                   label=f"recommended size (use this): {result.recommendation.safe}")


def memory_figure(result: SearchResult, summary: Mapping[str, Any] | None = None) -> Figure:
    """Peak memory (bytes, measured) against the searched size, with the fitted line (an
    estimate), the capacity and safe lines, OOM trials, the RAM guard's limit, the maximum
    and the recommended size. ``summary``: :func:`summarise` of ``result`` unless given."""
    s = summary if summary is not None else summarise(result)
    x_max, values = _scale(result)
    top = max((abs(v) for v in values), default=0.0)
    unit, div = ("GiB", GiB) if top >= GiB else ("MiB", MiB)
    fig, ax = style.figure((9, 6.4))  # taller than the default: the legend goes below
    _limits(ax, result, s, unit, div)
    _fit_and_peaks(ax, result, x_max, div)
    _ooms(ax, result, div)
    _guard(ax, result, unit, div)
    _maximum(ax, result)
    if result.recommendation is not None and result.recommendation.safe != result.max_ok:
        _safe(ax, result)
    meter = _METER.get(result.device.split(":", 1)[0], "measured")
    y_top = max(values, default=div) / div
    ax.set(xlabel=f"{s['size_label']} (items)",
           ylabel=f"peak memory above trial start ({unit}, {meter})",
           title=f"{result.workload}: peak memory vs {s['size_label']}\n{result.device} · "
                 f"{_MODE.get(result.mode, _MODE['in-process'])} · strategy {result.strategy}",
           xlim=(0, x_max), ylim=(0, y_top * 1.12 if y_top > 0 else 1.0))
    # Below the axes, so it never hides the capacity line or the points.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    return fig


def _spreads(ax: Any, result: SearchResult) -> None:
    """Each size's lowest to highest per-step rate, where a trial timed two steps or more."""
    bars = [(t.size, min(r), max(r)) for t in result.trials if t.ok and len(r := step_rates(t)) >= 2]
    if bars:
        ax.vlines([b[0] for b in bars], [b[1] for b in bars], [b[2] for b in bars],
                  color="tab:blue", lw=3, alpha=0.35,
                  label="step-to-step range of a size's rate (measured)")


def throughput_figure(result: SearchResult, summary: Mapping[str, Any] | None = None
                      ) -> Figure | None:
    """Measured items per second against size (None when no trial measured a rate), with
    each size's step-to-step range, the recommended size and the maximum marked, and a star
    on :func:`~oomguard.reports.json_report.fastest_safe_size` where there is one.
    ``summary`` as for :func:`memory_figure`."""
    measured = rates(result)
    if not measured:
        return None
    s = summary if summary is not None else summarise(result)
    fig, ax = style.figure()
    sizes = sorted(measured)
    ax.plot(sizes, [measured[n] for n in sizes], "o-", color="tab:blue", ms=5, lw=1.2,
            label=f"measured ({len(sizes)} sizes that fitted; {rate_basis(result)})")
    _spreads(ax, result)
    fastest = s["fastest_safe_size"]
    note = fastest_note(result, fastest, s.get("rate_spread"))
    if fastest is not None:
        ax.plot([fastest], [measured[fastest]], "*", color="tab:orange", ms=14, zorder=4,
                label=f"fastest: {note}")
    else:
        ax.plot([], [], " ", label=f"no size named fastest: {note}")
    _safe(ax, result)
    _maximum(ax, result)
    label = s["size_label"]
    top = max([measured[n] for n in sizes] + [b for t in result.trials for b in step_rates(t)])
    ax.set(xlabel=f"{label} (items)", ylabel="items per second (measured)",
           title=f"{result.workload}: throughput vs {label}\n{result.device} · {result.mode}",
           xlim=(0, max(sizes) * 1.08), ylim=(0, top * 1.15))
    # Below the axes, so it never hides a point (the figure keeps its size; the axes shrink).
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    return fig


def plot_throughput(result: SearchResult, path: str | os.PathLike[str],
                    summary: Mapping[str, Any] | None = None) -> Path | None:
    """Write :func:`throughput_figure` as a PNG to ``path``; None when there is none."""
    fig = throughput_figure(result, summary)
    return style.save(fig, Path(path)) if fig is not None else None
