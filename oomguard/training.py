"""Training-script parts beyond ``adaptive``, ``find_executable_batch_size``,
``accumulate`` and ``stats``: the :class:`Accumulator` that ``accumulate`` runs (for a
step that keeps its own), and :func:`reset_stats` (zero the counters ``stats`` shows)."""

from oomguard.engine.core.execute.stats import reset_stats
from oomguard.engine.training.accumulate import Accumulator

__all__ = ["Accumulator", "reset_stats"]
