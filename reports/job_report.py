"""``report.md`` and plots of an overnight job (``oomguard run``), from the content of its
``results.json`` alone (plain JSON types), every file written atomically.

Per metric: status, sizes and their source, retries, seconds, measured peak memory and the
result summary; failures; every OOM event with memory measured at it; every remedy tried; for a
metric that could run recomputed, each configuration measured and the one kept.
Plots go to ``plots/``.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oomguard.engine.errors import size_list
from oomguard.engine.util.atomic import atomic_write
from oomguard.engine.util.jsonable import json_text
from oomguard.engine.util.units import fmt_bytes
from oomguard.reports import style

log = logging.getLogger("oomguard.report")


class ReportInterrupted(Exception):
    """Writing the report stopped early because its ``cancelled()`` said so."""


def _go_on(cancelled: Callable[[], bool] | None) -> None:
    if cancelled is not None and cancelled():
        raise ReportInterrupted


_LANDSCAPE_KEYS = ("loss_grid", "losses", "grid", "surface", "loss")


def _grids(task: Mapping[str, Any], out: Path) -> dict[str, Any]:
    """Every 2-D numeric array of a task's result: inline summary lists and the ``.pt`` file."""
    found: dict[str, Any] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(value, list) and value and all(isinstance(r, list) for r in value):
            try:
                arr = np.array(value, dtype=float)
            except (TypeError, ValueError):
                return
            if arr.ndim == 2 and min(arr.shape) > 1:
                found[name] = arr

    walk(task.get("summary") or {}, "")
    if task.get("tensors"):
        try:
            for name, t in torch.load(out / task["tensors"], weights_only=True).items():
                if t.ndim == 2 and min(t.shape) > 1:
                    found[name] = t.double().numpy()
        except Exception:  # noqa: BLE001 - a missing tensor file only costs a plot
            log.warning("could not read %s for plots", task["tensors"])
    return found


def plot_peak_memory(summary: Mapping[str, Any], path: Path) -> Path | None:
    """Bar chart of measured peak bytes per metric that ran; None if none did."""
    tasks = [(k, t) for k, t in summary["tasks"].items() if t.get("peak_bytes") is not None]
    if not tasks:
        return None
    budget = summary["job"].get("budget_bytes")
    fig, ax = style.figure()
    ax.bar([k for k, _ in tasks], [t["peak_bytes"] / 2**20 for _, t in tasks], color="tab:blue")
    if budget:
        ax.axhline(budget / 2**20, color="tab:red", ls="--", label="budget")
        ax.legend()
    ax.set(ylabel="peak memory (MiB, measured)", title="Peak memory per metric")
    ax.tick_params(axis="x", rotation=30)
    return style.save(fig, path)


def plot_landscape(grid: Any, path: Path, title: str) -> Path:
    """Contour plot of a 2-D loss grid over the two directions' coordinates."""
    fig, ax = style.figure(grid=False)
    xs, ys = np.linspace(-1, 1, grid.shape[1]), np.linspace(-1, 1, grid.shape[0])
    cs = ax.contourf(xs, ys, grid, levels=20, cmap="viridis")
    ax.contour(xs, ys, grid, levels=10, colors="k", linewidths=0.4)
    fig.colorbar(cs, ax=ax, label="loss (nats/token)")
    ax.plot([0], [0], "r+", ms=10)
    ax.set(xlabel="direction 1 (relative step)", ylabel="direction 2 (relative step)", title=title)
    return style.save(fig, path)


def plot_heatmap(grid: Any, path: Path, title: str) -> Path:
    """Heatmap of a layer x head array (attention entropy, nats)."""
    fig, ax = style.figure(grid=False)
    fig.colorbar(ax.imshow(grid, aspect="auto", cmap="magma"), ax=ax, label="entropy (nats)")
    rows, cols = grid.shape
    if rows <= 32 and cols <= 32:  # one tick per layer and head, numbered from 0
        ax.set(yticks=range(rows), xticks=range(cols))
    ax.set(xlabel="head", ylabel="layer", title=title)
    return style.save(fig, path)


