"""Batches planned from a dataset's lengths (``oomguard bench --lengths``): the record written to
``shapes.json`` (the :class:`~oomguard.engine.core.shapes.ShapePlan`'s ``to_dict()`` and
the tokens per batch of its batches against sizing at the longest length), ``shapes.png`` (the
largest batch against length) and ``shapes.md``. Bytes in binary units; lengths in tokens."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.engine.util.atomic import atomic_write, atomic_write_json
from oomguard.engine.util.units import fmt_bytes
from oomguard.reports import style

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from oomguard.engine.core.shapes import ShapePlan


def shapes_record(plan: ShapePlan, lengths: Sequence[int]) -> dict[str, Any]:
    """``plan.to_dict()`` with what its batches of ``lengths`` move: ``lengths`` (count,
    shortest, median, longest, tokens), ``planned`` (batches, real and padded tokens per
    batch, each batch's shape ``[longest length, rows]``), ``longest_length_sizing`` (every
    batch at :meth:`ShapePlan.max_batch` of the longest length) and ``tokens_ratio``: the
    plan's real tokens per batch over longest-length sizing's."""
    batches = plan.batches(lengths)
    shapes = [[max(lengths[i] for i in b), len(b)] for b in batches]
    tokens, longest = sum(lengths), max(lengths)
    rows = plan.max_batch(longest)
    fixed_count = math.ceil(len(lengths) / rows) if rows else None
    planned = tokens / len(batches)
    fixed = tokens / fixed_count if fixed_count else None
    return plan.to_dict() | {
        "lengths": {"count": len(lengths), "shortest": min(lengths),
                    "median": statistics.median(lengths), "longest": longest, "tokens": tokens},
        "planned": {"batches": len(batches), "tokens_per_batch": planned,
                    "padded_tokens_per_batch": sum(n * r for n, r in shapes) / len(batches),
                    "largest_batch": max(r for _, r in shapes), "shapes": shapes},
        "longest_length_sizing": {"batch": rows, "batches": fixed_count,
                                  "tokens_per_batch": fixed},
        "tokens_ratio": planned / fixed if fixed else None,
    }


def shapes_figure(record: Mapping[str, Any]) -> Figure:
    """Rows against length (log-log): the plan's ``max_batch`` line over the lengths, the
    searched lengths' safe batches and measured maxima, each planned batch's shape and
    longest-length sizing's batch."""
    fig, ax = style.figure((8.0, 5.6))
    lo, hi = record["lengths"]["shortest"], record["lengths"]["longest"]
    line = record["max_batch_line"]
    ax.plot([n for n, _ in line], [r for _, r in line], "-", color="tab:green", lw=1.4,
            label="plan's max_batch (safe line; interpolated between searched lengths)")
    shapes = record["planned"]["shapes"]
    ax.plot([n for n, _ in shapes], [r for _, r in shapes], "o", color="tab:orange", ms=5,
            alpha=0.6, label=f"planned batches: longest length, rows ({len(shapes)} batches)",
            zorder=5)
    points = record["points"]
    # Hollow, so a planned batch or the safe batch at the same place shows through.
    ax.plot([p["seq_len"] for p in points], [p["max_ok"] for p in points], "^", color="tab:red",
            mfc="none", ms=11, mew=1.4, label="measured maximum at a searched length", zorder=4)
    ax.plot([p["seq_len"] for p in points], [p["safe"] for p in points], "s", color="tab:blue",
            mfc="none", ms=9, mew=1.6,
            label="searched length's safe batch (measured; margin kept)", zorder=4)
    fixed = record["longest_length_sizing"]["batch"]
    if fixed:
        ax.axhline(fixed, color="grey", lw=1.0, ls=":",
                   label=f"sizing at the longest length ({hi}): {fixed} rows for every batch")
    ratio = record["tokens_ratio"]
    ax.set(xscale="log", yscale="log", xlabel="longest length in the batch (tokens)",
           ylabel="rows per batch",
           title=f"{record['workload']}: largest batch vs length\n{record['device']} · budget "
                 f"{fmt_bytes(record['budget_bytes']) if record['budget_bytes'] else 'none'}"
                 + (f" · {ratio:.1f}x the real tokens per batch of longest-length sizing"
                    if ratio else ""),
           xlim=(lo / 1.15, hi * 1.15))
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):  # plain numbers, not powers of ten
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xticks(sorted({lo, hi, *(p["seq_len"] for p in points)}))
    ax.set_yticks(sorted({*(p["safe"] for p in points), *([fixed] if fixed else [])}))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    return fig


