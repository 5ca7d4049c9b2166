"""Isolated trials: each size runs in a fresh child process.

In-process trials inherit the caches, JIT kernels and heap fragments of every
earlier trial, so their headroom shrinks as a search runs; a fresh child per
trial measures the true maximum (docs/measurements.md#in-process-vs-isolated).

Children come from a ``forkserver`` that has already imported torch, ``torch._dynamo``
(which optimizers import when built) and the workload's ``preload`` modules, so a trial
pays a fork and the workload's own ``warmup()``, not an interpreter start
(docs/measurements.md#isolated-children-start-up). The forkserver starts in the
background as soon as an isolated search is planned (:class:`IsolatedRunner` is built,
or :func:`start_forkserver` is called), so the parent's own work overlaps its start-up
instead of the first trial waiting for it. In the child, in order: send ``started``;
keep every object inherited from the forkserver out of the child's collections
(``gc.freeze``); make glibc give freed memory back and trim its heap
(docs/measurements.md#return-freed-memory), before anything else allocates, so the
warm-up leaves no free heap for the budget to miss; send fd 2 to a temporary file;
unpickle the workload; ``warmup()``; the budget (if any); one trial; send the
:class:`~oomguard.engine.core.search.trial.Trial` back.

How the parent reads a child's end:

- a Trial (fitted or OOM) is returned; an error raised in the child is
  re-raised here, with the child's traceback as a note;
- a child that dies before ``started`` (its re-import of an unguarded main
  script failed) or cannot unpickle the workload raises
  :class:`ChildStartFailed` naming the likely cause and the fix;
- a child that dies after ``started`` is an OOM only with evidence: SIGKILL
  while a memory limit applies (the budget, ``RLIMIT_DATA``/``RLIMIT_AS``, a
  cgroup limit), or an allocation failure reported on its stderr (libgomp,
  C++ ``std::bad_alloc``; oneDNN's "could not create a primitive" under a
  memory limit), or death by a signal after the child's data segment, sampled
  from here while it runs under a CPU budget, came close to the limit (native
  code that does not check ``malloc`` segfaults there;
  :mod:`~oomguard.engine.core.child`). Otherwise :class:`ChildCrashed`.

The child's stderr is copied to this process's stderr after each trial.
"""

from __future__ import annotations

import gc
import logging
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from oomguard.engine.core.child import LimitWatch, how_it_ended, oom_evidence
from oomguard.engine.core.memory.budget import budget
from oomguard.engine.core.memory.heap import (
    ISOLATED_MMAP_THRESHOLD_BYTES,
    return_freed_memory_to_os,
    trim_heap,
)
from oomguard.engine.core.memory.oom import gc_frozen
from oomguard.engine.core.memory.ramguard import RamGuard
from oomguard.engine.core.search.trial import Trial, run_trial
from oomguard.engine.core.workload import preload_of, warm_up
from oomguard.engine.errors import ChildCrashed, ChildStartFailed, UsageError

log = logging.getLogger("oomguard.isolate")

# torch._dynamo: building any torch.optim optimizer imports it (so do oomguard's metrics
# through transformers): 1.5-3 s that every child paid in its warm-up
# (docs/measurements.md#isolated-children-start-up).
_BASE_PRELOAD = ("torch", "torch._dynamo", "oomguard.engine.core.search.isolate",
                 "oomguard.engine.core.search.trial", "oomguard.engine.core.memory.budget",
                 "oomguard.probes.peak")

MODULE_LEVEL_FIX = ("define the workload as a module-level function or a picklable class "
                    "in an importable file")
MAIN_GUARD_FIX = 'guard the script with `if __name__ == "__main__":`'


def _child(payload: bytes, size: int, device: str, budget_bytes: int | None, conn: Any,
           stderr_path: str, ram_guard: RamGuard | None = None, steps: int = 1) -> None:
    """Runs in the child: say it started, then unpickle, warm up, budget, one trial."""
    conn.send(("started",))
    # What the forkserver imported is the same in every child and is never a trial's
    # garbage: frozen, the child's collections (the budget's, the trial's) scan only
    # what the child itself creates; with torch._dynamo loaded a full collection took
    # 0.14-0.18 s, frozen 2 us (docs/measurements.md#isolated-children-start-up).
    gc.freeze()
    # Before anything allocates (unpickling imports the workload's modules, warmup()
    # builds it): every block >= the threshold freed from here on goes back to the
    # kernel, so no free heap from start-up or warm-up is left to absorb a trial's
    # allocations under the budget (docs/measurements.md#free-heap-at-budget-entry).
    # The child's lower threshold makes its answer the same from one child to the next.
    return_freed_memory_to_os(ISOLATED_MMAP_THRESHOLD_BYTES)
    trim_heap()
    try:
        sys.stderr.flush()
        fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
    except OSError:  # keep the inherited stderr; nothing is lost
        pass
    try:
        fn = pickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001 - any failure to rebuild the workload
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        conn.send(("unpickle-failed", f"{type(exc).__name__}: {first}"))
        conn.close()
        return
    try:
        warm_up(fn)
        guard: AbstractContextManager[Any] = (
            budget(budget_bytes, device) if budget_bytes is not None else nullcontext())
        with gc_frozen(), guard as entered:
            if entered is not None and entered.device == "cpu":  # the parent watches it
                conn.send(("limit", entered.limit))
            trial = run_trial(fn, size, device, ram_guard, steps)
        conn.send(("ok", trial))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        text = "".join(traceback.format_exception(exc))
        try:
            pickled: bytes | None = pickle.dumps(exc)
        except Exception:  # the exception itself may not pickle
            pickled = None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        conn.send(("error", pickled, f"{type(exc).__name__}: {first}", text))
    finally:
        sys.stderr.flush()
        conn.close()


