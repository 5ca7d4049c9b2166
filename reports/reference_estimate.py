"""``estimate-reference.md``: the *estimated* quick reference of ``oomguard reference
--estimate`` (no device, no weights), kept apart from the measured ``reference.md``: every
figure is labelled an estimate, with the margin it keeps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.engine.util.units import fmt_bytes


def _b(value: Any) -> str:
    return "-" if value is None else f"{fmt_bytes(value)} (est.)"


def render_estimate_markdown(doc: Mapping[str, Any]) -> str:
    """The estimated reference as markdown, from
    :func:`~oomguard.engine.jobs.reference_estimate.build_estimate_reference`'s dict."""
    margin = doc["margin"]
    out = [f"# Estimated quick reference: {doc['model']} for {doc['memory_name']}", "",
           f"**Every figure here is an estimate ({doc['kind']}), not a measurement.** "
           f"Method: {doc['method']}.", "",
           f"- **Memory**: {doc['memory_name']}, {fmt_bytes(doc['memory_bytes'])} in all; "
           f"sizes must fit {fmt_bytes(doc['capacity_bytes'])}, keeping a margin of "
           f"{margin:.0%} for what the estimate leaves out (CUDA context, the allocator's "
           "cache and fragmentation, cuBLAS workspace; a GPU lets a process allocate less "
           "than the total its driver reports).",
           f"- **Model**: {doc['model']}, {doc['dtype']}, sequences of {doc['seq_len']} "
           f"tokens, {doc['n_samples']} samples; estimated for {doc['device']}",
           f"- **Cost**: {doc['estimates']} estimates, {doc['seconds']:.1f} s", "",
           "| metric | knob | largest size (est.) | total at it (est.) | of which peak above "
           "the weights and data (est.) | next size | total at next (est.) | note |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    # A size is at least 1, so `or` stands in for None only.
    out += [f"| {r['metric']} | {r['knob']} | {r['max_ok'] or 'does not fit'} | "
            f"{_b(r['total_bytes'])} | {_b(r['peak_bytes'])} | {r['first_oom'] or '-'} | "
            f"{_b(r['next_total_bytes'])} | {r['note']} |" for r in doc["rows"]]
    out += ["", f"- **largest size (est.)**: the largest size whose estimated total fits the "
            f"memory less the {margin:.0%} margin, the metric's other knobs at their "
            "defaults. **total**: the storage alive after the warm-up (weights, gradients, "
            "buffers, data) plus the estimated peak above it. **next size**: the smallest "
            "size estimated not to fit.",
            "- No seconds per item: fake tensors compute nothing, so an estimate says "
            "nothing honest about speed; `oomguard reference` (measured) gives them."]
    out += [f"- {note}" for note in doc.get("notes", [])]
    if doc.get("measured_source"):
        out += ["", f"## Estimate against measurement ({doc['measured_source']})", "",
                "The measured reference's peak above the warmed-up state at its safe size "
                "(a trial ran there), against the estimated peak at that size.", "",
                "| metric | knob | measured maximum | size | measured peak | estimated peak "
                "(est.) | relative error |", "|---|---|---:|---:|---:|---:|---:|"]
        compared = [f"| {r['metric']} | {r['knob']} | {r.get('measured_max')} | "
                    f"{r['measured_size']} | {fmt_bytes(r['measured_peak_bytes'])} (measured) | "
                    f"{_b(r['estimated_peak_bytes'])} | {r['relative_error']:+.1%} |"
                    for r in doc["rows"] if "relative_error" in r]
        out += compared or ["| (no row with a measured peak at its safe size) | | | | | | |"]
    if doc.get("batch_rows"):
        batches = doc["batches"]
        out += ["", f"## Memory per batch size (est.), {doc['seq_len']} tokens", "",
                "Each metric's first memory knob at the batch size, over that many samples: "
                "the estimated total (weights, data and the peak above them). No time column: "
                "fake tensors compute nothing, so they cannot time a step honestly.", "",
                "| metric | knob | " + " | ".join(f"batch {b}" for b in batches) + " |",
                "|---|---|" + "---:|" * len(batches)]
        for r in doc["batch_rows"]:
            cells = " | ".join(_b(r["total_bytes"][str(b)]) for b in batches)
            out.append(f"| {r['metric']} | {r['knob']} | {cells} |")
    return "\n".join(out) + "\n"
