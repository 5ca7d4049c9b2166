"""Markdown report of a size search in the sections of the E10 Maximum Batch Size Report,
rendered from its trials and :func:`~oomguard.reports.json_report.summarise`'s figures; bytes
in binary units, seconds wall-clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.engine.core.search.record import peak_at, utilisation
from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.util.units import fmt_bytes
from oomguard.reports.json_report import (
    fastest_note,
    rate_basis,
    rates,
    status_text,
    summarise,
)
from oomguard.reports.remedies import remedies_section
from oomguard.reports.shapes import shapes_section

_KNOWN_CONTEXT = {"model", "parameters", "architecture", "device_name", "dtype", "data", "title",
                  "remedies", "shapes", "workload_spec"}  # the last is for `oomguard verify`, not for readers
_BUDGET_HOW = {"cpu": "RLIMIT_DATA above the process's data size at the start",
               "cuda": "torch.cuda.set_per_process_memory_fraction"}
_MODE = {
    "forked": ("forked: each trial ran in a fork of the searching process, which worked on "
               "copies and ended after it, so no trial inherits another's caches (oneDNN's "
               "kernels per input shape) or heap fragments, and the process itself keeps "
               "none; the maximum of this process as it was before the search"),
    "isolated": ("isolated: each trial ran in a fresh child process, so no trial inherits "
                 "another's caches or heap fragments; this is the faithful maximum"),
    "confirmed": ("confirmed: the search ran in-process, then the answer and the size above "
                  "it ran again in fresh child processes, and the search went on there where "
                  "they disagreed; the answer is the faithful maximum"),
    "in-process": ("in-process: all trials ran in one process one after another; later "
                   "trials inherit caches and heap fragments, so the result is "
                   "history-dependent: lower than a fresh process's maximum when leftovers "
                   "take room, higher under a CPU budget when free heap chunks are reused "
                   "without counting (rerun isolated for the faithful figure)"),
}
_MODE_OBSERVATION = {
    "forked": ("**Mode**: each trial ran in a fork of the searching process; the maximum "
               "does not depend on the order of the trials, and the search left nothing "
               "behind in the process that trains."),
    "in-process": ("**Mode caveat**: trials ran in-process; the maximum can differ from a "
                   "fresh process's (lower: caches, heap fragments; higher under a CPU "
                   "budget: reused free heap). Rerun with isolation for the faithful figure."),
    "confirmed": ("**Mode**: the answer was confirmed in fresh processes (it fits there and "
                  "the size above it does not), so it does not depend on the order of the "
                  "trials."),
    "isolated": ("**Mode**: each trial ran in a fresh process; the maximum does not depend "
                 "on the order of the trials."),
}
_SCALING_OBSERVATION = {
    None: "**Scaling unknown**: too few measured sizes for a fit.",
    "flat": ("**No memory growth with {label}**: the measured peaks do not rise with the "
             "size, so the fitted line predicts nothing beyond the sizes tried."),
    "untested": ("**Scaling barely measured**: the line goes through two points, so its R² "
                 "says nothing; treat fitted estimates as rough."),
    "confirmed": ("**Linear memory scaling**: R² = {r2:.4f} over {points} points; memory "
                  "grows predictably with {label}."),
    "approximate": "**Roughly linear scaling**: R² = {r2:.4f}; fitted estimates are rough.",
    "not supported": ("**Non-linear or noisy scaling**: R² = {r2:.4f}; do not trust the "
                      "fitted estimates, rely on measured sizes only."),
}

# What each search setting (SearchConfig.to_dict: the strategy's own fields, then the limits)
# means; a setting not listed is shown as a parameter of its strategy.
_SETTINGS = {
    "strategy": "how the next size is chosen (see Search Strategy)",
    "start": "the first size tried",
    "step": "the increment the size grows by while it fits",
    "factor": "the factor the size grows by while it fits",
    "misses": ("after this many wrong predictions the strategy stops predicting and only "
               "doubles and bisects"),
    "capacity_bytes": "the bytes the strategy's line predicts against",
    "max_size": "the largest size the search may try",
    "max_trials": "the most trials the search may run",
    "max_seconds": "the most seconds of trials (none: no time limit)",
    "margin": ("the fraction of what grows with the size (the usable memory above the fixed "
               "part) the recommended size keeps free, or 'measured': twice the largest "
               "spread of a trial's steady step peaks, at least 3% of what grows"),
    "steps_per_trial": "workload calls per trial (none: the workload's own count)",
    "verify_steps": "further steps run at the recommended size after the search (0: none)",
    "restore": "the objects put back as they were after every trial",
}


def fmt_value(value: Any) -> str:
    """A workload's return value for a table cell: floats to 4 decimals, None to ``-``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        inner = ", ".join(fmt_value(v) for v in value[:4])
        return f"[{inner}{', ...' if len(value) > 4 else ''}]"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 40 else text[:37] + "..."


