"""oomguard: an adaptive, OOM-resilient execution engine for PyTorch.

The public API, re-exported from the packages that hold the parts::

    import oomguard
    oomguard.probe("cpu").free_bytes              # memory snapshot, bytes
    result = oomguard.search(step, start=32, step=8, budget=2 * 1024**3)
    oomguard.write_report(result, "out/")         # report.md, report.json, memory.png
    oomguard.Executor().run(step, batch_size=64)  # OOM -> retry at half

    @oomguard.adaptive(batch_size=64)             # inside a training script
    def train_step(batch_size): ...

    oomguard.accumulate(step_fn, batch, params=model)  # micro-batches, same gradients

Names are resolved on first use (PEP 562), so ``import oomguard`` and
``oomguard --help`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # probes: measurement
    "MemorySnapshot": "oomguard.probes",
    "PeakMeter": "oomguard.probes",
    "probe": "oomguard.probes",
    "probe_all": "oomguard.probes",
    # the exception tree
    "OomguardError": "oomguard.engine.errors",
    "UsageError": "oomguard.engine.errors",
    "BudgetError": "oomguard.engine.errors",
    "ExecutionFailed": "oomguard.engine.errors",
    "NoExecutableBatchSize": "oomguard.engine.errors",
    "NoProgress": "oomguard.engine.errors",
    "RestartNeeded": "oomguard.engine.errors",
    "SearchFailed": "oomguard.engine.errors",
    "NoSizeFits": "oomguard.engine.errors",
    "TrialFailed": "oomguard.engine.errors",
    "IsolationError": "oomguard.engine.errors",
    "ChildStartFailed": "oomguard.engine.errors",
    "ChildCrashed": "oomguard.engine.errors",
    "CollectiveMismatch": "oomguard.engine.errors",
    "RamLimitReached": "oomguard.engine.errors",
    # core: classification, budgets, search, executor
    "OOM": "oomguard.engine.core.memory.oom",
    "call_catching_oom": "oomguard.engine.core.memory.oom",
    "is_oom": "oomguard.engine.core.memory.oom",
    "release_memory": "oomguard.engine.core.memory.oom",
    "Budget": "oomguard.engine.core.memory.budget",
    "budget": "oomguard.engine.core.memory.budget",
    "parse_size": "oomguard.engine.util.units",
    "Trial": "oomguard.engine.core.search.trial",
    "E10": "oomguard.engine.core.search.strategies",
    "Doubling": "oomguard.engine.core.search.strategies",
    "Guided": "oomguard.engine.core.search.strategies",
    "LinearJump": "oomguard.engine.core.search.strategies",
    "LinearFit": "oomguard.engine.core.search.fit",
    "Recommendation": "oomguard.engine.core.search.fit",
    "SearchResult": "oomguard.engine.core.search.search",
    "search": "oomguard.engine.core.search.search",
    "SearchConfig": "oomguard.engine.core.search.search",
    "RamGuard": "oomguard.engine.core.memory.ramguard",
    "Estimate": "oomguard.engine.core.estimate.estimate",
    "estimate": "oomguard.engine.core.estimate.estimate",
    "Executor": "oomguard.engine.core.execute.executor",
    "Halve": "oomguard.engine.core.execute.retry",
    "ReduceWith": "oomguard.engine.core.execute.retry",
    # training scripts
    "adaptive": "oomguard.engine.training.adaptive",
    "find_executable_batch_size": "oomguard.engine.training.adaptive",
    "stats": "oomguard.engine.training.adaptive",
    "reset_stats": "oomguard.engine.training.adaptive",
    "Accumulator": "oomguard.engine.training.accumulate",
    "accumulate": "oomguard.engine.training.accumulate",
    # reports
    "write_report": "oomguard.reports",
}

__all__ = [
    "Accumulator", "Budget", "BudgetError", "ChildCrashed", "ChildStartFailed",
    "CollectiveMismatch", "Doubling",
    "E10", "Estimate", "ExecutionFailed", "Executor", "Guided", "Halve", "IsolationError", "LinearFit", "LinearJump",
    "MemorySnapshot", "NoExecutableBatchSize", "NoProgress", "NoSizeFits", "OOM", "OomguardError",
    "PeakMeter", "RamGuard", "RamLimitReached", "Recommendation", "ReduceWith", "RestartNeeded", "SearchConfig", "SearchFailed",
    "SearchResult", "Trial", "TrialFailed", "UsageError", "accumulate", "adaptive", "budget",
    "call_catching_oom", "estimate", "find_executable_batch_size", "is_oom", "parse_size", "probe",
    "probe_all", "release_memory", "reset_stats", "search", "stats", "write_report",
]
# A test checks that __all__ and _EXPORTS name the same things.


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'oomguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the real names
    from oomguard.engine.core.estimate.estimate import Estimate, estimate
    from oomguard.engine.core.execute.executor import Executor
    from oomguard.engine.core.execute.retry import Halve, ReduceWith
    from oomguard.engine.core.memory.budget import Budget, budget
    from oomguard.engine.core.memory.oom import OOM, call_catching_oom, is_oom, release_memory
    from oomguard.engine.core.memory.ramguard import RamGuard
    from oomguard.engine.core.search.fit import LinearFit, Recommendation
    from oomguard.engine.core.search.search import SearchConfig, SearchResult, search
    from oomguard.engine.core.search.strategies import E10, Doubling, Guided, LinearJump
    from oomguard.engine.core.search.trial import Trial
    from oomguard.engine.errors import (
        BudgetError,
        ChildCrashed,
        ChildStartFailed,
        ExecutionFailed,
        IsolationError,
        NoExecutableBatchSize,
        NoProgress,
        NoSizeFits,
        OomguardError,
        RamLimitReached,
        RestartNeeded,
        SearchFailed,
        TrialFailed,
        UsageError,
    )
    from oomguard.engine.training.accumulate import Accumulator, accumulate
    from oomguard.engine.training.adaptive import (
        adaptive,
        find_executable_batch_size,
        reset_stats,
        stats,
    )
    from oomguard.engine.util.units import parse_size
    from oomguard.probes import MemorySnapshot, PeakMeter, probe, probe_all
    from oomguard.reports import write_report
