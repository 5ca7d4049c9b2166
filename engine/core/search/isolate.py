"""Isolated trials: each size in a fresh child process, the true maximum
(docs/measurements.md#in-process-vs-isolated), forked from the launcher's forkserver
(:mod:`oomguard.engine.core.child`, docs/measurements.md#isolated-children-start-up).
A child's error is re-raised with its traceback as a note; one that dies before ``started`` or
cannot unpickle the workload raises :class:`ChildStartFailed` with the likely fix; one that
dies after is an OOM only with evidence (:func:`~oomguard.engine.core.child.oom_evidence`),
else :class:`ChildCrashed`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from oomguard.engine.core import child as launcher
from oomguard.engine.core.memory.heap import heap_plugged, return_freed_memory_to_os, trim_heap
from oomguard.engine.core.memory.host_limit import HostLimit
from oomguard.engine.core.memory.oom import gc_frozen
from oomguard.engine.core.search.config import is_positive_seconds
from oomguard.engine.core.search.limit import limit_budget
from oomguard.engine.core.search.ramguard import RamGuard
from oomguard.engine.core.search.trial import Trial, run_trial, warm_up_trials
from oomguard.engine.core.workload import qualname, workload_preload
from oomguard.engine.errors import ChildCrashed, ChildStartFailed, UsageError, first_line

log = logging.getLogger("oomguard.isolate")

MODULE_LEVEL_FIX = ("define the workload as a module-level function or a picklable class "
                    "in an importable file")
MAIN_GUARD_FIX = 'guard the script with `if __name__ == "__main__":`'


class _CannotUnpickle(Exception):
    """The child could not rebuild the workload (its first line of why)."""


def _trial(payload: bytes, size: int, device: str, budget_bytes: int | None,
           limit: RamGuard | HostLimit | None = None, steps: int = 1,
           warm_call: bool = True) -> Trial:
    """Runs in the child: unpickle, warm up, enter the budget (given, else the one an enforced
    ``limit`` leaves room for), one trial. A CPU budget's limit is sent to the parent, which
    watches it."""
    # Before anything allocates, as search(budget=) does: large frees leave the heap. The
    # budget fills what is still free inside it, as it does in a user's own process, so
    # the two answer alike (docs/measurements.md#free-heap-at-budget-entry).
    return_freed_memory_to_os()
    trim_heap()
    try:
        fn = pickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001 - any failure to rebuild the workload
        raise _CannotUnpickle(f"{type(exc).__name__}: {first_line(exc)}") from None
    warm_up_trials(fn, device, warm_call)
    # Plugged with or without a budget: a peak is measured as resident growth, which the
    # warm-up's free chunks would hide (-15% on cka) when reused.
    with gc_frozen(), heap_plugged(), limit_budget(budget_bytes, device, limit) as entered:
        if entered is not None and entered.device == "cpu":  # the parent watches it
            launcher.ToParent().send(entered.limit)
        return run_trial(fn, size, device, limit if isinstance(limit, RamGuard) else None, steps)


def _main_program() -> str | None:
    """What a child re-imports of the parent: a script path or module name, or None
    (``python -c``, stdin, a notebook)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name:
        return name
    path = getattr(main, "__file__", None)
    return path if path and os.path.isfile(path) else None


