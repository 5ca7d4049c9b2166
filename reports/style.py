"""The one plot style: every PNG oomguard draws is made (:func:`figure`) and saved
(:func:`save`) here. No pyplot, no display, no ``matplotlib.use``, no global ``rcParams``
change: safe in headless jobs, threads and a user's own matplotlib session.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.engine.util.atomic import atomic_write

if TYPE_CHECKING:  # matplotlib's import is slow (docs/measurements.md#matplotlib-import)
    from matplotlib.figure import Figure

SIZE = (8.0, 5.0)  # inches; wide plots (a search with its legend below) pass their own
DPI = 110
TITLE_PT, LABEL_PT, TICK_PT, LEGEND_PT = 11, 10, 9, 8
GRID = {"alpha": 0.3, "linewidth": 0.6}


def figure(size: tuple[float, float] = SIZE, *, grid: bool = True) -> tuple[Figure, Any]:
    """A styled ``(figure, axes)``: Agg canvas, :data:`DPI`, ``size`` inches, a light grid.
    ``grid=False`` for images (heatmaps, contours) where grid lines would cross the data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if grid:
        ax.grid(True, **GRID)
        ax.set_axisbelow(True)
    return fig, ax


def save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Apply the common font sizes to every axes (colour bars included), lay out and write
    ``fig`` as a PNG to ``path`` atomically."""
    for ax in fig.axes:
        ax.title.set_fontsize(TITLE_PT)
        ax.xaxis.label.set_fontsize(LABEL_PT)
        ax.yaxis.label.set_fontsize(LABEL_PT)
        ax.tick_params(labelsize=TICK_PT)
        legend = ax.get_legend()
        if legend is not None:
            for text in legend.get_texts():
                text.set_fontsize(LEGEND_PT)
    fig.tight_layout()
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI))