def shapes_markdown(record: Mapping[str, Any]) -> str:
    """``shapes.md``: the searched lengths and what the plan's batches move."""
    return "\n".join([f"# {record['workload']}: Batches Planned from the Lengths", "",
                      *_body(record), ""])


def shapes_section(record: Mapping[str, Any] | None) -> list[str]:
    """``report.md``'s section for ``bench --lengths`` (empty without a plan): what
    :func:`shapes_markdown` says, under a heading of its own."""
    if not record:
        return []
    return ["## Batches Planned from the Lengths", "", *_body(record)]


def report_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """What ``report.json``'s context keeps of :func:`shapes_record` (shapes.json has it all):
    no batch shapes and no searches."""
    planned = {k: v for k, v in record["planned"].items() if k != "shapes"}
    keep = ("workload", "device", "budget_bytes", "seconds", "trials", "points", "lengths",
            "longest_length_sizing", "tokens_ratio")
    return {k: record[k] for k in keep} | {"planned": planned}


def _body(record: Mapping[str, Any]) -> list[str]:
    """The paragraphs and the table of the searched lengths, under a heading."""
    lengths, planned = record["lengths"], record["planned"]
    fixed, ratio = record["longest_length_sizing"], record["tokens_ratio"]
    rows = [f"| {p['seq_len']} | {p['safe']} | {p['max_ok']} | "
            f"{'-' if p['first_oom'] is None else p['first_oom']} | "
            f"{fmt_bytes(p['per_row_bytes'])} | {p['trials']} |" for p in record["points"]]
    budget = fmt_bytes(record["budget_bytes"]) if record["budget_bytes"] else "none"
    how = (f"read from the size cache (planned in {record['seconds']:.1f} s before; no trial "
           "now)" if record.get("source") == "cache" else
           f"planned in {record['seconds']:.1f} s, {record['trials']} real trials of the step")
    fixed_line = (f"Sizing every batch at the longest length ({lengths['longest']} tokens, "
                  f"{fixed['batch']} rows) takes {fixed['batches']} batches of "
                  f"{fixed['tokens_per_batch']:,.0f} real tokens: the plan moves "
                  f"**{ratio:.2f}x the real tokens per batch**."
                  if ratio else "No row fits at the longest length.")
    return [
        f"{lengths['count']:,} samples of {lengths['shortest']} to {lengths['longest']} tokens "
        f"(median {lengths['median']:g}), on {record['device']} under a {budget} budget; "
        f"{how}.", "",
        f"The plan cuts them into **{planned['batches']} batches of "
        f"{planned['tokens_per_batch']:,.0f} real tokens** on average "
        f"({planned['padded_tokens_per_batch']:,.0f} with padding to each batch's longest "
        f"sample; the largest batch {planned['largest_batch']} rows). {fixed_line}", "",
        "| searched length | safe batch | measured maximum | first OOM | per-row bytes "
        "(fitted) | trials |",
        "|---|---|---|---|---|---|", *rows, "",
        "The longest length is a batch-size search of the training step; each shorter "
        "searched length one trial, at the batch that search and the estimated per-row bytes "
        "predict; between them the safe batch is interpolated (`ShapePlan.max_batch`). "
        "shapes.png "
        "draws it with every planned batch's shape; shapes.json has the plan "
        "(`ShapePlan.to_dict()`), each batch's shape and the tokens per batch."]


def write_shapes(plan: ShapePlan, lengths: Sequence[int], out: str | os.PathLike[str],
                 record: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write ``shapes.json``, ``shapes.png`` and ``shapes.md`` for ``plan`` over ``lengths``
    into the folder ``out`` (atomically; ``record``: :func:`shapes_record` of them, unless
    given); their paths."""
    out = Path(out)
    record = record if record is not None else shapes_record(plan, lengths)
    lo, hi = min(lengths), max(lengths)
    grid = sorted({round(lo * (hi / lo) ** (k / 200)) for k in range(201)} | {lo, hi})
    line = {"max_batch_line": [[n, plan.max_batch(n)] for n in grid]}
    return {"json": atomic_write_json(out / "shapes.json", record),
            "png": style.save(shapes_figure(record | line), out / "shapes.png"),
            "markdown": atomic_write(out / "shapes.md", shapes_markdown(record))}