def _task_plots(key: str, task: Mapping[str, Any], out: Path,
                cancelled: Callable[[], bool] | None) -> dict[str, str]:
    """A finished task's loss landscape and attention entropy plots, where its results hold
    the 2-D arrays."""
    grids = _grids(task, out)
    landscape = None
    if task.get("metric") == "loss_landscape" or any("landscape" in g for g in grids):
        landscape = next((g for k in _LANDSCAPE_KEYS for g in grids if g.split(".")[-1] == k),
                         next(iter(grids), None))
    entropy = next((n for n in grids if "entropy" in n.lower()), None)
    plots: dict[str, str] = {}
    for name, label, file, draw, note in (
            (landscape, "loss landscape", "landscape", plot_landscape, ""),
            (entropy, entropy, "entropy", plot_heatmap, " (layer x head)")):
        if name is not None:
            _go_on(cancelled)
            p = draw(grids[name], out / "plots" / f"{key}-{file}.png", f"{key}: {label}{note}")
            plots[f"{key}: {label}"] = str(p.relative_to(out))
    return plots


def write_plots(summary: Mapping[str, Any], out: Path,
                cancelled: Callable[[], bool] | None = None) -> dict[str, str]:
    """Every plot the job's results call for; ``{title: path relative to out}``. A
    ``cancelled()`` that says True before a plot raises :class:`ReportInterrupted`."""
    (out / "plots").mkdir(exist_ok=True)
    _go_on(cancelled)
    mem = plot_peak_memory(summary, out / "plots" / "memory.png")
    plots = {"Peak memory per metric": str(mem.relative_to(out))} if mem else {}
    for key, task in summary["tasks"].items():
        plots |= _task_plots(key, task, out, cancelled) if task.get("status") == "ok" else {}
    return plots


def _sizes(s: Mapping[str, Any] | None) -> str:
    return size_list(s) or "-"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|") if text not in (None, "") else "-"


# An OOM event's figures in the order shown: the key that must be known, and the words.
_OOM_FIGURES = (
    ("reserved_bytes", "reserved {reserved_bytes}, allocated {allocated_bytes}"),
    ("fragmentation", "fragmentation {fragmentation:.1%}"),
    ("largest_free_block_bytes", "largest free block {largest_free_block_bytes}"),
    ("num_alloc_retries", "{num_alloc_retries} alloc retries"),
    ("vm_data_bytes", "VmData {vm_data_bytes}"),
    ("rss_bytes", "RSS {rss_bytes}"),
    ("free_heap_bytes", "free heap {free_heap_bytes}"),
    ("budget_limit_bytes", "headroom {budget_headroom_bytes} under a limit of {budget_limit_bytes}"),
)


def oom_view(event: Mapping[str, Any]) -> str:
    """One line of an OOM event's figures (``OomEvent.to_dict()``); unknown ones left out."""
    shown = defaultdict(lambda: fmt_bytes(None),
                        {k: fmt_bytes(v) if k.endswith("_bytes") else v for k, v in event.items()})
    parts = [words.format_map(shown) for key, words in _OOM_FIGURES if event.get(key) is not None]
    why_not = (event.get("sources") or {}).get("snapshot", "")
    if event.get("snapshot"):
        parts.append(f"snapshot `{event['snapshot']}`")
    elif why_not.startswith("none: "):  # asked for, and not possible here
        parts.append(f"no snapshot ({why_not.removeprefix('none: ')})")
    return ", ".join(parts) or "-"


def oom_events_section(tasks: Mapping[str, Any]) -> list[str]:
    """The report's "Out-of-memory events": one row per OOM the executor caught in a
    metric's run (task, sizes, device, memory measured at the OOM, what was done)."""
    rows = [(key, e) for key, t in tasks.items() for e in t.get("oom_events") or ()]
    lines = ["## Out-of-memory events", ""]
    if not rows:
        return lines + ["None: no metric ran out of memory during its run (search trials "
                        "are not counted here).", ""]
    lines += ["| task | sizes | device | memory at the OOM (measured) | done |",
              "|---|---|---|---|---|"]
    lines += [f"| {_cell(key)} | {_cell(_sizes(e.get('sizes')))} | {_cell(e.get('device'))} "
              f"| {_cell(oom_view(e))} | {_cell(e.get('action'))} |" for key, e in rows]
    return lines + ["", "Read when the error was caught, before memory was released for the "
                    "retry; a figure this platform cannot give is left out (`sources` in "
                    "results.json says how each was measured, or why not). Fragmentation is "
                    "(reserved - allocated) / reserved; the largest free block is the largest "
                    "inactive block in the allocator's segments.", ""]


