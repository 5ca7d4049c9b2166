"""oomguard: an adaptive, OOM-resilient execution engine for PyTorch.

The public API, re-exported from the packages that hold the parts::

    import oomguard
    oomguard.probe("cpu")                         # memory snapshot, bytes
    result = oomguard.search(step, start=32, step=8, budget=2 * 1024**3)
    oomguard.write_report(result, "out/")         # report.md, report.json, memory.png
    oomguard.Executor().run(step, batch_size=64)  # OOM -> retry at half
"""

from engine.budget import Budget, BudgetError, budget
from engine.executor import ExecutionFailed, Executor, Halve, ReduceWith
from engine.fit import LinearFit, Recommendation
from engine.oom import is_oom, release_memory
from engine.search import NoSizeFits, SearchResult, search
from engine.strategies import E10, Doubling, LinearJump
from engine.trial import Trial
from engine.units import parse_size
from probes import MemorySnapshot, PeakMeter, probe, probe_all

__version__ = "0.1.0"

__all__ = [
    "E10", "Budget", "BudgetError", "Doubling", "ExecutionFailed", "Executor", "Halve",
    "LinearFit", "LinearJump", "MemorySnapshot", "NoSizeFits", "PeakMeter", "Recommendation",
    "ReduceWith", "SearchResult", "Trial", "budget", "is_oom", "parse_size", "probe",
    "probe_all", "release_memory", "search",
]