def _heading(s: Mapping[str, Any]) -> str:
    return "Batch Size" if s["size_label"] == "batch size" else s["size_label"]


def _pct(frac: float | None) -> str:
    return "-" if frac is None else f"{frac * 100:.1f}%"


def _bytes_exact(n: float | None) -> str:
    return fmt_bytes(n) + (f" ({n:,} bytes)" if n is not None else "")


def _params(n: Any) -> str:
    if isinstance(n, int) and not isinstance(n, bool):
        for div, suf in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
            if n >= div:
                return f"{n:,} (~{n / div:.3g}{suf})"
        return f"{n:,}"
    return str(n)


def _label(key: str) -> str:
    return key.replace("_", " ").strip().capitalize()


def _item(key: str, value: Any) -> list[str]:
    """A context entry as a bullet; a mapping as a bullet with one sub-bullet per key."""
    if isinstance(value, Mapping):
        return [f"- **{key}**:", *(f"  - {_label(str(k))}: {v}" for k, v in value.items())]
    return [f"- **{key}**: {value}"]


def _context(ctx: Mapping[str, Any]) -> list[str]:
    """What was measured: the known context keys first, then any other, in order."""
    arch = ctx.get("architecture")
    return [*([f"- **Model**: {ctx['model']}"] if "model" in ctx else []),
            *([f"- **Parameters**: {_params(ctx['parameters'])}"] if "parameters" in ctx else []),
            *(_item("Architecture", arch) if isinstance(arch, Mapping) else []),
            *([f"- **Dtype**: {ctx['dtype']}"] if "dtype" in ctx else []),
            *(line for key, value in ctx.items() if key not in _KNOWN_CONTEXT
              for line in _item(_label(key), value))]


def _budget(result: SearchResult) -> str:
    if result.budget_bytes is not None:
        how = _BUDGET_HOW.get(result.device.split(":", 1)[0], "")
        return (f"- **Memory budget**: {fmt_bytes(result.budget_bytes)}"
                + (f" (enforced with {how}; OOMs are real allocator errors)" if how else ""))
    if result.limit and result.limit.get("enforced"):
        return f"- **Memory budget**: none; trials were bounded by the {result.limit['description']}"
    if result.limit:
        return (f"- **Memory budget**: none; trials ran under a {result.limit['description']}: "
                "a watchdog stopped a trial past it, and sizes predicted past it did not run. "
                "The limit is estimated from the RAM available, not enforced by the OS")
    return "- **Memory budget**: none (the device's own limit)"


def _capacity(result: SearchResult, s: Mapping[str, Any]) -> str:
    cap = result.capacity_bytes
    if cap is None:
        return ("- **Capacity**: unknown (no budget and free memory could not be probed; "
                "utilisation figures are omitted)")
    if s["capacity_kind"] == "budget":
        return f"- **Capacity**: {fmt_bytes(cap)} (the budget)"
    return (f"- **Capacity**: {fmt_bytes(cap)} (free memory probed before the search: an "
            "estimate of headroom, not a limit)")


