"""Progress on stderr, one module for every command: a search's trials, a job's tasks, the
reference's rows, verify's steps.

:class:`Steps` is the one display (steps done, time elapsed, an **estimated** time left), a
tqdm line on stderr when :func:`wanted`. :class:`Progress` reports a search's trials and a
job's tasks through it; :class:`CountedSteps` counts the steps of ``oomguard verify``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from oomguard.engine.errors import size_list
from oomguard.engine.jobs.records import INTERRUPTED, Task, TaskResult
from oomguard.engine.util.units import fmt_bytes

log = logging.getLogger("oomguard.job")

BAR_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} done, {elapsed} elapsed{postfix}"


def wanted(flag: bool | None) -> bool:
    """Whether to show progress: ``flag`` (``--progress`` True, ``--no-progress`` False), else
    only when stderr is a terminal (a log file or a pipe gets no bar)."""
    return sys.stderr.isatty() if flag is None else bool(flag)


def error_text(error: str | None) -> str:
    """An OOM's message for one terminal line: c10's "[enforce fail at alloc_cpu.cpp:127]
    err == 0." prefix says nothing to users and is dropped."""
    return re.sub(r"\[enforce fail at [^\]]*\][^.]*\.\s*", "", error or "")


class _Bar(tqdm):
    """tqdm without its monitor thread: a job forks its metrics' processes, and a fork
    while another thread holds a lock can leave the child waiting on it forever."""

    monitor_interval = 0


class Steps:
    """``total`` steps (None: not known yet) of ``unit`` (a plural noun) shown on stderr while
    ``show``: ``desc: 3/8 metrics done, 00:42 elapsed, about 01:10 left (estimate: 14.0 s per
    metric so far)``; the time left is an estimate, the mean measured seconds per step times
    the steps left. A :meth:`skip` counts as done, never in the mean. :meth:`write` prints a
    line above the bar."""

    def __init__(self, total: int | None, unit: str, desc: str = "", show: bool = False) -> None:
        self.total, self.unit, self.show, self.n = total, unit, show, 0
        self.status = ""
        self.timed: list[float] = []  # measured seconds of each step that ran
        self.mark = time.monotonic()
        self.lock = threading.Lock()  # verify's steps are counted from a watcher thread
        self.bar = _Bar(total=total, desc=desc, unit=unit, disable=not show, file=sys.stderr,
                        bar_format=BAR_FORMAT, dynamic_ncols=True, leave=True)

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, seconds: float | None = None) -> None:
        """One step done, that took ``seconds`` (None: the wall-clock since the last step)."""
        with self.lock:
            now = time.monotonic()
            self.timed.append(now - self.mark if seconds is None else seconds)
            self.mark = now
            self._count()

    def skip(self) -> None:
        """One step done without running (kept from an earlier run): not timed."""
        with self.lock:
            self.mark = time.monotonic()
            self._count()

    def set_total(self, total: int | None) -> None:
        with self.lock:
            self.total = self.bar.total = total
            self._refresh()

    def set_status(self, text: str) -> None:
        """What runs now (a task's name), shown after the counts."""
        with self.lock:
            self.status = text
            self._refresh()

    def left_seconds(self) -> float | None:
        """The estimated seconds left: mean measured seconds per step times the steps left;
        None before a step was timed or while the total is unknown."""
        if not self.timed or self.total is None:
            return None
        return sum(self.timed) / len(self.timed) * max(0, self.total - self.n)

    def estimate(self) -> str:
        """The time left in words, saying it is an estimate and from what."""
        left = self.left_seconds()
        if left is None:
            return "time left not known yet"
        per = sum(self.timed) / len(self.timed)
        return (f"about {tqdm.format_interval(left)} left (estimate: {per:.1f} s per "
                f"{self.unit.rstrip('s')} so far)")

    def write(self, line: str) -> None:
        if self.show:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()

    def _count(self) -> None:
        self.n += 1
        if self.show:
            self.bar.update(1)
        self._refresh()

    def _refresh(self) -> None:
        if self.show:
            self.bar.set_postfix_str(", ".join(filter(None, (self.estimate(), self.status))),
                                     refresh=True)


def trials_left(trials: list[Any], unit: int, max_size: int) -> int | None:
    """An estimate of a search's trials still to run: bisection's count between the largest
    size that fitted and the first that ran out of memory (0 once adjacent, or at
    ``max_size``); None before both are known. Strategies that predict need fewer."""
    lo = max((t.size for t in trials if t.ok), default=None)
    hi = min((t.size for t in trials if not t.ok and (lo is None or t.size > lo)), default=None)
    if lo is not None and lo >= max_size:
        return 0
    if lo is None or hi is None:
        return None
    gap = (hi - lo) // max(unit, 1)
    return math.ceil(math.log2(gap)) if gap > 1 else 0


