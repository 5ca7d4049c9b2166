"""How ``Executor``, ``@adaptive`` and ``accumulate`` shrink a size after an OOM:
``policy=...``. :class:`Halve` (the default of ``Executor`` and ``@adaptive``) halves down to a
minimum; :class:`ReduceWith` applies your function; :class:`FitPeaks` (``accumulate``'s
default, which feeds it the peaks it measures) goes to the largest size those peaks predict
fits, halving where none were measured."""

from oomguard.engine.core.execute.retry import FitPeaks, Halve, ReduceWith

__all__ = ["FitPeaks", "Halve", "ReduceWith"]
