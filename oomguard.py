"""oomguard: an adaptive, OOM-resilient execution engine for PyTorch.

The public API, re-exported from the packages that hold the parts::

    import oomguard
    oomguard.probe("cpu").free_bytes              # memory snapshot, bytes
    result = oomguard.search(step, start=32, step=8, budget=2 * 1024**3)
    oomguard.write_report(result, "out/")         # report.md, report.json, memory.png
    oomguard.Executor().run(step, batch_size=64)  # OOM -> retry at half

    @oomguard.adaptive(batch_size=64)             # inside a training script
    def train_step(batch_size): ...

    oomguard.accumulate(step_fn, batch)           # micro-batches, same gradients
"""

from engine.accumulate import Accumulator, accumulate
from engine.adaptive import (
    NoExecutableBatchSize,
    adaptive,
    find_executable_batch_size,
    reset_stats,
    stats,
)
from engine.budget import Budget, BudgetError, budget
from engine.executor import ExecutionFailed, Executor, Halve, ReduceWith
from engine.fit import LinearFit, Recommendation
from engine.oom import OOM, call_catching_oom, is_oom, release_memory
from engine.search import NoSizeFits, SearchResult, search
from engine.strategies import E10, Doubling, LinearJump
from engine.trial import Trial
from engine.units import parse_size
from probes import MemorySnapshot, PeakMeter, format_table, probe, probe_all
from reports import write_report

__version__ = "0.1.0"

__all__ = [
    "E10", "OOM", "Accumulator", "Budget", "BudgetError", "Doubling", "ExecutionFailed",
    "Executor", "Halve", "LinearFit", "LinearJump", "MemorySnapshot", "NoExecutableBatchSize",
    "NoSizeFits", "PeakMeter", "Recommendation", "ReduceWith", "SearchResult", "Trial",
    "accumulate", "adaptive", "budget", "call_catching_oom", "find_executable_batch_size",
    "format_table", "is_oom", "parse_size", "probe", "probe_all", "release_memory",
    "reset_stats", "search", "stats", "write_report",
]
