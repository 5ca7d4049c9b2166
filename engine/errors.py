"""The one exception tree of oomguard.

Every error oomguard raises on purpose derives from :class:`OomguardError`. Three
families matter to a caller: :class:`UsageError` (the command line prints it and exits 2;
it is the *only* family treated that way, so a bug inside a metric, a plain
``ValueError``, keeps its traceback), :class:`ExecutionFailed` and :class:`SearchFailed`.
This module imports nothing, so every layer may use it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any


class OomguardError(Exception):
    """Base of every error oomguard raises on purpose."""


class UsageError(OomguardError, ValueError):
    """Bad input from the user (a size <= 0, an unknown metric, a corrupt job file, a GPU
    asked for where there is none): a one-line message saying what to do (CLI: exit code 2).
    A ``ValueError``, so ``except ValueError`` in user code keeps working."""


def check_positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    """Raise :class:`UsageError` unless ``value`` is an int > 0 (``True`` is not a size);
    with ``optional``, None is accepted too. The one check of every size a user gives."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{name} must be a positive integer{' or None' if optional else ''}, "
                         f"got {value!r}; give a whole number such as 8")


class BudgetError(UsageError):
    """A budget that cannot be set: not positive, too small, or larger than the device."""


class JobError(UsageError):
    """A bad job file: the message is one line naming the field (and line if known)."""


class CacheError(UsageError):
    """The size cache cannot be locked or written (a read-only folder, a lock held elsewhere)."""


def first_line(exc: BaseException) -> str:
    """The first line of ``str(exc)`` without surrounding blanks; ``""`` for an empty message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def size_list(sizes: Mapping[str, Any] | None) -> str:
    """``chunk_size=8, internal_batch_size=4``: every size by name; ``""`` for none."""
    return ", ".join(f"{k}={v}" for k, v in (sizes or {}).items())


def format_sizes(sizes: Mapping[str, int]) -> str:
    """``64`` for one size, ``(chunk_size=8, internal_batch_size=4)`` for several."""
    return str(next(iter(sizes.values()))) if len(sizes) == 1 else f"({size_list(sizes)})"


class RamLimitReached(OomguardError, MemoryError):
    """A CPU trial passed the RAM guard's estimated limit and was stopped by its watchdog
    (:mod:`oomguard.engine.core.search.ramguard`). A ``MemoryError``, so an OOM; no message:
    the trial's record says what was measured."""


class ExecutionFailed(OomguardError, RuntimeError):
    """The executor or an adaptive wrapper gave up: every size down to the minimum ran out
    of memory. ``workload`` names what ran; ``tried`` lists the sizes of each attempt in
    order; ``errors`` the OOM message of each. ``str()`` is ``detail`` (one line with all of
    it), or with ``verbatim`` just ``message`` (accelerate's exact words)."""

    # Giving up is not itself an OOM: an outer handler must not retry it (is_oom reads this).
    oomguard_is_oom = False

    def __init__(self, workload: str, tried: Sequence[Mapping[str, int]], errors: Sequence[str],
                 message: str | None = None, *, verbatim: bool = False) -> None:
        self.workload = workload
        self.tried = [dict(s) for s in tried]
        self.errors = list(errors)
        self.message = (message or
                        "no executable size: every size down to the minimum ran out of memory")
        self.verbatim = verbatim
        shown = ", ".join(format_sizes(s) for s in self.tried) or "none"
        self.detail = (f"{workload}: {self.message} (tried {shown}); last error: "
                       f"{self.errors[-1] if self.errors else '-'}")
        super().__init__(self.message if verbatim else self.detail)

    def __reduce__(self) -> tuple:
        # The default calls __init__(str(self)): unpickled in another process it would fail.
        return (functools.partial(type(self), verbatim=self.verbatim),
                (self.workload, self.tried, self.errors, self.message))


class NoExecutableBatchSize(ExecutionFailed):
    """An adaptive batch size reached its minimum (or zero) on this rank or another one."""


class RestartNeeded(ExecutionFailed):
    """An OOM ladder (``on_oom``) must go on in a fresh process. ``ladder`` (a
    :class:`~oomguard.engine.core.execute.remedies.Ladder`) says where, ``why`` why, in one
    line. Not an OOM: a job's runner restarts the task."""

    ladder: Any = None
    why: str = ""


class StepPartlyApplied(ExecutionFailed):
    """An attempt ran out of memory after the optimizer's ``step()`` had begun writing (or had
    completed): no retry is made. ``str()`` is one line saying what to do. Not an OOM."""

    def __init__(self, workload: str, error: str, message: str) -> None:
        super().__init__(workload, [], [error], message, verbatim=True)

    def __reduce__(self) -> tuple:
        return (type(self), (self.workload, self.errors[-1], self.message))


class NoProgress(NoExecutableBatchSize):
    """Two failed attempts in a row with the same remedy, sizes and error: the ladder stops."""


class SearchFailed(OomguardError, RuntimeError):
    """A search ended without an answer; ``result`` (the partial
    :class:`~oomguard.engine.core.search.search.SearchResult`) holds every trial that ran."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result


class NoSizeFits(SearchFailed):
    """Even the smallest size tried ran out of memory. ``result`` holds every trial."""

    def __init__(self, result: Any) -> None:
        sizes = ", ".join(str(t.size) for t in result.trials)
        why = (f"every size tried ran out of memory ({sizes}); free memory, raise the budget or "
               "shrink the model" if sizes else  # a limit (max_trials, max_seconds) ended it
               f"no trial ran ({result.stopped_because}); raise the limit that stopped the search")
        super().__init__(f"no size fits: {why}", result)


class TrialFailed(SearchFailed):
    """A trial failed for a reason other than memory; the error is ``__cause__``."""


class CollectiveMismatch(OomguardError, RuntimeError):
    """Under torch.distributed, some ranks of a process group made a collective oomguard
    call (an adaptive size) and others did not within the presence check's timeout."""


class IsolationError(OomguardError, RuntimeError):
    """An isolated trial's child process failed for a reason other than memory."""


class ChildStartFailed(IsolationError):
    """The child process died before it could run the workload (import or unpickling)."""


class ChildCrashed(IsolationError):
    """The child process died while running the workload, without evidence of an OOM."""
