"""Forked trials: each size in a copy-on-write fork of the searching process, so what a trial
leaves behind (oneDNN's compiled kernels, one set per input shape; the graph a failed backward
leaves queued; heap fragments) dies with it and never shrinks a later trial's room, nor the
user's own run after the search (docs/measurements.md#forked-trials).

The child is a copy of the caller taken inside the budget: the workload, a closure over the
user's model and optimizer included, needs no pickling, and the user's objects are never
changed, nor called in the caller (the child works on copies; ``restore=`` needs no snapshot
there). The ``RLIMIT_DATA`` budget and the filled heap are inherited. The child sends its
:class:`~oomguard.engine.core.search.trial.Trial` back through a pipe; a death is an OOM only
with evidence, as for isolated trials (:func:`~oomguard.engine.core.search.isolate.child_trial`).

Only on Linux, for CPU trials, where no CUDA context exists (:func:`fork_refused`). Three
things keep the child's trial the one the caller would run:

- GNU OpenMP keeps its thread pool across a fork, without the threads: a child's first
  parallel region with more than one thread then waits forever. The caller's pool is released
  (``omp_pause_resource_all``) before each fork, so the child starts its own; where that call
  is missing the child runs one thread.
- A fork copies no page-table entries for file mappings never written (the libraries' code),
  so a resident peak would count each page of code the trial runs, which the caller has
  mapped already: the child maps them first (:func:`map_parents_file_pages`).
- The child warms up before its trial (:func:`~oomguard.engine.core.search.trial.warm_up_trials`:
  ``warmup()``, else one call at size 1; a ``restore=`` step inside a snapshot of its objects,
  so that the trial's first step still allocates the optimizer's state), outside the budget,
  which then leaves the trial the room the caller had: what the warm-up keeps is not charged,
  as in a search in the caller's process, which itself never calls the step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import multiprocessing as mp
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy
import torch

from oomguard.engine.core import child as launcher
from oomguard.engine.core.memory.budget import active_budget
from oomguard.engine.core.memory.heap import plug_free_heap, unplug_heap
from oomguard.engine.core.search.isolate import child_trial, raised_in_child
from oomguard.engine.core.search.ramguard import RamGuard
from oomguard.engine.core.search.trial import Trial, run_trial, warm_up_trials
from oomguard.engine.core.snapshot import Restorable, Snapshot
from oomguard.probes import host

log = logging.getLogger("oomguard.search")

MODE = "forked"
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22
_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


def fork_refused(device: torch.device) -> str | None:
    """Why trials on ``device`` cannot run in a fork of this process, or None where they can:
    Linux, the CPU, a ``fork`` start method, and no CUDA context (a forked child cannot use
    one, and must not inherit one)."""
    if not sys.platform.startswith("linux") or "fork" not in mp.get_all_start_methods():
        return "fork is used only on Linux"
    if device.type != "cpu":
        return f"trials on {device.type} run in this process"
    if torch.cuda.is_initialized():
        return "this process has a CUDA context, which a forked child cannot use"
    return None


class ForkedRunner:
    """Calling it with a size runs one trial in a fork of this process -> :class:`Trial` with
    ``mode`` ``"forked"``. Build it inside the budget (inherited); each child warms up itself.
    ``guard``: a RAM guard that watches the trial (in the child). ``timeout``:
    seconds before a child is killed (:class:`ChildCrashed`). ``restore``: the modules and
    optimizers a whole training step changes (``search(restore=)``), put back in the child
    after its warm-up call."""

    mode = MODE

    def __init__(self, fn: Callable[[int], Any], device: torch.device, guard: RamGuard | None,
                 timeout: float, restore: Sequence[Restorable] = ()) -> None:
        self.fn, self.device, self.guard, self.timeout = fn, device, guard, timeout
        self.restore = tuple(restore)
        self.ctx = mp.get_context("fork")

    def __call__(self, size: int, steps: int = 1) -> Trial:
        b = active_budget()
        budgeted = b is not None and b.device == "cpu"
        watch = launcher.LimitWatch(b.nbytes if budgeted and b is not None else 0)
        threads = _release_openmp_threads()
        with launcher.Child(self.ctx, _forked_trial, self.fn, size, self.device, self.guard,
                            steps, self.restore, threads, capture_stderr=True) as child:
            try:
                ended = child.wait(self.timeout, watch)
            finally:
                watch.close()
        trial = child_trial(ended, size, watch, budgeted, MODE, self.timeout, _raised)
        log.debug("forked trial %d: %.2f s in the child, %.2f s in all", size, trial.seconds,
                  ended.seconds)
        return trial


def _raised(size: int, ended: launcher.Ended) -> Exception:
    return raised_in_child(size, ended, MODE)


def _forked_trial(fn: Callable[[int], Any], size: int, device: torch.device,
                  guard: RamGuard | None, steps: int, restore: tuple[Restorable, ...],
                  threads: bool) -> Trial:
    """Runs in the child: everything before the trial outside the budget (the parent's file
    pages mapped, the warm-up, whose pages are copied now and not in the trial, the heap
    filled again), then one trial with the room the parent had at the fork."""
    if not threads:  # the parent's OpenMP pool could not be released: its threads are gone here
        torch.set_num_threads(1)
    # What the preparation keeps is not charged to the trial: reading the parent's page map
    # left 1.0 MiB in the heap and filling it 0.3 MiB (measured on a small GPT-2 Trainer
    # step, 2 rows of its 64 MiB search: docs/measurements.md#forked-trials). The budget's
    # entry fills the heap before it measures, too.
    with _outside_the_limit():
        map_parents_file_pages()
        snapshot = Snapshot.take(restore) if restore else None
        warm_up_trials(fn, device)
        if snapshot is not None:
            snapshot.restore()
        del snapshot
        # The warm-up's frees left chunks the trial could reuse uncounted; the budget's entry
        # filled the parent's (docs/measurements.md#free-heap-at-budget-entry).
        plugs = plug_free_heap()
    limit = host.data_limit()
    if active_budget() is not None and limit is not None:  # the parent watches the data segment
        launcher.ToParent().send(limit)
    try:
        return run_trial(fn, size, device, guard, steps)
    finally:
        unplug_heap(plugs)


def map_parents_file_pages() -> int:
    """In a forked child: map the pages of files (the libraries' code and data) that the parent
    has mapped; the pages mapped (0 where /proc says nothing). A fork copies no page-table
    entries for file mappings never written, so the child's resident size starts without them,
    and a trial's peak would count each page of code it runs (27 MiB of a small GPT-2 step,
    measured: docs/measurements.md#forked-trials). Each run of pages present in the parent is
    populated at once (``MADV_POPULATE_READ``, Linux 5.14), else read a byte a page."""
    parent, mapped = os.getppid(), 0
    try:
        with open(f"/proc/{parent}/maps", encoding="utf-8") as maps:
            ranges = [line.split() for line in maps]
        pagemap = open(f"/proc/{parent}/pagemap", "rb")  # noqa: SIM115 - closed below
    except OSError:
        return 0
    with pagemap:
        for fields in ranges:
            if len(fields) < 6 or not fields[5].startswith("/") or fields[1][0] != "r":
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                pagemap.seek(start // _PAGE * 8)
                present = numpy.frombuffer(pagemap.read((end - start) // _PAGE * 8),
                                           dtype="<u8") >> 63
            except (OSError, ValueError):
                continue
            # Runs of present pages: where the 0/1 sequence, padded with 0 each side, changes.
            edges = numpy.flatnonzero(numpy.diff(numpy.concatenate(([0], present, [0]))))
            for first, after in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
                _populate(start + first * _PAGE, (after - first) * _PAGE)
                mapped += after - first
    return mapped


def _populate(address: int, length: int) -> None:
    """Map ``length`` bytes of a readable mapping at ``address`` into this process."""
    if _madvise()(address, length, _MADV_POPULATE_READ) != 0:  # before Linux 5.14: EINVAL
        for page in range(address, address + length, _PAGE):
            ctypes.string_at(page, 1)


@contextlib.contextmanager
def _outside_the_limit() -> Iterator[None]:
    """``RLIMIT_DATA`` lifted to its hard limit for the block, then set to leave the room
    (bytes above ``VmData``) it left before: what the block kept is not charged to the trial,
    as the parent's warm-up is not."""
    import resource  # Linux only, as forks are here (fork_refused)

    limit, before = host.data_limit(), host.proc_status("VmData")
    if limit is None or before is None:
        yield
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    try:
        yield
    finally:
        now = host.proc_status("VmData") or before
        soft = now + limit - before
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _release_openmp_threads() -> bool:
    """End this thread's OpenMP pool (``omp_pause_resource_all(omp_pause_hard)``) so that a
    forked child builds its own (torch starts a new one at its next parallel op); whether the
    child may use more than one thread (also where this process never asked for more)."""
    pause = _openmp_pause()
    if pause is not None and pause(2) == 0:  # 2: omp_pause_hard
        return True
    return torch.get_num_threads() == 1


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    """libc's ``madvise(address, length, advice)``."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.restype, madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t,
                                                       ctypes.c_int]
    return madvise


@functools.cache
def _openmp_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime this process loaded (torch's ``libgomp``,
    Intel's or LLVM's), found in ``/proc/self/maps``; None without one."""
    with contextlib.suppress(OSError):
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
        for path in sorted(paths):
            if any(name in path.rsplit("/", 1)[-1] for name in _OPENMP_LIBRARIES):
                with contextlib.suppress(OSError, AttributeError):
                    fn = ctypes.CDLL(path).omp_pause_resource_all
                    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
                    return fn
    return None
