"""Progress on stderr, one class for every command: a search's trials, a job's tasks."""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from oomguard.engine.errors import size_list
from oomguard.engine.jobs.records import INTERRUPTED, Task, TaskResult
from oomguard.engine.util.units import fmt_bytes

log = logging.getLogger("oomguard.job")


def error_text(error: str | None) -> str:
    """An OOM's message for one terminal line: c10's "[enforce fail at alloc_cpu.cpp:127]
    err == 0." prefix says nothing to users and is dropped."""
    return re.sub(r"\[enforce fail at [^\]]*\][^.]*\.\s*", "", error or "")


@dataclass
class Progress:
    """Called with each trial of a search (its ``on_trial``): one line,
    ``  batch     48  ok   peak 1.93 GiB  (5.60 s)`` (``label``: the size's name;
    ``fresh`` ends a trial run in a fresh child if ``mark_fresh``). Without a ``bar`` it
    pickles, so a search run in another process takes it along. A job's backend reports
    its tasks here: :meth:`finished` keeps a result in ``results``, advances ``bar``
    (tqdm, over ``n_tasks``) and logs a line; :meth:`show` puts a status on the bar."""

    label: str = "size"
    mark_fresh: bool = False
    n_tasks: int = 0
    bar: Any = None
    results: dict[str, TaskResult] = field(default_factory=dict)
    count: int = 0

    def __call__(self, trial: Any) -> None:
        peak = f"peak {fmt_bytes(trial.peak_bytes)}" if trial.ok else error_text(trial.error)[:100]
        verdict = "ok " if trial.ok else "RAM guard" if trial.guarded else "OOM"
        fresh = "  fresh" if self.mark_fresh and trial.mode == "isolated" else ""
        print(f"  {self.label} {trial.size:>6}  {verdict}  {peak}  "
              f"({trial.seconds:.2f} s){fresh}", file=sys.stderr, flush=True)

    def skipped(self, record: TaskResult) -> None:
        """A result kept from an earlier run (its line is logged by the caller)."""
        self.results[record.task] = record
        self.count += 1
        self.bar.update(1)

    def finished(self, record: TaskResult) -> None:
        self.skipped(record)
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
        self.bar.set_postfix_str(text, refresh=True)