def _remedies_of(key: str, t: Mapping[str, Any], dtype: str) -> list[str]:
    """One metric's remedies: what produced its result and every rung tried; nothing for a
    metric whose first attempt simply worked."""
    rungs = t.get("remedies") or []
    if not rungs or (len(rungs) == 1 and rungs[0].get("outcome") == "ok" and not t.get("remedy")):
        return []
    tried = "; ".join(f"{r['remedy']} {r['outcome']}" + (f" ({r['why']})" if r.get("why") else "")
                      for r in rungs)
    what = f"**{t.get('status')}**"
    if t.get("status") == "ok":
        what = f"result from **{t.get('remedy') or 'the first attempt'}**" + (
            f", at **{t.get('precision')}** instead of {dtype}" if t.get("lowered_precision") else "")
    return [f"- **{key}**: {what}. Tried: {tried}.",
            *(f"  - fresh process: {why}" for why in t.get("restarts") or () if why not in tried)]


def remedies_section(tasks: Mapping[str, Any], dtype: str) -> list[str]:
    """The report's "Remedies": per metric with a ladder that went past its first attempt,
    what produced its result (or that nothing did) and every remedy tried."""
    lines = [line for key, t in tasks.items() for line in _remedies_of(key, t, dtype)]
    if not lines:
        return []
    return ["## Remedies", "", "What ran after an out-of-memory error at the minimum sizes "
            "(the job's `on_oom`), in order. A result computed at a lower precision is "
            "flagged in the table above.", "", *lines, ""]


def recompute_section(tasks: Mapping[str, Any]) -> list[str]:
    """The report's "Recomputation": per metric that could run with the model's blocks
    checkpointed, each configuration (its sizes, peak, one timed run's samples per second)
    and the one kept; nothing where no metric had that choice."""
    rows = []
    for key, t in tasks.items():
        for c in (t.get("sizes") or {}).get("configurations") or ():
            rate = c.get("samples_per_second")
            rows.append(f"| {_cell(key)} | {_cell(c.get('configuration'))} "
                        f"| {_sizes(c.get('sizes'))} | {fmt_bytes(c.get('peak_bytes'))} "
                        f"| {'-' if rate is None else f'{rate:.3g}'} "
                        f"| {'**yes**' if c.get('chosen') else 'no'} | {_cell(c.get('note'))} |")
    if not rows:
        return []
    return ["## Recomputation", "",
            "Metrics that can run with the model's repeated blocks checkpointed (activations "
            "recomputed in the backward: the same result in less memory, for one more forward "
            "per block) were sized both ways; each configuration ran once at its sizes, timed, "
            "and the one with more samples per second was kept. Peaks are the searches' "
            "(measured or fitted); a size from the cache keeps the measurements of its search.",
            "", "| metric | configuration | sizes | peak | samples per second | kept | note |",
            "|---|---|---|---:|---:|---|---|", *rows, ""]


def device_label(device: Mapping[str, Any] | None) -> str:
    """A task's device in a few words: name, MIG profile, total memory."""
    if not device:
        return "-"
    mig = f" MIG {device['mig_profile']}" if device.get("mig_profile") else ""
    return f"{device.get('name') or device.get('device')}{mig} ({fmt_bytes(device.get('total_bytes'))})"