def _setting(key: str, value: Any, result: SearchResult) -> str:
    """One search setting as a sub-bullet: its value and what it means."""
    if key == "steps_per_trial":
        ran = sorted({t.steps for t in result.trials})
        what = (_SETTINGS[key] + (f" (here {', '.join(map(str, ran))})" if value is None and ran
                                  else ""))
    else:
        what = _SETTINGS.get(key, "a parameter of the strategy")
    shown = "none" if value is None else value
    return f"  - {key} = {shown}: {what}"


def _configuration(result: SearchResult, s: Mapping[str, Any], ctx: Mapping[str, Any]) -> list[str]:
    where = f"{ctx['device_name']} ({result.device})" if ctx.get("device_name") else result.device
    settings = [_setting(k, v, result) for k, v in (result.config or {}).items()]
    return ["## Configuration", f"- **Workload**: {result.workload}", *_context(ctx),
            f"- **Device**: {where}", _budget(result), _capacity(result, s),
            f"- **Mode**: {_MODE.get(result.mode, _MODE['in-process'])}",
            *(["- **Search settings**:", *settings] if settings else [])]


def _data(ctx: Mapping[str, Any]) -> list[str]:
    data = ctx.get("data")
    if not isinstance(data, Mapping) or not data:
        return []
    return ["## Data Configuration", *(f"- **{_label(str(k))}**: {v}" for k, v in data.items())]


def _maximum(result: SearchResult, s: Mapping[str, Any]) -> str:
    if result.max_ok is None:
        return f"### Maximum {_heading(s)}: **-**"
    suffix = ("" if result.first_oom is not None
              else " (no OOM seen: the largest useful size, every sample at once)"
              if s["capped_by"] == "samples" else " (no OOM seen: a lower bound)")
    return f"### Maximum {_heading(s)}: **{result.max_ok}**{suffix}"


