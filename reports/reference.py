"""``reference.md``: the measured quick reference of ``oomguard reference``, one row per
metric and memory knob, then the sizes a job on this device uses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.engine.errors import size_list
from oomguard.engine.util.units import fmt_bytes


def _size(value: Any) -> str:
    return "-" if value is None else str(value)


def _peak(row: Mapping[str, Any]) -> str:
    if row.get("peak_at_safe_bytes") is None:
        return "-"
    tag = "" if row.get("peak_source") == "measured" else " (est.)"
    return fmt_bytes(row["peak_at_safe_bytes"]) + tag


def _rate(seconds: Any) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render_reference_markdown(doc: Mapping[str, Any]) -> str:
    """The reference as markdown, from :meth:`Reference.to_dict` (``reference.json``)."""
    dev = doc.get("device", {})
    budget = dev.get("budget_bytes")
    where = f"{dev.get('name') or dev.get('device')} ({fmt_bytes(dev.get('total_bytes'))})"
    measured = sum(1 for r in doc["rows"] if r["source"] == "measured")
    out = [f"# Quick reference: {doc['model']} on {dev.get('device')}", "",
           f"- **Device**: {where}" + (f", under a budget of {fmt_bytes(budget)}" if budget
                                        else ", no budget: the device's own memory"),
           *(f"- **Limit**: the first search was bounded by the {limit}" for limit in [
               r["limit"] for r in doc["rows"] if r.get("limit") and r["source"] == "measured"][:1]),
           f"- **Model**: {doc['model']}, {doc['dtype']}, sequences of {doc['seq_len']} "
           f"tokens, {doc['n_samples']} samples",
           f"- **Rows**: {len(doc['rows'])} (metric, memory knob), {measured} searched now "
           f"in {doc['trials']} trials, {len(doc['rows']) - measured} from the size cache; "
           f"{doc['seconds']:.1f} s; {doc['created']}",
           "- **Trials**: each knob searched in a fresh process of its own ("
           + ", ".join(sorted({r['mode'] for r in doc['rows'] if r.get('mode')}) or ["-"])
           + " trials: see `oomguard search --help` for the modes)", "",
           "| metric | knob | maximum | safe | peak at safe | per item | source | note |",
           "|---|---|---:|---:|---:|---:|---|---|",
           *(f"| {r['metric']} | {r['knob']} | {_size(r['max_ok'])} | {_size(r['safe'])} "
             f"| {_peak(r)} | {_rate(r['seconds_per_item'])} | {r['source']} | {r['note']} |"
             for r in doc["rows"]),
           "", "- **maximum**: the largest size that ran (measured), the metric's knobs before "
           "this one at their chosen sizes, the ones after it at their defaults (`others` in "
           "reference.json). **safe**: the recommendation, which keeps the search's "
           "margin of the capacity free, never above the maximum.",
           "- **peak at safe**: measured when a trial ran at the safe size, else estimated "
           "from the line fitted to the measured peaks (est.).",
           "- **per item**: seconds per item at the maximum, measured after each trial's "
           "first step.", "- **source**: measured now, or read from the size cache, where an "
           "earlier reference stored it.", "",
           "## Sizes a job uses on this device", "",
           "A job file with this model, dtype, sequence length, device and budget takes "
           "these sizes from the size cache (no search), or pin them with "
           "`oomguard run JOB.toml --sizes sizes.toml`.", "",
           "| metric | sizes | from |", "|---|---|---|"]
    out += [f"| {metric} | {size_list(sizes)} | {doc['job_sizes_source'].get(metric, '')} |"
            for metric, sizes in doc["job_sizes"].items()] or ["| (none: no metric fitted) | | |"]
    return "\n".join(out) + "\n"
