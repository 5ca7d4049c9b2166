"""Reports: render what a search or a job produced (Markdown, JSON and PNG).

A search's files (:func:`write_report`) are written atomically and all render the figures
:func:`~oomguard.reports.json_report.summarise` derives. A job's report is
:func:`oomguard.reports.job_report.write_job_report`.
"""

from __future__ import annotations

import os
from pathlib import Path

from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.util.atomic import atomic_write, atomic_write_json
from oomguard.reports.json_report import render_json, summarise
from oomguard.reports.markdown import render_markdown
from oomguard.reports.plot import plot_memory, plot_throughput

__all__ = ["plot_memory", "plot_throughput", "render_json", "render_markdown", "write_report"]


def write_report(
    result: SearchResult, out_dir: str | os.PathLike[str], context: dict | None = None
) -> dict[str, Path]:
    """Write ``report.md``, ``report.json``, ``memory.png`` and, when the trials measured
    a rate, ``throughput.png`` into ``out_dir`` (created if needed); their paths as
    ``{"markdown", "json", "png"[, "throughput_png"]}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(result, context)
    paths = {
        "markdown": atomic_write(out / "report.md", render_markdown(result, context, summary)),
        "json": atomic_write_json(out / "report.json", render_json(result, context, summary)),
        "png": plot_memory(result, out / "memory.png", summary),
    }
    speed = plot_throughput(result, out / "throughput.png", summary)
    return paths | ({"throughput_png": speed} if speed is not None else {})