def _header(summary: Mapping[str, Any], kinds: Counter[str]) -> list[str]:
    job, dev = summary["job"], summary["job"].get("device") or {}
    data = job["data"]
    counts = Counter(t.get("status", "?") for t in summary["tasks"].values())
    total = f", {fmt_bytes(dev['total_bytes'])} total" if dev.get("total_bytes") else ""
    budget = fmt_bytes(job["budget_bytes"]) if job.get("budget_bytes") else "none"
    where = f" `{data['path']}`" if data.get("path") else ""
    lines = [f"# oomguard job report: {job['name']}", "",
             f"- **Status**: {summary['status']} (exit code {summary['exit_code']}); "
             + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
             f"- **Job file**: `{job['path']}`",
             f"- **Device**: {dev.get('device')} ({dev.get('name') or '?'}{total})",
             f"- **Budget**: {budget}",
             f"- **Models**: {', '.join(job['models'])}; dtype {job['dtype']}",
             f"- **Data**: {data['source']}{where}, {data['n_samples']} samples x "
             f"{data['seq_len']} tokens",
             f"- **Finished**: {summary['finished']} (run {summary['run']})"]
    if dev.get("ray"):
        lines.append("- **Tasks ran on**: " + ", ".join(
            f"{k} ({n} task{'' if n == 1 else 's'})" for k, n in kinds.items()))
    return [*lines, ""]


def _metric_row(key: str, t: Mapping[str, Any], where: bool) -> str:
    """A task's row: status, device (``where``), sizes and their source, retries, seconds,
    peak; dashes for a task that did not run."""
    if t.get("seconds") is None:
        return f"| {key} | {t.get('status')} |{' - |' if where else ''} - | - | - | - | - |"
    s = t.get("sizes") or {}
    used = _sizes(s.get("final") or s.get("start"))
    if not s.get("final") and len(s.get("attempts") or []) > 1:
        used = "tried " + " > ".join(_sizes(a) for a in s["attempts"])
    dev = f" {_cell(device_label(t.get('device')))} |" if where else ""
    # a remedy that lowered the precision is flagged in the table, never silent
    flag = f" **(lowered precision: {t.get('precision')})**" if t.get("lowered_precision") else ""
    return (f"| {key} | {t.get('status')}{flag} |{dev} {used} | {s.get('source') or '-'} "
            f"| {s.get('retries', '-')} | {t['seconds']:.2f} | {fmt_bytes(t.get('peak_bytes'))} |")


