"""Plain-text tables for the command line (``oomguard probe``, ``estimate``, ``cache show``)."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(rows: Sequence[Sequence[str]], right: int = 0) -> str:
    """``rows`` (the header first) as lines of cells two spaces apart, each column as wide
    as its widest cell: the first ``right`` columns right-aligned (numbers), the rest left."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i < right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                     for r in rows)
