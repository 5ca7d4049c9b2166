"""Reports: render what a search or a job produced (Markdown, JSON, PNG).

``write_report(result, out_dir)`` writes ``report.md``, ``report.json`` and
``memory.png`` into ``out_dir``, each atomically (a temporary file in the same
directory, then ``os.replace``), so a reader never sees a half-written report.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from oomguard.engine.core.search import SearchResult
from oomguard.reports.json_report import render_json
from oomguard.reports.markdown import render_markdown
from oomguard.reports.plot import plot_memory

__all__ = ["plot_memory", "render_json", "render_markdown", "write_report"]


def _atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary path next to ``path``, then move it into place."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-",
                                    suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a report is for reading
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_report(
    result: SearchResult, out_dir: str | os.PathLike[str], context: dict | None = None
) -> dict[str, Path]:
    """Write ``report.md``, ``report.json`` and ``memory.png`` for ``result`` into ``out_dir``.

    Creates ``out_dir`` (and parents) if needed. Returns ``{"markdown": ...,
    "json": ..., "png": ...}`` paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = render_markdown(result, context)
    doc = json.dumps(render_json(result, context), indent=2, ensure_ascii=False) + "\n"
    return {
        "markdown": _atomic(out / "report.md", lambda p: p.write_text(md, encoding="utf-8")),
        "json": _atomic(out / "report.json", lambda p: p.write_text(doc, encoding="utf-8")),
        "png": _atomic(out / "memory.png", lambda p: plot_memory(result, p)),
    }