def _in_bootstrapping_child() -> bool:
    """True while a multiprocessing child re-imports the main script (before its target runs)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def _main_program() -> str | None:
    """What a forkserver/spawn child re-imports of the parent: a script path or module
    name, or None (``python -c``, stdin, a notebook: nothing it can import)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name:
        return name
    path = getattr(main, "__file__", None)
    return path if path and os.path.isfile(path) else None


class IsolatedRunner:
    """Context manager; calling it with a size runs one isolated trial -> :class:`Trial`.

    ``fn`` must be picklable (a module-level function or class instance in an
    importable file); :class:`ChildStartFailed` says so at once if it is not.
    ``budget`` bytes are applied in the child after ``fn.warmup()``; a RAM
    ``guard`` watches the child's trial (see :func:`~oomguard.engine.core.search.trial.run_trial`).
    ``timeout`` seconds (finite, > 0) bound each trial, from the child's start to
    its result: a child still running then is killed and reported as
    :class:`ChildCrashed`, never as an OOM (nothing says it ran out of memory).
    """

    def __init__(self, fn: Callable[[int], Any], device: str | torch.device = "cpu",
                 budget: int | None = None, timeout: float = 600.0,
                 guard: RamGuard | None = None) -> None:
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                and math.isfinite(timeout) and timeout > 0):
            raise UsageError(f"the trial timeout must be a positive number of seconds, "
                             f"got {timeout!r}")
        if _in_bootstrapping_child():
            raise ChildStartFailed(
                "an isolated trial's child process is re-running the main script, which starts "
                f"a search at import: {MAIN_GUARD_FIX}")
        try:
            self.payload = pickle.dumps(fn)
        except Exception as exc:  # PicklingError, AttributeError, TypeError
            raise ChildStartFailed(
                f"isolated trials cannot send {_name(fn)} to a child process ({type(exc).__name__}:"
                f" {str(exc).splitlines()[0] if str(exc) else ''}): {MODULE_LEVEL_FIX}") from exc
        self.fn, self.device, self.budget, self.timeout = fn, str(device), budget, timeout
        self.guard = guard
        # Started now, in the background: the parent's work until the first trial (its
        # report header, a probe) overlaps the forkserver's imports.
        self.ctx = start_forkserver(workload_preload(fn))

    def __enter__(self) -> IsolatedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, size: int, steps: int = 1) -> Trial:
        fd, stderr_path = tempfile.mkstemp(prefix="oomguard-child-", suffix=".stderr")
        os.close(fd)
        try:
            return self._run(size, stderr_path, steps)
        finally:
            try:
                os.unlink(stderr_path)
            except OSError:
                pass

    def _run(self, size: int, stderr_path: str, steps: int = 1) -> Trial:
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_child, daemon=True, args=(
            self.payload, size, self.device, self.budget, child, stderr_path, self.guard, steps))
        start = time.perf_counter()
        proc.start()
        child.close()
        started, message, timed_out = False, None, False
        watch: LimitWatch | None = None
        while message is None:
            left = self.timeout - (time.perf_counter() - start)
            if left <= 0:
                timed_out = True
                break
            if not parent.poll(left if watch is None else min(left, watch.interval)):
                if watch is None:
                    timed_out = True
                    break
                watch.sample()
                continue
            try:
                received = parent.recv()
            except EOFError:  # the child is gone
                break
            if received[0] == "started":
                started = True
            elif received[0] == "limit":
                watch = LimitWatch(proc.pid, received[1], self.budget or 0)
            else:
                message = received
        if watch is not None:
            watch.close()
        parent.close()
        proc.join(timeout=0 if timed_out else 30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        elapsed = time.perf_counter() - start
        stderr = _pass_through(stderr_path)
        if timed_out:
            raise ChildCrashed(f"isolated trial at size {size}: no result after "
                               f"{self.timeout:g} s; the child process was killed")
        if not started:
            raise _start_failure(size, proc.exitcode)
        if message is None:
            return self._died(size, proc.exitcode, stderr, elapsed, watch)
        if message[0] == "unpickle-failed":
            where = (" (a child cannot import what python -c, stdin or a notebook defines)"
                     if _main_program() is None else "")
            raise ChildStartFailed(f"isolated trial at size {size}: the child process cannot "
                                   f"unpickle {_name(self.fn)} ({message[1]}){where}: "
                                   f"{MODULE_LEVEL_FIX}")
        if message[0] == "error":
            _, pickled, summary, text = message
            log.debug("isolated trial at size %d failed:\n%s", size, text)
            exc = _rebuild(pickled, summary)
            if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt: not ours to raise
                raise ChildCrashed(f"isolated trial at size {size}: the workload raised "
                                   f"{summary} in the child process")
            if hasattr(exc, "add_note"):
                exc.add_note(f"raised in the isolated child process at size {size}:\n{text}")
            raise exc
        trial: Trial = message[1]
        trial.mode = "isolated"
        log.debug("isolated trial %d: %.2f s in the child, %.2f s in all", size, trial.seconds,
                  elapsed)
        return trial

    def _died(self, size: int, exitcode: int | None, stderr: str, elapsed: float,
              watch: LimitWatch | None = None) -> Trial:
        how = how_it_ended(exitcode)
        evidence = oom_evidence(exitcode, stderr, self.budget is not None) or (
            watch.evidence(exitcode) if watch is not None else None)
        if evidence is not None:
            return Trial(size=size, ok=False, peak_bytes=None, seconds=elapsed, mode="isolated",
                         error=f"child process {how} ({evidence})")
        hint = (" (SIGKILL without a memory limit: the kernel's OOM killer or another process;"
                " see dmesg)" if exitcode == -signal.SIGKILL else "")
        raise ChildCrashed(f"isolated trial at size {size}: the child process {how} while "
                           f"running the workload, with no sign of running out of memory{hint}")


def _rebuild(pickled: bytes | None, summary: str) -> BaseException:
    """The child's exception, or a RuntimeError with its text where it cannot be rebuilt here."""
    try:
        exc = pickle.loads(pickled) if pickled is not None else None
    except Exception:  # its class or arguments do not unpickle in this process
        exc = None
    return exc if isinstance(exc, BaseException) else RuntimeError(summary)


def _start_failure(size: int, exitcode: int | None) -> ChildStartFailed:
    main = _main_program()
    if main is not None:
        cause = (f"each child re-imports {os.path.basename(main)}, and one without a main guard "
                 f"starts the search again: {MAIN_GUARD_FIX}")
    else:
        cause = (f"the main program is not a file a child can import (python -c, stdin, a "
                 f"notebook): {MODULE_LEVEL_FIX}")
    return ChildStartFailed(f"isolated trial at size {size}: the child process {how_it_ended(exitcode)} "
                            f"before it started (its error is above); likely cause: {cause}")


def _pass_through(path: str) -> str:
    """The child's captured stderr, also written to this process's stderr."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()
    return text


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def workload_preload(fn: Any) -> tuple[str, ...]:
    """The modules a forkserver should import for ``fn``: its ``preload`` and its module."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return preload_of(fn) + (module,)


def start_forkserver(preload: Iterable[str] = ()) -> Any:
    """Start the forkserver now, in the background, and return the context children come from.

    Call it as soon as isolated trials are planned, before other work: the server
    process imports torch and ``preload`` while this process goes on (it does not
    wait), and the first trial waits only for what is left of that start-up (several
    seconds measured, docs/measurements.md#isolated-children-start-up). The server
    imports what every call named until it started (see :func:`forkserver_context`);
    calling this again, or building :class:`IsolatedRunner` after it, reuses it.
    Where there is no forkserver (Windows), it returns the spawn context and starts nothing.
    """
    ctx = forkserver_context(tuple(preload))
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        # Spawns the server and returns: its imports run while this process goes on.
        forkserver.ensure_running()
    return ctx


_preload: dict[str, None] = {}  # every module asked for so far, in order (a set)


def forkserver_context(preload: tuple[str, ...]) -> Any:
    """The forkserver context, with torch and ``preload`` named for the server to import.

    The forkserver is shared by the whole process: it imports the union of what every
    call named before it started (:func:`start_forkserver`, or the first child);
    modules named after it started are imported by each child instead (slower, still
    correct).
    """
    if sys.platform == "win32" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    _preload.update(dict.fromkeys(_BASE_PRELOAD + tuple(m for m in preload if m != "__main__")))
    ctx.set_forkserver_preload(list(_preload))  # no effect once the server runs
    return ctx