class IsolatedRunner(AbstractContextManager["IsolatedRunner"]):
    """Context manager; calling it with a size runs one isolated trial -> :class:`Trial`.

    ``fn`` must be picklable (else :class:`ChildStartFailed` at once). ``budget`` bytes apply in
    the child after its warm-up; without them an enforced ``limit`` (a ``HostLimit``) sets the
    child's budget, and a RAM guard ``limit`` watches its trial. ``timeout`` seconds (finite,
    > 0) bound each trial from the child's start; then it is killed: :class:`ChildCrashed`,
    never an OOM. ``warm_call``: whether the warm-up may call ``fn(1)`` (False with ``restore=``).
    """

    mode = "isolated"

    def __init__(self, fn: Callable[[int], Any], device: str | torch.device = "cpu",
                 budget: int | None = None, timeout: float = 600.0,
                 limit: RamGuard | HostLimit | None = None, warm_call: bool = True) -> None:
        if not is_positive_seconds(timeout):
            raise UsageError(f"the trial timeout must be a positive number of seconds, "
                             f"got {timeout!r}; give one such as 300")
        # True while a multiprocessing child re-imports the main script (before its target runs)
        if getattr(mp.current_process(), "_inheriting", False):
            raise ChildStartFailed(
                "an isolated trial's child process is re-running the main script, which starts "
                f"a search at import: {MAIN_GUARD_FIX}")
        try:
            self.payload = pickle.dumps(fn)
        except Exception as exc:  # PicklingError, AttributeError, TypeError
            raise ChildStartFailed(
                f"isolated trials cannot send {qualname(fn)} to a child process ({type(exc).__name__}:"
                f" {first_line(exc)}): {MODULE_LEVEL_FIX}") from exc
        self.fn, self.device, self.budget, self.timeout = fn, str(device), budget, timeout
        self.limit, self.warm_call = limit, warm_call
        # Started now: the parent's work until the first trial overlaps its imports.
        self.ctx = launcher.start_forkserver(workload_preload(fn))

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, size: int, steps: int = 1) -> Trial:
        watch = launcher.LimitWatch(self.budget or 0)
        with launcher.Child(self.ctx, _trial, self.payload, size, self.device, self.budget,
                            self.limit, steps, self.warm_call, capture_stderr=True) as child:
            try:
                ended = child.wait(self.timeout, watch)
            finally:
                watch.close()
        if ended.how != launcher.TIMED_OUT and not ended.started:
            raise _start_failure(size, ended.exitcode)
        trial = child_trial(ended, size, watch, self.budget is not None, "isolated",
                            self.timeout, self._raised)
        log.debug("isolated trial %d: %.2f s in the child, %.2f s in all", size, trial.seconds,
                  ended.seconds)
        return trial

    def _raised(self, size: int, ended: launcher.Ended) -> Exception:
        """What to raise for an exception in the child: the workload's own, re-raised."""
        exc = raised_in_child(size, ended, "isolated")
        if isinstance(exc, _CannotUnpickle):
            where = (" (a child cannot import what python -c, stdin or a notebook defines)"
                     if _main_program() is None else "")
            return ChildStartFailed(f"isolated trial at size {size}: the child process cannot "
                                    f"unpickle {qualname(self.fn)} ({exc}){where}: "
                                    f"{MODULE_LEVEL_FIX}")
        return exc


def child_trial(ended: launcher.Ended, size: int, watch: launcher.LimitWatch, budgeted: bool,
                mode: str, timeout: float,
                raised: Callable[[int, launcher.Ended], Exception]) -> Trial:
    """The :class:`Trial` a child that ran one trial (isolated, or forked:
    :mod:`~oomguard.engine.core.search.forked`) ``ended`` with, its ``mode`` set: what it
    returned, an OOM where it died with evidence of one (``budgeted``: an oomguard budget
    applied in it), else raised: ``raised(size, ended)`` for its own exception,
    :class:`ChildCrashed` for a timeout or a death without evidence."""
    if ended.how == launcher.TIMED_OUT:
        raise ChildCrashed(f"{mode} trial at size {size}: no result after {timeout:g} s; the "
                           "child process was killed")
    if ended.how == launcher.RAISED:
        raise raised(size, ended)
    if ended.how == launcher.RETURNED:
        trial: Trial = ended.value
        trial.mode = mode
        return trial
    exitcode = ended.exitcode
    how = launcher.how_it_ended(exitcode)
    evidence = launcher.oom_evidence(exitcode, ended.stderr, budgeted) or watch.evidence(exitcode)
    if evidence is not None:
        return Trial(size=size, ok=False, peak_bytes=None, seconds=ended.seconds, mode=mode,
                     error=f"child process {how} ({evidence})")
    hint = (" (SIGKILL without a memory limit: the kernel's OOM killer or another process;"
            " see dmesg)" if launcher.killed_by_sigkill(exitcode) else "")
    raise ChildCrashed(f"{mode} trial at size {size}: the child process {how} while running "
                       f"the workload, with no sign of running out of memory{hint}")


def raised_in_child(size: int, ended: launcher.Ended, mode: str) -> Exception:
    """The exception a ``mode`` trial's child raised, for the parent to raise: the workload's
    own, its traceback a note; :class:`ChildCrashed` for a ``SystemExit`` or
    ``KeyboardInterrupt``, which are not ours to raise."""
    assert ended.raised is not None
    log.debug("%s trial at size %d failed:\n%s", mode, size, ended.raised[2])
    exc = ended.error(f"the {mode} child process at size {size}")
    if not isinstance(exc, Exception):
        return ChildCrashed(f"{mode} trial at size {size}: the workload raised "
                            f"{ended.raised[1]} in the child process")
    return exc


def _start_failure(size: int, exitcode: int | None) -> ChildStartFailed:
    main = _main_program()
    if main is not None:
        cause = (f"each child re-imports {os.path.basename(main)}, and one without a main guard "
                 f"starts the search again: {MAIN_GUARD_FIX}")
    else:
        cause = (f"the main program is not a file a child can import (python -c, stdin, a "
                 f"notebook): {MODULE_LEVEL_FIX}")
    return ChildStartFailed(f"isolated trial at size {size}: the child process "
                            f"{launcher.how_it_ended(exitcode)} before it started (its error is "
                            f"above); likely cause: {cause}")