def _performance(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    cap, util, seconds = result.capacity_bytes, s["utilisation"], s["seconds_at_max"]
    of_cap = f" (of {fmt_bytes(cap)} {s['capacity_kind']})" if cap else " (capacity unknown)"
    return ["### Performance Metrics", "| Metric | Value |", "|--------|-------|",
            f"| Peak Memory at maximum | {fmt_bytes(s['peak_at_max_bytes'])} |",
            f"| Memory Utilization | {_pct(util)}{of_cap if util is not None else ''} |",
            f"| Left free at maximum | {_bytes_exact(s['margin_left_bytes'])} |",
            f"| Seconds (trial at maximum) | {'-' if seconds is None else f'{seconds:.3f}'} |",
            f"| Value returned at maximum | {fmt_value(s['value_at_max'])} |",
            f"| Search wall time | {result.seconds:.2f} s |", "",
            "Peak memory is measured above the state at the trial's start (see What the peak "
            "measures); utilization is that peak over the capacity; left free is the capacity "
            "less the peak. Seconds are the wall-clock seconds of the whole trial (every step, "
            "the first included). The value is what the workload returned at the trial's last "
            "step (the built-in training step returns its loss, in nats per token)."]


def _trial_table(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    out = ["### Search Details",
           f"| {_heading(s)} | Status | Peak Memory | Seconds | Value |",
           "|-----------|--------|-------------|---------|-------|",
           *(f"| {t.size} | {status_text(t)} | {fmt_bytes(t.peak_bytes)} | {t.seconds:.3f} | "
             f"{fmt_value(t.value)} |" for t in result.trials)]
    steps = sorted({t.steps for t in result.trials})
    out += ["", f"Each trial ran {' or '.join(map(str, steps))} "
            f"step{'s' if steps != [1] else ''}; Seconds and Value as above, per trial."]
    if any(not t.ok and not t.guarded for t in result.trials):
        out += ["", "An OOM trial's peak is unknown (the allocation that failed never "
                "happened); its row shows `-`."]
    if any(t.guarded for t in result.trials):
        out += ["", "A RAM guard row is the guard's verdict against its estimated limit, not "
                "an allocation that failed: its peak is what was measured until the trial was "
                "stopped, or `-` for a size that did not run because its predicted peak was "
                "over the limit."]
    return out


def _no_growth(result: SearchResult, s: Mapping[str, Any]) -> str:
    """The honest sentence for a fit that does not rise: memory is not what ``size`` costs."""
    fit, label = result.fit, s["size_label"]
    assert fit is not None
    sizes = sorted({t.size for t in result.trials if t.ok and t.peak_bytes is not None})
    how = "" if fit.per_item_bytes <= 0 else ": no more than the scatter of the measurements"
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


def _linear(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    """The fitted line of a size whose memory grows, and what it predicts at capacity."""
    fit, label, verdict, step = result.fit, s["size_label"], s["memory_scaling"], result.config.get("step")
    assert fit is not None
    lin = "untested (only two points; R² is 1 by construction)" if verdict == "untested" else verdict
    each = (f": each +{step} {label} increment adds ~{fmt_bytes(fit.per_item_bytes * step)} peak "
            "memory" if isinstance(step, int) and step > 0 else "")
    out = [f"- **Linear scaling {lin}** (R² = {fit.r2:.4f}){each}",
           f"- **Starting overhead** (intercept at size 0): ~{fmt_bytes(fit.base_bytes)}",
           f"- **Per-item cost**: ~{fmt_bytes(fit.per_item_bytes)} per +1 of {label} "
           f"({fit.per_item_bytes:,.0f} bytes)",
           f"- **Fit**: peak ≈ {fmt_bytes(fit.base_bytes)} + {fmt_bytes(fit.per_item_bytes)} × "
           f"{result.size_name}, a least-squares line over the {fit.points} measured peaks of "
           "successful trials; sizes and peaks it predicts are estimates, not measurements."]
    if not result.capacity_bytes:
        return out
    pred = s["fitted_size_at_capacity"]
    out.append(f"- **Fitted size at capacity** (estimate): {pred} (measured maximum: "
               f"{result.max_ok})")
    # Only an OOM shows that the line over-predicts; without one the search was capped.
    if pred is not None and result.first_oom is not None and pred >= result.first_oom:
        out.append("  - The line predicts more than ran: memory the peak does not count "
                   "(allocator rounding and fragmentation, thread stacks, caches) uses the "
                   "difference. Trust the measured maximum.")
    return out


def _scaling(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    fit = result.fit
    if fit is None:
        lines = ["- **No fit**: fewer than two distinct sizes ran with a measured peak, so no "
                 "scaling line could be fitted."]
    elif s["memory_scaling"] == "flat":
        lines = [_no_growth(result, s),
                 f"- **Fit**: peak ≈ {fmt_bytes(fit.base_bytes)} + {fit.per_item_bytes:,.0f} "
                 f"bytes × {result.size_name}, a least-squares line over the {fit.points} "
                 "measured peaks of successful trials; it does not rise, so it says nothing "
                 "about sizes beyond those tried."]
    else:
        lines = _linear(result, s)
    meaning = s["peak_measures"]
    if meaning == "unknown":
        meaning = "the device's peak bytes over the trial"
    return ["## Memory Scaling Analysis", *lines,
            f"- **What the peak measures**: {meaning}. It counts bytes above the state at the "
            "start of each trial, not the model and data loaded before it."]


def _estimate(result: SearchResult, size: int) -> str:
    """The peak at ``size`` as the search's record states it: measured where a trial or the
    check of the recommended size ran there, else from the fitted line."""
    peak, source = peak_at(result, size)
    if peak is None:
        return "peak unknown"
    util = utilisation(peak, result.capacity_bytes)
    return (f"{'measured' if source == 'measured' else 'estimated'} {fmt_bytes(peak)}"
            + (f", {_pct(util)} utilization" if util is not None else ""))


def _below_line(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    """Why the recommended size's limit is below the safe line, where it is."""
    limit, line, rec = s["recommended_limit_bytes"], s["safe_line_bytes"], result.recommendation
    if limit is None or (line is not None and limit >= int(line)):
        return []
    assert rec is not None
    usable = fmt_bytes(limit + (rec.margin_bytes or 0))
    if line is None:
        return [f"- **Against what**: no capacity is known; the margin is kept below {usable}, "
                f"{s['recommended_limit_against']}, where memory ran out."]
    return [f"- **Why under {fmt_bytes(limit)}, not the safe line**: memory ran out where the "
            f"fitted peak is {usable}, below the {fmt_bytes(result.capacity_bytes)} "
            f"{s['capacity_kind']}: the limit counted bytes the peak does not, so the margin is "
            "kept below where memory ran out."]


def _why(result: SearchResult, s: Mapping[str, Any]) -> str:
    """The one recommendation in one sentence: which size, and why."""
    rec, label = result.recommendation, s["size_label"]
    assert rec is not None
    limit, line = s["recommended_limit_bytes"], s["safe_line_bytes"]
    if limit is None:
        return (f"**Use {label} {rec.safe}.** It is {rec.margin:.0%} below the measured maximum "
                f"({rec.maximum}), assuming memory grows in proportion to the size: no capacity "
                "and no fitted line were known to keep a margin of memory against.")
    against = (f"the {fmt_bytes(result.capacity_bytes)} {s['capacity_kind']}"
               if line is not None and rec.limit_against == "capacity"
               else f"{fmt_bytes(limit + (rec.margin_bytes or 0))}, "
                    f"{s['recommended_limit_against']}")
    return (f"**Use {label} {rec.safe}.** Its peak ({_estimate(result, rec.safe)}) stays under "
            f"{fmt_bytes(limit)}, which keeps a {fmt_bytes(rec.margin_bytes)} margin below "
            f"{against}.")


def _how_sure(result: SearchResult, s: Mapping[str, Any]) -> str:
    """Whether the recommended size's peak was measured or read off the fitted line."""
    rec, label, verdict = result.recommendation, s["size_label"], s["memory_scaling"]
    assert rec is not None
    if any(t.ok and t.size == rec.safe and t.peak_bytes is not None for t in result.trials):
        return f"- **How sure**: {label} {rec.safe} ran in the search; its peak is measured."
    if result.fit is None or s["recommended_limit_bytes"] is None:
        return (f"- **How sure**: {label} {rec.safe} did not run in the search and no peak "
                "could be estimated for it: verify it before a long run.")
    fit = ("a line through two points, so its R² says nothing" if verdict == "untested"
           else f"R² = {result.fit.r2:.4f} over {result.fit.points} points")
    return (f"- **How sure**: {label} {rec.safe} did not run in the search; its peak is read "
            f"off the line fitted to the measured peaks ({fit}), an estimate: verify it before "
            "a long run.")


def _measured_max(result: SearchResult, s: Mapping[str, Any]) -> str:
    """The maximum, as a measured fact beside the recommendation."""
    rec, label, util = result.recommendation, s["size_label"], s["utilisation"]
    assert rec is not None
    oom = (f"{result.first_oom} ran out of memory" if result.first_oom is not None
           else "no size ran out of memory, so larger sizes may fit too")
    free = ""
    if util is not None:
        free = (f"; it leaves {_pct(1 - util)} of the {s['capacity_kind']} unused "
                f"({fmt_bytes(s['margin_left_bytes'])})"
                + (f", less than the {fmt_bytes(rec.margin_bytes)} margin"
                   if rec.margin_bytes is not None and s["margin_left_bytes"] is not None
                   and s["margin_left_bytes"] < rec.margin_bytes else ""))
    return (f"- **Measured maximum**: {label} {rec.maximum} ran ({_estimate(result, rec.maximum)}); "
            f"{oom}{free}. The largest size that fitted a few steps, not a size to run for "
            "hours.")


def _recommendation(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    """The report's first statement: the one size to use, why, and the facts beside it."""
    rec, label = result.recommendation, s["size_label"]
    if rec is None:
        return ["## Recommendation", f"**No {label} to recommend**: no size fitted."]
    out = ["## Recommendation", _why(result, s), "",
           f"- **Margin**: {rec.margin_source or f'{rec.margin:.0%}'}; kept free for what "
           "a search's few steps do not show: later steps, fragmentation, other inputs. The "
           "fixed part (weights, gradients, optimizer state: the fitted peak at size 0) needs "
           "no margin: it does not grow with the size."]
    line, keep = s["safe_line_bytes"], rec.margin_bytes or 0
    if line is not None:
        top = (f"capacity {fmt_bytes(result.capacity_bytes)}"
               if result.capacity_bytes is not None and line + keep <= result.capacity_bytes
               else f"{fmt_bytes(line + keep)}, {rec.limit_against} (the peaks read more than "
                    f"the {fmt_bytes(result.capacity_bytes)} capacity: the meter counts bytes the "
                    "limit does not)")
        out.append(f"- **Safe line**: {fmt_bytes(line)} = {top} less the {fmt_bytes(keep)} "
                   "margin, drawn in `memory.png`.")
    out += [*_below_line(result, s), _how_sure(result, s)]
    if rec.conservative_ran and rec.conservative != rec.safe and s["safe_line_bytes"] is not None:
        out.append(f"- **Largest size measured under the line**: {rec.conservative} "
                   f"({_estimate(result, rec.conservative)}).")
    out += [_measured_max(result, s),
            f"- **Check it**: `oomguard verify` on this report's folder runs further steps at "
            f"{rec.safe} and fails, saying by how much, if a step's peak crosses "
            + ("the safe line or the limit above." if s["safe_line_bytes"] is not None
               else "the limit above." if s["recommended_limit_bytes"] is not None
               else "nothing: without a capacity it only catches an out-of-memory.")]
    return out


def _throughput(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    """Measured rates per size, and the fastest one only where it is faster beyond the
    step-to-step spread (the largest is not always the fastest)."""
    measured, fastest, spread = rates(result), s["fastest_safe_size"], s["rate_spread"]
    if not measured:
        return []
    why = fastest_note(result, fastest, spread)
    verdict = (f"- **Fastest at or below the recommended size**: {fastest} "
               f"({measured[fastest]:,.1f} items/s): {why}; starred in `throughput.png`"
               if fastest is not None else f"- **No size is named fastest**: {why}")
    noise = (f"a size's rate varied by up to {spread:.1%} from one step to the next"
             if spread is not None else "their step-to-step spread was not measured")
    return ["## Throughput", verdict,
            "- **Measured**: " + ", ".join(f"{n}: {r:,.1f}/s" for n, r in sorted(measured.items())),
            f"- **What the rates are**: {rate_basis(result)}; {noise}."]


def _verification(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    """The steps the search ran after it at the recommended size, against the line the
    recommendation keeps (as ``oomguard verify`` judges them)."""
    check = result.verification
    if not check:
        return []
    head = f"- {check['steps']} further steps at {check['size']}: "
    if not check["ok"]:
        return ["## Verification", f"{head}RAN OUT OF MEMORY: {check['error']}"]
    top = max(check.get("step_peaks") or [], default=None)
    line = s["recommended_limit_bytes"]
    if top is None or line is None:
        return ["## Verification", f"{head}ran without running out of memory"]
    where = (f"{fmt_bytes(top - line)} ABOVE the line the recommendation keeps "
             f"({fmt_bytes(line)}): the margin was not kept" if top > line
             else f"{fmt_bytes(line - top)} under the line the recommendation keeps "
                  f"({fmt_bytes(line)})")
    return ["## Verification", f"{head}ran without running out of memory; highest step peak "
            f"{fmt_bytes(top)}, {where}"]


def cap_advice(result: SearchResult, s: Mapping[str, Any]) -> str | None:
    """What capped a search that did not close its bracket (``s["capped_by"]``), and which
    option to change (a Markdown sentence; None if nothing did)."""
    cause, label, cfg, top = s["capped_by"], s["size_label"], result.config, result.max_ok
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
    if cause == "strategy":
        return (f"**No OOM seen**: the strategy stopped proposing sizes ({result.stopped_because}) "
                f"before any size ran out of memory, {lower}; {not_max_size}.")
    trials = cause == "max_trials"
    spent = (f"all {cfg.get('max_trials')} trials (max_trials)" if trials
             else f"its time (max_seconds = {cfg.get('max_seconds')})")
    option = "raise max_trials (--max-trials)" if trials else "raise max_seconds"
    if result.first_oom is not None:
        return (f"**Bracket left open**: the search used {spent} before closing in; the limit "
                f"lies between {top} (fits) and {result.first_oom} (OOM); {option} to narrow it.")
    return (f"**No OOM seen**: the search used {spent} before any size ran out of memory, "
            f"{lower}; {option}, start larger (--start) or grow faster (--strategy doubling); "
            f"{not_max_size}.")


def _observations(result: SearchResult, s: Mapping[str, Any]) -> list[str]:
    fit = result.fit
    obs = [_SCALING_OBSERVATION[s["memory_scaling"]].format(
               label=s["size_label"], r2=fit.r2 if fit else 0, points=fit.points if fit else 0),
           f"**Search cost**: {s['trials']} trials ({s['trials_ok']} fitted, {s['trials_oom']} "
           f"ran out of memory), {s['trial_seconds']:.2f} s in trials, {result.seconds:.2f} s of "
           "search wall time.",
           f"**Stopped because**: {result.stopped_because}.",
           *filter(None, [cap_advice(result, s)])]  # None: nothing capped the search
    if s["non_monotonic_oom_sizes"]:
        sizes = ", ".join(str(n) for n in s["non_monotonic_oom_sizes"])
        obs.append(f"**Non-monotonic outcomes**: size(s) {sizes} ran out of memory although "
                   f"{result.max_ok} fitted; memory use depends on history or is noisy here, "
                   "so keep a wider margin.")
    obs.append(_MODE_OBSERVATION.get(result.mode, _MODE_OBSERVATION["isolated"]))
    if fit is not None and fit.base_bytes < 0:
        obs.append("**Negative intercept**: the fitted overhead is below zero, so the line is "
                   "only meaningful within the measured range.")
    return ["## Key Observations", "", *(f"{i}. {o}" for i, o in enumerate(obs, 1))]


def _conclusion(result: SearchResult, s: Mapping[str, Any], ctx: Mapping[str, Any]) -> list[str]:
    rec, label = result.recommendation, s["size_label"]
    if rec is None or result.max_ok is None:
        return ["## Conclusion", f"**{result.workload}: no {label} fitted.**"]
    where = ctx.get("device_name") or result.device
    util = s["utilisation"]
    of = f", {_pct(util)} of the {s['capacity_kind']}" if util is not None else ""
    bound = "at least " if result.first_oom is None else ""
    return ["## Conclusion",
            f"**Use {label} {rec.safe} for {result.workload} on {where}.** The measured "
            f"maximum is {bound}{result.max_ok} ({result.mode}{of}), without the "
            + (f"{fmt_bytes(rec.margin_bytes)} margin." if rec.margin_bytes is not None
               else f"{rec.margin:.0%} margin.")]


def render_markdown(result: SearchResult, context: Mapping[str, Any] | None = None,
                    summary: Mapping[str, Any] | None = None) -> str:
    """``result`` as the Markdown report. ``context`` describes what was measured: ``model``,
    ``parameters`` (int), ``architecture`` (dict), ``device_name``, ``dtype``, ``data`` (dict),
    ``title``; any other key is listed under Configuration. ``summary`` is :func:`summarise`
    of them (computed here unless given)."""
    ctx: Mapping[str, Any] = context or {}
    s = summary if summary is not None else summarise(result, ctx)
    title = ctx.get("title") or f"{result.workload} Maximum {_heading(s)} Report"
    parts = [[f"# {title}"], _recommendation(result, s), _configuration(result, s, ctx),
             _data(ctx),
             ["## Search Strategy", f"Strategy `{result.strategy}`: {result.strategy_description}"],
             [f"{i}. {step}" for i, step in enumerate(s["search_steps"], 1)],
             ["## Results"], [_maximum(result, s)], _performance(result, s),
             _trial_table(result, s), _scaling(result, s), _throughput(result, s),
             remedies_section(ctx.get("remedies")),
             shapes_section(ctx.get("shapes")),
             _verification(result, s), _observations(result, s), _conclusion(result, s, ctx)]
    return "\n\n".join("\n".join(p) for p in parts if p) + "\n"