def _search_cost(tasks: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per metric whose sizes this run searched: the search's trials and measured seconds
    against the metric's own run."""
    rows = []
    for key, t in tasks.items():
        searches = t.get("searches") or ([t["search"]] if t.get("search") else [])
        if not searches or (t.get("sizes") or {}).get("source") == "cache":
            continue
        trials = sum(se.get("trials") or 0 for se in searches)
        spent = sum(se.get("seconds") or 0.0 for se in searches)
        run = t.get("seconds")
        how = "; ".join(dict.fromkeys(se.get("source") or "measured" for se in searches))
        rows.append(f"| {key} | {how} | {trials} | {spent:.2f} | "
                    f"{'-' if run is None else f'{run:.2f}'} |")
    if not rows:
        return []
    return ["## Search cost", "",
            "| metric | sizes by | trials | search seconds | run seconds |",
            "|---|---|---:|---:|---:|", *rows, "",
            "Seconds are measured.", ""]


def _metrics(summary: Mapping[str, Any], kinds: Counter[str]) -> list[str]:
    """The table of metrics; a device column when tasks ran on several kinds (a job on Ray)."""
    where = len(kinds) > 1
    lines = ["## Metrics", "",
             f"| metric | status |{' device |' if where else ''} sizes used | from | retries "
             "| seconds | peak memory |",
             f"|---|---|{'---|' if where else ''}---|---|---:|---:|---:|",
             *(_metric_row(key, t, where) for key, t in summary["tasks"].items()),
             "", "Peak memory is measured (what the meter counts is given per metric); "
             "seconds are the metric's own run, without model build and search.", ""]
    if summary["status"] == "interrupted":
        lines += ["The job was interrupted: run the same command again to finish it "
                  "(finished metrics are kept).", ""]
    return lines


def _reruns_and_failures(tasks: Mapping[str, Any]) -> list[str]:
    rerun = {k: t["rerun_because"] for k, t in tasks.items() if t.get("rerun_because")}
    failed = {k: t for k, t in tasks.items() if t.get("status") == "failed"}
    lines = []
    if rerun:
        lines += ["## Rerun because their inputs changed", "",
                  "The earlier results of these metrics no longer answered the job; they "
                  "were moved to `results/stale/` and the metrics ran again.", "",
                  *(f"- **{k}**: {'; '.join(why)}" for k, why in rerun.items()), ""]
    if failed:
        lines += ["## Failures", "",
                  *(f"- **{k}**: {t.get('reason')} (traceback: `{t.get('traceback')}`)"
                    for k, t in failed.items()), ""]
    return lines


def _task(key: str, t: Mapping[str, Any], dtype: str) -> list[str]:
    """A finished task's section: what ran where, its sizes, search and peak, its summary."""
    s = t.get("sizes") or {}
    searches = t.get("searches") or ([t["search"]] if t.get("search") else [])
    host = (t.get("device") or {}).get("host")
    lines = [f"## {key}", "", f"- metric `{t['metric']}` on `{t['model']}`, "
             f"parameters {json_text(t.get('params') or {}, indent=None)}",
             f"- ran on {device_label(t.get('device'))}" + (f" on host `{host}`" if host else "")
             + (f", {t['threads']} thread(s)" if t.get("threads") else ""),
             f"- sizes: started at {_sizes(s.get('start'))} ({s.get('source')}), "
             f"ran at {_sizes(s.get('final'))} after {s.get('retries', 0)} retries",
             *([f"- OOMs: {'; '.join(s['errors'])}"] if s.get("errors") else []),
             *([f"- configuration: {s.get('configuration')} (see Recomputation)"]
               if s.get("configurations") else [])]
    if t.get("lowered_precision"):
        lines.append(f"- **precision: {t.get('precision')}** (the job's dtype is {dtype}), "
                     f"lowered by the remedy `{t.get('remedy')}`")
    for se in searches:  # every knob's, named where there are several
        n = se.get("trials")
        what = f"search of `{se.get('knob')}`" if len(searches) > 1 else "search"
        lines.append(f"- {what}: {n} trial{'' if n == 1 else 's'} in {se.get('seconds')} s, "
                     f"max ok {se.get('max_ok')}, stopped: {se.get('stopped_because')}"
                     + (f"; bounded by the {se['limit']}" if se.get("limit") else ""))
    return [*lines, f"- peak memory {fmt_bytes(t.get('peak_bytes'))} ({t.get('peak_source')})",
            *([f"- full tensors: `{t['tensors']}`"] if t.get("tensors") else []),
            "", "```json", json_text(t.get("summary")).rstrip("\n")[:4000], "```", ""]


def render_job_markdown(summary: Mapping[str, Any], plots: Mapping[str, str]) -> str:
    """The job's report.md, from the content of its ``results.json`` and the plots drawn
    (``{title: path relative to the job folder}``)."""
    tasks, dtype = summary["tasks"], summary["job"]["dtype"]
    kinds = Counter(device_label(t.get("device")) for t in tasks.values() if t.get("device"))
    lines = [*_header(summary, kinds), *_metrics(summary, kinds), *_search_cost(tasks),
             *recompute_section(tasks), *remedies_section(tasks, dtype),
             *oom_events_section(tasks), *_reruns_and_failures(tasks)]
    for key, t in tasks.items():
        lines += _task(key, t, dtype) if t.get("status") == "ok" else []
    if plots:
        lines += ["## Plots", "", *(f"![{title}]({path})" for title, path in plots.items()), ""]
    return "\n".join(lines)


def write_job_report(summary: Mapping[str, Any], out: str | Path,
                     cancelled: Callable[[], bool] | None = None) -> Path:
    """Write ``report.md`` and the plots for a job's ``results.json`` content; a plot that
    fails (but for ``OSError``) is left out with a logged traceback."""
    out = Path(out)
    try:
        plots = write_plots(summary, out, cancelled)
    except (OSError, ReportInterrupted):  # the disk, not the pictures; or asked to stop
        raise
    except Exception:  # noqa: BLE001 - the text report matters more than pictures
        log.exception("plots failed; writing report.md without them")
        plots = {}
    _go_on(cancelled)
    return atomic_write(out / "report.md", render_job_markdown(summary, plots))
