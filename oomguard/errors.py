"""Every error oomguard raises on purpose: the whole tree under :class:`OomguardError`
(:mod:`oomguard.engine.errors` says when each is raised). The top level has the ones a
caller usually catches: ``OomguardError``, ``UsageError``, ``ExecutionFailed``,
``NoExecutableBatchSize`` and ``SearchFailed``."""

from oomguard.engine.errors import (
    BudgetError,
    CacheError,
    ChildCrashed,
    ChildStartFailed,
    CollectiveMismatch,
    ExecutionFailed,
    IsolationError,
    JobError,
    NoExecutableBatchSize,
    NoProgress,
    NoSizeFits,
    OomguardError,
    RamLimitReached,
    RestartNeeded,
    SearchFailed,
    StepPartlyApplied,
    TrialFailed,
    UsageError,
)

__all__ = ["BudgetError", "CacheError", "ChildCrashed", "ChildStartFailed", "CollectiveMismatch",
           "ExecutionFailed", "IsolationError", "JobError", "NoExecutableBatchSize", "NoProgress",
           "NoSizeFits", "OomguardError", "RamLimitReached", "RestartNeeded", "SearchFailed",
           "StepPartlyApplied", "TrialFailed", "UsageError"]
