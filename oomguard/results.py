"""What the top-level calls return, for annotations: ``search`` a :class:`SearchResult` (its
:class:`Trial` list, :class:`LinearFit` and :class:`Recommendation`), ``estimate`` :class:`Estimate`
records, ``probe`` a :class:`MemorySnapshot`, ``budget`` a :class:`Budget`, ``search_shapes`` a
:class:`ShapePlan`."""

from oomguard.engine.core.estimate.estimate import Estimate
from oomguard.engine.core.memory.budget import Budget
from oomguard.engine.core.search.fit import LinearFit, Recommendation
from oomguard.engine.core.search.search import SearchResult
from oomguard.engine.core.search.trial import Trial
from oomguard.engine.core.shapes import ShapePlan
from oomguard.probes import MemorySnapshot

__all__ = ["Budget", "Estimate", "LinearFit", "MemorySnapshot", "Recommendation",
           "SearchResult", "ShapePlan", "Trial"]
