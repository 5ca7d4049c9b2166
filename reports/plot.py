"""PNG plots of one search: peak memory against the searched size (batch size or a knob),
``memory.png``, and measured throughput against it, ``throughput.png``.

Drawn in the one plot style (:mod:`oomguard.reports.style`: a standalone
``Figure`` on an Agg canvas, no pyplot) and written atomically. Memory is
shown in GiB, or MiB when everything is under 1 GiB.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.util.units import GiB, MiB, fmt_bytes
from oomguard.reports import style
from oomguard.reports.json_report import capacity_label, size_label
from oomguard.reports.throughput import fastest_safe_size, rate_basis, rates

if TYPE_CHECKING:  # for annotations only: matplotlib is imported when a figure is drawn
    from matplotlib.figure import Figure

_OOM_NOTE = "OOM (peak unknown; drawn at capacity)"


def _unit(values: list[float]) -> tuple[str, int]:
    top = max((abs(v) for v in values), default=0.0)
    return ("GiB", GiB) if top >= GiB else ("MiB", MiB)


def plot_memory(result: SearchResult, path: str | os.PathLike[str]) -> Path:
    """Write :func:`memory_figure` of ``result`` as a PNG to ``path`` (atomically); return it."""
    return style.save(memory_figure(result), Path(path))


def memory_figure(result: SearchResult) -> Figure:
    """Peak memory (GiB or MiB) against the searched size, named as the report names it.

    Shows the successful trials' measured peaks (points), the least-squares fit
    (dashed; per-item cost and R² in the legend), the capacity line and the
    safe-margin line at ``capacity x (1 - margin)``, OOM trials as red crosses
    on the capacity line (their peak is unknown), and vertical markers at the
    measured maximum and the recommended safe size.
    """
    ok = [t for t in result.trials if t.ok and t.peak_bytes is not None]
    ooms = [t for t in result.trials if not t.ok and not t.guarded]
    guarded = [t for t in result.trials if t.guarded]
    guard_limit = result.limit["limit_bytes"] if result.limit else None
    cap = result.capacity_bytes
    rec = result.recommendation
    fit = result.fit
    margin = rec.margin if rec else result.config.get("margin")
    safe_line = cap * (1 - margin) if cap and margin is not None else None

    all_sizes = [t.size for t in result.trials] or [1]
    x_max = max(all_sizes) * 1.08
    fit_end = fit.predict(x_max) if fit else None
    scale_vals = [float(t.peak_bytes) for t in ok] + ([float(cap)] if cap else []) + (
        [float(guard_limit)] if guard_limit else [])
    if fit_end is not None:
        scale_vals.append(fit_end)
    unit, div = _unit(scale_vals)

    fig, ax = style.figure((9, 6.4))  # taller than the default: the legend goes below

    if cap:
        cap_name = "capacity (budget)" if capacity_label(result) == "budget" else "free memory"
        ax.axhline(cap / div, color="black", lw=1.4,
                   label=f"{cap_name}: {fmt_bytes(cap, unit)}")
    if safe_line is not None:
        ax.axhline(safe_line / div, color="tab:green", lw=1.1, ls=":",
                   label=f"safe limit: capacity × (1 − {margin:.2f}) = "
                         f"{fmt_bytes(safe_line, unit)}")
    if fit is not None:
        xs = [0.0, x_max]
        ax.plot(xs, [fit.predict(x) / div for x in xs], ls="--", color="tab:blue", lw=1.2,
                label=f"least-squares fit: {fmt_bytes(fit.per_item_bytes)}/item "
                      f"{'+' if fit.base_bytes >= 0 else '−'} {fmt_bytes(abs(fit.base_bytes))}, "
                      f"R² = {fit.r2:.4f} (estimate)")
    if ok:
        ax.plot([t.size for t in ok], [t.peak_bytes / div for t in ok], "o", color="tab:blue",
                ms=5, label=f"measured peak ({len(ok)} successful trials)", zorder=3)
    if ooms:
        if cap:
            y_oom = cap / div
            note = _OOM_NOTE
        else:
            top = max([t.peak_bytes for t in ok], default=0)
            y_oom = top / div * 1.05 if top else 1.0
            note = "OOM (peak unknown; drawn above the highest peak)"
        ax.plot([t.size for t in ooms], [y_oom] * len(ooms), "x", color="red", ms=9, mew=2,
                label=f"{note} ({len(ooms)} trials)", zorder=4)
    if guard_limit:
        ax.axhline(guard_limit / div, color="tab:orange", lw=1.1, ls="--",
                   label=f"RAM guard limit: {fmt_bytes(guard_limit, unit)} (estimated, not enforced)")
    if guarded:
        ax.plot([t.size for t in guarded],
                [(t.peak_bytes if t.peak_bytes is not None else guard_limit) / div for t in guarded],
                "x", color="tab:orange", ms=9, mew=2, zorder=4,
                label=f"stopped or not run by the RAM guard ({len(guarded)} trials; at the "
                      "peak measured, or on its limit when not run)")
    if result.max_ok is not None:
        ax.axvline(result.max_ok, color="tab:red", lw=1.0, ls="-.",
                   label=f"measured maximum: {result.max_ok}")
    if rec is not None and rec.safe != result.max_ok:
        ax.axvline(rec.safe, color="tab:green", lw=1.0, ls="-.",
                   label=f"recommended safe size: {rec.safe}")

    device_kind = result.device.split(":", 1)[0]
    what = "resident, VmHWM" if device_kind == "cpu" else "allocator reserved" \
        if device_kind == "cuda" else "measured"
    mode = {"isolated": "isolated trials (fresh process each)",
            "confirmed": "in-process trials, answer confirmed in fresh processes",
            }.get(result.mode, "in-process trials (history-dependent)")
    label = size_label(result)
    ax.set_xlabel(f"{label} (items)")
    ax.set_ylabel(f"peak memory above trial start ({unit}, {what})")
    ax.set_title(f"{result.workload}: peak memory vs {label}\n"
                 f"{result.device} · {mode} · strategy {result.strategy}")
    ax.set_xlim(0, x_max)
    y_top = max(scale_vals, default=div) / div
    ax.set_ylim(0, y_top * 1.12 if y_top > 0 else 1.0)
    # Below the axes, so it never hides the capacity line or the points.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    return fig


def throughput_figure(result: SearchResult) -> Figure | None:
    """Measured items per second against size (None when no trial measured a rate), with
    the recommended size, the maximum and the fastest size at or below the recommendation
    marked."""
    measured = rates(result)
    if not measured:
        return None
    fig, ax = style.figure()
    sizes = sorted(measured)
    ax.plot(sizes, [measured[s] for s in sizes], "o-", color="tab:blue", ms=5, lw=1.2,
            label=f"measured ({len(sizes)} sizes that fitted; {rate_basis(result)})")
    rec, fastest = result.recommendation, fastest_safe_size(result)
    if fastest is not None:
        ax.plot([fastest], [measured[fastest]], "*", color="tab:orange", ms=14, zorder=4,
                label=f"fastest at or below the recommendation: {fastest}")
    if rec is not None:
        ax.axvline(rec.safe, color="tab:green", lw=1.0, ls="-.",
                   label=f"recommended safe size: {rec.safe}")
    if result.max_ok is not None:
        ax.axvline(result.max_ok, color="tab:red", lw=1.0, ls="-.",
                   label=f"measured maximum: {result.max_ok}")
    label = size_label(result)
    ax.set_xlabel(f"{label} (items)")
    ax.set_ylabel("items per second (measured)")
    ax.set_title(f"{result.workload}: throughput vs {label}\n{result.device} · {result.mode}")
    ax.set_xlim(0, max(sizes) * 1.08)
    ax.set_ylim(0, max(measured.values()) * 1.15)
    ax.legend(loc="lower right", frameon=False)
    return fig


def plot_throughput(result: SearchResult, path: str | os.PathLike[str]) -> Path | None:
    """Write :func:`throughput_figure` as a PNG to ``path`` (atomically); None, and nothing
    written, when no trial measured a rate."""
    fig = throughput_figure(result)
    return style.save(fig, Path(path)) if fig is not None else None