@dataclass
class Progress:
    """A search's ``on_trial``: one line per trial, ``  batch     48  ok   peak 1.93 GiB  (5.60 s)``
    (``fresh`` marks an isolated trial if ``mark_fresh``). With ``steps`` each trial is a
    step, the total the trials run plus :func:`trials_left`; without, it pickles. A job's
    backend reports its tasks here (:meth:`finished`, :meth:`skipped`, :meth:`show`)."""

    label: str = "size"
    mark_fresh: bool = False
    n_tasks: int = 0
    steps: Steps | None = None
    results: dict[str, TaskResult] = field(default_factory=dict)
    count: int = 0
    unit: int = 1
    max_size: int = 0
    trials: list[Any] = field(default_factory=list)

    def __call__(self, trial: Any) -> None:
        peak = f"peak {fmt_bytes(trial.peak_bytes)}" if trial.ok else error_text(trial.error)[:100]
        verdict = "ok " if trial.ok else "RAM guard" if trial.guarded else "OOM"
        fresh = "  fresh" if self.mark_fresh and trial.mode == "isolated" else ""
        line = (f"  {self.label} {trial.size:>6}  {verdict}  {peak}  "
                f"({trial.seconds:.2f} s){fresh}")
        if self.steps is None:
            print(line, file=sys.stderr, flush=True)
            return
        self.trials.append(trial)
        self.steps.write(line)
        left = trials_left(self.trials, self.unit, self.max_size)
        self.steps.set_total(None if left is None else len(self.trials) + left)
        # In-process, a trial's own seconds (not the build and warm-up); isolated, the
        # wall-clock, as each pays its process's start-up.
        self.steps.advance(None if trial.mode == "isolated" else trial.seconds)

    def skipped(self, record: TaskResult) -> None:
        """A result kept from an earlier run: counted and logged in the order results come,
        as a finished one is (``[n/N]`` numbers results, not the job's order)."""
        self.results[record.task] = record
        self.count += 1
        log.info("[%d/%d] %s: already done, kept", self.count, self.n_tasks, record.task)
        if self.steps is not None:
            self.steps.skip()

    def finished(self, record: TaskResult) -> None:
        self.results[record.task] = record
        self.count += 1
        if self.steps is not None:
            self.steps.advance()
        sizes = record.sizes or {}
        final = size_list(sizes.get("final")) or "-"
        if record.ok:
            log.info("[%d/%d] %s: ok in %.1f s at %s (from %s, %d retries)", self.count,
                     self.n_tasks, record.task, record.seconds or 0.0, final,
                     sizes.get("source"), sizes.get("retries", 0))
        else:
            log.error("[%d/%d] %s: FAILED: %s", self.count, self.n_tasks, record.task,
                      record.reason)

    def interrupted(self, task: Task, run_id: str) -> None:
        self.results[task.key] = TaskResult.of(task, run_id, INTERRUPTED)

    def show(self, text: str) -> None:
        if self.steps is not None:
            self.steps.set_status(text)


class CountedSteps:
    """A workload that counts its calls: each call of ``inner`` appends its measured seconds
    as a line to the file ``path`` (the steps may run in a fresh child), which
    :meth:`watching` reads into a :class:`Steps`. Every other attribute is ``inner``'s."""

    def __init__(self, inner: Any, path: str | os.PathLike[str]) -> None:
        self.inner, self.path = inner, os.fspath(path)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("inner", "path"):  # pickle probes these first
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = self.inner(*args, **kwargs)
        seconds = time.perf_counter() - t0
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{seconds:.6f}\n".encode())
        finally:
            os.close(fd)
        return result

    @contextlib.contextmanager
    def watching(self, steps: Steps, every: float = 0.2) -> Iterator[None]:
        """Meanwhile, advance ``steps`` with each step's measured seconds as it is written
        (a thread reads the file every ``every`` seconds, and once more at the end)."""
        done = threading.Event()

        def poll() -> None:
            seen = 0
            while True:
                last = done.wait(every)
                try:
                    with open(self.path, encoding="utf-8") as fh:
                        lines = fh.read().split("\n")[:-1]  # whole lines only
                except OSError:
                    lines = []
                for text in lines[seen:]:
                    steps.advance(float(text))
                seen = max(seen, len(lines))
                if last:
                    return

        thread = threading.Thread(target=poll, name="oomguard-steps", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
